"""Index outputs judged by what the op promises, not by the reference's choice among ties.

argmax, max/min with a dim, topk, sort, kthvalue, median, mode and max pooling return the index
of an element; where several elements are equal, any of them is right (ATen's own CUDA and CPU
kernels pick differently, and a sort need not be stable). Before an index output is compared with
the reference's, each index that names an element equal to the one the reference names (NaN
equal to NaN), inside the op's own range (the row, or the pooling window), is replaced by the
reference's index. Indices out of range, outside their window, naming a different value, or a
row of topk/sort naming one element twice stay as they are, for the comparison to reject.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from torch_kernelize.core.encoding import decode_arg
from torch_kernelize.core.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class AlongDim:
    """An op whose output ``out`` holds indices of ``self``'s elements along a dim: the dim is
    argument ``dim_at`` (default ``dim_default``; None: over the flattened input); ``keepdim_at``
    names the keepdim argument of a reduction; None: the indices have ``self``'s rank (topk, sort),
    and a row must not name one element twice."""
    dim_at: int
    dim_default: int | None
    keepdim_at: int | None
    out: int


@dataclasses.dataclass(frozen=True)
class Pooling:
    """max_pool{2,3}d_with_indices: output ``out`` holds flat indices into each input plane, which
    must lie in the output element's window (arguments 1-4: kernel_size, stride, padding, dilation)."""
    spatial: int
    out: int = 1


OPS: dict[str, AlongDim | Pooling] = {
    "aten.argmax.default": AlongDim(1, None, 2, 0),
    "aten.argmin.default": AlongDim(1, None, 2, 0),
    "aten.max.dim": AlongDim(1, None, 2, 1),
    "aten.min.dim": AlongDim(1, None, 2, 1),
    "aten.kthvalue.default": AlongDim(2, -1, 3, 1),
    "aten.median.dim": AlongDim(1, None, 2, 1),
    "aten.nanmedian.dim": AlongDim(1, None, 2, 1),
    "aten.mode.default": AlongDim(1, -1, 2, 1),
    "aten.topk.default": AlongDim(2, -1, None, 1),
    "aten.sort.default": AlongDim(1, -1, None, 1),
    "aten.max_pool2d_with_indices.default": Pooling(2),
    "aten.max_pool3d_with_indices.default": Pooling(3),
}


def settle_index_ties(spec: KernelSpec, inputs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                      refs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """``outs`` with the index output of ``spec``'s op (if OPS has it) settled on ``refs``'
    choice wherever the candidate's choice is as good (module docstring); else ``outs``."""
    rule = OPS.get(spec.op)
    if rule is None or len(outs) <= rule.out or len(refs) <= rule.out or not spec.args:
        return outs
    args = [decode_arg(a, inputs) for a in spec.args]
    kwargs = {k: decode_arg(v, inputs) for k, v in spec.kwargs.items()}
    x, got, want = args[0], outs[rule.out], refs[rule.out]
    if not isinstance(x, torch.Tensor) or not isinstance(got, torch.Tensor) or x.is_complex():
        return outs
    want = want.to(got.device, torch.int64)
    if got.shape != want.shape or got.dtype != torch.int64 or got.numel() == 0 or x.numel() == 0:
        return outs
    x = x.to(got.device)
    if isinstance(rule, Pooling):
        settled = _settle_pooling(rule, x, args, kwargs, got, want)
    else:
        settled = _settle_along_dim(rule, x, args, kwargs, got, want)
    if settled is None:
        return outs
    return [settled if i == rule.out else o for i, o in enumerate(outs)]


def _arg(args: list[Any], kwargs: dict[str, Any], at: int, name: str, default: Any) -> Any:
    """Argument ``name`` (position ``at``), or ``default`` where it is not given or None."""
    value = args[at] if len(args) > at else kwargs.get(name)
    return default if value is None else value


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b


def _take(got: torch.Tensor, want: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``want`` where ``ok``, else ``got``, in ``got``'s layout (torch.where's is its own)."""
    return torch.empty_like(got).copy_(torch.where(ok, want, got))


def _settle_along_dim(rule: AlongDim, x: torch.Tensor, args: list[Any], kwargs: dict[str, Any],
                      got: torch.Tensor, want: torch.Tensor) -> torch.Tensor | None:
    dim = _arg(args, kwargs, rule.dim_at, "dim", rule.dim_default)
    if dim is None:  # argmax/argmin over all elements: indices into the flattened input
        x, dim = x.reshape(-1), 0
        g, w = got.reshape(-1), want.reshape(-1)
    elif x.dim() == 0:
        return None
    else:
        dim = dim % x.dim()
        reduces = rule.keepdim_at is not None
        keep = reduces and bool(_arg(args, kwargs, rule.keepdim_at, "keepdim", False))
        g, w = (got.unsqueeze(dim), want.unsqueeze(dim)) if reduces and not keep else (got, want)
    if g.dim() != x.dim() or bool(((g < 0) | (g >= x.shape[dim])).any()):
        return None
    if rule.keepdim_at is None and g.shape[dim] > 1 and bool((g.sort(dim).values.diff(dim=dim) == 0).any()):
        return None  # one element named twice: no tie explains it
    ok = _same(x.gather(dim, g), x.gather(dim, w))
    return _take(got, want, ok.reshape(got.shape))


def _settle_pooling(rule: Pooling, x: torch.Tensor, args: list[Any], kwargs: dict[str, Any],
                    got: torch.Tensor, want: torch.Tensor) -> torch.Tensor | None:
    n = rule.spatial
    if x.dim() not in (n + 1, n + 2) or got.dim() != x.dim():
        return None

    def per_dim(at: int, name: str, default: Any) -> list[int]:
        value = _arg(args, kwargs, at, name, default)
        value = default if value == [] else value   # stride=[]: the kernel size
        value = list(value) if isinstance(value, (list, tuple)) else [value]
        return value * n if len(value) == 1 else value

    kernel = per_dim(1, "kernel_size", 1)
    stride = per_dim(2, "stride", kernel)
    padding, dilation = per_dim(3, "padding", 0), per_dim(4, "dilation", 1)
    sizes = list(x.shape[-n:])
    plane = 1
    for s in sizes:
        plane *= s
    if bool(((got < 0) | (got >= plane)).any()):
        return None
    flat_x = x.reshape(*x.shape[:-n], plane)
    g, w = got.reshape(*got.shape[:-n], -1), want.reshape(*want.shape[:-n], -1)
    ok = _same(flat_x.gather(-1, g), flat_x.gather(-1, w)).reshape(got.shape)
    rest = got
    for d in reversed(range(n)):  # each coordinate of the index inside its output element's window
        coord, rest = rest % sizes[d], rest // sizes[d]
        axis = got.dim() - n + d
        shape = [1] * got.dim()
        shape[axis] = got.shape[axis]
        start = torch.arange(got.shape[axis], device=got.device).reshape(shape) * stride[d] - padding[d]
        offset = coord - start
        ok &= (offset >= 0) & (offset % dilation[d] == 0) & (offset // dilation[d] < kernel[d])
    return _take(got, want, ok)
