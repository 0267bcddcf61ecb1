"""float64 replacements of ops whose kernels run no float64, for float64 references.

A reference (``KernelSpec.reference``, a region's or whole graph's replay in region_graph.py)
runs each op on float64 tensors. Some ops have no float64 kernel: CUDA's fused attention
(attention_reference.py writes it out) and ``aten._grouped_mm`` (float32, bfloat16 and float16
only, on every device). Each is replaced here by what it computes, written in ops that take
float64. One table, keyed by overload: a new op of this kind is one entry.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from torch_kernelize.core.attention_reference import ATTENTION

aten = torch.ops.aten


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten._grouped_mm`` of a 2-D input by 3-D weights with offsets (an MoE's experts: rows
    [offs[e-1], offs[e]) by ``mat_b[e]``), the one form the grouped_mm family computes. Rows past
    the last offset are zero: the op leaves them unwritten (cuBLAS), so any value is the op's, and
    the family's kernels write zeros there as transformers' own loop does. ``out_dtype``: a
    reference's outputs stay float64, compared with outputs of any dtype."""
    if mat_a.dim() != 2 or mat_b.dim() != 3 or offs is None:
        raise ValueError("aten._grouped_mm's float64 reference takes a 2-D input, 3-D weights and offsets")
    if bias is not None:
        raise ValueError("aten._grouped_mm with a bias has no float64 reference here")
    out = mat_a.new_zeros(mat_a.shape[0], mat_b.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        end = min(max(int(end), start), mat_a.shape[0])
        out[start:end] = mat_a[start:end] @ mat_b[e]
        start = end
    return out


REFERENCES: dict[Any, Callable] = {**ATTENTION, aten._grouped_mm.default: _grouped_mm}


def float64_reference(target: Any, args: list) -> Callable | None:
    """The replacement of ``target`` for a replay on float64 tensors; None where it runs as it is."""
    fn = REFERENCES.get(target)
    if fn is None or not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float64:
        return None
    return fn
