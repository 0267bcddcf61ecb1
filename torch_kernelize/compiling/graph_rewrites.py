"""Rewrites a whole-graph candidate may apply before Inductor compiles the graph (issue 35, "measured
tiers"): each is a decomposition table, by name, whose functions return NotImplemented where they
do not apply. fill_cache's Inductor generator offers "Inductor's program of the graph rewritten so"
as one more candidate (``fill_cache/inductor.py``); it is validated and timed against Inductor's
program of the graph as traced and the graph's own assembly, so a rewrite is kept only where it
measured faster, never by rank.

- ``patch-conv``: a convolution whose kernel (larger than 1x1) equals its stride (no padding, no
  dilation, one group, not transposed; a vision transformer's patch embedding, ConvNeXt's stem and
  downsampling layers) as one GEMM over non-overlapping patches. Its im2col is a reshape and a
  permute, no gather: (N, C, o0, k0, o1, k1) to (N * o0 * o1, C * k0 * k1), times the weight as
  (C * k0 * k1, Cout), plus the bias (``addmm``: cuBLAS's bias epilogue on CUDA). On the H100
  a ViT-B/16 patch embedding ran as cuDNN's NCHW-to-NHWC conversion and an sm80-class kernel,
  0.31 ms a call
  (`benchmarks/results/2026-12-06-h100-vit-max-autotune.log`), for a GEMM of 7.4 GFLOP (about
  0.02 ms at the tensor cores' rate) and 19 MB to move. The result has the convolution's layout
  (channels-last where an operand is, as cuDNN gives it; else contiguous): the graph's layouts
  are unchanged.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

aten = torch.ops.aten


def patch_convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any, padding: Any,
                      dilation: Any, transposed: bool, output_padding: Any, groups: int) -> Any:
    """``aten.convolution`` where the kernel tiles the input (kernel == stride), else NotImplemented."""
    k = list(weight.shape[2:])
    s = len(k)
    if x.dim() != s + 2 or not _tiles(k, stride, padding, dilation, transposed, groups):
        return NotImplemented
    n, c, cout = x.shape[0], x.shape[1], weight.shape[0]
    outs = [size // kk for size, kk in zip(x.shape[2:], k)]
    if n == 0 or any(o == 0 for o in outs):
        return NotImplemented
    # a remainder of an input dim that no patch covers is dropped, as the convolution drops it
    cropped = x[(slice(None), slice(None), *[slice(0, o * kk) for o, kk in zip(outs, k)])]
    patches = cropped.reshape(n, c, *[v for o, kk in zip(outs, k) for v in (o, kk)])
    order = [0, *[2 + 2 * d for d in range(s)], 1, *[3 + 2 * d for d in range(s)]]  # (N, o..., C, k...)
    cols = patches.permute(order).reshape(n * math.prod(outs), c * math.prod(k))
    w = weight.reshape(cout, c * math.prod(k)).t()
    out = aten.addmm(bias, cols, w) if bias is not None else aten.mm(cols, w)
    out = out.view(n, *outs, cout).permute(0, s + 1, *range(1, s + 1))  # channels-last strides
    return out if _channels_last(x, weight, s) else out.contiguous()


def _tiles(k: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, groups: int) -> bool:
    """Whether a convolution's kernel tiles its input: kernel == stride, larger than 1x1 (a 1x1 is
    cuDNN's own GEMM, and an NCHW input would need a transpose), no padding or dilation, one group."""
    return (not transposed and groups == 1 and len(k) > 0 and list(stride) == list(k) and math.prod(k) > 1
            and all(p == 0 for p in padding) and all(d == 1 for d in dilation))


def _channels_last(x: torch.Tensor, weight: torch.Tensor, spatial: int) -> bool:
    """Whether the convolution gives its output channels-last: either operand is (cuDNN's rule)."""
    fmt = {2: torch.channels_last, 3: torch.channels_last_3d}.get(spatial)
    return fmt is not None and any(t.is_contiguous(memory_format=fmt) and not t.is_contiguous() for t in (x, weight))


# rewrite name -> decomposition table (make_fx's ``decomposition_table``)
REWRITES: dict[str, dict[Any, Callable]] = {
    "patch-conv": {aten.convolution.default: patch_convolution},
}


# rewrite name -> whether it has something to change at a node of an encoded region graph
# (core/region_graph.py: the node's op and literal arguments; ``shape_of`` a tensor argument's shape)
SITES: dict[str, Callable[[dict, Callable[[Any], Any]], bool]] = {
    "patch-conv": lambda node, shape_of: node["op"] == "aten.convolution.default" and _tiles(
        list(shape_of(node["args"][1]))[2:], *node["args"][3:7], node["args"][8]),
}


def counted(name: str, applied: list) -> dict[Any, Callable]:
    """The rewrite ``name``'s table, each function appending to ``applied`` where it applied."""
    def wrap(fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if out is not NotImplemented:
                applied.append(fn.__name__)
            return out
        return run
    return {op: wrap(fn) for op, fn in REWRITES[name].items()}
