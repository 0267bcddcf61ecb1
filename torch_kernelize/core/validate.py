"""Validation: does a candidate compute the spec's function? Against a float64 reference.

Each trial draws fresh inputs (several seeds of random values, plus the edge kinds the op's
family admits), runs the candidate twice, its outputs poisoned and then filled with a seeded
pattern (core/fills.py), requires the two runs' outputs to be bit-identical, and compares every output
with the reference under the tolerances of ``torch_kernelize.core.tolerances``; with
``elementwise_bar``, also with the vendor op's own output under the elementwise bar there.

Comparisons stream over blocks of the outputs (``CHUNK_ELEMENTS`` at most, so their float64
temporaries stay a fraction of the output's own size), and a trial's tensors are dropped
before the next trial starts: what validation holds beyond one trial is what ``Trials`` keeps.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from torch_kernelize.core.fills import PATTERN, POISON, filling
from torch_kernelize.core.index_ties import settle_index_ties
from torch_kernelize.core.errors import InputRejected
from torch_kernelize.core.graph_accuracy import is_whole, judge as judge_graph
from torch_kernelize.core.spec import KernelSpec, TensorMeta, dtype_from_name
from torch_kernelize.core.tolerances import elementwise_bar, region_tolerance, tolerance

DEFAULT_SEEDS = (0, 1, 2)
CHUNK_ELEMENTS = 1 << 24   # the most elements one comparison step converts to float64
MIN_CHUNK_ELEMENTS = 1 << 16


@dataclasses.dataclass
class Comparison:
    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    reason: str = ""
    max_err: float = 0.0   # max |out - ref| / max(1, max |ref|): what atol is compared with


def _blocks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """``t``'s elements in row-major order, as flat blocks of at most ``limit`` elements (views
    where its strides allow; a copy of one block at most otherwise)."""
    if t.dim() == 0 or t.numel() <= limit:
        yield t.reshape(-1)
        return
    inner = t[0].numel()
    if inner > limit:
        for i in range(t.shape[0]):
            yield from _blocks(t[i], limit)
        return
    step = max(1, limit // inner)
    for i in range(0, t.shape[0], step):
        yield t[i:i + step].reshape(-1)


def _chunk_elements(numel: int) -> int:
    # about a 64th of the output per step: each step holds ~6 float64 temporaries of its size,
    # a tenth of an fp32 output's own bytes, while its float64 reference and the vendor's are held
    return max(MIN_CHUNK_ELEMENTS, min(CHUNK_ELEMENTS, numel // 64))


def _paired_blocks(out: torch.Tensor, ref: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Matching float64 blocks of ``out`` and ``ref`` (same shape), on ``out``'s device; complex128
    where either is complex (a cast to float64 would drop the imaginary parts)."""
    wide = torch.complex128 if out.is_complex() or ref.is_complex() else torch.float64
    limit = _chunk_elements(out.numel())
    for o, r in zip(_blocks(out.detach(), limit), _blocks(ref.detach(), limit)):
        yield o.to(wide), r.to(out.device, wide)


def _settle_range(o: torch.Tensor, r: torch.Tensor, dtype: torch.dtype, atol: float, rtol: float):
    """Judge a reference beyond ``dtype``'s range as the output type can hold it.

    A finite reference beyond the output type's range rounds to +-inf: that is the exact answer.
    Within tolerance of the largest finite value, both roundings are right: a sum accumulated in
    another order may land on either side of the overflow threshold.
    """
    if not dtype.is_floating_point or dtype == torch.float64:
        return o, r
    big = torch.finfo(dtype).max
    # Both cases below need |r| near or beyond ``big``: most blocks have no such element.
    if not bool((r.abs() >= big * (1 - (atol + rtol))).any()):
        return o, r
    near = r.isfinite() & ((r.abs() - big).abs() <= (atol + rtol) * big) & ~o.isnan() & (o.sign() == r.sign())
    if bool(near.any()):  # judge both sides of the threshold as +-max, under the usual tolerance
        o = torch.where(near, o.clamp(-big, big), o)
        r = torch.where(near, r.clamp(-big, big), r)
    rounded = r.to(dtype)
    overflow = r.isfinite() & rounded.isinf()
    if bool(overflow.any()):
        r = torch.where(overflow, rounded.to(torch.float64), r)
    return o, r


def compare(out: torch.Tensor, ref: torch.Tensor, op: str | None = None,
            dtype: torch.dtype | None = None, factor: float = 1.0,
            tol: tuple[float, float] | None = None, scaled: bool = True) -> Comparison:
    """Compare one candidate output with its float64 (or exact integer) reference.

    ``factor`` widens the tolerances, e.g. 2 when ``ref`` is itself a rounded (vendor) result;
    ``tol`` replaces the (atol, rtol) that ``dtype`` and ``op`` would give. ``scaled=False``
    drops the ``max(1, max|ref|)`` scale of atol: the elementwise bar ``torch.allclose`` checks.
    ``ref`` may live on another device (the CPU) than ``out``: it is moved over block by block.
    """
    dtype = dtype or out.dtype
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(False, math.inf, math.inf, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if out.numel() == 0:
        return Comparison(True)
    atol, rtol = tol if tol is not None else tolerance(dtype, op)
    atol, rtol = atol * factor, rtol * factor
    passed = _clear_pass(out, ref, dtype, atol, rtol, scaled)
    if passed is not None:
        return passed
    # Not clearly within the bar: judged again element by element, to say where and how far off.
    scale = 1.0
    if scaled:  # a first pass: the largest finite reference value
        for o, r in _paired_blocks(out, ref):
            o, r = _settle_range(o, r, dtype, atol, rtol)
            r = r[r.isfinite()]
            if r.numel():
                scale = max(scale, float(r.abs().max()))
    extra = missing = bad_count = 0
    inf_differ = False
    max_abs = max_rel = 0.0
    first: tuple[float, float] | None = None
    nan_at = inf_at = bad_at = None  # flat index of the first element of each kind of failure
    offset = 0
    for o, r in _paired_blocks(out, ref):
        o, r = _settle_range(o, r, dtype, atol, rtol)
        ref_nan, out_nan = r.isnan(), o.isnan()
        extra += int((out_nan & ~ref_nan).sum())
        missing += int((ref_nan & ~out_nan).sum())
        if nan_at is None and (extra or missing):
            nan_at = offset + int((ref_nan != out_nan).nonzero()[0, 0])
        ref_inf, out_inf = r.isinf(), o.isinf()
        if not torch.equal(ref_inf, out_inf) or not torch.equal(r[ref_inf], o[out_inf]):
            inf_differ = True
            if inf_at is None:
                inf_at = offset + int(((ref_inf != out_inf) | (ref_inf & (r != o))).nonzero()[0, 0])
        finite = ~(ref_nan | ref_inf | out_nan | out_inf)
        rf, of = r[finite], o[finite]
        block = o.numel()
        if rf.numel() == 0:
            offset += block
            continue
        diff = (of - rf).abs()
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / rf.abs().clamp_min(1e-30)).max()))
        bad = diff > atol * scale + rtol * rf.abs()
        n_bad = int(bad.sum())
        if n_bad and first is None:
            i = int(bad.nonzero()[0, 0])
            first = (of[i].item(), rf[i].item())
            bad_at = offset + int(finite.nonzero()[i, 0])
        bad_count += n_bad
        offset += block
    if extra or missing:
        return Comparison(False, math.inf, math.inf,
                          f"NaN mismatch: {extra} unexpected NaN (unwritten or wrong), {missing} missing; first at "
                          f"index {_unravel(nan_at, out.shape)}")
    if inf_differ:
        return Comparison(False, math.inf, math.inf,
                          f"infinities differ from the reference; first at index {_unravel(inf_at, out.shape)}")
    if bad_count:
        bar = f"atol {atol:g}x{scale:.3g}" if scaled else f"atol {atol:g}"
        return Comparison(False, max_abs, max_rel, max_err=max_abs / scale, reason=
                          f"{bad_count} element(s) out of tolerance ({bar}, rtol {rtol:g}), max error "
                          f"{max_abs / scale:.3g}; first at index {_unravel(bad_at, out.shape)}: got {_num(first[0])}, "
                          f"expected {_num(first[1])}")
    return Comparison(True, max_abs, max_rel, max_err=max_abs / scale)


def _num(x: float | complex) -> str:
    return f"{x:.6g}" if isinstance(x, complex) else f"{float(x):.6g}"


def _clear_pass(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, atol: float, rtol: float,
                scaled: bool) -> Comparison | None:
    """The passing Comparison of ``compare`` in one pass over the blocks, without a sync per
    block; None unless every element is within the bar by a margin far above float64 rounding
    (then ``compare`` judges element by element, as before).

    The scaled bar ``|o - r| <= atol * scale + rtol * |r|`` needs the scale (max |r|) before any
    element is judged; ``|o - r| - rtol * |r|``'s maximum, compared with ``atol * scale`` once
    the scale is known, judges them all at the end.
    """
    stats = []   # per block, on the device: [mismatch, scale, max_abs, max_rel, max excess]
    for o, r in _paired_blocks(out, ref):
        o, r = _settle_range(o, r, dtype, atol, rtol)
        ref_nan, out_nan, ref_inf, out_inf = r.isnan(), o.isnan(), r.isinf(), o.isinf()
        mismatch = (ref_nan != out_nan) | ((ref_inf | out_inf) & (r != o) & ~(ref_nan | out_nan))
        finite = ~(ref_nan | ref_inf | out_nan | out_inf)
        zero = torch.zeros((), dtype=torch.float64, device=o.device)
        rabs = torch.where(finite, r.abs(), zero)
        diff = torch.where(finite, (o - r).abs(), zero)
        excess = torch.where(finite, diff - rtol * rabs, torch.full_like(diff, -math.inf))
        stats.append(torch.stack([mismatch.any().to(torch.float64), rabs.max(), diff.max(),
                                  (diff / rabs.clamp_min(1e-30)).max(), excess.max()]))
    # amax, not max(0): on the CPU, max with a dim (values and indices) of this 5-wide stack took
    # ~20 ms a call on 2 busy cores (a parallel region per call), amax microseconds
    mismatch, top, max_abs, max_rel, excess = torch.stack(stats).amax(0).tolist()
    scale = max(1.0, top) if scaled else 1.0
    if mismatch or excess > atol * scale - 1e-12 * (atol + rtol) * scale:
        return None
    return Comparison(True, max_abs, max_rel, max_err=max_abs / scale)


def _unravel(flat: int | None, shape: Sequence[int]) -> tuple[int, ...]:
    """The row-major index in ``shape`` of element ``flat``."""
    index = []
    for n in reversed(shape):
        index.append(flat % n if flat is not None else 0)
        flat = flat // n if flat is not None else None
    return tuple(reversed(index))


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their size: equal exactly where the bits are."""
    return t.view(_SAME_SIZE_INT[t.element_size()]) if t.is_floating_point() else t


def changed_input(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> str | None:
    """Which input a run wrote to (bit for bit, NaN equal to NaN), and where; None if none."""
    for n, (b, a) in enumerate(zip(before, after)):
        if not isinstance(b, torch.Tensor):
            continue
        if torch.equal(_bits(b), _bits(a)):  # the common case, without a temporary per element kind
            continue
        same = (a == b) | (a.isnan() & b.isnan()) if b.is_floating_point() else a == b
        if not bool(same.all()):
            flat = int((~same).reshape(-1).nonzero()[0, 0])
            return f"input {n} at index {_unravel(flat, b.shape)} ({int((~same).sum())} element(s) changed)"
    return None


def _run_on_both_fills(run: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]],
                       inputs: Sequence[torch.Tensor], seed: int, device: str | torch.device
                       ) -> tuple[Sequence[torch.Tensor], str | None]:
    """``run``'s outputs with its buffers filled with a seeded pattern, and why they are not the
    bits of a run on the same inputs with its buffers poisoned (None: they are). A kernel must not
    depend on what its outputs or uninitialised temporaries held (core/fills.py).

    The first run's outputs are kept as digests only: one run's outputs are held at a time, as
    before (fill_cache's memory plan). Where the digests differ, a third run finds the index."""
    with filling(POISON):
        outs = run(inputs)
        sync_device(device)
    digests = [_digest(o) for o in outs]
    del outs
    with filling(PATTERN, seed):
        outs = run(inputs)
        sync_device(device)
    if [_digest(o) for o in outs] == digests:
        return outs, None
    with filling(POISON):
        poisoned = run(inputs)
        sync_device(device)
    for i, (a, b) in enumerate(zip(poisoned, outs)):
        if isinstance(a, torch.Tensor) and not torch.equal(_bits(a), _bits(b)):
            same = _bits(a) == _bits(b)
            flat = int((~same).reshape(-1).nonzero()[0, 0])
            where = f" at index {_unravel(flat, a.shape)} ({int((~same).sum())} element(s))"
            break
    else:
        where = " (and a third run differs from the first)"
    return outs, (f"output {i} depends on what its buffer held before the run: two runs on the same inputs, "
                  f"with the outputs and uninitialised temporaries filled differently, differ{where}; a kernel "
                  "must write every output element without reading it first")


def _digest(t: Any) -> Any:
    """A position-weighted sum of ``t``'s bits (wrapping int64), in blocks: equal bits give equal
    digests; different ones, different digests but by a 2**-64 chance."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_complex():
        t = torch.view_as_real(t)
    total, offset = 0, 0
    for block in _blocks(_bits(t.detach()), _chunk_elements(t.numel())):
        weights = torch.arange(offset, offset + block.numel(), device=block.device, dtype=torch.int64)
        total += int((block.to(torch.int64) * (weights * 2 + 1)).sum())
        offset += block.numel()
    return (tuple(t.shape), total & 0xFFFF_FFFF_FFFF_FFFF)


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


def compare_elementwise(outs: Sequence[torch.Tensor], vendor: Sequence[torch.Tensor], spec: KernelSpec) -> Comparison:
    """The elementwise bar against the vendor op's outputs (``tolerances.ELEMENTWISE_BAR``):
    ``|out - vendor| <= atol + rtol * |vendor|`` on every element, NaN and inf where it has them."""
    if len(outs) != len(vendor):
        return Comparison(False, math.inf, math.inf, f"{len(outs)} outputs, the vendor op gives {len(vendor)}")
    worst = Comparison(True)
    for i, (o, v, m) in enumerate(zip(outs, vendor, spec.outputs)):
        bar = _elementwise_bar(spec, m)
        if bar is None:
            continue
        c = compare(o, v, spec.op, m.torch_dtype, tol=bar, scaled=False)
        if not c.ok:
            c.reason = f"output {i}: {c.reason.replace('expected', 'vendor')}"
            return c
        worst.max_abs = max(worst.max_abs, c.max_abs)
        worst.max_rel = max(worst.max_rel, c.max_rel)
    return worst


def compare_elementwise_or_exact(outs: Sequence[torch.Tensor], vendor: Sequence[torch.Tensor],
                                 refs: Sequence[torch.Tensor], spec: KernelSpec) -> Comparison:
    """The elementwise bar, each element against whichever of the vendor output and the float64
    reference it is nearer. Eager rounds each op's result to the output dtype; a fused kernel
    keeps fp32 between them, so on a bf16 region (``a*b - c*d`` where the products cancel) a
    right answer can be more than the bar from eager while nearer the exact one: there it is
    judged against the exact answer, by the same bar. A candidate far from both still fails
    (issue 25's region, 2e-4 from an eager that was itself exact, does)."""
    return compare_elementwise(outs, nearest_expected(outs, refs, vendor), spec)


def _elementwise_bar(spec: KernelSpec, out: TensorMeta) -> tuple[float, float] | None:
    if spec.op == "region":  # judged by the loosest value it rounds on the way, as its float64 bar
        return _graph_dtypes_bar(spec.graph, tuple(m.dtype for m in spec.inputs))
    return elementwise_bar([out.torch_dtype])


def _region_tolerance(spec: KernelSpec) -> tuple[float, float]:
    """A region is judged by every value it rounds on the way, not only its output dtype."""
    return _graph_tolerance(spec.graph, tuple(m.dtype for m in spec.inputs))


def _graph_dtypes(graph_json: str, input_dtypes: tuple[str, ...]) -> tuple[list[torch.dtype], list[str]]:
    graph = json.loads(graph_json)
    metas = [m for n in graph["nodes"] for m in (n["meta"] if isinstance(n["meta"], list) else [n["meta"]])
             if m is not None]   # a tuple-valued node (native_layer_norm) has one meta per piece
    dtypes = [TensorMeta.from_json(m).torch_dtype for m in metas]
    return dtypes + [dtype_from_name(d) for d in input_dtypes], [n["op"] for n in graph["nodes"]]


@functools.lru_cache(maxsize=1024)
def _graph_tolerance(graph_json: str, input_dtypes: tuple[str, ...]) -> tuple[float, float]:
    return region_tolerance(*_graph_dtypes(graph_json, input_dtypes))  # once per region, not per trial


@functools.lru_cache(maxsize=1024)
def _graph_dtypes_bar(graph_json: str, input_dtypes: tuple[str, ...]) -> tuple[float, float] | None:
    return elementwise_bar(_graph_dtypes(graph_json, input_dtypes)[0])


class Trials:
    """The trials' inputs, float64 references and vendor outputs, computed afresh on each call.

    fill_cache's ``TrialStore`` keeps them instead, so that all candidates of a spec are judged
    on the same trials against references computed once. ``seconds`` is the time spent drawing
    inputs and computing references (``reference``) and vendor outputs (``vendor``).
    """

    def __init__(self, spec: KernelSpec, sample_inputs: Callable[[KernelSpec, int, str, Any], list[torch.Tensor]],
                 device: str | torch.device = "cpu", reference_device: str | torch.device = "cpu"):
        self.spec, self.sample_inputs = spec, sample_inputs
        self.device, self.reference_device = device, str(reference_device)
        self.seconds = {"reference": 0.0, "vendor": 0.0}

    def inputs(self, seed: int, kind: str) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return self.sample_inputs(self.spec, seed, kind, self.device)
        finally:
            self.seconds["reference"] += time.perf_counter() - t0

    def reference(self, seed: int, kind: str, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        """The float64 reference; None where the op rejects this edge kind (histc of inf)."""
        t0 = time.perf_counter()
        try:
            return self.spec.reference(inputs, self.reference_device)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            if kind in ("random", "captured"):
                first = (str(e).strip().splitlines() or [""])[0]
                raise InputRejected(f"{self.spec.op}'s reference rejects the {kind} inputs of trial seed {seed} "
                                    f"({type(e).__name__}: {first}): could not check; the op needs an input "
                                    "domain rule (core/input_domains.py)") from e
            return None
        finally:
            sync_device(self.reference_device)
            self.seconds["reference"] += time.perf_counter() - t0

    def vendor(self, seed: int, kind: str, inputs: Sequence[torch.Tensor],
               ref: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], bool]:
        """The vendor op's outputs on these inputs, and whether they are far from the float64
        reference (fail its bar): then the candidate is judged against them instead."""
        t0 = time.perf_counter()
        try:
            out = self.spec.run_vendor(inputs)
            return out, self.far_from(out, ref)
        finally:
            sync_device(self.device)
            self.seconds["vendor"] += time.perf_counter() - t0

    def far_from(self, vendor: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> bool:
        """Whether the vendor op's outputs fail the float64 bar against the reference."""
        return not compare_all(vendor, ref, self.spec).ok

    def forget(self, seed: int, kind: str) -> None:
        """Drop what is kept of one trial (a candidate wrote to its inputs); nothing is kept here."""

    def vendor_needs_reference(self, seed: int, kind: str) -> bool:
        """Whether ``vendor`` of this trial still compares with the reference (else validation
        lets the reference go first: it and the vendor's output need not be held at once)."""
        return True


def sync_device(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# On an edge trial where the vendor op uses more than this share of the float64 bar (and passes
# it), the trial's arithmetic, not the kernel, is at the bar: a candidate is judged there against
# the reference at twice the bar (``at_the_bar``). Mixtral's fp16 down projection (K = 14336) on
# "large" inputs (x1e3) sums products of ~1e6 into partial sums of ~1e8 whose finite results
# cancel to ~1e4: on an H100, cuBLAS failed the bar in three of four buckets and a Triton
# candidate failed it by 2% in the fourth, where cuBLAS did not (fp32 on the CPU, in either order,
# stays near 0.1 of the bar: the tensor cores' accumulation is coarser). A candidate must not
# fail for a draw the vendor happened to win.
VENDOR_AT_THE_BAR = 0.5

# What decided a validation: the float64 bar, the elementwise bar against the vendor output, or
# (an edge trial on which the vendor op itself is far from float64) the vendor output alone.
BY_REFERENCE, BY_ELEMENTWISE, BY_VENDOR = "float64 reference", "elementwise vs vendor", "vendor (far from float64)"
BY_EXACT_NEARER = " (or float64, where nearer)"  # compare_elementwise_or_exact decided some elements
BY_AT_THE_BAR = "float64 reference at twice the bar (the vendor at it too)"
BY_TERMS = "float64 reference, cancelling elements by the size of their terms"
BY_VENDOR_ERROR = "float64 reference, relative to the vendor's error (a whole graph: core/graph_accuracy.py)"


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
    # the elementwise bar against the vendor output, by output dtype (absent: not applied)
    elementwise: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    elementwise_waived: list[str] = dataclasses.field(default_factory=list)  # kinds where the vendor left float64
    max_vendor_abs_err: float = 0.0   # max |out - vendor| over the trials the elementwise bar judged
    decided_by: str = ""              # the bar that failed it, or the bars it passed
    trials_note: str = ""             # why the trials are fewer than usual (fill_cache: a huge spec)
    # trials (by kind) whose elements nearer the float64 reference than the vendor's were judged
    # against the reference (``compare_elementwise_or_exact``)
    elementwise_exact: list[str] = dataclasses.field(default_factory=list)
    at_the_bar: list[str] = dataclasses.field(default_factory=list)  # edge kinds judged at twice the bar
    by_terms: list[str] = dataclasses.field(default_factory=list)  # edge kinds whose cancelling elements _by_terms judged

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("max_abs_err", "max_rel_err", "max_err", "max_vendor_abs_err"):
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


def validate(run: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]], spec: KernelSpec,
             sample_inputs: Callable[[KernelSpec, int, str, Any], list[torch.Tensor]],
             edge_kinds: Sequence[str] = (), seeds: Sequence[int] = DEFAULT_SEEDS,
             device: str | torch.device = "cpu", extra_trials: int = 0,
             trials: Trials | None = None, reference_device: str = "cpu",
             resolve_ties: Callable | None = None, elementwise_bar: bool = False,
             magnitudes: Callable | None = None) -> ValidationRecord:
    """Run ``run`` (inputs -> outputs, its buffers filled before each run) on every trial, twice
    per trial (``_run_on_both_fills``); stop at the first failure.

    ``sample_inputs(spec, seed, kind, device)`` draws the inputs of one trial; ``extra_trials``
    adds trials of kind "captured" (seed = index), e.g. the real inputs a repro captured.
    ``trials`` (e.g. fill_cache's TrialStore) supplies each trial's inputs, reference and vendor
    outputs instead of computing them here. ``resolve_ties(spec, inputs, outs, refs)`` (a
    family's; by default core/index_ties.py's) settles choices the op leaves open before each
    comparison. ``elementwise_bar``:
    every trial must also pass ``compare_elementwise`` against the vendor op's output, except
    where that output is itself far from float64 (then it is the bar, as ``vendor_judged``).
    ``magnitudes``: a family's ``term_magnitudes`` (``_judge_edge``)."""
    source = trials or Trials(spec, sample_inputs, device, reference_device)
    settle = resolve_ties or settle_index_ties  # (a family's hook settles these ops too: KernelFamily)
    plan = [(s, "random") for s in seeds] + [(seeds[0] + 1000 + i, k) for i, k in enumerate(edge_kinds)]
    plan += [(i, "captured") for i in range(extra_trials)]
    kinds = [k for _, k in plan]
    region_tol = _region_tolerance(spec) if spec.op == "region" else None
    tol = {m.dtype: list(region_tol or tolerance(m.torch_dtype, spec.op)) for m in spec.outputs}
    whole = is_whole(spec)  # judged as a compiled model is (graph_accuracy.py), not by one op's bars
    bars = {m.dtype: list(b) for m in spec.outputs if (b := _elementwise_bar(spec, m)) is not None} \
        if elementwise_bar and not whole else {}
    graph_judged = False
    worst_abs = worst_rel = worst = worst_vendor = 0.0
    vendor_judged: list[str] = []
    at_the_bar: list[str] = []
    by_terms: list[str] = []
    waived: list[str] = []
    exact_nearer: list[str] = []

    def failed(n, seed, kind, c, by):
        return ValidationRecord(False, list(seeds), kinds, n, c.max_abs, c.max_rel, tol,
                                f"trial {n} ({kind}, seed {seed}): {c.reason}", c.max_err,
                                source.reference_device, vendor_judged, bars, waived, worst_vendor, by)

    for n, (seed, kind) in enumerate(plan, 1):
        inputs = source.inputs(seed, kind)
        ref = source.reference(seed, kind, inputs)
        if ref is None:
            continue
        before = [t.clone() for t in inputs]
        try:
            outs, unstable = _run_on_both_fills(run, inputs, seed, device)
        except Exception as e:
            return ValidationRecord(False, list(seeds), kinds, n, math.inf, math.inf, tol,
                                    f"trial {n} ({kind}, seed {seed}) raised {type(e).__name__}: {e}",
                                    reference_device=source.reference_device, elementwise=bars,
                                    decided_by=BY_REFERENCE)
        written = changed_input(before, inputs)
        if written is not None:
            source.forget(seed, kind)  # kept for the next candidate: it must be drawn again
            return ValidationRecord(False, list(seeds), kinds, n, math.inf, math.inf, tol,
                                    f"trial {n} ({kind}, seed {seed}): the kernel wrote to its {written}; "
                                    "a kernel must leave its inputs as they were",
                                    reference_device=source.reference_device, elementwise=bars,
                                    decided_by=BY_REFERENCE)
        del before
        if unstable is not None:
            return ValidationRecord(False, list(seeds), kinds, n, math.inf, math.inf, tol,
                                    f"trial {n} ({kind}, seed {seed}): {unstable}",
                                    reference_device=source.reference_device, elementwise=bars,
                                    decided_by=BY_REFERENCE)
        c = compare_all(settle(spec, inputs, outs, ref), ref, spec)
        if c.ok and not source.vendor_needs_reference(seed, kind):
            ref = None
        vendor, far = (None, False)
        if bars or (not c.ok and kind not in ("random", "captured")):
            vendor, far = source.vendor(seed, kind, inputs, ref)
        by = BY_REFERENCE
        if not c.ok and whole:
            if vendor is None:
                vendor, far = source.vendor(seed, kind, inputs, ref)
            why = judge_graph(settle(spec, inputs, outs, ref), ref, vendor)
            c = dataclasses.replace(c, ok=why is None, reason=why or "")
            by, graph_judged = BY_VENDOR_ERROR, graph_judged or why is None
        elif not c.ok and kind not in ("random", "captured"):
            again = _judge_edge(spec, settle, inputs, outs, ref, vendor, far, magnitudes, source.reference_device)
            if again is not None:
                c, by = again
                if c.ok:
                    {BY_VENDOR: vendor_judged, BY_AT_THE_BAR: at_the_bar, BY_TERMS: by_terms}[by].append(kind)
        if not c.ok:
            return failed(n, seed, kind, c, by)
        if bars and (far or kind not in ("random", "captured")):
            # users' allclose is a check on inputs like theirs: on edge trials (values near
            # overflow, inf, NaN) two right fp32 GEMMs differ by more than 1e-4 on elements that
            # cancel; those trials are judged by the float64 reference (and the vendor) above
            waived.append(kind)
        elif bars:
            settled = settle(spec, inputs, outs, vendor)
            e = compare_elementwise(settled, vendor, spec)
            if not e.ok:
                exact = ref if ref is not None else source.reference(seed, kind, inputs)
                either = compare_elementwise_or_exact(settled, vendor, exact, spec)
                if not either.ok:
                    e.reason += " (nor are they all within it of the float64 reference where nearer it)"
                    return failed(n, seed, kind, e, BY_ELEMENTWISE)
                exact_nearer.append(kind)
                del exact
            del settled
            worst_vendor = max(worst_vendor, e.max_abs)  # |out - vendor|, nearer float64 or not
        worst_abs, worst_rel, worst = max(worst_abs, c.max_abs), max(worst_rel, c.max_rel), max(worst, c.max_err)
        del inputs, ref, outs, vendor  # nothing of this trial is held into the next
    elementwise = BY_ELEMENTWISE + (BY_EXACT_NEARER if exact_nearer else "")
    decided = " + ".join([BY_VENDOR_ERROR if graph_judged else BY_REFERENCE] + ([elementwise] if bars else [])
                         + [b for b, kinds in ((BY_VENDOR, vendor_judged), (BY_AT_THE_BAR, at_the_bar),
                                                 (BY_TERMS, by_terms)) if kinds])
    return ValidationRecord(True, list(seeds), kinds, len(plan), worst_abs, worst_rel, tol, max_err=worst,
                            reference_device=source.reference_device, vendor_judged=vendor_judged,
                            elementwise=bars, elementwise_waived=waived, elementwise_exact=exact_nearer,
                            at_the_bar=at_the_bar, by_terms=by_terms,
                            max_vendor_abs_err=worst_vendor,
                            decided_by=decided)


def _judge_edge(spec: KernelSpec, settle: Callable, inputs: Sequence[torch.Tensor],
                outs: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], vendor: Sequence[torch.Tensor],
                far: bool, magnitudes: Callable | None = None,
                reference_device: str = "cpu") -> tuple[Comparison, str] | None:
    """An edge trial (near overflow, inf, NaN) a candidate fails against float64, judged again
    where the vendor op shows the trial's arithmetic itself is off: far from float64, the
    candidate must match what the vendor computes (each element: the nearer of the two, at twice
    the bar); at the bar (more than ``VENDOR_AT_THE_BAR`` of it), the reference at twice the bar.
    Where that fails too and ``magnitudes`` gives the size of each element's terms, ``_by_terms``.
    None where the vendor sits well inside the bar and nothing else applies: the failure stands."""
    again = None
    if far:
        settled = settle(spec, inputs, outs, vendor)
        again = compare_all(settled, nearest_expected(settled, ref, vendor), spec, factor=2.0), BY_VENDOR
    elif not compare_all(vendor, ref, spec, factor=VENDOR_AT_THE_BAR).ok:
        again = compare_all(settle(spec, inputs, outs, ref), ref, spec, factor=2.0), BY_AT_THE_BAR
    if (again is None or not again[0].ok) and magnitudes is not None:
        mags = magnitudes(spec, inputs, reference_device)
        if mags is not None:
            snapped = _by_terms(settle(spec, inputs, outs, ref), ref, vendor, mags)
            terms = compare_all(snapped, nearest_expected(snapped, ref, vendor) if far else ref, spec, factor=2.0)
            if terms.ok or again is None:
                return terms, BY_TERMS
    return again


# An edge trial's element whose candidate is within this many times the vendor's worst error per
# unit of terms (|vendor - ref| / terms) of the reference counts as right (``_by_terms``).
TERMS_FACTOR = 4.0
# ... that error taken at least as fp32's unit roundoff (the accumulator of every sums-of-products
# family): where the vendor happens to land on the reference everywhere, an element whose terms
# are ~1e4 times its size is still no better determined in fp32 than that.
ACCUMULATOR_ROUNDOFF = 2.0 ** -24


def _by_terms(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], vendors: Sequence[torch.Tensor],
              mags: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``outs`` with each finite element that is within ``TERMS_FACTOR`` x the vendor's worst
    error per unit of its terms' size (``mags``) of the reference replaced by the reference.

    A GEMM on "large" inputs sums products of ~1e6 into partial sums of ~1e7 whose finite results
    cancel to ~1e4; an epilogue multiplying by another large input turns the fp32 order's error
    into 10% of such an element (the matmul group's fp16 SiLU-times-up region on an H100: 692 off
    7208 where cuBLAS landed near it). Per unit of its terms the error is the accumulation's, as the
    vendor's is (taken at least as fp32's roundoff: ``ACCUMULATOR_ROUNDOFF``); the output's scale
    does not see it. An element its terms do not swamp (terms ~ its value)
    gets an allowance far below the bar, so a wrong element still fails; so does a NaN or an
    infinity out of place (judged after, as ever)."""
    out = []
    for o, r, v, m in zip(outs, refs, vendors, mags):
        if not (isinstance(o, torch.Tensor) and o.is_floating_point() and o.shape == r.shape == v.shape == m.shape):
            out.append(o)
            continue
        # block by block, as nearest_expected: whole, the float64 temporaries were several outputs' size
        snapped = o.detach().contiguous().clone()
        flat, big, limit = snapped.reshape(-1), torch.finfo(o.dtype).max, _chunk_elements(o.numel())
        ends = [(i, min(i + limit, flat.numel())) for i in range(0, flat.numel(), limit)]
        rf, vf, mf = (t.detach().reshape(-1) for t in (r, v, m))  # (row-major, as ``flat``)

        def block(i: int, j: int) -> tuple[torch.Tensor, ...]:
            o64, r64, v64, m64 = (t[i:j].to(o.device, torch.float64) for t in (flat, rf, vf, mf))
            finite = o64.isfinite() & r64.isfinite() & v64.isfinite() & (m64 > 0) & (r64.abs() <= big)
            return o64, r64, v64, m64, finite

        unit = ACCUMULATOR_ROUNDOFF  # the vendor's worst error per unit of terms, at least this
        for i, j in ends:
            _, r64, v64, m64, finite = block(i, j)
            if bool(finite.any()):
                unit = max(unit, float(((v64 - r64).abs() / m64)[finite].max()))
        for i, j in ends:
            o64, r64, _, m64, finite = block(i, j)
            near = finite & ((o64 - r64).abs() <= TERMS_FACTOR * unit * m64)
            flat[i:j] = torch.where(near, r64, o64).to(o.dtype)
        out.append(snapped)
    return out


def _distance(out: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|out - want| elementwise, 0 where both are the same NaN or infinity, inf where only one is NaN."""
    o, w = out.detach().to(want.device, torch.float64), want.to(torch.float64)
    same = (o.isnan() & w.isnan()) | (o == w)
    d = (o - w).abs()
    return torch.where(same, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf))


def nearest_expected(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor],
                     vendors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per element, the float64 reference or the vendor's output, whichever the candidate is
    nearer: on an edge trial where the vendor leaves the reference, each element must be right
    or be what the vendor computes (AVX-512 ATen gives gelu(+inf) = NaN, the exact answer inf)."""
    merged = []
    for o, r, v in zip(outs, refs, vendors):
        if not (isinstance(o, torch.Tensor) and o.is_floating_point() and o.shape == r.shape == v.shape):
            merged.append(v)
            continue
        # block by block, on the candidate's device: whole, its float64 temporaries were ~5x the
        # output's size, and a reference kept on the host pulled the work there
        m = torch.empty(o.shape, dtype=torch.float64, device=o.device)
        limit = _chunk_elements(o.numel())
        for mb, ob, rb, vb in zip(_blocks(m, limit), _blocks(o.detach(), limit), _blocks(r, limit), _blocks(v, limit)):
            rb, vb = rb.to(o.device, torch.float64), vb.to(o.device, torch.float64)
            mb.copy_(torch.where(_distance(ob, rb) <= _distance(ob, vb), rb, vb))
        merged.append(m)
    return merged
