"""The one place where accuracy tolerances are written down.

A candidate output ``out`` passes against the float64 reference ``ref`` when, elementwise,
``|out - ref| <= atol * scale + rtol * |ref|`` where ``scale = max(1, max|ref|)`` over the
finite reference values (so a sum that cancels to ~0 is judged against the size of its terms'
result, not against 0); NaN only where the reference has NaN; infinities equal, sign included.
Integer and bool outputs must match exactly. Complex outputs are judged as complex numbers
(``|out - ref|`` is the modulus of the difference) under their real dtype's tolerances.
"""
from __future__ import annotations

import torch

# (atol, rtol) by output dtype. fp16/bf16 rows allow a few ulps of the output format.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 2e-2),
}

# Per-op adjustments, keyed by op name: multiplies the dtype tolerance. Keep this short and
# say why for each row.
OP_FACTORS: dict[str, float] = {
    # TF32-free fp32 matmuls still sum K products in another order than the float64 reference.
    "aten.mm.default": 4.0, "aten.addmm.default": 4.0, "aten.bmm.default": 4.0,
    "aten.convolution.default": 4.0,
    # transformers' MoE expert matmul (lowering/kernels/grouped_mm.py): the mm rows of each expert
    "transformers.grouped_mm_fallback.default": 4.0,
    "aten._grouped_mm.default": 4.0,
}


def _real(dtype: torch.dtype) -> torch.dtype:
    """complex64 -> float32 (the precision of its parts), other dtypes as they are."""
    return dtype.to_real() if dtype.is_complex else dtype


def tolerance(dtype: torch.dtype, op: str | None = None) -> tuple[float, float]:
    """(atol, rtol) for an output of ``dtype`` produced by ``op``; (0, 0) means exact. A complex
    output is judged by the bar of its parts' dtype (on the modulus of its difference)."""
    dtype = _real(dtype)
    if not dtype.is_floating_point:
        return 0.0, 0.0
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    f = OP_FACTORS.get(op or "", 1.0)
    return atol * f, rtol * f


def region_tolerance(dtypes: "list[torch.dtype]", ops: "list[str]") -> tuple[float, float]:
    """(atol, rtol) for the output of a fused region: the loosest tolerance of any value the
    region rounds on the way (an fp16 matmul read back as fp32 carries fp16's error) times the
    largest per-op factor among its nodes."""
    floats = [_real(d) for d in dtypes if d.is_floating_point or d.is_complex]
    if not floats:
        return 0.0, 0.0
    atol, rtol = max((TOLERANCES.get(d, TOLERANCES[torch.float32]) for d in floats), key=lambda t: t[0])
    f = max([OP_FACTORS.get(op, 1.0) for op in ops] or [1.0])
    return atol * f, rtol * f


# The elementwise bar a stored kernel must also meet against the vendor op's own output, on every
# trial: ``|out - vendor| <= atol + rtol * |vendor|``, what ``torch.allclose`` checks (and
# KernelBench, and users comparing with eager). The float64 bar above scales atol by max|ref|, so
# where an output's largest value is big it is loose for the small elements; this one is not.
# It applies on random and captured trials (inputs like users'); edge trials, and a trial where
# the vendor op itself is far from float64 (validate's ``vendor_judged``), are waived.
ELEMENTWISE_BAR: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 1e-2),
}


def elementwise_bar(dtypes: "list[torch.dtype]") -> tuple[float, float] | None:
    """(atol, rtol) of the bar against the vendor output for an output computed through values
    of ``dtypes`` (a region's: the loosest of them, as ``region_tolerance``); None where no
    bar is written down (float64, integers: the float64 bar alone decides)."""
    bars = [ELEMENTWISE_BAR[_real(d)] for d in dtypes if _real(d) in ELEMENTWISE_BAR]
    return max(bars, key=lambda t: t[0]) if bars else None
