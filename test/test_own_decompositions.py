"""Our decompositions of the ops of ranking and preprocessing models (constant_pad_nd, flip,
searchsorted, argmax/argmin): on a chip that runs none of them, exactly eager's values, edge
cases included (negative and zero pads, ties, NaN, both sides, int32 outputs)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.lower import lower
from torch_kernelize.core.targets import Target

NOTHING = Target("nothing", device="cpu", triton="none", supported=frozenset())


def _check(fn, *args, op: str):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    lowered = lower(gm, list(args), {"repro_dir": "off"}, target=NOTHING)
    tiers = [d.tier for d in lowered.report.decisions if d.op == op]
    assert tiers == ["decompose"], (op, tiers)
    got, want = lowered(list(args)), fn(*args)
    for g, w in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (got, want))):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w) or torch.allclose(g, w, equal_nan=True), (g, w)


@pytest.mark.parametrize("pad", [(1, 2), (0, 0, 2, 1), (-1, 2, 1, -2), (0, 0), (3, -3, 0, 0, 1, 1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_constant_pad_nd(pad, dtype):
    x = (torch.randn(2, 4, 5) * 10).to(dtype)
    _check(lambda t: F.pad(t, pad, value=7), x, op="aten.constant_pad_nd.default")


@pytest.mark.parametrize("dims", [(0,), (1, 2), (-1,), (0, 1, 2)], ids=str)
def test_flip(dims):
    _check(lambda t: torch.flip(t, dims), torch.randn(3, 4, 5), op="aten.flip.default")


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("out_int32", [False, True])
def test_searchsorted_of_a_sorted_row(side, out_int32):
    seq = torch.tensor([-2.0, 0.0, 0.0, 1.5, 3.0, 3.0, 8.0])
    values = torch.tensor([[-5.0, 0.0, 3.0], [1.5, 9.0, 2.0]])  # ties on boundaries, both ends outside
    _check(lambda s, v: torch.searchsorted(s, v, side=side, out_int32=out_int32), seq, values,
           op="aten.searchsorted.Tensor")


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("dim,keepdim", [(1, False), (0, True), (None, False), (None, True)], ids=str)
def test_argmax_argmin_first_of_ties_and_nan(name, dim, keepdim):
    x = torch.tensor([[1.0, 3.0, 3.0, -1.0], [2.0, float("nan"), 5.0, float("nan")], [-4.0, -4.0, 0.0, 0.0]])
    _check(lambda t: getattr(torch, name)(t, dim, keepdim), x, op=f"aten.{name}.default")


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("case", ["plain", "empty_bags", "weights", "padding", "last_offset"])
def test_embedding_bag(mode, case):
    """Bags by offsets, empty bags zero, per_sample_weights (sum only), padding_idx that neither adds
    nor counts, include_last_offset; against eager (float64 weights: the sums are exact enough)."""
    weight = torch.randn(12, 5, dtype=torch.float64)
    ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 11])
    offsets = torch.tensor({"empty_bags": [0, 0, 4, 4, 10], "last_offset": [0, 3, 7, 10]}.get(case, [0, 3, 3, 7]))
    kwargs = {"mode": mode, "include_last_offset": case == "last_offset",
              "padding_idx": 4 if case == "padding" else None}
    if case == "weights":
        if mode != "sum":
            pytest.skip("per_sample_weights is for mode='sum' only")
        kwargs["per_sample_weights"] = torch.rand(10, dtype=torch.float64)
    args = [ids, offsets, weight] + ([kwargs.pop("per_sample_weights")] if "per_sample_weights" in kwargs else [])

    def f(i, o, w, *psw):
        return F.embedding_bag(i, w, o, per_sample_weights=psw[0] if psw else None, **kwargs)
    _check(f, *args, op="aten._embedding_bag_forward_only.default")  # (no grad: the forward-only op)


@pytest.mark.parametrize("case", [
    ("2d", (3,), (), 0, False, True, None), ("2d", (2, 3), (1, 2), 1, False, True, None),
    ("2d", (3, 3), (2, 2), 1, False, False, None), ("2d", (2, 2), (), 0, False, True, 3),
    ("1d", (3,), (2,), 1, False, False, None), ("3d", (2, 2, 2), (), 0, False, True, None)], ids=str)
def test_avg_pool(case):
    kind, kernel, stride, padding, ceil_mode, include_pad, divisor = case
    x = torch.randn(2, 3, 6, 7, 5) if kind == "3d" else torch.randn(2, 3, 7, 9) if kind == "2d" else torch.randn(2, 3, 9)
    pool = {"1d": F.avg_pool1d, "2d": F.avg_pool2d, "3d": F.avg_pool3d}[kind]
    kwargs = {} if kind == "1d" else {"divisor_override": divisor}
    op = "aten.avg_pool3d.default" if kind == "3d" else "aten.avg_pool2d.default"
    gm_fn = lambda t: pool(t, kernel, stride or None, padding, ceil_mode, include_pad, **kwargs)  # noqa: E731
    gm = make_fx(gm_fn, tracing_mode="fake")(x)
    lowered = lower(gm, [x], {"repro_dir": "off"}, target=NOTHING)
    assert [d.tier for d in lowered.report.decisions if d.op == op] == ["decompose"]
    torch.testing.assert_close(lowered([x]), gm_fn(x))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("out_int32", [False, True])
def test_searchsorted_of_sorted_rows(side, out_int32):
    seq = torch.tensor([[-2.0, 0.0, 0.0, 1.5], [1.0, 1.0, 2.0, 3.0]])
    values = torch.tensor([[-5.0, 0.0, 1.5, float("nan")], [1.0, 9.0, 2.5, -1.0]])
    _check(lambda s, v: torch.searchsorted(s, v, side=side, out_int32=out_int32), seq, values,
           op="aten.searchsorted.Tensor")


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_scatter_reduce_with_self(reduce):
    x, src = torch.randn(4, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    index = torch.tensor([[0, 1, 0, 3, 3], [1, 1, 2, 3, 0], [0, 2, 2, 2, 1]])  # repeats: several values per element
    _check(lambda a, i, b: a.scatter_reduce(0, i, b, reduce, include_self=True), x, index, src,
           op="aten.scatter_reduce.two")


@pytest.mark.parametrize("name", ["max", "min"])
def test_max_min_of_all_elements(name):
    x = torch.tensor([[1.0, -3.0], [float("nan"), 2.0]])
    _check(lambda t: getattr(torch, name)(t), x, op=f"aten.{name}.default")
    _check(lambda t: getattr(torch, name)(t), x[:1], op=f"aten.{name}.default")


@pytest.mark.parametrize("k,dim,keepdim", [(1, -1, False), (3, 0, True), (4, 1, False)], ids=str)
def test_kthvalue(k, dim, keepdim):
    x = torch.tensor([[3.0, 1.0, float("nan"), 2.0], [0.5, -1.0, 7.0, 4.0], [2.0, 9.0, -3.0, 1.5]])
    _check(lambda t: torch.kthvalue(t, k, dim, keepdim), x, op="aten.kthvalue.default")


@pytest.mark.parametrize("nan", [False, True])
def test_median_of_all_elements(nan):
    x = torch.tensor([[3.0, 1.0, 5.0], [2.0, -1.0, 8.0]])
    if nan:
        x[0, 1] = float("nan")
    _check(lambda t: torch.median(t), x, op="aten.median.default")


def test_functional_copy_converts_and_broadcasts_into_the_destination():
    dst, src = torch.zeros(3, 4, dtype=torch.float64).t(), torch.arange(3, dtype=torch.int32)
    _check(lambda d, s: torch.ops.aten.copy.default(d, s), dst, src, op="aten.copy.default")


@pytest.mark.parametrize("dim,keepdim", [([1], False), ([0, 1], True)], ids=str)
def test_a_sum_of_bools_is_a_count(dim, keepdim):
    x = torch.randn(5, 7) > 0
    _check(lambda t: t.sum(dim, keepdim), x, op="aten.sum.dim_IntList")


# --- issue 44: scatters, running max/min, mode, pooling, distances (decompositions_scatter.py) --------
D64 = torch.float64


def _nan_at(t: torch.Tensor, *where) -> torch.Tensor:
    t = t.clone()
    for w in where:
        t[w] = float("nan")
    return t


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_reduce_every_reduction(reduce, include_self, dim):
    """Repeated indices (several values per element), elements that receive none, an index
    shorter than src and self in the other dim, NaN in self and in src; float64 against eager."""
    x, src = _nan_at(torch.randn(6, 5, dtype=D64), (2, 1)), _nan_at(torch.randn(5, 5, dtype=D64), (1, 2))
    index = torch.tensor([[0, 1, 0, 3], [1, 1, 2, 3], [0, 2, 2, 2], [4, 0, 1, 3]])  # 4 x 4: a corner of src
    _check(lambda a, i, b: a.scatter_reduce(dim, i, b, reduce, include_self=include_self), x, index, src,
           op="aten.scatter_reduce.two")


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    x, source = torch.randn(4, 6, dtype=D64), _nan_at(torch.randn(4, 5, dtype=D64), (0, 3))
    index = torch.tensor([1, 3, 1, 0, 5])
    _check(lambda a, i, b: a.index_reduce(1, i, b, reduce, include_self=include_self), x, index, source,
           op="aten.index_reduce.default")
    _check(lambda a, i, b: a.index_reduce(0, i, b, reduce, include_self=include_self),
           torch.tensor(2.0, dtype=D64), torch.tensor([0]), torch.tensor(-3.0, dtype=D64),
           op="aten.index_reduce.default")  # 0-d, as the OpInfo sample


def test_scatter_src_value_and_put():
    """scatter of src and of a value (unique indices per column, and a shorter index); put with
    negative indices, adding (repeats add up) and storing."""
    x, src = torch.randn(10, 5, dtype=D64), torch.randn(5, 5, dtype=D64)
    index = torch.stack([torch.randperm(10)[:4] for _ in range(3)], 1)
    _check(lambda a, i, b: a.scatter(0, i, b), x, index, src, op="aten.scatter.src")
    _check(lambda a, i: a.scatter(0, i, -2.5), x, index, op="aten.scatter.value")
    for accumulate in (True, False):
        index = torch.tensor([6, -4, 6] if accumulate else [6, -4, 2])
        _check(lambda a, i, b: a.put(i, b, accumulate), torch.randn(3, 3, dtype=D64), index,
               torch.randn(3, dtype=D64), op="aten.put.default")


@pytest.mark.parametrize("mask_shape", [(5, 6), (6,)], ids=str)
def test_masked_scatter(mask_shape):
    mask = torch.rand(mask_shape) < 0.5
    _check(lambda a, m, s: a.masked_scatter(m, s), torch.randn(5, 6, dtype=D64), mask, torch.randn(40, dtype=D64),
           op="aten.masked_scatter.default")


@pytest.mark.parametrize("offset,dim1,dim2", [(0, 0, 1), (2, 0, 1), (-1, 0, 1), (1, 2, 0), (-3, 1, 2)], ids=str)
def test_diagonal_scatter(offset, dim1, dim2):
    x = torch.randn(4, 6, 5, dtype=D64)
    src = torch.randn_like(torch.diagonal(x, offset, dim1, dim2))
    _check(lambda a, b: torch.diagonal_scatter(a, b, offset, dim1, dim2), x, src, op="aten.diagonal_scatter.default")


@pytest.mark.parametrize("size,stride,offset", [((2, 2), (3, 1), 1), ((), (), 0), ((3,), (4,), 2)], ids=str)
def test_as_strided_scatter(size, stride, offset):
    src = torch.randn(size, dtype=D64)
    src.view(-1)[0] = -0.0  # stored as is: -0.0, not +0.0
    _check(lambda a, b: torch.as_strided_scatter(a, b, size, stride, offset), torch.randn(3, 4, dtype=D64), src,
           op="aten.as_strided_scatter.default")


@pytest.mark.parametrize("name", ["cummax", "cummin"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cummax_cummin_ties_take_the_last_index_and_nan_propagates(name, dim):
    x = torch.randn(5, 6, 4, dtype=D64)
    x[0, :, 1] = 1.0                      # ties along every dim
    x[2, 0, 0] = x[2, 3, 0]
    x = _nan_at(x, (1, 2, 3), (3, 2, 3))  # two NaNs in one row: the later one's index
    _check(lambda t: getattr(torch, name)(t, dim), x, op=f"aten.{name}.default")


@pytest.mark.parametrize("dim,keepdim", [(-1, False), (0, True), (1, False)], ids=str)
def test_mode_smallest_of_the_most_frequent_at_its_last_index(dim, keepdim):
    x = torch.randint(0, 4, (5, 7, 6)).to(D64)   # many ties in counts and values
    _check(lambda t: torch.mode(t, dim, keepdim), x, op="aten.mode.default")
    _check(lambda t: torch.mode(t, dim, keepdim), torch.randn(5, 7, 6, dtype=D64), op="aten.mode.default")


@pytest.mark.parametrize("x", [torch.tensor(3.0), torch.tensor([1.0, float("nan"), 3.0, 2.0]),
                               torch.tensor([float("nan")] * 3), torch.randn(4, 5)], ids=["0d", "nan", "all_nan", "2d"])
def test_nanmedian_of_all_elements(x):
    _check(lambda t: torch.nanmedian(t), x, op="aten.nanmedian.default")


@pytest.mark.parametrize("dim,keepdim", [(1, False), (0, True)], ids=str)
def test_nanmedian_along_a_dim_skips_nan(dim, keepdim):
    """Lower median of the non-NaN (even and odd counts), its index; an all-NaN row gives NaN at
    some NaN's index (ATen's nth_element picks which)."""
    n = float("nan")
    x = torch.tensor([[n, n, n, n], [3.0, n, 1.0, 2.0], [n, 5.0, n, 4.0], [2.0, 1.0, 4.0, 3.0]], dtype=D64)
    x = x if dim == 1 else x.t()
    fn = lambda t: tuple(torch.nanmedian(t, dim, keepdim))
    gm = make_fx(fn, tracing_mode="fake")(x)
    lowered = lower(gm, [x], {"repro_dir": "off"}, target=NOTHING)
    assert [d.tier for d in lowered.report.decisions if d.op == "aten.nanmedian.dim"] == ["decompose"]
    (values, indices), (want_v, want_i) = lowered([x]), fn(x)
    assert torch.equal(values.isnan(), want_v.isnan()) and torch.equal(values.nan_to_num(), want_v.nan_to_num())
    picked = x.gather(dim, indices if keepdim else indices.unsqueeze(dim))
    assert torch.equal(picked.isnan(), (want_v if keepdim else want_v.unsqueeze(dim)).isnan())
    assert torch.equal(indices[1:] if dim == 1 else indices[:, 1:], want_i[1:] if dim == 1 else want_i[:, 1:])


@pytest.mark.skipif(not hasattr(torch.ops.aten, "hash_tensor"), reason="aten.hash_tensor is new in torch 2.13")
@pytest.mark.parametrize("x,kwargs", [
    (torch.tensor([float("nan"), -0.0, float("inf"), 1.5]), {}),                 # float64 bits, every dim
    (torch.randn(3, 5, 2), {"dim": [0, 2], "keepdim": True}),                     # 3 (not a power of 2) x 2
    (torch.randint(-100, 100, (7, 4), dtype=torch.int32).t(), {"dim": -1}),       # sign-extended to 64
    (torch.randn(7).half(), {"dim": 0})], ids=["special", "dims_keepdim", "int32", "f16"])
def test_hash_tensor_xors_the_widened_bits(x, kwargs):
    _check(lambda t: torch.hash_tensor(t, **kwargs).view(torch.int64), x, op="aten.hash_tensor.default")


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2), (0, 1)], ids=str)
def test_addbmm(beta, alpha):
    x = torch.randn(5, 10, dtype=D64)
    if beta == 0:
        x[0, 0] = float("nan")  # beta = 0 ignores self, NaN too
    b1, b2 = torch.randn(4, 5, 3, dtype=D64), torch.randn(4, 3, 10, dtype=D64)
    _check(lambda a, p, q: torch.addbmm(a, p, q, beta=beta, alpha=alpha), x, b1, b2, op="aten.addbmm.default")


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 3.0, 0.5, float("inf")], ids=str)
def test_cdist_from_differences(p):
    x1, x2 = torch.randn(2, 5, 3, dtype=D64), torch.randn(2, 6, 3, dtype=D64)
    x2[0, 0] = x1[0, 0]  # a zero distance
    x2[1, 1, :2] = x1[1, 2, :2]  # p = 0: one differing coordinate
    _check(lambda a, b: torch.cdist(a, b, p), x1, x2, op="aten._cdist_forward.default")


def test_bilinear_trilinear():
    x1, x2, w, b = (torch.randn(2, 3, dtype=D64), torch.randn(2, 4, dtype=D64), torch.randn(5, 3, 4, dtype=D64),
                    torch.randn(5, dtype=D64))
    _check(lambda a, c, m, d: F.bilinear(a, c, m, d), x1, x2, w, b, op="aten._trilinear.default")


@pytest.mark.parametrize("output_size", [(2, 3), (3, 4), (7, 9), (1, 1), (4, 5)], ids=str)
def test_adaptive_max_pool2d_first_max_last_nan(output_size):
    x = torch.randn(2, 3, 7, 9, dtype=D64)
    x[1, 1, :3, :3] = 2.0                                     # ties: the first index
    x = _nan_at(x, (0, 0, 1, 1), (0, 0, 2, 2))                # NaNs: the last one's index
    _check(lambda t: F.adaptive_max_pool2d(t, output_size, return_indices=True), x,
           op="aten.adaptive_max_pool2d.default")
    _check(lambda t: F.adaptive_max_pool1d(t, output_size[1], return_indices=True), x[0, :, 0],
           op="aten.adaptive_max_pool2d.default")


def test_avg_pool_ceil_mode_where_windows_agree_with_floor():
    """ceil_mode with stride 1 changes no window (taken); where it adds one past the input, declines."""
    x = torch.randn(1, 3, 9, 9)
    fn = lambda t: F.avg_pool2d(t, 3, 1, 1, True, False, 2)  # noqa: E731  (the OpInfo sample)
    gm = make_fx(fn, tracing_mode="fake")(x)
    lowered = lower(gm, [x], {"repro_dir": "off"}, target=NOTHING)
    assert [d.tier for d in lowered.report.decisions if d.op == "aten.avg_pool2d.default"] == ["decompose"]
    torch.testing.assert_close(lowered([x]), fn(x))
    gm = make_fx(lambda t: F.avg_pool2d(t, 2, 2, 0, True), tracing_mode="fake")(x)
    lowered = lower(gm, [x], {"repro_dir": "off"}, target=NOTHING)
    assert [d.tier for d in lowered.report.decisions if d.op == "aten.avg_pool2d.default"] != ["decompose"]


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select_raises_on_a_negative_index_as_eager_does(dim):
    """torch's decomposition gathers with index's rule, which counts a negative index from the
    end: on a chip without index_select it returned other rows where eager raises."""
    x = torch.randn(5, 4)
    _check(lambda t, i: torch.index_select(t, dim, i), x, torch.tensor([3, 0, 3, 1]),
           op="aten.index_select.default")
    gm = make_fx(lambda t, i: torch.index_select(t, dim, i), tracing_mode="fake")(x, torch.tensor([0, 1]))
    lowered = lower(gm, [x, torch.tensor([0, 1])], {"repro_dir": "off"}, target=NOTHING)
    for bad in ([0, -1], [x.shape[dim], 0]):  # negative, and one past the end
        with pytest.raises((IndexError, RuntimeError)):  # (eager's CPU kernel raises either, by dim)
            torch.index_select(x, dim, torch.tensor(bad))
        with pytest.raises(IndexError):
            lowered([x, torch.tensor(bad)])
