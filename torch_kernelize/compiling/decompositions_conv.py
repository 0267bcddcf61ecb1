"""Convolutions as gathers and batched matmuls, for a chip without a convolution engine (issue 44):
merged into decompositions.OWN_DECOMPOSITIONS.

- 1-D and 2-D: im2col by ``unfold`` (torch decomposes it into a pad and one gather) + bmm.
- 3-D: the same im2col built here, one gather of the padded input by three broadcast index
  tensors (torch's ``unfold`` is 2-D only), + bmm.
- Transposed (1-D to 3-D): the regular convolution, stride 1, of the input with ``stride - 1``
  zeros inserted between its elements and ``dilation * (k - 1) - padding`` padded on each side
  (``output_padding`` more on the high side; a negative pad crops), by the weight with its
  spatial dims flipped and in/out channels swapped within each group. The inserted zeros cost
  ``prod(stride)`` times the multiply-adds of a scatter-based col2im, but only plain pads,
  gathers and a bmm run: no atomics, the same sums in every order.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from torch_kernelize.compiling.decomposition_registry import registrar

aten = torch.ops.aten
CONV_DECOMPOSITIONS: dict[Any, Callable] = {}
_register = registrar(CONV_DECOMPOSITIONS)


def _out_sizes(sizes, k, stride, padding, dilation) -> list[int]:
    return [(n + 2 * p - d * (kk - 1) - 1) // s + 1 for n, kk, s, p, d in zip(sizes, k, stride, padding, dilation)]


def _im2col(x: torch.Tensor, k, stride, padding, dilation) -> torch.Tensor:
    """(N, C * prod(k), prod(out)) columns of a convolution over any number of spatial dims: the
    zero-padded input gathered at ``o * stride + j * dilation`` along each dim by broadcast index
    tensors, the kernel offsets then moved before the output positions."""
    s = len(k)
    outs = _out_sizes(x.shape[2:], k, stride, padding, dilation)
    pads = [p for d in reversed(range(s)) for p in (padding[d], padding[d])]
    padded = torch.constant_pad_nd(x, pads, 0.0) if any(pads) else x
    index = []
    for d in range(s):  # dim d's index: shape (k_d, out_d) at its place among the 2 * s broadcast dims
        idx = (torch.arange(k[d], device=x.device) * dilation[d]).reshape(k[d], 1) \
            + (torch.arange(outs[d], device=x.device) * stride[d]).reshape(1, outs[d])
        index.append(idx.reshape([1] * (2 * d) + [k[d], outs[d]] + [1] * (2 * (s - d - 1))))
    cols = padded[(slice(None), slice(None), *index)]  # (N, C, k0, o0, k1, o1, ...)
    order = [0, 1] + [2 + 2 * d for d in range(s)] + [3 + 2 * d for d in range(s)]
    n, c = x.shape[:2]
    k_all, o_all = 1, 1
    for kk, o in zip(k, outs):
        k_all, o_all = k_all * kk, o_all * o
    return cols.permute(order).reshape(n, c * k_all, o_all)


def _conv_bmm(cols: torch.Tensor, weight: torch.Tensor, bias, groups: int, outs) -> torch.Tensor:
    """The grouped matmul of im2col columns (N, C*K, L) by the weight (Cout, C/G, k...)."""
    n, cout = cols.shape[0], weight.shape[0]
    ck = weight[0].numel()  # C/G * prod(k)
    cols = cols.reshape(n * groups, ck, cols.shape[-1])
    w = weight.reshape(groups, cout // groups, ck)
    w = w.unsqueeze(0).expand(n, groups, cout // groups, ck).reshape(n * groups, cout // groups, ck)
    out = torch.bmm(w, cols).reshape(n, cout, *outs)
    if bias is not None:
        out = out + bias.reshape(1, cout, *[1] * len(outs))
    return out


def _conv2d_by_unfold(x, weight, bias, stride, padding, dilation, groups):
    """Non-transposed 1-D and 2-D convolution as im2col (unfold) + batched matmul."""
    one_d = weight.dim() == 3
    if one_d:  # treat (N, C, L) as (N, C, 1, L)
        x, weight = x.unsqueeze(2), weight.unsqueeze(2)
        stride, padding, dilation = [1, stride[0]], [0, padding[0]], [1, dilation[0]]
    kh, kw = weight.shape[2:]
    cols = torch.nn.functional.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
    out = _conv_bmm(cols, weight, bias, groups, _out_sizes(x.shape[2:], (kh, kw), stride, padding, dilation))
    return out.squeeze(2) if one_d else out


def _conv_nd(x, weight, bias, stride, padding, dilation, groups):
    """Non-transposed convolution over any number of spatial dims (3-D) as im2col + bmm."""
    k = weight.shape[2:]
    cols = _im2col(x, k, stride, padding, dilation)
    return _conv_bmm(cols, weight, bias, groups, _out_sizes(x.shape[2:], k, stride, padding, dilation))


def _zero_insert(x: torch.Tensor, stride) -> torch.Tensor:
    """``stride - 1`` zeros after every element along each spatial dim: (n - 1) * s + 1 long,
    plus s - 1 trailing zeros per dim that the caller's pad crops."""
    if all(s == 1 for s in stride):
        return x
    n, c, sizes = x.shape[0], x.shape[1], x.shape[2:]
    spread = x.reshape(n, c, *[v for size in sizes for v in (size, 1)])
    pads = [p for s in reversed(stride) for p in (0, s - 1, 0, 0)]  # each size-1 slot grows to s
    spread = torch.constant_pad_nd(spread, pads, 0.0)  # (N, C, n0, s0, n1, s1, ...)
    return spread.reshape(n, c, *[size * s for size, s in zip(sizes, stride)])


def _transposed_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """(Cin, Cout/G, k...) -> (Cout, Cin/G, k...), spatial dims flipped."""
    cin, cout_g, k = weight.shape[0], weight.shape[1], weight.shape[2:]
    w = weight.reshape(groups, cin // groups, cout_g, *k).transpose(1, 2).reshape(groups * cout_g, cin // groups, *k)
    return torch.flip(w, list(range(2, w.dim())))


def _conv_transposed(x, weight, bias, stride, padding, dilation, output_padding, groups):
    """Transposed convolution as the stride-1 convolution of the zero-inserted, padded input."""
    k = weight.shape[2:]
    low = [d * (kk - 1) - p for kk, p, d in zip(k, padding, dilation)]
    high = [lo + op - (s - 1) for lo, op, s in zip(low, output_padding, stride)]  # s - 1: _zero_insert's tail
    pads = [p for d in reversed(range(len(k))) for p in (low[d], high[d])]
    xz = _zero_insert(x, stride)
    xz = torch.constant_pad_nd(xz, pads, 0.0) if any(pads) else xz
    w = _transposed_weight(weight, groups)
    return _convolution(xz, w, bias, [1] * len(k), [0] * len(k), list(dilation), False, [0] * len(k), groups)


@_register(aten.convolution.default)
def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """1-D to 3-D convolution, transposed or not. The 3-D and transposed paths decline empty
    operands (the gathers have nothing to read; eager returns an empty output or raises)."""
    if weight.dim() not in (3, 4, 5) or x.dim() != weight.dim():
        return NotImplemented
    if not transposed and weight.dim() < 5:
        return _conv2d_by_unfold(x, weight, bias, stride, padding, dilation, groups)
    k = weight.shape[2:]
    if transposed:
        outs = [(n - 1) * s - 2 * p + d * (kk - 1) + op + 1
                for n, kk, s, p, d, op in zip(x.shape[2:], k, stride, padding, dilation, output_padding)]
    else:
        outs = _out_sizes(x.shape[2:], k, stride, padding, dilation)
    if x.numel() == 0 or weight.numel() == 0 or any(v <= 0 for v in outs):
        return NotImplemented
    if transposed:
        return _conv_transposed(x, weight, bias, stride, padding, dilation, output_padding, groups)
    return _conv_nd(x, weight, bias, stride, padding, dilation, groups)
