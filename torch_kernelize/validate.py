"""Validation: does a candidate compute the spec's function? Against a float64 CPU reference.

Each trial draws fresh inputs (several seeds of random values, plus the edge kinds the op's
family admits), runs the candidate with its outputs poisoned first, and compares every output
with the reference under the tolerances of ``torch_kernelize.tolerances``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.spec import KernelSpec, TensorMeta, dtype_from_name
from torch_kernelize.tolerances import region_tolerance, tolerance

DEFAULT_SEEDS = (0, 1, 2)


@dataclasses.dataclass
class Comparison:
    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    reason: str = ""
    max_err: float = 0.0   # max |out - ref| / max(1, max |ref|): what atol is compared with


def compare(out: torch.Tensor, ref: torch.Tensor, op: str | None = None,
            dtype: torch.dtype | None = None, factor: float = 1.0,
            tol: tuple[float, float] | None = None) -> Comparison:
    """Compare one candidate output with its float64 (or exact integer) reference.

    ``factor`` widens the tolerances, e.g. 2 when ``ref`` is itself a rounded (vendor) result;
    ``tol`` replaces the (atol, rtol) that ``dtype`` and ``op`` would give.
    """
    dtype = dtype or out.dtype
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(False, math.inf, math.inf, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    # Compare where the reference lives (fill_cache keeps large references on the GPU).
    out64 = out.detach().to(ref.device, torch.float64)
    ref64 = ref.detach().to(torch.float64)
    if out64.numel() == 0:
        return Comparison(True)
    atol, rtol = tol if tol is not None else tolerance(dtype, op)
    atol, rtol = atol * factor, rtol * factor
    if dtype.is_floating_point and dtype != torch.float64:
        # A finite reference beyond the output type's range rounds to +-inf: that is the exact
        # answer. Within tolerance of the largest finite value, both roundings are right: a sum
        # accumulated in another order may land on either side of the overflow threshold.
        big = torch.finfo(dtype).max
        near = ref64.isfinite() & ((ref64.abs() - big).abs() <= (atol + rtol) * big) & ~out64.isnan() & (
            out64.sign() == ref64.sign())
        if bool(near.any()):  # judge both sides of the threshold as +-max, under the usual tolerance
            out64 = torch.where(near, out64.clamp(-big, big), out64)
            ref64 = torch.where(near, ref64.clamp(-big, big), ref64)
        overflow = ref64.isfinite() & ref64.to(dtype).isinf()
        if bool(overflow.any()):
            ref64 = torch.where(overflow, ref64.to(dtype).to(torch.float64), ref64)
    ref_nan, out_nan = ref64.isnan(), out64.isnan()
    if not torch.equal(ref_nan, out_nan):
        extra = int((out_nan & ~ref_nan).sum())
        missing = int((ref_nan & ~out_nan).sum())
        return Comparison(False, math.inf, math.inf,
                          f"NaN mismatch: {extra} unexpected NaN (unwritten or wrong), {missing} missing; first at "
                          f"index {_index_of(ref_nan != out_nan, 0)}")
    ref_inf, out_inf = ref64.isinf(), out64.isinf()
    if not torch.equal(ref_inf, out_inf) or not torch.equal(ref64[ref_inf], out64[out_inf]):
        differ = (ref_inf != out_inf) | (ref_inf & (ref64 != out64))
        return Comparison(False, math.inf, math.inf,
                          f"infinities differ from the reference; first at index {_index_of(differ, 0)}")
    finite = ~(ref_nan | ref_inf)
    r, o = ref64[finite], out64[finite]
    if r.numel() == 0:
        return Comparison(True)
    diff = (o - r).abs()
    max_abs = float(diff.max())
    max_rel = float((diff / r.abs().clamp_min(1e-30)).max())
    scale = max(1.0, float(r.abs().max()))
    bad = diff > atol * scale + rtol * r.abs()
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0]) if bad.dim() else 0
        where = _index_of(finite, i)
        return Comparison(False, max_abs, max_rel, max_err=max_abs / scale, reason=
                          f"{int(bad.sum())} element(s) out of tolerance (atol {atol:g}x{scale:.3g}, rtol {rtol:g}), "
                          f"max error {max_abs / scale:.3g}; first at index {where}: got {float(o.flatten()[i]):.6g}, "
                          f"expected {float(r.flatten()[i]):.6g}")
    return Comparison(True, max_abs, max_rel, max_err=max_abs / scale)


def _index_of(mask: torch.Tensor, i: int) -> tuple[int, ...]:
    """The index in ``mask``'s shape of its ``i``-th True element."""
    return tuple(int(v) for v in mask.nonzero()[i]) if mask.dim() else ()


def changed_input(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> str | None:
    """Which input a run wrote to (bit for bit, NaN equal to NaN), and where; None if none."""
    for n, (b, a) in enumerate(zip(before, after)):
        if not isinstance(b, torch.Tensor):
            continue
        same = (a == b) | (a.isnan() & b.isnan()) if b.is_floating_point() else a == b
        if not bool(same.all()):
            return f"input {n} at index {_index_of(~same, 0)} ({int((~same).sum())} element(s) changed)"
    return None


def compare_all(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], spec: KernelSpec,
                factor: float = 1.0) -> Comparison:
    if len(outs) != len(refs):
        return Comparison(False, math.inf, math.inf, f"{len(outs)} outputs, reference has {len(refs)}")
    worst = Comparison(True)
    tol = _region_tolerance(spec) if spec.op == "region" else None
    for i, (o, r, m) in enumerate(zip(outs, refs, spec.outputs)):
        c = compare(o, r, spec.op, m.torch_dtype, factor, tol)
        if not c.ok:
            c.reason = f"output {i}: {c.reason}"
            return c
        worst.max_abs = max(worst.max_abs, c.max_abs)
        worst.max_rel = max(worst.max_rel, c.max_rel)
        worst.max_err = max(worst.max_err, c.max_err)
    return worst


def _region_tolerance(spec: KernelSpec) -> tuple[float, float]:
    """A region is judged by every value it rounds on the way, not only its output dtype."""
    return _graph_tolerance(spec.graph, tuple(m.dtype for m in spec.inputs))


@functools.lru_cache(maxsize=1024)
def _graph_tolerance(graph_json: str, input_dtypes: tuple[str, ...]) -> tuple[float, float]:
    graph = json.loads(graph_json)  # once per region, not once per trial or checked call
    dtypes = [TensorMeta.from_json(n["meta"]).torch_dtype for n in graph["nodes"]]
    dtypes += [dtype_from_name(d) for d in input_dtypes]
    return region_tolerance(dtypes, [n["op"] for n in graph["nodes"]])


@dataclasses.dataclass
class ValidationRecord:
    ok: bool
    seeds: list[int]
    kinds: list[str]
    trials: int
    max_abs_err: float
    max_rel_err: float
    tolerance: dict[str, list[float]]
    reason: str = ""
    max_err: float = 0.0  # the scaled error compared with atol (see Comparison.max_err)
    reference_device: str = "cpu"
    vendor_judged: list[str] = dataclasses.field(default_factory=list)  # edge kinds judged against the vendor

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("max_abs_err", "max_rel_err", "max_err"):
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


def validate(run: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]], spec: KernelSpec,
             sample_inputs: Callable[[KernelSpec, int, str, Any], list[torch.Tensor]],
             edge_kinds: Sequence[str] = (), seeds: Sequence[int] = DEFAULT_SEEDS,
             device: str | torch.device = "cpu", extra_trials: int = 0,
             trial_cache: dict | None = None, reference_device: str = "cpu",
             resolve_ties: Callable | None = None) -> ValidationRecord:
    """Run ``run`` (inputs -> outputs, poisoned before each run) on every trial; stop at the first failure.

    ``sample_inputs(spec, seed, kind, device)`` draws the inputs of one trial; ``extra_trials``
    adds trials of kind "captured" (seed = index), e.g. the real inputs a repro captured.
    ``trial_cache`` (a dict kept by the caller) keeps each trial's inputs and reference, so that
    the candidates of one spec are all judged on the same trials without recomputing references.
    ``resolve_ties(spec, inputs, outs, refs)`` (a family's) settles choices the op leaves open
    before each comparison.
    """
    settle = resolve_ties or (lambda spec, inputs, outs, refs: outs)
    trials = [(s, "random") for s in seeds] + [(seeds[0] + 1000 + i, k) for i, k in enumerate(edge_kinds)]
    trials += [(i, "captured") for i in range(extra_trials)]
    region_tol = _region_tolerance(spec) if spec.op == "region" else None
    tol = {m.dtype: list(region_tol or tolerance(m.torch_dtype, spec.op)) for m in spec.outputs}
    worst_abs = worst_rel = worst = 0.0
    vendor_judged: list[str] = []
    for n, (seed, kind) in enumerate(trials, 1):
        cached = trial_cache.get((seed, kind)) if trial_cache is not None else None
        if cached is None:
            inputs = sample_inputs(spec, seed, kind, device)
            try:
                ref = spec.reference(inputs, reference_device)
            except Exception:  # the op rejects this edge kind (e.g. histc of inf): the kind does not apply
                if kind in ("random", "captured"):
                    raise
                ref = None
            if trial_cache is not None:
                trial_cache[(seed, kind)] = (inputs, ref)
        else:
            inputs, ref = cached
        if ref is None:
            continue
        before = [t.clone() for t in inputs]
        try:
            outs = run(inputs)
            if device != "cpu" and torch.device(device).type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:
            return ValidationRecord(False, list(seeds), [k for _, k in trials], n, math.inf, math.inf, tol,
                                    f"trial {n} ({kind}, seed {seed}) raised {type(e).__name__}: {e}")
        written = changed_input(before, inputs)
        if written is not None:
            if trial_cache is not None:  # the trial is shared with the next candidate: draw it again
                trial_cache.pop((seed, kind), None)
            return ValidationRecord(False, list(seeds), [k for _, k in trials], n, math.inf, math.inf, tol,
                                    f"trial {n} ({kind}, seed {seed}): the kernel wrote to its {written}; "
                                    "a kernel must leave its inputs as they were")
        c = compare_all(settle(spec, inputs, outs, ref), ref, spec)
        if not c.ok and kind not in ("random", "captured"):
            # On edge inputs (near overflow, inf, NaN) the vendor op may itself leave the float64
            # reference: there the candidate must match what the vendor computes instead.
            vendor = _vendor_outputs(spec, inputs, trial_cache, (seed, kind))
            if not compare_all(vendor, ref, spec).ok:
                vendor = [v.to(torch.float64) if v.is_floating_point() else v for v in vendor]
                c = compare_all(settle(spec, inputs, outs, vendor), vendor, spec, factor=2.0)
                if c.ok:
                    vendor_judged.append(kind)
        if not c.ok:
            return ValidationRecord(False, list(seeds), [k for _, k in trials], n, c.max_abs, c.max_rel, tol,
                                    f"trial {n} ({kind}, seed {seed}): {c.reason}", c.max_err)
        worst_abs, worst_rel, worst = max(worst_abs, c.max_abs), max(worst_rel, c.max_rel), max(worst, c.max_err)
    return ValidationRecord(True, list(seeds), [k for _, k in trials], len(trials), worst_abs, worst_rel, tol,
                            max_err=worst, reference_device=reference_device, vendor_judged=vendor_judged)


def _vendor_outputs(spec: KernelSpec, inputs: Sequence[torch.Tensor], trial_cache: dict | None,
                    key: tuple) -> tuple[torch.Tensor, ...]:
    k = ("vendor",) + key
    if trial_cache is not None and k in trial_cache:
        return trial_cache[k]
    out = spec.run_vendor(inputs)
    if trial_cache is not None:
        trial_cache[k] = out
    return out
