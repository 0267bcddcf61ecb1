"""fill_cache for shape buckets: one winner per bucket, validated over the whole bucket.

``--model M --dynamic INPUT:DIM:LO-HI`` traces the model with that input dim symbolic; every node
and fused region whose family takes its varying sizes at run time (``KernelFamily.bucket_support``)
becomes one BucketWork per bucket covering LO-HI (powers of two, or ``--buckets`` upper edges). A recorded
miss that names its bucket dims (the serving path writes them) defines the bucket of its size.

A bucket is one strategy of the fill driver (fill_run.FillRun.process_bucket), which searches
and stores it as any spec, under the same store policy. What is the bucket's own is here: its
search space (``BucketFamily``) and its measurer (``BucketMeasurer``). The search runs at its
representative, the upper edge, where each candidate is validated and timed against the vendor
op as any spec is; a correct one is then validated again, with the same binaries and the launch
sizes serving would compute, at the lower edge and at random sizes inside. A candidate wrong at
any of them is incorrect. The winner is stored under the bucket key with the bucket (dims,
ranges, the sizes validated) in its record; it gets no binaries for unaligned views (such calls
run the vendor op).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from torch_kernelize.compiling.bucket_lookup import bucket_runner, bucket_sizes, region_bucket_sizes
from torch_kernelize.core.buckets import Boundaries, Bucket, Dim, Range, spec_at, unbucketable, values_of
from torch_kernelize.fill_cache.builder import Builder
from torch_kernelize.fill_cache.collect import UsageError, load_model, running_model
from torch_kernelize.fill_cache.measure import Evaluation, Measurer
from torch_kernelize.fill_cache.whole_buckets import program_places, whole_works
from torch_kernelize.lowering.kernels import Config, KernelFamily, family_for
from torch_kernelize.core.targets import Target
from torch_kernelize.core.spec import KernelSpec

if TYPE_CHECKING:
    from torch_kernelize.compiling.lower import LoweredGraph

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
    # a dynamic graph's bucket (whole_buckets.py): its probe keys, its generator, its spec at a
    # size, and what makes its baseline (of the target and the cache: the graph served without it)
    probes: tuple[str, ...] = ()
    generator: KernelFamily | None = None
    at: Callable[[Sequence[int]], KernelSpec] | None = None
    baseline: Callable[[Target, Path], Callable] | None = None
    # where serving looks it up: (graph, the sizes of the --dynamic dim it serves there); at the
    # quick fill's budget a bucket whose every place a graph's program covers is not searched
    # (FillRun._fill_buckets). Empty where not known (several --dynamic dims): always searched.
    places: list[tuple[str, Range]] = dataclasses.field(default_factory=list)
    scale: int = 1  # a dynamic graph's: what its dims hold per unit of the variable (core/buckets.Bucket)

    @property
    def whole(self) -> bool:
        """A dynamic graph's bucket (whole_buckets.py), not a node's or a region's."""
        return bool(self.probes)

    @property
    def key(self) -> str:
        return Bucket(self.dims, self.ranges, probes=self.probes, scale=self.scale).key(self.spec)

    def spec_at(self, values: Sequence[int]) -> KernelSpec:
        """The concrete spec at the variables' ``values``."""
        return self.at(values) if self.at is not None else spec_at(self.spec, self.dims, values)

    def row(self) -> dict[str, Any]:
        """The bucket's row of the summary, before its search."""
        where = " x ".join(f"{lo}-{hi}" for lo, hi in self.ranges)
        return {"spec": f"{self.spec.describe()} bucket {where}", "key": self.key, "source": self.source,
                "status": "", "winner": "", "speedup": None, "max_err": None, "evaluated": 0, "resumed": 0}

    def record(self) -> dict[str, Any]:
        """What its entry's record holds beside what any search stores: the bucket."""
        return {"bucket": Bucket(self.dims, self.ranges, tuple(inside_sizes(self.ranges, self.key)),
                                 self.probes, self.scale).to_json()}


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
                     boundaries: Boundaries, wholes: bool = False) -> list[BucketWork]:
    """The buckets of every node of ``ref`` whose sizes vary with the ``dynamic`` dims; with
    ``wholes`` (the Inductor generator is asked), then each of its dynamic graphs whole."""
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
    session = Session(Options.for_fill(cache_dir), target)
    graphs: list[LoweredGraph] = []
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
        if g.plan is not None:
            _graph_works(g, example, boundaries, f"model:{ref}", works)
    # then each dynamic graph whole, per bucket: its own assembly (the buckets above) is its baseline
    for w in whole_works(graphs, example, boundaries, f"model:{ref}", BucketWork) if wholes else ():
        works.setdefault(w.key, w)
    return list(works.values())


def _graph_works(g: LoweredGraph, example: dict[int, DynamicDim], boundaries: Boundaries, source: str,
                 works: dict[str, BucketWork]) -> None:
    """Add to ``works`` (by key) the buckets of every node and region that a specialization of
    ``g`` looked up whose sizes vary with the --dynamic dims (``example``: by traced size)."""
    nodes = {n.name: n for n in g.plan.gm.graph.nodes}
    for key, spec_ in g.specializations().items():
        bindings = g.binder.bindings(key)
        symbols = [s for s, v in bindings.items() if v in example]
        places = program_places(g, symbols[0]) if len(symbols) == 1 and g.kind == "inference" else {}
        for dec in spec_.decisions + spec_.regions:
            if dec.op == "region":  # a fused region looked up (hit or miss): its graph's sizes vary too
                region = g.region_of(dec.spec_key)
                found = region_bucket_sizes(region) if region is not None and dec.spec is not None else None
                held = {places.get(n.name, g.name) for n in region.nodes} if region is not None else {g.name}
            else:
                node = nodes.get(dec.node)
                found = bucket_sizes(node) if node is not None and dec.spec is not None else None
                held = {places.get(dec.node, g.name)}
            if found is None:
                continue
            place = held.pop() if len(held) == 1 else g.name  # (a region across stretches: no program holds it)
            dims, sizes = _dynamic_only(*found, bindings, example)
            if not dims:
                continue
            ranges = [boundaries.covering(*span) if span is not None else []
                      for span in (_span(e, bindings, example) for e in sizes)]
            if all(ranges):
                for w in works_for(dec.spec, dims, ranges, source):
                    served = _served_span(sizes, w.ranges, bindings, example)
                    w = works.setdefault(w.key, w)
                    if served is not None and (place, served) not in w.places:
                        w.places.append((place, served))


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


def _served_span(sizes: Sequence[Any], ranges: Sequence[Range], bindings: dict,
                 example: dict[int, DynamicDim]) -> Range | None:
    """The sizes of the one --dynamic dim for which every variable (``sizes``: each an increasing
    function of it, the other symbols at their traced sizes) falls in its bucket of ``ranges``;
    None where they vary with several --dynamic dims, or no size does."""
    dyn = {s: example[bindings[s]] for e in sizes for s in e.free_symbols if example.get(bindings.get(s))}
    if len(dyn) != 1:
        return None
    (symbol, d), = dyn.items()
    fixed = {s: int(v) for s, v in bindings.items() if s != symbol}
    lo, hi = d.lo, d.hi
    for e, (a, b) in zip(sizes, ranges):
        at = lambda n: int(e.subs({**fixed, symbol: n}))  # noqa: E731 - increasing in n
        lo = max(lo, _first(lo, hi + 1, lambda n: at(n) >= a))
        hi = min(hi, _first(lo, hi + 1, lambda n: at(n) > b) - 1)
    return (lo, hi) if lo <= hi else None


def _first(lo: int, end: int, holds: Callable[[int], bool]) -> int:
    """The least n in [lo, end) for which ``holds`` (false, then true), else ``end``: a bisection."""
    while lo < end:
        mid = (lo + end) // 2
        if holds(mid):
            end = mid
        else:
            lo = mid + 1
    return lo


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


class BucketMeasurer:
    """A bucket's measurer (measure.CandidateMeasurer): candidates are built, validated and timed
    at the representative (the upper edge) as any spec's are; a correct one is validated again,
    with the same binaries and the launch sizes serving computes, at the other ``inside_sizes``.
    In this process: those checks load the representative's binaries. ``cache_dir``: the root
    of the cache being filled (above the target's namespace), where a whole graph's own
    assembly (its baseline) runs from."""

    contains_faults = False

    def __init__(self, work: BucketWork, family: KernelFamily, target: Target, builder: Builder,
                 cache_dir: Path | None = None):
        self.spec, self.family, self.dims, self.builder = work.spec, family, work.dims, builder
        self.scale = work.scale
        self.sizes = inside_sizes(work.ranges, work.key)
        self.top = Measurer(work.spec, family, target, builder=builder, cache_dir=cache_dir,
                            baseline=work.baseline(target, cache_dir) if work.baseline and cache_dir else None)
        self.others = [(v, Measurer(work.spec_at(v), family, target, builder=builder))
                       for v in self.sizes if v != tuple(hi for _, hi in work.ranges)]

    @property
    def seconds(self) -> dict[str, float]:
        measurers = [self.top] + [m for _, m in self.others]
        return {k: sum(m.seconds[k] for m in measurers) for k in self.top.seconds}

    def evaluate(self, config: Config) -> Evaluation:
        ev = self.top.evaluate(config)
        if not ev.correct:
            return ev
        _, base = self.top.build(config)
        for v, m in self.others:
            record = m.validate_runner(bucket_runner(m.spec, self.dims, base, self.scale).run_poisoned)
            if not record.ok:
                ev.correct, ev.fitness, ev.error = False, 0.0, f"at sizes {list(v)}: {record.reason}"
                return ev
        ev.validation = dict(ev.validation or {}, bucket_sizes=[list(v) for v in self.sizes])
        return ev

    def check_fits(self) -> None:
        self.top.check_fits()  # (the upper edge: the largest of its sizes)

    def prepare(self, configs: Sequence[Config]) -> None:
        self.top.prepare(configs)

    def build(self, config: Config) -> tuple[Path, Any]:
        return self.top.build(config)

    def confirm(self, config: Config, rounds: int = 3) -> tuple[float, float] | None:
        return self.top.confirm(config, rounds)

    def validate_unaligned(self, directory: Path) -> str | None:
        return "a bucket's kernel has no binaries for unaligned views: such calls run the vendor op"

    def peak_extra_bytes(self) -> int | None:
        return self.top.peak_extra_bytes()

    def close(self) -> None:
        for m in [self.top] + [m for _, m in self.others]:
            m.close()


def works_from_args(args: Any, target: Target) -> list[BucketWork]:
    """The buckets fill_cache's arguments ask for: each --model's --dynamic dims (its graphs
    whole too where the Inductor generator is asked: whole_buckets.py), and the recorded misses
    under --repros that name their bucket dims."""
    import json
    try:
        boundaries = Boundaries.parse(args.buckets)
    except ValueError as e:
        raise UsageError(str(e)) from None
    dynamic = [DynamicDim.parse(t) for t in args.dynamic]
    if dynamic and not args.model:
        raise UsageError("--dynamic names dims of a model's inputs: give the model with --model")
    from torch_kernelize.fill_cache.generators import chosen_generators
    wholes = any(g.name == "inductor" for g in chosen_generators(args.generators, target))
    works: list[BucketWork] = []
    for ref in args.model if dynamic else ():
        works += works_from_model(ref, target, args.cache_dir, dynamic, boundaries, wholes)
    for folder in args.repros:
        for meta_path in sorted(Path(folder).glob("*/spec.json")):
            try:
                meta = json.loads(meta_path.read_text())
                spec = KernelSpec.from_json(meta["spec"])
            except (OSError, ValueError, KeyError):
                continue  # (the exact-shape work reports an unreadable repro)
            works += work_from_repro(spec, meta, str(meta_path.parent), boundaries)
    return works
