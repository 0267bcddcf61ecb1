"""The fused-region family's data model (fused.py): a region's nodes (``_Node``), its inputs and
outputs as the kernel addresses them (``_Tensor``) and the plan of one region (``_Plan``), which
fused_analysis.py builds and the emitters (fused_emit.py, fused_emit_rowwise.py) write out."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.elementwise import PointwiseOp
from torch_kernelize.core.spec import TensorMeta

Ref = tuple  # ("input", i) | ("node", j) | ("const", number)


@dataclasses.dataclass
class _Node:
    index: int
    op: str
    role: str                     # "pointwise" | "reduce" | "softmax"
    meta: TensorMeta
    args: dict[str, Any]          # bound arguments (encoded)
    operands: list[Ref]           # pointwise: one per op operand; reduce/softmax: [x]
    vtype: str                    # type of the node's Triton variable
    ctype: str = ""               # pointwise: the type its arithmetic runs in
    pw: PointwiseOp | None = None
    reduce: str = ""              # sum mean amax amin softmax log_softmax
    shape: str = "full"           # "full" | "row"
    level: int = 0
    exact: bool = False           # the variable holds a value exactly representable in meta.dtype
    rounds: bool = False          # a cast to fp16/bf16: the value is rounded to it
    cat: tuple | None = None      # cat: (dim, ((piece ref, start, size), ...)) along the output


@dataclasses.dataclass
class _Tensor:
    """An input or output as the kernel addresses it."""
    name: str                     # in0 / out1
    meta: TensorMeta
    cls: str                      # rowwise: full row col scalar; pointwise: block scalar
    strides: tuple[int, ...]      # broadcast to the iteration shape
    row_off: str = "0"            # rowwise: offset of the row (expression over rows)
    col_stride: int = 0           # rowwise: stride of the last dim
    flat_off: str = "0"           # pointwise: offset expression over idx
    hint: bool = False            # 16-byte alignment of the base pointer implies aligned vectors
    piece: tuple[int, int] | None = None  # pointwise, read in a cat piece: (cat node, piece)
    shift: int = 0                # ... and the element offset of that piece's start


@dataclasses.dataclass
class _Plan:
    kind: str
    nodes: list[_Node]
    inputs: list[_Tensor]
    outputs: list[_Tensor]
    out_nodes: list[int]
    shape: tuple[int, ...]        # iteration shape (full)
    M: int = 1
    N: int = 1
    lead_sizes: tuple[int, ...] = ()
    lead_strides: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # inputs then outputs
    flat_sizes: tuple[int, ...] = ()
    flat_strides: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # outputs then inputs
    cat_coords: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # cat dim -> its
    # coordinate as a stride set over flat_sizes
    pieces: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)  # (cat, piece) ->
    # the nodes computed for that piece, in order
    passes: int = 1
    helpers: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _vtype(dtype: str) -> str:
    return "float32" if dtype in cg.FLOAT_TYPES else dtype


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()
