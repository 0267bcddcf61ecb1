"""Decompositions of bucketize and the histograms (compiling/decompositions_histogram.py) on a chip
that runs none of them, against eager in float64: bucketize of a 0-d input and with empty
boundaries, histogram's edges from the data (a one-point range widened), from ``range`` and from
a bins tensor, weights, density, the last bin holding its right edge, histogramdd's linearized
bins; a non-finite data range raises."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.lower import lower
from torch_kernelize.core.targets import Target

NOTHING = Target("nothing", device="cpu", triton="none", supported=frozenset())


def _lowered(fn, *args, op: str):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    lowered = lower(gm, list(args), {"repro_dir": "off"}, target=NOTHING)
    assert [d.tier for d in lowered.report.decisions if d.op == op] == ["decompose"], op
    return lowered


def _check(fn, *args, op: str) -> None:
    got, want = (pytree.tree_leaves(r) for r in (_lowered(fn, *args, op=op)(list(args)), fn(*args)))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-12, atol=1e-12)


def test_bucketize_of_0d_input_and_empty_boundaries():
    bounds = torch.tensor([-1., 0., 0., 2., 5.], dtype=torch.float64)
    x = torch.tensor([[0., -1., 7., float("nan")], [2., 2.5, -3., 5.]], dtype=torch.float64)
    op = "aten.bucketize.Tensor"
    _check(lambda x, b: torch.bucketize(x, b, right=True, out_int32=True), x, bounds, op=op)
    _check(lambda x, b: torch.bucketize(x, b), torch.tensor(0., dtype=torch.float64), bounds, op=op)
    _check(lambda x, b: torch.bucketize(x, b), x, bounds[:0], op=op)


def test_histogram_edges_weights_density():
    torch.manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64)
    x[0, 0] = float("nan")  # no range from NaN: given range only
    w = torch.rand(7, 5, dtype=torch.float64)
    xs = torch.linspace(0, 1, 11, dtype=torch.float64)  # elements on every edge, the last on the right edge
    op = "aten.histogram.bin_ct"
    _check(lambda a: torch.histogram(a, 10), xs, op=op)
    _check(lambda a: torch.histogram(a, 3), torch.tensor(2., dtype=torch.float64), op=op)  # [1.5, 2.5]
    _check(lambda a: torch.histogram(a, 4), xs[:0], op=op)  # [0, 1]
    _check(lambda a, w: torch.histogram(a, 6, range=(-1., 1.), weight=w, density=True), x, w, op=op)
    edges = torch.tensor([-1., 0., 0.5, 2.], dtype=torch.float64)
    _check(lambda a, b, w: torch.histogram(a, b, weight=w, density=True), x, edges, w,
           op="aten.histogram.bins_tensor")


def test_histogramdd_and_a_non_finite_range():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    w = torch.rand(4, 6, dtype=torch.float64)
    _check(lambda a, w: torch.histogramdd(a, [3, 2, 5], weight=w, density=True), x, w,
           op="aten._histogramdd_from_bin_cts.default")
    x[1, 2, 1] = float("inf")
    lowered = _lowered(lambda a: torch.histogramdd(a, [2, 2, 2]), x, op="aten._histogramdd_from_bin_cts.default")
    with pytest.raises(IndexError):
        lowered([x])
