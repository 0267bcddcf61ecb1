"""Decompositions of bucketize and of the histogram ops (issue 44) into a binary search (gathers),
index arithmetic and an index_add: merged into decompositions.OWN_DECOMPOSITIONS (OVERRIDES:
HISTOGRAM_OVERRIDES).

- ``bucketize.Tensor``: torch's binary search, on the input flattened to 1-D (torch's own indexes
  the boundaries with a 0-d tensor for a 0-d input: a read of the value on the host) and with
  the int64/int32 result for empty boundaries (torch's returns the input's dtype there);
- ``histogram.bin_ct``, ``histogram.bins_tensor``, ``_histogramdd_bin_edges``,
  ``_histogramdd_from_bin_cts``, ``_histogramdd_from_bin_tensors``: ATen's rule, per dimension
  (column of the input reshaped to (M, N)): the edges are ``linspace(min, max, bins + 1)`` of
  the column (or of ``range``; a range of one point widened by 0.5 each side, an empty input's
  [0, 1]); an element falls in the bin whose edges hold it, the last bin including its right
  edge (the count of edges at or below it, less one: a bucketize); NaN and elements outside
  the edges are dropped; the weights (or ones) are added at the linearized bin (index_add);
  ``density`` divides by the total and by each bin's width.

The edges follow ATen's linspace (``start + step * i`` up to half way, ``end - step * (steps -
1 - i)`` after) in the input's dtype; ATen's CPU kernel fuses the multiply-add (one rounding),
so an interior edge may differ from eager's in its last bit, and an element on that bit falls in
the neighbouring bin. The hist always agrees with the edges returned. A data range that is not
finite (inf or NaN in the input) raises where eager raises: the range is read through a gather
whose index is out of range exactly then (an IndexError where ATen raises a RuntimeError).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.compiling.decomposition_registry import registrar

aten = torch.ops.aten
HISTOGRAM_DECOMPOSITIONS: dict[Any, Callable] = {}  # merged into decompositions.OWN_DECOMPOSITIONS
HISTOGRAM_OVERRIDES: set[Any] = set()

_register = registrar(HISTOGRAM_DECOMPOSITIONS, HISTOGRAM_OVERRIDES)
_FLOATS = (torch.float32, torch.float64)  # ATen's CPU histograms dispatch floating types only


@_register(aten.bucketize.Tensor, override=True)  # torch's reads a 0-d input's bucket on the host
def _bucketize(x: torch.Tensor, boundaries: torch.Tensor, *, out_int32: bool = False, right: bool = False):
    """torch's binary search (``ceil(log2(n + 1))`` gathers from the boundaries) on ``x`` as 1-D."""
    from torch._decomp import decomposition_table
    search = decomposition_table.get(aten.bucketize.Tensor)
    if search is None or boundaries.dim() != 1 or x.is_complex() or boundaries.is_complex():
        return NotImplemented  # (ATen's own error)
    dtype = torch.int32 if out_int32 else torch.int64
    if boundaries.numel() == 0 or x.numel() == 0:
        return torch.zeros(x.shape, dtype=dtype, device=x.device)
    return search(x.reshape(-1), boundaries, out_int32=out_int32, right=right).reshape(x.shape)


# --- edges ------------------------------------------------------------------------------------------

def _checked_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) (one entry per column) read through a gather whose index is out of range where an
    entry is not finite (NaN or inf in the data), so that the graph raises there as eager does."""
    n = lo.numel()
    pair = torch.cat([lo, hi])
    index = torch.where(torch.isfinite(pair), torch.arange(2 * n, device=lo.device), 2 * n)
    pair = pair.index_select(0, index)
    return pair[:n], pair[n:]


def _outer_edges(x2: torch.Tensor, range_: Sequence[float] | None) -> list[tuple[Any, Any]] | None:
    """Each column's (leftmost, rightmost) edge, as ATen's select_outer_bin_edges gives them:
    ``range`` (python floats), else the column's min and max (0-d tensors), else [0, 1] for an
    empty input; a range of one point widened by 0.5 each side. None: ATen raises (a bad range)."""
    n = x2.size(1)
    if range_ is not None:
        if len(range_) != 2 * n:
            return None
        pairs = [(float(range_[2 * d]), float(range_[2 * d + 1])) for d in range(n)]
        if not all(math.isfinite(a) and math.isfinite(b) and a <= b for a, b in pairs):
            return None
        return [(a - 0.5, b + 0.5) if a == b else (a, b) for a, b in pairs]
    if x2.numel() == 0:
        return [(0.0, 1.0)] * n
    lo, hi = _checked_range(x2.amin(0), x2.amax(0))
    same = lo == hi
    lo, hi = torch.where(same, lo - 0.5, lo), torch.where(same, hi + 0.5, hi)
    return [(lo[d], hi[d]) for d in range(n)]


def _linspace(lo: Any, hi: Any, steps: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """ATen's linspace of ``steps`` (>= 2) points in ``dtype``: from the start up to half way,
    from the end after it (so both ends are exact)."""
    lo = lo.to(dtype) if isinstance(lo, torch.Tensor) else torch.full((), lo, dtype=dtype, device=device)
    hi = hi.to(dtype) if isinstance(hi, torch.Tensor) else torch.full((), hi, dtype=dtype, device=device)
    i = torch.arange(steps, device=device)
    step = (hi - lo) / (steps - 1)
    return torch.where(i < steps // 2, lo + step * i.to(dtype), hi - step * (steps - 1 - i).to(dtype))


def _bin_edges(x2: torch.Tensor, bins: Sequence[int], range_) -> list[torch.Tensor] | None:
    outer = _outer_edges(x2, range_)
    if outer is None or len(bins) != x2.size(1) or any(b <= 0 for b in bins):
        return None
    return [_linspace(lo, hi, b + 1, x2.dtype, x2.device) for (lo, hi), b in zip(outer, bins)]


# --- counting ---------------------------------------------------------------------------------------

def _hist(x2: torch.Tensor, edges: list[torch.Tensor], weight: torch.Tensor | None, density: bool) -> torch.Tensor:
    """The histogram of the rows of ``x2`` (M, N) over the edges of each column: each row's bin
    linearized over the N dims, a dropped row sent to one bin past the end, then an index_add."""
    m, bins = x2.size(0), [e.numel() - 1 for e in edges]
    total = math.prod(bins)
    flat = torch.zeros(m, dtype=torch.int64, device=x2.device)
    keep = torch.ones(m, dtype=torch.bool, device=x2.device)
    stride = total
    for d, e in enumerate(edges):
        col = x2[:, d]
        stride //= bins[d]
        keep = keep & (col >= e[0]) & (col <= e[-1])  # (False for NaN)
        pos = torch.bucketize(col, e, right=True) - 1
        flat = flat + torch.where(pos >= bins[d], bins[d] - 1, pos) * stride  # the last bin holds its right edge
    flat = torch.where(keep, flat, total)
    add = weight.reshape(m) if weight is not None else torch.ones(m, dtype=x2.dtype, device=x2.device)
    hist = torch.zeros(total + 1, dtype=x2.dtype, device=x2.device).index_add(0, flat, add)[:total].reshape(bins)
    if density:
        hist = hist / hist.sum()
        for d, e in enumerate(edges):
            shape = [1] * len(bins)
            shape[d] = bins[d]
            hist = hist / (e[1:] - e[:-1]).reshape(shape)
    return hist


def _declines(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Inputs ATen rejects (its own error) or that the sketch above does not cover."""
    if x.dtype not in _FLOATS or (weight is not None and weight.dtype != x.dtype):
        return True
    return x.numel() >= 2**24 and x.dtype == torch.float32  # (float32 counts stay exact below 2**24)


def _rows(x: torch.Tensor, weight: torch.Tensor | None, n: int) -> tuple[torch.Tensor, bool]:
    """x as (M, N) rows (N > 0); whether ``weight`` has one entry per row (ATen's check)."""
    x2 = x.reshape(-1, n)
    return x2, weight is None or weight.numel() == x2.size(0)


@_register(aten.histogram.bin_ct)
def _histogram_bin_ct(x, bins: int = 100, *, range=None, weight=None, density: bool = False):
    if _declines(x, weight):
        return NotImplemented
    x2, ok = _rows(x, weight, 1)
    edges = _bin_edges(x2, [bins], range)
    if edges is None or not ok:
        return NotImplemented
    return _hist(x2, edges, weight, density), edges[0]


@_register(aten.histogram.bins_tensor)
def _histogram_bins_tensor(x, bins, *, weight=None, density: bool = False):
    if _declines(x, weight) or bins.dim() != 1 or bins.numel() < 2 or bins.dtype != x.dtype:
        return NotImplemented
    x2, ok = _rows(x, weight, 1)
    if not ok:
        return NotImplemented
    return _hist(x2, [bins], weight, density), bins.clone()


def _dd_edges(x, bins, range_, weight):
    if x.dim() < 2 or x.size(-1) == 0 or _declines(x, weight):
        return None
    x2, ok = _rows(x, weight, x.size(-1))
    edges = _bin_edges(x2, list(bins), range_)
    return (x2, edges) if ok and edges is not None else None


@_register(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(x, bins, *, range=None, weight=None, density: bool = False):
    got = _dd_edges(x, bins, range, weight)
    return NotImplemented if got is None else got[1]


@_register(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density: bool = False):
    got = _dd_edges(x, bins, range, weight)
    return NotImplemented if got is None else _hist(got[0], got[1], weight, density)


@_register(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(x, bins, *, weight=None, density: bool = False):
    if x.dim() < 2 or x.size(-1) == 0 or _declines(x, weight) or len(bins) != x.size(-1) or any(
            b.dim() != 1 or b.numel() < 2 or b.dtype != x.dtype for b in bins):
        return NotImplemented
    x2, ok = _rows(x, weight, x.size(-1))
    return _hist(x2, list(bins), weight, density) if ok else NotImplemented
