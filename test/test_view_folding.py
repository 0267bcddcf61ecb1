"""View folding: chains of views in a static inference graph become one re-striding of their root,
with the same values, strides and storage as the original views, and the original ops replayed
when the root arrives in another layout than traced."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.serving.view_folding import FoldedView, fold_views

aten = torch.ops.aten


def _chains(x, w):
    h = aten.mm.default(aten.view.default(x, [8, 6]), w)          # view feeding a compute op
    q = aten.permute.default(aten.view.default(h, [2, 4, 2, 2]), [0, 2, 1, 3])
    k = aten.select.int(aten.slice.Tensor(q, 3, 1, 2), 3, 0)     # a chain of four views
    e = aten.expand.default(aten.unsqueeze.default(k, 0), [3, 2, 2, 4])
    return aten.add.Tensor(aten.t.default(aten.view.default(h, [8, 4])), 1.0), k, e


def test_chains_fold_into_one_call_with_the_same_views():
    x, w = torch.randn(2, 4, 6), torch.randn(6, 4)
    gm = make_fx(_chains)(x, w)
    views = sum(n.target in (aten.view.default, aten.permute.default, aten.select.int, aten.slice.Tensor,
                             aten.unsqueeze.default, aten.expand.default, aten.t.default) for n in gm.graph.nodes)
    want = gm(x, w)
    assert views == 9 and fold_views(gm) == 4
    assert not any(n.target in (aten.view.default, aten.permute.default) for n in gm.graph.nodes)
    left = [n for n in gm.graph.nodes if n.op == "call_function" and not isinstance(n.target, FoldedView)]
    assert [n.target for n in left] == [aten.mm.default, aten.add.Tensor]
    # one call per chain end that something reads: mm's input, k, e, and the add's input
    assert sum(isinstance(n.target, FoldedView) for n in gm.graph.nodes) == 4
    got = gm(x, w)
    for g, r in zip(got, want):
        assert torch.equal(g, r) and g.stride() == r.stride() and g.storage_offset() == r.storage_offset()
    assert got[1].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()  # still views of h


def test_a_root_in_another_layout_gets_its_own_re_striding():
    x = torch.randn(4, 6)
    gm = make_fx(lambda x: aten.permute.default(aten.view.default(x, [2, 2, 6]), [2, 0, 1]))(x)
    fold_views(gm)
    (folded,) = [n.target for n in gm.graph.nodes if isinstance(n.target, FoldedView)]
    # strides (12, 1), storage offset 6: the view needs no copy, folding must not assume (6, 1)
    base = torch.randn(9, 6)[1::2]
    for _ in range(2):  # worked out on a meta tensor once, then re-strided
        got = gm(base)
        want = base.reshape(2, 2, 6).permute(2, 0, 1)
        assert torch.equal(got, want) and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset() == 6
    assert list(folded._layouts) == [(12, 1)]


def test_a_layout_the_views_refuse_still_raises():
    gm = make_fx(lambda x: aten.view.default(aten.mul.Tensor(x, 2), [24]))(torch.randn(4, 6))
    fold_views(gm)
    assert any(isinstance(n.target, FoldedView) for n in gm.graph.nodes)
    (folded,) = [n.target for n in gm.graph.nodes if isinstance(n.target, FoldedView)]
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        folded(torch.randn(6, 4).t())  # a transposed root: flattening it needs a copy, as in eager
    assert folded._layouts == {(1, 4): None}


def test_symbolic_layouts_are_left_alone():
    g = fx.Graph()
    x = g.placeholder("x")
    v = g.call_function(aten.view.default, (x, [-1]))
    g.output(v)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert fold_views(gm) == 0  # no traced values: nothing known about layouts


def test_pieces_of_split_and_unbind_fold_like_slices_and_selects():
    # RoPE's chunk(2, -1) and the K/V unpacking of a Llama layer: a dispatch per split and per
    # piece before; now each piece read is one re-striding of the split's input
    def f(x):
        a, b = aten.split.Tensor(x, 3, -1)                       # sizes 3, 2
        c, d = aten.split_with_sizes.default(x, [1, 3], 0)
        k, v = aten.unbind.int(aten.permute.default(x, [1, 0, 2]), 0)[1:3]
        return aten.mul.Tensor(a, 2), b + 1, c * d[:1], k - v

    x = torch.randn(4, 3, 5)
    gm = make_fx(f)(x)
    want = gm(x)
    assert {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int} <= {n.target for n in gm.graph.nodes}
    fold_views(gm)
    left = {n.target for n in gm.graph.nodes if n.op == "call_function" and not isinstance(n.target, FoldedView)}
    assert left == {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor}
    for g, r in zip(gm(x), want):
        assert torch.equal(g, r)
    base = torch.randn(8, 3, 5)[::2]  # another layout: the replayed slices and selects are still right
    for g, r in zip(gm(base), f(base)):
        assert torch.equal(g, r)
