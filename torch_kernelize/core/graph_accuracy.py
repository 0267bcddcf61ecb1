"""A whole graph's outputs judged as a compiled model's are: against the float64 reference,
relative to the error its own ops make in the graph's precision.

A graph of hundreds of ops in float16 (a transformer, a ResNet) is as far from float64 as its
rounding takes it: eager PyTorch itself misses a single op's bar there, on every element that
many layers amplify. A candidate program for the graph (Inductor's, our assembly) is right when
it is no further from float64 than the vendor's execution of the same graph (eager ATen ops in
the graph's dtypes) is, within a factor: the rule torch._dynamo's accuracy check applies to a
compiled model (``torch._dynamo.utils.same`` with ``fp64_ref``): per output,
``RMSE(out, ref64) <= multiplier * RMSE(vendor, ref64) + atol / 10``, with multiplier 3 for 16-bit
floats and 2 otherwise, each RMSE over the elements where it and the reference are finite.

Non-finite values sit where the vendor's are or where the reference's are: a program that keeps
a value finite where the vendor's float16 overflowed (it computes in float32 inside a fusion) is
nearer float64, and that value is then judged by the RMSE above; where the vendor overflowed, a
NaN for its inf (or the other way) is the same overflow summed in another order, and an infinity
where float64 is within the dtype's tolerance of its largest value (of float64's sign) is a
rounding across the edge that the vendor's order stayed under. Where the vendor has no finite
element that float64 has (an input far beyond what the graph's precision computes: every weight of
a deep network drawn large), its error is unbounded everywhere and the RMSE rule has nothing to
scale by: the output passes if its non-finite values sit as above (``same`` would call the vendor's
NaN "unable to produce this with stable numerics in this precision"). Integer and boolean outputs
equal the reference's or the vendor's: ``same`` compares them with the eager result in the graph's
precision, and where they come from rounded floats float64 may choose otherwise at a near-tie. An
op that picks positions by comparing floats and whose picks are read (an MoE router's top-k, whose
flip moves every later position of the stable sort of the expert ids) ends a whole graph's
stretch (compiling/whole_graph.py): it is judged as its own op, on rows without ties.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from torch_kernelize.core.tolerances import tolerance

WHOLE = "whole"   # the region kind of a whole graph (compiling/whole_graph.py)


def is_whole(spec: Any) -> bool:
    """Whether ``spec`` is a whole graph's region (read from its canonical graph)."""
    graph = getattr(spec, "graph", None)
    return bool(graph) and f'"kind":"{WHOLE}"' in graph and json.loads(graph).get("kind") == WHOLE


def multiplier(dtype: torch.dtype) -> float:
    return 3.0 if dtype in (torch.float16, torch.bfloat16) else 2.0


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Over the elements where both are finite."""
    d = (a - b)[a.isfinite() & b.isfinite()]
    return float(d.square().mean().sqrt()) if d.numel() else 0.0


def _non_finite(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf, per element."""
    return t.isnan().to(torch.int8) + 2 * (t == float("inf")).to(torch.int8) + 3 * (t == float("-inf")).to(torch.int8)


def judge_output(out: torch.Tensor, ref: torch.Tensor, vendor: torch.Tensor) -> str | None:
    """None if ``out`` passes the rule above for one output; else why not."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if not out.dtype.is_floating_point and not out.dtype.is_complex:
        out = out.to(ref.device, ref.dtype)
        wrong = int((out != ref).sum())
        if not wrong:
            return None
        unlike_vendor = int((out != vendor.to(ref.device, ref.dtype)).sum())
        return None if not unlike_vendor else (
            f"{wrong} element(s) differ from the reference, {unlike_vendor} from the vendor's")
    o, v, r = (torch.view_as_real(t) if t.is_complex() else t for t in (out, vendor, ref))
    # on the reference's device (the host where a graph's float64 reference does not fit on the
    # GPU: Llama's logits on the H200 met a CUDA output there)
    o, v, r = (t.to(ref.device).double() for t in (o, v, r))
    kinds, vendor_kinds, ref_kinds = _non_finite(o), _non_finite(v), _non_finite(r)
    atol, rtol = tolerance(out.dtype)
    # where the vendor overflowed and float64 did not, which non-finite value comes out is the
    # order of a sum (inf - inf is NaN): any of them is the vendor's overflow
    overflowed = (vendor_kinds != 0) & (ref_kinds == 0) & (kinds != 0)
    # an infinity of the reference's sign where float64 is within the dtype's tolerance of its
    # largest value: rounding in another order crosses the edge the vendor stayed under
    if out.dtype.is_floating_point:
        edge = torch.finfo(out.dtype).max / (1 + rtol)
        overflowed |= (o.isinf() & (r.abs() >= edge) & (o.sign() == r.sign()))
    wrong = ~((kinds == vendor_kinds) | (kinds == ref_kinds) | overflowed)
    if bool(wrong.any()):
        at = int(wrong.flatten().nonzero()[0])
        return (f"its non-finite values are neither where the vendor's are nor where the reference's are "
                f"({int(wrong.sum())} element(s); first at flat index {at}: {o.flatten()[at].item():.6g}, "
                f"vendor {v.flatten()[at].item():.6g}, float64 {r.flatten()[at].item():.6g})")
    if not bool((v.isfinite() & r.isfinite()).any()):
        # no element where the vendor and float64 are both finite: its error is unbounded on every
        # one (a deep graph's "large" trial: eager's float32 ConvNeXt is NaN throughout where float64
        # reaches 1e10), so no output is further from float64 than it; the placement rule above holds
        return None
    mine, theirs = _rmse(o, r), _rmse(v, r)
    bar = multiplier(out.dtype) * theirs + atol / 10
    if mine > bar:
        return (f"RMSE against float64 {mine:.3g}, above {multiplier(out.dtype):g} x the vendor's {theirs:.3g} "
                f"+ {atol / 10:g}")
    return None


def judge(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], vendor: Sequence[torch.Tensor]) -> str | None:
    """None if every output passes; else which one fails and why."""
    if not (len(outs) == len(refs) == len(vendor)):
        return f"{len(outs)} outputs, the reference has {len(refs)}, the vendor {len(vendor)}"
    for i, (o, r, v) in enumerate(zip(outs, refs, vendor)):
        why = judge_output(o, r, v)
        if why is not None:
            return f"output {i}: {why}"
    return None
