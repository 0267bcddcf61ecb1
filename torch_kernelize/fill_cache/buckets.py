"""fill_cache for shape buckets: one winner per bucket, validated over the whole bucket.

``--model M --dynamic INPUT:DIM:LO-HI`` traces the model with that input dim symbolic; every node
and fused region whose family takes its varying sizes at run time (``KernelFamily.bucket_support``)
becomes one BucketWork per bucket covering LO-HI (powers of two, or ``--buckets`` upper edges). A recorded
miss that names its bucket dims (the serving path writes them) defines the bucket of its size.

A bucket's search runs at its representative, the upper edge, where each candidate is validated
and timed against the vendor op as any spec is; a correct one is then validated again, with the
same binaries and the launch sizes serving would compute, at the lower edge and at random sizes
inside. A candidate wrong at any of them is incorrect. The winner is stored under the bucket key
with the bucket (dims, ranges, the sizes validated) in its record.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from torch_kernelize.compiling.bucket_lookup import bucket_runner, bucket_sizes, region_bucket_sizes
from torch_kernelize.core.buckets import Boundaries, Bucket, Dim, Range, bucket_key, spec_at, unbucketable, values_of
from torch_kernelize.core.errors import machine_error
from torch_kernelize.fill_cache.builder import Builder
from torch_kernelize.fill_cache.collect import UsageError, load_model, running_model
from torch_kernelize.fill_cache.journal import Journal
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.fill_cache.search import DeviceFault, run_search
from torch_kernelize.lowering.kernels import Config, KernelFamily, family_for
from torch_kernelize.core.targets import Target
from torch_kernelize.core.spec import KernelSpec

log = logging.getLogger("torch_kernelize.fill_cache")

INSIDE_SIZES = 2  # random sizes validated strictly inside a bucket, beside its two edges


@dataclasses.dataclass(frozen=True)
class DynamicDim:
    """One ``--dynamic INPUT:DIM:LO-HI``: dim DIM of the model's example input number INPUT."""
    input: int
    dim: int
    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> "DynamicDim":
        m = re.fullmatch(r"(\d+):(-?\d+):(\d+)-(\d+)", text.strip())
        if m is None:
            raise UsageError(f"--dynamic {text!r}: write INPUT:DIM:LO-HI, e.g. 0:1:1-512 (the example input's "
                             "index, its dim, the range of sizes it takes)")
        d = cls(*(int(g) for g in m.groups()))
        if not 1 <= d.lo <= d.hi:
            raise UsageError(f"--dynamic {text!r}: the range needs 1 <= LO <= HI")
        return d


@dataclasses.dataclass
class BucketWork:
    spec: KernelSpec                 # the representative: every variable at its bucket's upper edge
    dims: tuple[Dim, ...]
    ranges: tuple[Range, ...]
    source: str

    @property
    def key(self) -> str:
        return bucket_key(self.spec, self.dims, self.ranges)


class BucketFamily(KernelFamily):
    """``family`` generating its bucketed kernels for ``dims`` (the search sees a plain family)."""
    generates_in_parent = True  # the builder's workers know the family, not the dims

    def __init__(self, family: KernelFamily, dims: tuple[Dim, ...]):
        self.family, self.dims = family, dims
        self.name, self.ops, self.edge_kinds = family.name, family.ops, family.edge_kinds

    def generate(self, spec: KernelSpec, config: Config):
        return self.family.generate_bucketed(spec, config, self.dims)

    def __getattr__(self, name: str) -> Any:  # what else the harness asks of a family (the base's own are below)
        return getattr(self.family, name)

    def supports(self, spec: KernelSpec) -> str | None:
        return self.family.bucket_support(spec, self.dims)

    def seed_configs(self, spec: KernelSpec) -> list[Config]:
        return [c for c in self.family.seed_configs(spec) if self.family.bucket_config_problem(c) is None]

    def neighbours(self, spec: KernelSpec, config: Config) -> list[Config]:
        return [c for c in self.family.neighbours(spec, config) if self.family.bucket_config_problem(c) is None]

    def sample_inputs(self, spec, seed, kind="random", device="cpu"):
        return self.family.sample_inputs(spec, seed, kind, device)

    def resolve_ties(self, spec, inputs, outs, refs):
        return self.family.resolve_ties(spec, inputs, outs, refs)

    def evaluations(self, spec: KernelSpec, budget: int) -> int:
        return self.family.evaluations(spec, budget)

    def provenance(self, config: Config) -> dict[str, Any]:
        return self.family.provenance(config)


def bucket_of(spec: KernelSpec, dims: tuple[Dim, ...], boundaries: Boundaries) -> tuple[Range, ...] | None:
    ranges = tuple(boundaries.bucket_of(v) for v in values_of(spec, dims))
    return None if any(r is None for r in ranges) else ranges


def works_for(spec: KernelSpec, dims: tuple[Dim, ...], ranges_per_var: Sequence[Sequence[Range]],
              source: str) -> list[BucketWork]:
    """A BucketWork per combination of the variables' buckets, if ``spec``'s family fills buckets."""
    family = family_for(spec)
    if family is None or unbucketable(spec, dims) is not None or family.bucket_support(spec, dims) is not None:
        return []
    out = []
    for ranges in itertools.product(*ranges_per_var):
        rep = spec_at(spec, dims, [hi for _, hi in ranges])
        if family.bucket_support(rep, dims) is None:
            out.append(BucketWork(rep, dims, tuple(ranges), source))
    return out


def _resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` with ``size`` entries along ``dim``, its own values repeated (token ids stay valid)."""
    reps = -(-size // t.shape[dim])
    return torch.cat([t] * reps, dim=dim).narrow(dim, 0, size).contiguous()


def works_from_model(ref: str, target: Target, cache_dir: Path, dynamic: Sequence[DynamicDim],
                     boundaries: Boundaries) -> list[BucketWork]:
    """The buckets of every node of ``ref`` whose sizes vary with the ``dynamic`` dims."""
    from torch_kernelize.backend import compile_with_session
    from torch_kernelize.compiling.lower import Session
    from torch_kernelize.core.options import Options

    model, inputs = load_model(ref)
    inputs = list(inputs)
    device = "cuda" if target.device == "cuda" else "cpu"
    taken: set[int] = {int(s) for t in inputs if isinstance(t, torch.Tensor) for s in t.shape}
    example: dict[int, DynamicDim] = {}  # the traced size of each dynamic dim -> its range
    for d in dynamic:
        if d.input >= len(inputs) or not isinstance(inputs[d.input], torch.Tensor) \
                or not -inputs[d.input].dim() <= d.dim < inputs[d.input].dim():
            raise UsageError(f"--dynamic {d.input}:{d.dim}: {ref}'s example inputs have no tensor {d.input} "
                             f"with a dim {d.dim}")
        # a size no other dim has, so each variable of a node is known by its traced size
        size = next((s for s in range(max(d.lo, 2), d.hi + 1) if s not in taken and s not in example), None)
        if size is None:
            raise UsageError(f"--dynamic {d.input}:{d.dim}:{d.lo}-{d.hi}: no size in the range to trace at that "
                             "no other dim of the example inputs has")
        example[size] = d
        inputs[d.input] = _resized(inputs[d.input], d.dim, size)
    session = Session(Options(target=None, cache_dir=Path(cache_dir), repro_dir=None), target)
    graphs: list[Any] = []
    torch._dynamo.reset()
    # traced as serving traces it (dynamic=True: every input dim a symbol, and Python floats such
    # as a norm's eps graph inputs), so that the specs filled are the ones served; the symbols of
    # dims that no --dynamic names stay at their traced sizes in the buckets
    try:
        with running_model(ref, device):
            model = model.to(device)
            inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs]
            compiled = torch.compile(model, dynamic=True,
                                     backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
            with torch.no_grad():
                compiled(*inputs)
    finally:
        torch._dynamo.reset()
    works: dict[str, BucketWork] = {}
    for g in graphs:
        if g.plan is None:
            continue
        nodes = {n.name: n for n in g.plan.gm.graph.nodes}
        for key, spec_ in g._specializations.items():
            bindings = g.binder.bindings(key)
            for dec in spec_.decisions + spec_.regions:
                if dec.op == "region":  # a fused region looked up (hit or miss): its graph's sizes vary too
                    region = g._region_of.get(dec.spec_key)
                    found = region_bucket_sizes(region) if region is not None and dec.spec is not None else None
                else:
                    node = nodes.get(dec.node)
                    found = bucket_sizes(node) if node is not None and dec.spec is not None else None
                if found is None:
                    continue
                dims, sizes = _dynamic_only(*found, bindings, example)
                if not dims:
                    continue
                ranges = [boundaries.covering(*span) if span is not None else []
                          for span in (_span(e, bindings, example) for e in sizes)]
                if all(ranges):
                    for w in works_for(dec.spec, dims, ranges, f"model:{ref}"):
                        works.setdefault(w.key, w)
    return list(works.values())


def _dynamic_only(dims: tuple[Dim, ...], sizes: tuple[Any, ...], bindings: dict,
                  example: dict[int, DynamicDim]) -> tuple[tuple[Dim, ...], tuple[Any, ...]]:
    """``dims`` without the variables whose size has no --dynamic symbol (each is known by its
    traced size): those stay at their traced sizes; the others are numbered again."""
    keep = [v for v, e in enumerate(sizes) if any(example.get(bindings.get(s)) for s in e.free_symbols)]
    new = {v: k for k, v in enumerate(keep)}
    return (tuple((side, i, d, new[v]) for side, i, d, v in dims if v in new), tuple(sizes[v] for v in keep))


def _span(size: Any, bindings: dict, example: dict[int, DynamicDim]) -> Range | None:
    """The sizes ``size`` (a size symbol, or a product of them and a positive integer: it grows
    with each) takes as its --dynamic symbols range over their ranges, the others at their traced
    sizes (each symbol is known by its traced size); None when it has no --dynamic symbol."""
    dyn = {s: example.get(bindings.get(s)) for s in size.free_symbols}
    if not any(dyn.values()):
        return None
    fixed = {s: int(bindings[s]) for s, d in dyn.items() if d is None}
    return (int(size.subs({**fixed, **{s: d.lo for s, d in dyn.items() if d}})),
            int(size.subs({**fixed, **{s: d.hi for s, d in dyn.items() if d}})))


def work_from_repro(spec: KernelSpec, meta: dict[str, Any], source: str, boundaries: Boundaries) -> list[BucketWork]:
    """The bucket of a recorded miss that names its bucket dims (``bucket_dims`` in spec.json)."""
    raw = meta.get("bucket_dims")
    if not raw:
        return []
    dims = tuple((str(s), int(i), int(d), int(v)) for s, i, d, v in raw)
    ranges = bucket_of(spec, dims, boundaries)
    return works_for(spec, dims, [[r] for r in ranges], source) if ranges is not None else []


def inside_sizes(ranges: Sequence[Range], seed: str) -> list[tuple[int, ...]]:
    """Where a bucket's winner is validated: both edges, and random sizes strictly inside."""
    rng = random.Random(seed)
    sizes = [tuple(lo for lo, _ in ranges), tuple(hi for _, hi in ranges)]
    for _ in range(INSIDE_SIZES):
        sizes.append(tuple(rng.randint(lo + 1, hi - 1) if hi - lo > 1 else hi for lo, hi in ranges))
    return list(dict.fromkeys(sizes))  # in order, without repeats


def fill_bucket(run: Any, work: BucketWork, builder: Builder, family: KernelFamily | None = None) -> dict[str, Any]:
    """Search, validate and store one bucket (``run``: the FillRun, for its cache, budget and
    rules; ``family``: the spec's registered one by default); the row of the summary table."""
    key, spec = work.key, work.spec
    row = bucket_row(work)
    status, entry, _ = run.cache.lookup(key)
    if status in ("hit", "vendor") and not run.force:
        row.update(status="cached", winner=entry.family or "vendor", speedup=entry.speedup)
        return row
    family = BucketFamily(family or family_for(spec), work.dims)
    top = Measurer(spec, family, run.target, builder=builder)
    sizes = inside_sizes(work.ranges, key)
    others = [(v, Measurer(spec_at(spec, work.dims, v), family, run.target, builder=builder))
              for v in sizes if v != values_of(spec, work.dims)]

    def evaluate(config: Config) -> dict[str, Any]:
        ev = top.evaluate(config).to_json()
        if ev["correct"]:
            _, base = top.build(config)
            for v, m in others:
                record = m._validate(bucket_runner(m.spec, work.dims, base).run_poisoned)
                if not record.ok:
                    ev.update(correct=False, fitness=0.0, error=f"at sizes {list(v)}: {record.reason}")
                    break
        ev.update(spec=key, search_id=run.search_id, family=family.name)
        return ev

    journal = Journal(run.cache.journal_path(key))
    journal.archive()
    try:
        with run.cache.lock(key):
            result = run_search(spec, family, evaluate, family.evaluations(spec, run.budget), [], journal.append)
            row["evaluated"] = len(result.evaluated)
            best = result.best
            if best is None:
                errors = sorted({r["error"][:120] for r in result.evaluated if r["error"]})
                row.update(status="no correct candidate", winner="; ".join(errors[:2]))
                return row
            validation = dict(best["validation"] or {}, bucket_sizes=[list(v) for v in sizes])
            timings = {"candidate_ms": best["candidate_ms"], "vendor_ms": best["vendor_ms"],
                       "speedup": best["fitness"] if best["measured"] else None, "measured": best["measured"]}
            record = {"format": 1, "key": key, "spec": spec.to_json(), "family": family.name,
                      "config": best["config"], "validation": validation, "timings": timings,
                      "bucket": Bucket(work.dims, work.ranges, tuple(sizes)).to_json(),
                      "provenance": {**run.provenance(family.name, result), **family.provenance(Config.from_json(best["config"]))}}
            row["max_err"] = validation.get("max_err")
            if best["measured"] and best["fitness"] <= run.min_speedup:
                record.update(winner="vendor", note=f"vendor wins: best bucketed candidate ran at "
                              f"{best['fitness']:.3f}x the vendor kernel at the upper edge")
                run.cache.put(record, None, replace=run.force)
                row.update(status="vendor wins", winner="vendor", speedup=best["fitness"])
                return row
            # (no binaries for unaligned views: such calls run the vendor op)
            record.update(winner="triton", note="" if best["measured"] else "interpreter target: not timed")
            built, _ = top.build(Config.from_json(best["config"]))
            run.cache.put(record, built, replace=run.force)
            row.update(status="stored", winner=f"{family.name} " + " ".join(
                f"{k}={v}" for k, v in sorted(best["config"].items())), speedup=timings["speedup"])
            return row
    finally:
        builder.discard(spec)
        for m in [top] + [m for _, m in others]:
            m.close()


def bucket_row(work: BucketWork) -> dict[str, Any]:
    """A bucket's row of the summary, before its search."""
    where = " x ".join(f"{lo}-{hi}" for lo, hi in work.ranges)
    return {"spec": f"{work.spec.describe()} bucket {where}", "key": work.key, "source": work.source, "status": "",
            "winner": "", "speedup": None, "max_err": None, "evaluated": 0, "resumed": 0}


def fill_buckets(run: Any, works: Sequence[BucketWork]) -> list[dict[str, Any]]:
    """Fill every bucket of ``works`` (deduplicated by key), in order; one row each."""
    builder = Builder(run.target)
    rows, seen = [], set()
    try:
        for w in works:
            if w.key in seen:
                continue
            seen.add(w.key)
            try:
                rows.append(fill_bucket(run, w, builder))
            except (DeviceFault, UsageError):  # the CUDA context is gone; the arguments must change
                raise
            except Exception as e:  # one bucket's failure never ends the run: its sizes stay on the vendor
                if machine_error(e):  # a full disk, a permission: the machine's, exit 4 (not the bucket's)
                    raise
                log.warning("bucket of %s: failed (%s: %s)", w.spec.describe()[:90], type(e).__name__, str(e)[:300])
                rows.append(dict(bucket_row(w), status="failed", winner=f"{type(e).__name__}: {e}"[:300]))
            log.info("bucket %s: %s", rows[-1]["spec"][:100], rows[-1]["status"])
    finally:
        builder.close()
    return rows


def works_from_args(args: Any, target: Target) -> list[BucketWork]:
    """The buckets fill_cache's arguments ask for: each --model's --dynamic dims, and the recorded
    misses under --repros that name their bucket dims."""
    import json
    try:
        boundaries = Boundaries.parse(args.buckets)
    except ValueError as e:
        raise UsageError(str(e)) from None
    dynamic = [DynamicDim.parse(t) for t in args.dynamic]
    if dynamic and not args.model:
        raise UsageError("--dynamic names dims of a model's inputs: give the model with --model")
    works: list[BucketWork] = []
    for ref in args.model if dynamic else ():
        works += works_from_model(ref, target, args.cache_dir, dynamic, boundaries)
    for folder in args.repros:
        for meta_path in sorted(Path(folder).glob("*/spec.json")):
            try:
                meta = json.loads(meta_path.read_text())
                spec = KernelSpec.from_json(meta["spec"])
            except (OSError, ValueError, KeyError):
                continue  # (the exact-shape work reports an unreadable repro)
            works += work_from_repro(spec, meta, str(meta_path.parent), boundaries)
    return works
