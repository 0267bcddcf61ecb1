"""Decompositions of bucketize and the histograms (compiling/decompositions_histogram.py) on a chip
that runs none of them, against eager in float64: bucketize of a 0-d input and with empty
boundaries, histogram's edges from the data (a one-point range widened), from ``range`` and from
a bins tensor, weights, density, the last bin holding its right edge, histogramdd's linearized
bins; a non-finite data range raises."""
from __future__ import annotations

import pytest
import torch

from decomposition_testing import check_against_eager, lowered_decomposing




def test_bucketize_of_0d_input_and_empty_boundaries():
    bounds = torch.tensor([-1., 0., 0., 2., 5.], dtype=torch.float64)
    x = torch.tensor([[0., -1., 7., float("nan")], [2., 2.5, -3., 5.]], dtype=torch.float64)
    op = "aten.bucketize.Tensor"
    check_against_eager(lambda x, b: torch.bucketize(x, b, right=True, out_int32=True), x, bounds, op=op)
    check_against_eager(lambda x, b: torch.bucketize(x, b), torch.tensor(0., dtype=torch.float64), bounds, op=op)
    check_against_eager(lambda x, b: torch.bucketize(x, b), x, bounds[:0], op=op)


def test_histogram_edges_weights_density():
    torch.manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64)
    x[0, 0] = float("nan")  # no range from NaN: given range only
    w = torch.rand(7, 5, dtype=torch.float64)
    xs = torch.linspace(0, 1, 11, dtype=torch.float64)  # elements on every edge, the last on the right edge
    op = "aten.histogram.bin_ct"
    check_against_eager(lambda a: torch.histogram(a, 10), xs, op=op)
    check_against_eager(lambda a: torch.histogram(a, 3), torch.tensor(2., dtype=torch.float64), op=op)  # [1.5, 2.5]
    check_against_eager(lambda a: torch.histogram(a, 4), xs[:0], op=op)  # [0, 1]
    check_against_eager(lambda a, w: torch.histogram(a, 6, range=(-1., 1.), weight=w, density=True), x, w, op=op)
    edges = torch.tensor([-1., 0., 0.5, 2.], dtype=torch.float64)
    check_against_eager(lambda a, b, w: torch.histogram(a, b, weight=w, density=True), x, edges, w,
                        op="aten.histogram.bins_tensor")


def test_histogramdd_and_a_non_finite_range():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    w = torch.rand(4, 6, dtype=torch.float64)
    check_against_eager(lambda a, w: torch.histogramdd(a, [3, 2, 5], weight=w, density=True), x, w,
                        op="aten._histogramdd_from_bin_cts.default")
    x[1, 2, 1] = float("inf")
    lowered = lowered_decomposing(lambda a: torch.histogramdd(a, [2, 2, 2]), x,
                                  op="aten._histogramdd_from_bin_cts.default")
    with pytest.raises(IndexError):
        lowered([x])
