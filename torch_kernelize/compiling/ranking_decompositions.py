"""Decompositions of the ops of ranking and preprocessing models (issue 44) that torch has none
for, into ops the kernel families generate (gathers, index_add/scatter_add, cumsum, pointwise
ops), so that a DLRM-style model trains and a preprocessing module runs
on a chip whose vendor runs only GEMMs:

- ``_embedding_bag`` and ``_embedding_bag_forward_only``: sum, mean and max bags by offsets,
  ``per_sample_weights``, ``padding_idx``, ``include_last_offset``, with the bookkeeping outputs
  the backward reads (offset2bag, bag_size, max_indices: ATen's values in the traced shapes);
- ``_embedding_bag_backward`` (dense) and ``_embedding_bag_dense_backward``: the rows' gradients
  added at their ids (sum, mean, ``scale_grad_by_freq``), or each bag's gradient at its max's id;
  ``_embedding_bag_per_sample_weights_backward``: a row-wise dot product;
- ``segment_reduce`` by lengths or offsets, along its axis: sum, mean, max, min, prod, ``initial``;
- ``repeat_interleave.Tensor`` with ``output_size`` (the segment id of each slot: jagged row ids).

Bags and segments are contiguous runs of positions, so a position's bag is the count of bag
starts at or before it, less one (a histogram of the starts and its running sum). Sums are
index_adds; a max, min or product along a run is a segmented inclusive scan by doubling (``_segmented_scan``: ceil(log2 n) steps, each a
gather of the state shifted by 2**k and a pointwise combine where the shift stays in the run),
read at each run's last position.

Where eager raises on the values (an id or offset out of range, a first offset other than 0,
negative lengths or repeats, lengths that do not sum to the size), the decomposition reads the
offending values through a gather from ``arange`` (``_checked``) whose index is out of range
exactly then: the indexing family's range check raises eager's IndexError (ATen raises a
RuntimeError with its own message for some of these), and nothing is read out of bounds.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from torch_kernelize.compiling.decomposition_registry import registrar

aten = torch.ops.aten
RANKING_DECOMPOSITIONS: dict[Any, Callable] = {}  # merged into decompositions.OWN_DECOMPOSITIONS

SUM, MEAN, MAX = 0, 1, 2

_register = registrar(RANKING_DECOMPOSITIONS)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _checked(values: torch.Tensor, ok: torch.Tensor | None, size: int) -> torch.Tensor:
    """``values`` (integers in [0, size)) read back through a gather from ``arange(size)``: the
    same values where ``ok``; an IndexError (the gather's range check) where a value lies outside
    [0, size) or ``ok`` is False, as eager raises on invalid inputs. The gather reads ``size``
    there, never a negative index: torch's index_select decomposes to ``index``, which wraps one."""
    ok = values >= 0 if ok is None else ok & (values >= 0)
    index = torch.where(ok, values, size).reshape(-1)
    return torch.arange(size, dtype=values.dtype, device=values.device).index_select(0, index).reshape(values.shape)


def _clip(x: torch.Tensor, low: int | None = None, high: int | None = None) -> torch.Tensor:
    """clamp of integers as a compare and a select per bound (clamp's decomposition also tests
    for NaN, which integers never are)."""
    if low is not None:
        x = torch.where(x < low, low, x)
    if high is not None:
        x = torch.where(x > high, high, x)
    return x


def _segment_of(n: int, starts: torch.Tensor) -> torch.Tensor:
    """The run each of positions 0..n-1 lies in: the count of starts at or before it, less one
    (starts rise), as ATen's make_offset2bag counts: a histogram of the starts (an index_add of
    ones, in float32: exact while fewer than 2**24 starts share a position) and its running sum;
    two passes over n, where a binary search of the starts (bucketize) takes log2 of their count."""
    if starts.numel() >= 2**24:
        return torch.bucketize(torch.arange(n, device=starts.device), starts, right=True) - 1
    ones = torch.ones(starts.numel(), dtype=torch.float32, device=starts.device)
    hist = torch.zeros(n + 1, dtype=torch.float32, device=starts.device).index_add(0, _clip(starts, 0, n), ones)
    return torch.cumsum(hist[:n], 0, dtype=torch.int64) - 1


def _segmented_scan(state: list[torch.Tensor], run_start: torch.Tensor,
                    step: Callable[[list[torch.Tensor], list[torch.Tensor], torch.Tensor], list[torch.Tensor]]
                    ) -> list[torch.Tensor]:
    """The inclusive scan of ``state`` (tensors of n rows) within runs of positions, by doubling:
    after step k a position holds the combination of the 2**(k+1) positions up to it that share
    its run (``run_start``: the first position of each position's run). ``step(earlier, later,
    outside)`` gives the new state: ``later`` combined with ``earlier`` (the state 2**k rows up,
    an associative combination, earlier rows first) except where ``outside`` (that row is before
    the run: keep ``later``; a bool per row, shaped to broadcast over the state's other dims)."""
    n = state[0].size(0)
    position = torch.arange(n, device=run_start.device)
    shift = 1
    while shift < n:
        back = position - shift
        outside = back < run_start
        src = torch.where(outside, position, back)  # (never read where outside)
        earlier = [t.index_select(0, src) for t in state]
        state = step(earlier, state, outside.reshape([n] + [1] * (state[0].dim() - 1)))
        shift *= 2
    return state


# --- embedding bags ---------------------------------------------------------------------------------

def _bag_layout(weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx,
                forward_only: bool) -> tuple[int, int, tuple[int, ...], torch.dtype]:
    """The sizes of the bookkeeping outputs the op returns (offset2bag, bag_size, max_indices) and
    offset2bag's dtype, as torch's meta function gives them: on the CPU, offset2bag is empty on
    the fast path of sum (float/half weights without padding_idx), and bag_size has one entry per
    bag (per offset in the forward-only op); elsewhere per offset, max_indices empty but in max mode."""
    bags = offsets.size(0) - (1 if include_last_offset else 0)
    if offsets.device.type != "cpu":
        return (indices.size(0), offsets.size(0), (bags, weight.size(1)) if mode == MAX else (0,), indices.dtype)
    fast_sum = (weight.dtype in (torch.float32, torch.float16) and padding_idx < 0
                and (per_sample_weights is None or per_sample_weights.stride(0) == 1))
    offset2bag = indices.size(0) if mode != SUM or not fast_sum else 0
    bag_size = offsets.size(0) if forward_only else bags
    return offset2bag, bag_size, (bags, weight.size(1)) if mode == MAX else (bags,), offsets.dtype


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    return t if t.size(0) == size else torch.constant_pad_nd(t[:size], [0, max(size - t.size(0), 0)], 0)


def _bags(indices, offsets, bags: int):
    """(bag of each position, first and last+1 position of each bag), the offsets checked as eager
    checks them: within [0, n], the first one 0. The last bag runs to the end of the ids, as ATen
    runs it (with include_last_offset too)."""
    n = indices.size(0)
    first = torch.arange(offsets.size(0), device=offsets.device) == 0
    starts = _checked(offsets, ~first | (offsets == 0), n + 1)
    bag = _segment_of(n, starts[:bags])
    ends = torch.constant_pad_nd(starts[1:bags], [0, 1], n)
    return bag, starts[:bags], ends


def _max_bags(rows, keep, bag, starts, ends, n: int):
    """Each bag's max per column and the position it was taken from, as ATen's sequential loop
    takes it: the first of equal maxima; a NaN wins only as the bag's first (non-padding) row, and
    no NaN after it is taken. An empty bag (or one of padding only) gives (0, -1)."""
    position = torch.arange(n, device=rows.device)
    width = rows.size(1)
    best_ok = ~torch.isnan(rows)
    if keep is not None:
        best_ok = best_ok & keep.unsqueeze(1)
    best_pos = torch.where(best_ok, position.unsqueeze(1).expand(n, width), -1)   # -1: nothing yet
    first = position if keep is None else torch.where(keep, position, -1)        # first kept row of the span

    def step(earlier, later, outside):
        e_val, e_pos, e_first = earlier
        l_val, l_pos, l_first = later
        keep = outside | ((l_pos >= 0) & ((e_pos < 0) | (l_val > e_val)))  # the later row's max stands
        return [torch.where(keep, l_val, e_val), torch.where(keep, l_pos, e_pos),
                torch.where(outside.squeeze(1) | (e_first < 0), l_first, e_first)]

    run_start = starts.index_select(0, bag)
    val, pos, head = _segmented_scan([rows, best_pos, first], run_start, step)
    nonempty = ends > starts
    last = _clip(ends - 1, 0)
    val, pos, head = val.index_select(0, last), pos.index_select(0, last), head.index_select(0, last)
    head = torch.where(nonempty, head, -1)
    head_rows = rows.index_select(0, _clip(head, 0))
    nan_head = torch.isnan(head_rows) & (head >= 0).unsqueeze(1)
    pos = torch.where(nan_head, head.unsqueeze(1).expand_as(pos), torch.where(nonempty.unsqueeze(1), pos, -1))
    val = torch.where(nan_head, head_rows, torch.where(pos >= 0, val, 0.0))
    return val, pos


def _embedding_bag_impl(weight, indices, offsets, scale_grad_by_freq=False, mode=SUM, sparse=False,
                        per_sample_weights=None, include_last_offset=False, padding_idx=-1, *, forward_only: bool):
    if indices.dim() != 1 or offsets.dim() != 1 or weight.dim() != 2 or mode not in (SUM, MEAN, MAX):
        return NotImplemented
    if per_sample_weights is not None and mode != SUM:
        return NotImplemented  # ATen's error
    n, width, device = indices.size(0), weight.size(1), weight.device
    bags = offsets.size(0) - (1 if include_last_offset else 0)
    if bags < 0 or (n and bags == 0):
        return NotImplemented
    o2b_size, size_size, max_shape, o2b_dtype = _bag_layout(weight, indices, offsets, mode, per_sample_weights,
                                                            include_last_offset, padding_idx, forward_only)
    if n == 0:  # every bag empty: zeros (the offsets are all 0, or eager raises)
        zeros = torch.zeros(size_size, dtype=offsets.dtype, device=device)
        return (torch.zeros(bags, width, dtype=weight.dtype, device=device),
                torch.zeros(o2b_size, dtype=o2b_dtype, device=device), zeros,
                torch.zeros(max_shape, dtype=offsets.dtype, device=device))
    acc = _acc(weight.dtype)
    bag, starts, ends = _bags(indices, offsets, bags)
    keep = (indices != padding_idx) if padding_idx >= 0 else None
    # an id out of range raises here (a negative one made so: torch's index_select wraps it)
    rows = weight.index_select(0, torch.where(indices >= 0, indices, weight.size(0)))
    if mode != SUM:  # rows per bag, padding not counted (ATen leaves a sum's bag sizes zero)
        counted = torch.ones(n, dtype=acc, device=device) if keep is None else keep.to(acc)
        count = torch.zeros(bags, dtype=acc, device=device).index_add(0, bag, counted)
    if mode == MAX:
        out, pos = _max_bags(rows, keep, bag, starts, ends, n)
        max_indices = torch.where(pos >= 0, indices.index_select(0, _clip(pos.reshape(-1), 0)).reshape(pos.shape), 0)
        max_indices = max_indices.to(offsets.dtype)
    else:
        rows = rows.to(acc)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.to(acc).unsqueeze(1)
        if keep is not None:
            rows = torch.where(keep.unsqueeze(1), rows, 0.0)
        out = torch.zeros(bags, width, dtype=acc, device=device).index_add(0, bag, rows)
        if mode == MEAN:
            out = out / torch.where(count > 0, count, 1.0).unsqueeze(1)
    sizes = torch.zeros(bags, dtype=offsets.dtype, device=device) if mode == SUM else count.to(offsets.dtype)
    bag_size = _padded(sizes, size_size)
    if mode != MAX:  # the CPU's are the bag sizes again
        max_indices = _padded(sizes, max_shape[0])
    offset2bag = bag.to(o2b_dtype) if o2b_size else torch.zeros(0, dtype=o2b_dtype, device=device)
    return out.to(weight.dtype), offset2bag, bag_size, max_indices


@_register(aten._embedding_bag.default)
def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False, per_sample_weights=None,
                   include_last_offset=False, padding_idx=-1):
    return _embedding_bag_impl(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
                               include_last_offset, padding_idx, forward_only=False)


@_register(aten._embedding_bag_forward_only.default)
def _embedding_bag_forward_only(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                                per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    return _embedding_bag_impl(weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights,
                               include_last_offset, padding_idx, forward_only=True)


def _offset2bag(indices, offsets, offset2bag, bags: int) -> torch.Tensor:
    """The forward's offset2bag, or (where the CPU's fast path left it empty) the same from the
    offsets, as ATen's backward makes it; positions past the last bag (include_last_offset) are
    the last bag's."""
    if offset2bag.numel() == indices.numel():
        return offset2bag
    return _clip(_segment_of(indices.size(0), offsets), 0, max(bags - 1, 0))


@_register(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights: int,
                                  scale_grad_by_freq: bool, mode: int, per_sample_weights=None, padding_idx: int = -1):
    if grad.dim() != 2 or indices.dim() != 1 or mode not in (SUM, MEAN, MAX):
        return NotImplemented
    acc, device, width = _acc(grad.dtype), grad.device, grad.size(1)
    out = torch.zeros(num_weights, width, dtype=acc, device=device)
    if mode == MAX:  # each bag's gradient goes to the row its max came from; empty bags give nothing
        nonempty = (bag_size[:grad.size(0)] > 0).unsqueeze(1)
        index = torch.where(nonempty, maximum_indices, 0).to(torch.int64)
        return out.scatter_add(0, index, torch.where(nonempty, grad.to(acc), 0.0)).to(grad.dtype)
    if indices.numel() == 0:
        return out.to(grad.dtype)
    if offset2bag.numel() != indices.numel():
        return NotImplemented
    rows = grad.to(acc).index_select(0, offset2bag)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.to(acc).unsqueeze(1)
    if mode == MEAN:
        rows = rows / bag_size.index_select(0, offset2bag).to(acc).unsqueeze(1)
    if scale_grad_by_freq:
        counts = torch.zeros(num_weights, dtype=acc, device=device).index_add(
            0, indices, torch.ones(indices.numel(), dtype=acc, device=device))
        rows = rows / counts.index_select(0, indices).unsqueeze(1)
    if padding_idx >= 0:
        rows = torch.where((indices != padding_idx).unsqueeze(1), rows, 0.0)
    return out.index_add(0, indices, rows).to(grad.dtype)


@_register(aten._embedding_bag_backward.default)
def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights: int,
                            scale_grad_by_freq: bool, mode: int, sparse: bool, per_sample_weights=None,
                            padding_idx: int = -1):
    if sparse or indices.dim() != 1:
        return NotImplemented  # a sparse gradient is not a dense kernel's output
    o2b = _offset2bag(indices, offsets, offset2bag, grad.size(0)) if mode != MAX and indices.numel() else offset2bag
    return _embedding_bag_dense_backward(grad, indices, o2b, bag_size, maximum_indices, num_weights,
                                         scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@_register(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode: int,
                                               padding_idx: int = -1):
    """d out / d per_sample_weights[i]: the dot product of position i's row with its bag's gradient."""
    if mode != SUM or grad.dim() != 2 or indices.dim() != 1 or indices.numel() == 0:
        return NotImplemented
    acc = _acc(grad.dtype)
    o2b = _offset2bag(indices, offsets, offset2bag, grad.size(0))
    dots = (grad.to(acc).index_select(0, o2b) * weight.index_select(0, indices).to(acc)).sum(1)
    if padding_idx >= 0:
        dots = torch.where(indices != padding_idx, dots, 0.0)
    return dots.to(grad.dtype)


# --- segments and jagged rows -------------------------------------------------------------------------

_INITIAL = {"sum": 0.0, "mean": float("nan"), "max": float("-inf"), "min": float("inf"), "prod": 1.0}
_COMBINE = {"max": torch.maximum, "min": torch.minimum, "prod": torch.mul}


@_register(aten.segment_reduce.default)
def _segment_reduce(data, reduce: str, *, lengths=None, indices=None, offsets=None, axis: int = 0,
                    unsafe: bool = False, initial=None):
    """Segments of ``data`` along ``axis`` by lengths (checked as eager checks them: none negative,
    each row summing to the axis' size unless ``unsafe``) or offsets (unchecked, as in eager). Sum
    and mean by index_add (an empty mean is NaN, or ``initial``); max, min and prod by a segmented
    scan (NaN propagates), an empty segment giving ``initial`` or the reduction's identity."""
    if indices is not None or reduce not in _INITIAL or not data.is_floating_point():
        return NotImplemented
    bounds = lengths if lengths is not None else offsets
    if bounds is None or bounds.dim() < 1 or axis % max(data.dim(), 1) != bounds.dim() - 1:
        return NotImplemented
    lead = bounds.shape[:-1]
    if data.shape[:len(lead)] != lead:
        return NotImplemented
    size, rows = data.size(axis), int(torch.Size(lead).numel())
    rest = data.shape[axis + 1:]
    if lengths is not None:
        segments = lengths.size(-1)
        ends = torch.cumsum(lengths, -1)
        if not unsafe:  # eager: "lengths contains negative value", "all rows of lengths ... sum to" the size
            last = torch.arange(segments, device=data.device) == segments - 1
            ends = _checked(ends, (lengths >= 0) & (~last | (ends == size)), size + 1)
        starts = ends - lengths
    else:
        segments = offsets.size(-1) - 1
        starts, ends = offsets[..., :-1], offsets[..., 1:]
    if segments <= 0 or size == 0:
        return NotImplemented
    acc = _acc(data.dtype)
    n = rows * size
    row_base = (torch.arange(rows, device=data.device) * size).reshape(lead + (1,)) if lead else 0
    g_starts, g_ends = (starts + row_base).reshape(-1), (ends + row_base).reshape(-1)
    x = data.reshape((n,) + rest).to(acc)
    seg = _clip(_segment_of(n, g_starts), 0)
    inside = torch.arange(n, device=data.device) < g_ends.index_select(0, seg)
    inside = inside & (torch.arange(n, device=data.device) >= g_starts.index_select(0, seg))
    expand = inside.reshape([n] + [1] * len(rest))
    start = _INITIAL[reduce] if initial is None else float(initial)
    count = torch.zeros(rows * segments, dtype=acc, device=data.device).index_add(0, seg, inside.to(acc))
    if reduce in ("sum", "mean"):
        total = torch.zeros((rows * segments,) + rest, dtype=acc, device=data.device).index_add(
            0, seg, torch.where(expand, x, 0.0))
        if initial is not None:
            total = total + float(initial)
        if reduce == "mean":
            filled = (count > 0).reshape([-1] + [1] * len(rest))
            total = torch.where(filled, total / count.clamp(min=1).reshape([-1] + [1] * len(rest)), start)
    else:
        combine = _COMBINE[reduce]
        run_start = g_starts.index_select(0, seg)
        (scanned,) = _segmented_scan([x], run_start, lambda e, l, outside: [torch.where(outside, l[0], combine(e[0], l[0]))])
        last = _clip(g_ends - 1, 0, n - 1)
        total = scanned.index_select(0, last)
        filled = (count > 0).reshape([-1] + [1] * len(rest))
        if initial is not None:
            total = combine(total, torch.full((), float(initial), dtype=acc, device=data.device))
        total = torch.where(filled, total, start)
    return total.reshape(lead + (segments,) + rest).to(data.dtype)


@_register(aten.repeat_interleave.Tensor)
def _repeat_interleave(repeats, *, output_size=None):
    """The index of the segment each of ``output_size`` slots falls in (``repeat_interleave`` of
    ``arange``, as jagged tensors' row ids): the count of the repeats' running sums at or before it.
    Without ``output_size`` the result's size is the data's, which a static graph cannot hold."""
    if output_size is None or repeats.dim() != 1 or repeats.numel() == 0:
        return NotImplemented
    count = repeats.size(0)
    ends = torch.cumsum(repeats, 0)
    last = torch.arange(count, device=repeats.device) == count - 1
    # eager: "repeats can not be negative", "allocated size does not match required size"
    ends = _checked(ends, (repeats >= 0) & (~last | (ends == output_size)), output_size + 1)
    return (_segment_of(output_size, ends) + 1).to(repeats.dtype)  # the count of segment ends at or before a slot
