"""Our decompositions of scatters, running reductions and the ops the breadth sweep left on the host
(issue 44): merged into decompositions.OWN_DECOMPOSITIONS (OVERRIDES: SCATTER_OVERRIDES).

Scatters whose elements combine by something other than a sum (prod, amax, amin, and the plain
``scatter``, whose last write wins) are computed densely: each destination element along the dim
against each index along it, ``hit[..., k, j] = index[..., j] == k``, reduced over j with the
reductions family (amax/amin/sum) or, for prod, a product of the J slices (a fused region). That is
O(n * J) work and memory, bounded by DENSE_MAX elements (larger inputs decline); sums and means add
with scatter_add (the indexing family's atomics). Running max/min (cummax, cummin) and mode compare
every element of a row with every other (rows up to QUADRATIC_MAX_N). All index arithmetic done by
reductions is in float32: exact below 2**24.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from torch_kernelize.compiling.decomposition_registry import registrar

aten = torch.ops.aten
SCATTER_DECOMPOSITIONS: dict[Any, Callable] = {}
SCATTER_OVERRIDES: set[Any] = set()     # ops whose torch decomposition would not lower (prims) or not apply

DENSE_MAX = 1 << 24        # elements of the dense hit tensor of a scatter (and pool windows, cdist)
QUADRATIC_MAX_N = 4096     # row length of the N x N compares of cummax/cummin/mode
PROD_MAX_J = 64            # a product over J slices, unrolled

_register = registrar(SCATTER_DECOMPOSITIONS, SCATTER_OVERRIDES)


def _lowest(dtype: torch.dtype, largest: bool) -> float:
    return float("-inf") if largest else float("inf")


# --- scatters ---------------------------------------------------------------------------------------

def _dense_hits(x: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor):
    """(hit, values, J): the dim moved last; ``hit[..., k, j]``: index j along the dim names
    destination k; ``values[..., 1, j]`` the src element it carries (src cut to index's shape);
    None where the dense tensor would pass DENSE_MAX."""
    n, J = x.size(dim), index.size(dim)
    if J == 0 or index.numel() // J * n * J > DENSE_MAX:
        return None
    for k in range(index.dim()):
        if src.size(k) != index.size(k):
            src = src.narrow(k, 0, index.size(k))
    idx, vals = index.movedim(dim, -1), src.movedim(dim, -1)
    k = torch.arange(n, device=x.device).reshape(n, 1)
    return idx.unsqueeze(-2) == k, vals.unsqueeze(-2), J


def _place(r: torch.Tensor, got: torch.Tensor, x: torch.Tensor, dim: int, keep_x: Callable) -> torch.Tensor:
    """``r`` ([..., n] over index's other dims, dim moved last) where ``got`` (its received mask)
    holds, else ``x``; index's other dims may be shorter than x's (padded: nothing received there)."""
    r, got = r.movedim(-1, dim), got.movedim(-1, dim)
    if tuple(r.shape) != tuple(x.shape):
        pads = [p for d in reversed(range(x.dim())) for p in (0, x.size(d) - r.size(d))]
        r = torch.constant_pad_nd(r, pads, 0.0)
        got = torch.constant_pad_nd(got.to(torch.float32), pads, 0.0) > 0
    return torch.where(got, keep_x(r), x)


def _product(hit: torch.Tensor, vals: torch.Tensor, J: int) -> torch.Tensor:
    """The product over j of the values that hit (1 elsewhere), as J multiplies of slices."""
    out = None
    for j in range(J):
        v = torch.where(hit.select(-1, j), vals.select(-1, j), 1.0)
        out = v if out is None else out * v
    return out


def _scatter_reduce_impl(x, dim: int, index, src, reduce: str, include_self: bool):
    if x.dim() == 0:
        out = _scatter_reduce_impl(x.reshape(1), 0, index.reshape(1), src.reshape(1), reduce, include_self)
        return out if out is NotImplemented else out.reshape(())
    dim %= x.dim()
    if index.numel() == 0:
        return x.clone()
    if reduce in ("sum", "mean"):
        if reduce == "mean" and not x.is_floating_point():
            return NotImplemented  # (ATen floor-divides integer means)
        count = torch.scatter_add(torch.zeros_like(x), dim, index, torch.ones_like(src))
        start = x if include_self else torch.where(count > 0, 0, x)
        total = torch.scatter_add(start, dim, index, src)
        if reduce == "sum":
            return total
        count = count + 1 if include_self else count
        return torch.where(count > 0, total / torch.where(count > 0, count, 1), x)
    if reduce not in ("prod", "amax", "amin") or not x.is_floating_point():
        return NotImplemented
    dense = _dense_hits(x, dim, index, src)
    if dense is None or (reduce == "prod" and dense[2] > PROD_MAX_J):
        return NotImplemented
    hit, vals, J = dense
    got = hit.to(torch.float32).amax(-1) > 0
    if reduce == "prod":
        r = _product(hit, vals, J)
        return _place(r, got, x, dim, (lambda t: t * x) if include_self else (lambda t: t))
    largest = reduce == "amax"
    r = torch.where(hit, vals, _lowest(x.dtype, largest))
    r = r.amax(-1) if largest else r.amin(-1)
    both = torch.maximum if largest else torch.minimum
    return _place(r, got, x, dim, (lambda t: both(t, x)) if include_self else (lambda t: t))


@_register(aten.scatter_reduce.two)
def _scatter_reduce(x, dim: int, index, src, reduce: str, *, include_self: bool = True):
    """scatter_reduce: sum and mean (of floats) by scatter_add, with the count of values each
    element received; prod, amax and amin (of floats) densely. Without include_self, an element
    that receives values is their reduction alone; one that receives none keeps its value."""
    return _scatter_reduce_impl(x, dim, index, src, reduce, include_self)


@_register(aten.index_reduce.default)
def _index_reduce(x, dim: int, index, source, reduce: str, *, include_self: bool = True):
    """index_reduce is scatter_reduce with the 1-D index spread over source's shape along dim."""
    if x.dim() == 0:
        x, source, squeeze = x.reshape(1), source.reshape(1), True
    else:
        squeeze = False
    dim %= x.dim()
    shape = [1] * source.dim()
    shape[dim] = index.numel()
    full = index.reshape(shape).expand(source.shape)
    out = _scatter_reduce_impl(x, dim, full, source, reduce, include_self)
    return out.reshape(()) if squeeze and out is not NotImplemented else out


def _scatter_last(x, dim: int, index, src):
    """scatter of src: each element named by the index takes the value of the last index naming
    it (as ATen's CPU loop, in order); densely."""
    if x.dim() == 0:
        out = _scatter_last(x.reshape(1), 0, index.reshape(1), src.reshape(1))
        return out if out is NotImplemented else out.reshape(())
    dim %= x.dim()
    if index.numel() == 0:
        return x.clone()
    dense = _dense_hits(x, dim, index, src)
    if dense is None:
        return NotImplemented
    hit, vals, J = dense
    j = torch.arange(J, device=x.device, dtype=torch.float32)
    last = torch.where(hit, j, -1.0).amax(-1)                          # [..., n]
    picked = vals.squeeze(-2).gather(-1, last.clamp(min=0).to(torch.int64))
    return _place(picked.to(x.dtype), last >= 0, x, dim, lambda t: t)


@_register(aten.scatter.src)
def _scatter_src(x, dim: int, index, src):
    return _scatter_last(x, dim, index, src)


@_register(aten.scatter.value)
def _scatter_value(x, dim: int, index, value):
    return _scatter_last(x, dim, index, torch.full(index.shape, value, dtype=x.dtype, device=x.device))


@_register(aten.put.default)
def _put(x, index, source, accumulate: bool = False):
    """put into the flattened x (negative indices from the end): adds by scatter_add, or stores
    (the last of repeated indices wins) densely."""
    flat = x.reshape(-1)
    if index.numel() == 0:
        return x.clone()
    idx = index.reshape(-1)
    idx = torch.where(idx < 0, idx + flat.numel(), idx)
    src = source.reshape(-1)
    out = torch.scatter_add(flat, 0, idx, src) if accumulate else _scatter_last(flat, 0, idx, src)
    return out if out is NotImplemented else out.reshape(x.shape)


@_register(aten.masked_scatter.default)
def _masked_scatter(x, mask, source):
    """The i-th True of the (broadcast) mask takes source's i-th element: its position is the
    cumsum of the mask (the scan family), gathered from the flat source."""
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    if source.numel() == 0 or math.prod(shape) == 0:
        return NotImplemented
    m = mask.expand(shape).reshape(-1)
    pos = torch.cumsum(m, 0) - 1
    vals = source.reshape(-1).gather(0, pos.clamp(0, source.numel() - 1))
    return torch.where(m, vals, x.expand(shape).reshape(-1)).reshape(shape)


@_register(aten.diagonal_scatter.default, override=True)  # torch's is prims.copy_to
def _diagonal_scatter(x, src, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """src on the diagonal (j - i == offset of dims dim1, dim2), by a gather along src's last
    dim and a select."""
    dim1, dim2 = dim1 % x.dim(), dim2 % x.dim()
    if dim1 == dim2:
        return NotImplemented
    xt = x.movedim((dim1, dim2), (-2, -1))
    R, C, L = xt.size(-2), xt.size(-1), src.size(-1)
    if L == 0:
        return x.clone()
    i = torch.arange(R, device=x.device).reshape(R, 1)
    j = torch.arange(C, device=x.device).reshape(1, C)
    on = (j - i) == offset
    k = (i.expand(R, C) if offset >= 0 else j.expand(R, C)).clamp(0, L - 1)
    picked = src.index_select(-1, k.reshape(-1)).reshape(*src.shape[:-1], R, C)
    return torch.where(on, picked.to(x.dtype), xt).movedim((-2, -1), (dim1, dim2))


@_register(aten.as_strided_scatter.default, override=True)  # torch's is prims.as_strided_scatter
def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """src into the view of a contiguous x: each of the view's positions (distinct, checked) takes
    its element by scatter_add into -0.0 (x + -0.0 == x, for every x), selected by where."""
    offset = storage_offset or 0
    if not x.is_contiguous() or x.storage_offset() != 0 or math.prod(size) > 1 << 20:
        return NotImplemented
    positions = {offset}
    for n, st in zip(size, stride):
        positions = {p + i * st for p in positions for i in range(n)} if n else set()
    if len(positions) != math.prod(size) or (positions and (min(positions) < 0 or max(positions) >= x.numel())):
        return NotImplemented  # an overlapping view (ATen leaves its values undefined) or outside x
    flat = x.reshape(-1)
    if not positions:
        return x.clone()
    pos = torch.full((), offset, dtype=torch.int64, device=x.device)
    for d, (n, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        pos = pos + torch.arange(n, device=x.device).reshape(shape) * st
    pos = pos.reshape(-1)
    vals = torch.scatter_add(torch.full_like(flat, -0.0), 0, pos, src.reshape(-1).to(x.dtype))
    got = torch.scatter_add(torch.zeros_like(flat), 0, pos, torch.ones_like(pos, dtype=x.dtype))
    return torch.where(got > 0, vals, flat).reshape(x.shape)


# --- running max/min, mode, nanmedian ----------------------------------------------------------------

def _by_rows(x, dim: int, body):
    """A (values, indices) op along ``dim`` from an N x N compare: ``body(dim, N, x with dim
    last)``; a 0-d ``x`` is its own answer at index 0; NotImplemented where no compare is made
    (not floating, empty, or too large: the op stays on its own rung)."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    dim %= x.dim()
    N = x.size(dim)
    if not x.is_floating_point() or N == 0 or N > QUADRATIC_MAX_N or x.numel() * N > DENSE_MAX:
        return NotImplemented
    return body(dim, N, x.movedim(dim, -1))


def _cumulative_best(x, dim: int, largest: bool):
    """cummax/cummin: the best of each prefix (NaN propagates) and the last index holding it (a
    later equal element takes the index, as ATen's ``x >= best``), from an N x N compare."""
    def body(dim: int, N: int, xt: torch.Tensor):
        i = torch.arange(N, device=x.device).reshape(N, 1)
        j = torch.arange(N, device=x.device).reshape(1, N)
        upto = j <= i                                                       # [N (prefix), N]
        row = xt.unsqueeze(-2)                                              # [..., 1, N]
        masked = torch.where(upto, row, _lowest(x.dtype, largest))
        best = masked.amax(-1) if largest else masked.amin(-1)              # [..., N]
        b = best.unsqueeze(-1)
        match = upto & ((row == b) | ((row != row) & (b != b)))
        last = torch.where(match, j.to(torch.float32), -1.0).amax(-1).to(torch.int64)
        return best.movedim(-1, dim), last.movedim(-1, dim)
    return _by_rows(x, dim, body)


@_register(aten.cummax.default)
def _cummax(x, dim: int):
    return _cumulative_best(x, dim, True)


@_register(aten.cummin.default)
def _cummin(x, dim: int):
    return _cumulative_best(x, dim, False)


@_register(aten.mode.default)
def _mode(x, dim: int = -1, keepdim: bool = False):
    """The most frequent value of each row (the smallest of equally frequent ones, as ATen's sort
    and scan) and the last index holding it; counts from an N x N compare. Rows with NaN: the
    count of a NaN is 0 (it equals nothing), so NaN is a mode only of an all-NaN row."""
    def body(dim: int, N: int, xt: torch.Tensor):
        count = (xt.unsqueeze(-1) == xt.unsqueeze(-2)).to(torch.float32).sum(-1)      # [..., N]
        top = count.amax(-1, keepdim=True)
        value = torch.where(count == top, xt, float("inf")).amin(-1, keepdim=True)
        value = torch.where(top > 0, value, float("nan"))
        j = torch.arange(N, device=x.device, dtype=torch.float32)
        at = torch.where((xt == value) | ((xt != xt) & (value != value)), j, -1.0).amax(-1, keepdim=True).to(torch.int64)
        value, at = value.movedim(-1, dim), at.movedim(-1, dim)
        return (value, at) if keepdim else (value.squeeze(dim), at.squeeze(dim))
    return _by_rows(x, dim, body)


@_register(aten.nanmedian.default)
def _nanmedian(x):
    """The lower median of the non-NaN elements (sorted, NaN last), NaN when all are NaN."""
    if x.numel() == 0:
        return NotImplemented
    ordered = torch.sort(x.reshape(-1), stable=True).values
    count = (x == x).to(torch.float32).sum()
    k = torch.floor(torch.clamp(count - 1, min=0) / 2).to(torch.int64).reshape(1)
    return ordered.gather(0, k).reshape(())


@_register(aten.nanmedian.dim)
def _nanmedian_dim(x, dim: int = -1, keepdim: bool = False):
    """Per row along ``dim``: the lower median of the non-NaN elements and its index, from a
    stable sort (NaN last) and a count of the non-NaN; an all-NaN row gives NaN (its first)."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
    if x.numel() == 0 or x.size(dim) > 2**24:
        return NotImplemented  # (ATen's error; a count in float32 is exact below 2**24)
    values, indices = torch.sort(x, dim=dim, stable=True)
    count = (x == x).to(torch.float32).sum(dim, keepdim=True)
    k = torch.floor(torch.clamp(count - 1, min=0) / 2).to(torch.int64)
    values, indices = values.gather(dim, k), indices.gather(dim, k)
    return (values, indices) if keepdim else (values.squeeze(dim), indices.squeeze(dim))


# --- hashes ---------------------------------------------------------------------------------------

def _xor_halves(y: torch.Tensor) -> torch.Tensor:
    """The xor of ``y``'s last dim (int64) as a tree of elementwise xors of its halves (no xor
    reduction exists): padded with zeros (xor's identity) to a power of two, log2 steps."""
    n = y.size(-1)
    p = 1 << max(0, (n - 1).bit_length())
    if p != n:
        y = torch.constant_pad_nd(y, [0, p - n], 0)
    while y.size(-1) > 1:
        h = y.size(-1) // 2
        y = torch.bitwise_xor(y[..., :h], y[..., h:])
    return y.squeeze(-1)


_HASH_TENSOR = getattr(aten, "hash_tensor", None)   # torch 2.13; not in 2.11


if _HASH_TENSOR is not None:
    @_register(_HASH_TENSOR.default)
    def _hash_tensor(x, dim=(), keepdim: bool = False, *, mode: int = 0):
        """mode 0: the xor over ``dim`` (every dim if none) of each element's bits widened to 64
        (floats as float64, integers and bool as int64), as uint64."""
        if mode != 0 or x.is_complex():
            return NotImplemented
        dims = sorted({d % max(x.dim(), 1) for d in dim}) if dim else list(range(x.dim()))
        if x.dim() and any(x.size(d) == 0 for d in dims):
            return NotImplemented  # (ATen's error)
        bits = x.to(torch.float64 if x.is_floating_point() else torch.int64).view(torch.int64)
        if not dims or x.dim() == 0:
            return bits.clone().view(torch.uint64)
        keep = [d for d in range(x.dim()) if d not in dims]
        y = _xor_halves(bits.permute(keep + dims).reshape([x.size(d) for d in keep] + [-1]))
        if keepdim:
            y = y.reshape([1 if d in dims else x.size(d) for d in range(x.dim())])
        return y.view(torch.uint64)


# --- products, distances, pooling ------------------------------------------------------------------

@_register(aten.addbmm.default)
def _addbmm(x, batch1, batch2, *, beta=1, alpha=1):
    """beta * x + alpha * (the sum over the batch of batch1 @ batch2); beta = 0 ignores x (NaN too)."""
    r = torch.bmm(batch1, batch2).sum(0)
    if alpha != 1:
        r = r * alpha
    if beta == 0:
        return r.expand(torch.broadcast_shapes(x.shape, r.shape)).clone()
    return (x if beta == 1 else x * beta) + r


@_register(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p: float, compute_mode=None):
    """The p-norm distance of every row pair from the differences (not the mm expansion of p = 2,
    whose cancellation loses accuracy): p = 0 counts the differing coordinates, inf takes the
    largest."""
    if x1.size(-1) == 0 or p < 0:
        return NotImplemented
    diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)                          # [..., P, R, M]
    if math.prod(diff.shape) > DENSE_MAX:
        return NotImplemented
    if p == 0:
        return (diff != 0).to(x1.dtype).sum(-1)
    if p == 1:
        return diff.abs().sum(-1)
    if p == 2:
        return (diff * diff).sum(-1).sqrt()
    if math.isinf(p):
        return diff.abs().amax(-1)
    return diff.abs().pow(p).sum(-1).pow(1.0 / p)


@_register(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim: int = 1):
    """Each input unsqueezed at its expand dims, the three multiplied (broadcast), summed over sumdim."""
    def spread(t, dims):
        for d in sorted(dims):
            t = t.unsqueeze(d)
        return t
    prod = spread(i1, expand1) * spread(i2, expand2) * spread(i3, expand3)
    return prod.sum(list(sumdim)) if sumdim else prod


def _window_masks(n: int, out: int, device) -> torch.Tensor:
    """[out, n]: h lies in adaptive window i, from floor(i n / out) to ceil((i + 1) n / out)."""
    i = torch.arange(out, device=device).reshape(out, 1)
    h = torch.arange(n, device=device).reshape(1, n)
    return ((h + 1) * out > i * n) & (h * out < (i + 1) * n)


def _adaptive_max_pool2d(x, output_size):
    """Adaptive max pooling with indices (flat in each plane): the window's max (NaN propagates)
    and its first index (the last NaN's, as ATen's ``val > max || isnan(val)``), densely."""
    H, W = x.size(-2), x.size(-1)
    oh, ow = output_size
    if x.dim() not in (3, 4) or not x.is_floating_point() or H * W == 0 or oh * ow == 0:
        return NotImplemented
    if x.numel() * oh * ow > DENSE_MAX or H * W >= 1 << 24:
        return NotImplemented
    win = (_window_masks(H, oh, x.device).reshape(oh, 1, H, 1)
           & _window_masks(W, ow, x.device).reshape(1, ow, 1, W))          # [oh, ow, H, W]
    xs = x.unsqueeze(-3).unsqueeze(-3)                                     # [..., 1, 1, H, W]
    best = torch.where(win, xs, float("-inf")).amax((-2, -1))              # [..., oh, ow]
    b = best.unsqueeze(-1).unsqueeze(-1)
    flat = torch.arange(H * W, device=x.device, dtype=torch.float32).reshape(H, W)
    first = torch.where(win & (xs == b), flat, float(H * W)).amin((-2, -1))
    last_nan = torch.where(win & (xs != xs), flat, -1.0).amax((-2, -1))
    at = torch.where(best != best, last_nan, first).to(torch.int64)
    return best, at


@_register(aten.adaptive_max_pool2d.default, override=True)  # torch's applies to even windows only
def _adaptive_max_pool2d_or_torch(x, output_size):
    out = _adaptive_max_pool2d(x, output_size)
    if out is NotImplemented:
        from torch._decomp import decomposition_table
        return decomposition_table[aten.adaptive_max_pool2d.default](x, output_size)
    return out
