"""Region inputs that view folding removed, replayed from their roots' copies for a reproducer
(compiling/folded_capture.py): the chain's view ops and the size arithmetic they read."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling import folded_capture


def _graph():
    def f(x, w):
        y = torch.mm(x, w)                                  # a value of the bound graph: the root
        v = y.view(x.shape[0], 2, -1).permute(1, 0, 2)      # folded away: a view of a view of it
        z = torch.relu(y)[:, :3]                            # a view of a computed value not bound
        return v.sum(), z.sum()
    return make_fx(f, tracing_mode="symbolic")(torch.randn(4, 6), torch.randn(6, 8))


def _named(gm, target, index=0):
    return [n.name for n in gm.graph.nodes if n.target == target][index]


def test_a_folded_view_is_replayed_from_its_roots_copy_compactly():
    gm = _graph()
    mm, permute = _named(gm, torch.ops.aten.mm.default), _named(gm, torch.ops.aten.permute.default)
    bound = {n.name for n in gm.graph.nodes if n.op == "placeholder"} | {mm}
    replay = folded_capture.plan(gm, {permute}, bound)
    x_in = next(n.name for n in gm.graph.nodes if n.op == "placeholder")
    assert replay is not None and replay.roots == {mm, x_in}  # (x: the view's size is read off it)
    assert replay.copied_roots(set()) == {mm}  # a graph value is copied; an input only if written
    assert replay.copied_roots({0}) == {mm, x_in}
    x, w = torch.randn(10, 6), torch.randn(6, 8)  # (another size: the size arithmetic is replayed too)
    y = x @ w
    (value,) = replay.run([x, w], {mm: y.clone()}).values()
    torch.testing.assert_close(value, y.view(10, 2, -1).permute(1, 0, 2))
    assert value.untyped_storage().nbytes() == value.numel() * value.element_size()


def test_a_folded_value_that_needs_another_tensor_op_is_left_to_the_planned_graph():
    gm = _graph()
    mm, sliced = _named(gm, torch.ops.aten.mm.default), _named(gm, torch.ops.aten.slice.Tensor)
    bound = {n.name for n in gm.graph.nodes if n.op == "placeholder"} | {mm}
    assert folded_capture.plan(gm, {sliced}, bound) is None  # relu is not a view, and not bound
