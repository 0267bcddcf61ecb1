"""Decompositions of ranking and preprocessing ops (compiling/ranking_decompositions.py) on a chip
that runs none of them, against eager in float64: embedding_bag's three modes with every
bookkeeping output (empty bags, padding_idx, per_sample_weights, include_last_offset, NaN and
ties in max mode), its backward and per_sample_weights' gradient, segment_reduce, and
repeat_interleave with output_size; invalid ids, offsets, lengths and repeats raise where eager
raises."""
from __future__ import annotations

import pytest
import torch

from decomposition_testing import lowered_decomposing

aten = torch.ops.aten
SUM, MEAN, MAX = 0, 1, 2


def _same(got, want) -> None:
    got, want = (x if isinstance(x, (tuple, list)) else (x,) for x in (got, want))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
        if w.is_floating_point():
            torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(g, w), (g, w)


def _check(fn, *args, op: str):
    _same(lowered_decomposing(fn, *args, op=op)(list(args)), fn(*args))


def _table() -> torch.Tensor:
    torch.manual_seed(0)
    weight = torch.randn(12, 5, dtype=torch.float64)
    weight[9, 1] = weight[2, 1] = 7.0            # a tie for the max of a column
    weight[5, 2] = weight[11, 3] = float("nan")  # NaN as a bag's first row and as a later one
    return weight


IDS = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 11, 7])
OFFSETS = {  # (offsets, include_last_offset)
    "plain": ([0, 3, 3, 7], False), "empty_bags": ([0, 0, 4, 4, 11], False),
    "last_offset": ([0, 3, 7, 11], True), "short_last_offset": ([0, 3, 7, 9], True),  # (the last bag runs to the end)
    "one_bag": ([0], False)}


def _bag_args(mode: int, case: str, padding: bool, weights: bool):
    offsets, last = OFFSETS[case]
    psw = torch.rand(IDS.numel(), dtype=torch.float64) if weights else None
    return _table(), IDS, torch.tensor(offsets), psw, last, 4 if padding else -1


MODES = pytest.mark.parametrize("mode", [SUM, MEAN, MAX], ids=["sum", "mean", "max"])


@MODES
@pytest.mark.parametrize("case,padding,weights", [
    ("plain", False, False), ("empty_bags", True, False), ("last_offset", False, True),
    ("short_last_offset", True, True), ("one_bag", False, False)], ids=str)
def test_embedding_bag_with_its_bookkeeping(mode, case, padding, weights):
    """Every output of aten._embedding_bag: the bags, offset2bag, bag_size (rows counted without
    padding; a sum's are zero in ATen) and max_indices (the id each column's max came from: the
    first of equal maxima; a NaN only where it is the bag's first row). per_sample_weights in sum
    mode only (ATen's rule)."""
    weights = weights and mode == SUM
    weight, ids, offsets, psw, last, pad = _bag_args(mode, case, padding, weights)
    args = [weight, ids, offsets] + ([psw] if weights else [])

    def f(w, i, o, *p):
        return aten._embedding_bag(w, i, o, False, mode, False, p[0] if p else None, last, pad)
    _check(f, *args, op="aten._embedding_bag.default")


@pytest.mark.parametrize("mode", [SUM, MEAN, MAX], ids=["sum", "mean", "max"])
def test_embedding_bag_forward_only_in_float32(mode):
    """The forward-only op (no grad), float32: the CPU's fast path of sum leaves offset2bag empty."""
    weight = _table().float()
    _check(lambda w, i, o: aten._embedding_bag_forward_only(w, i, o, False, mode, False, None, False, -1)[0],
           weight, IDS, torch.tensor([0, 0, 4, 4]), op="aten._embedding_bag_forward_only.default")


def _reference_grad(grad, ids, offsets, last, mode, psw, pad, by_freq, rows=12):
    """d bags / d weight written out in float64: each position's bag gradient at its id, scaled by
    its weight, its bag's size (mean) and its id's frequency (the documented scaling; ATen's CPU
    loop divides by the count of another id where ids repeat unevenly)."""
    bags = grad.size(0)
    bag_of = (torch.bucketize(torch.arange(ids.numel()), offsets[:bags], right=True) - 1).tolist()
    keep = [int(i) != pad for i in ids]
    size = [sum(k for b, k in zip(bag_of, keep) if b == bag) for bag in range(bags)]
    counts = torch.bincount(ids, minlength=rows).double()
    out = torch.zeros(rows, grad.size(1), dtype=torch.float64)
    for p, (i, b) in enumerate(zip(ids.tolist(), bag_of)):
        if keep[p]:
            scale = (psw[p] if psw is not None else 1.0) / (size[b] if mode == MEAN else 1.0)
            out[i] += grad[b] * scale / (counts[i] if by_freq else 1.0)
    return out


@MODES
@pytest.mark.parametrize("case,padding,weights,by_freq", [
    ("plain", False, False, False), ("empty_bags", True, False, False), ("short_last_offset", False, True, False),
    ("empty_bags", True, False, True), ("plain", False, True, True)], ids=str)
def test_embedding_bag_backward(mode, case, padding, weights, by_freq):
    """aten._embedding_bag_backward from the forward's bookkeeping: sum and mean against eager (and
    the written-out float64 reference with scale_grad_by_freq), max to the rows of the maxima;
    empty bags and padding rows get nothing. (per_sample_weights for sum only; max does not scale
    by frequency: ATen's rules.)"""
    weights, by_freq = weights and mode == SUM, by_freq and mode != MAX
    weight, ids, offsets, psw, last, pad = _bag_args(mode, case, padding, weights)
    _, o2b, bag_size, max_indices = aten._embedding_bag(weight, ids, offsets, by_freq, mode, False, psw, last, pad)
    grad = torch.randn(offsets.numel() - last, weight.size(1), dtype=torch.float64)
    args = [grad, ids, offsets, o2b, bag_size, max_indices] + ([psw] if weights else [])

    def f(g, i, o, a, b, m, *p):
        return aten._embedding_bag_backward(g, i, o, a, b, m, 12, by_freq, mode, False, p[0] if p else None, pad)
    got = lowered_decomposing(f, *args, op="aten._embedding_bag_backward.default")(args)
    want = _reference_grad(grad, ids, offsets, last, mode, psw, pad, by_freq) if by_freq else f(*args)
    _same(got, want)
    if mode != MAX:
        _same(got, _reference_grad(grad, ids, offsets, last, mode, psw, pad, by_freq))


def test_embedding_bag_backward_recomputes_an_empty_offset2bag():
    """float32 sum (the CPU's fast path) saves no offset2bag: the backward makes it from the offsets."""
    weight, grad = _table().float(), torch.randn(4, 5)
    _, o2b, bag_size, max_indices = aten._embedding_bag(weight, IDS, torch.tensor([0, 0, 4, 4]), False, SUM, False,
                                                        None, False, -1)
    assert o2b.numel() == 0

    def f(g, i, o, a, b, m):
        return aten._embedding_bag_backward(g, i, o, a, b, m, 12, False, SUM, False, None, -1)
    _check(f, grad, IDS, torch.tensor([0, 0, 4, 4]), o2b, bag_size, max_indices,
           op="aten._embedding_bag_backward.default")


@pytest.mark.parametrize("case", ["plain", "empty_bags", "last_offset"])
@pytest.mark.parametrize("padding", [False, True])
def test_per_sample_weights_backward(case, padding):
    weight, ids, offsets, psw, last, pad = _bag_args(SUM, case, padding, True)
    _, o2b, _, _ = aten._embedding_bag(weight, ids, offsets, False, SUM, False, psw, last, pad)
    grad = torch.randn(offsets.numel() - last, weight.size(1), dtype=torch.float64)
    weight = torch.nan_to_num(weight)
    _check(lambda g, w, i, o, a: aten._embedding_bag_per_sample_weights_backward(g, w, i, o, a, SUM, pad),
           grad, weight, ids, offsets, o2b, op="aten._embedding_bag_per_sample_weights_backward.default")


@pytest.mark.parametrize("ids,offsets", [([1, 12], [0, 1]), ([1, -1], [0, 1]), ([1, 2], [1, 1]), ([1, 2], [0, 3])],
                         ids=["id_past_the_table", "negative_id", "first_offset_not_0", "offset_past_the_ids"])
def test_embedding_bag_raises_where_eager_raises(ids, offsets):
    """Eager raises a RuntimeError on each of these; the decomposition's range-checked gathers an
    IndexError (the indexing family's check on the chip; ATen's index_select here)."""
    weight, ids, offsets = _table(), torch.tensor(ids), torch.tensor(offsets)

    def f(w, i, o):
        return torch.nn.functional.embedding_bag(i, w, o, mode="sum")
    with pytest.raises(RuntimeError):
        f(weight, ids, offsets)
    lowered = lowered_decomposing(f, weight, torch.tensor([1, 2]), torch.tensor([0, 1]), op="aten._embedding_bag_forward_only.default")
    with pytest.raises(IndexError):
        lowered([weight, ids, offsets])


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("by,initial", [("lengths", None), ("offsets", 2.5), ("lengths_axis1", None),
                                        ("lengths", -1.0)], ids=str)
def test_segment_reduce(reduce, by, initial):
    """Empty segments (0, NaN for a mean, -inf/inf/1, or ``initial``), NaN propagating through
    max/min, segments by offsets that leave the tail out, batched lengths along axis 1."""
    data = torch.randn(6, 2, dtype=torch.float64)
    data[3, 1] = float("nan")
    if by == "lengths_axis1":
        data, kwargs = data.reshape(2, 3, 2), {"lengths": torch.tensor([[1, 0, 2], [3, 0, 0]]), "axis": 1}
    elif by == "lengths":
        kwargs = {"lengths": torch.tensor([2, 0, 4])}
    else:
        kwargs = {"offsets": torch.tensor([0, 2, 2, 5])}
    bounds = kwargs.pop("lengths" if "lengths" in kwargs else "offsets")
    name = "lengths" if "lengths" in by else "offsets"
    _check(lambda d, b: torch.segment_reduce(d, reduce, **{name: b}, initial=initial, **kwargs), data, bounds,
           op="aten.segment_reduce.default")


@pytest.mark.parametrize("lengths", [[2, -1, 5], [2, 0, 3], [2, 3, 2]], ids=["negative", "short", "long"])
def test_segment_reduce_raises_where_eager_raises(lengths):
    data, lengths = torch.randn(6, dtype=torch.float64), torch.tensor(lengths)

    def f(d, b):
        return torch.segment_reduce(d, "sum", lengths=b)
    with pytest.raises(RuntimeError):
        f(data, lengths)
    lowered = lowered_decomposing(f, data, torch.tensor([2, 0, 4]), op="aten.segment_reduce.default")
    with pytest.raises(IndexError):
        lowered([data, lengths])
    _same(lowered([data, torch.tensor([1, 5, 0])]), f(data, torch.tensor([1, 5, 0])))  # valid lengths, same graph


@pytest.mark.parametrize("repeats", [[2, 0, 3], [0, 0, 1], [4], [1, 1, 1, 0]], ids=str)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_repeat_interleave_with_output_size(repeats, dtype):
    """Jagged rows' ids: each slot's segment, empty segments skipped; int32 repeats give int32."""
    r = torch.tensor(repeats, dtype=dtype)
    _check(lambda t: torch.repeat_interleave(t, output_size=sum(repeats)), r, op="aten.repeat_interleave.Tensor")
    x = torch.randn(len(repeats), 2, dtype=torch.float64)  # of a tensor: the same ids, then a gather
    _check(lambda t, v: torch.repeat_interleave(v, t, dim=0, output_size=sum(repeats)), r, x,
           op="aten.repeat_interleave.Tensor")


@pytest.mark.parametrize("repeats", [[2, -1, 4], [2, 1], [2, 4]], ids=["negative", "short", "long"])
def test_repeat_interleave_raises_where_eager_raises(repeats):
    def f(t):
        return torch.repeat_interleave(t, output_size=5)
    with pytest.raises(RuntimeError):
        f(torch.tensor(repeats))
    lowered = lowered_decomposing(f, torch.tensor([1] * len(repeats)), op="aten.repeat_interleave.Tensor")
    with pytest.raises(IndexError):
        lowered([torch.tensor(repeats)])
