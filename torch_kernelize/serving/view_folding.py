"""View folding: chains of view ops in a bound inference graph become one cheap re-striding.

A decomposed ATen graph is full of views (a Llama layer has ~45: view, permute, select, slice,
unsqueeze, expand, t, and the pieces of split and unbind). Each costs a trip through the
dispatcher on every call (~5 us of host time), which dominates when the graph is not captured in
CUDA graphs. For a graph of static shapes, a view's size, stride and storage offset relative to
the tensor it views follow from the traced layout of that tensor (replayed on a meta tensor), so
each chain of views (x -> view -> permute -> select) collapses into one call that re-strides the
chain's root the way Inductor's generated code does (``reinterpret_tensor``).

That is only right if the root has, at run time, the layout it was traced with. Graph inputs are
guarded by Dynamo, and our kernels allocate exactly the traced layout, but a vendor op could
return another one; so every folded call compares the root's strides first and, if they differ,
uses the chain's result for that layout (worked out once) instead.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

log = logging.getLogger("torch_kernelize.serving.runtime")

aten = torch.ops.aten

# Single-output view ops whose result is determined by the input's layout and the op's arguments
# (as_strided is not: its offset is absolute).
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.permute.default, aten.select.int,
    aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.expand.default, aten.t.default, aten.transpose.int, aten.alias.default, aten.diagonal.default,
    aten.unfold.default,
})


def _reinterpret_fn() -> Callable[[torch.Tensor, tuple, tuple, int], torch.Tensor]:
    fn = getattr(torch._C._dynamo.guards, "_reinterpret_tensor", None)  # what Inductor's code uses
    if fn is not None:
        return fn
    return lambda t, size, stride, delta: t.as_strided(size, stride, t.storage_offset() + delta)


reinterpret_tensor = _reinterpret_fn()  # (tensor, size, stride, storage offset delta)


def _layout(node: Any) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """(size, stride, storage offset) of a node's traced value, if it is a tensor of static layout."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        layout = tuple(val.shape), tuple(val.stride()), val.storage_offset()
    except Exception:  # e.g. a sparse or opaque tensor
        return None
    if not all(type(v) is int for v in (*layout[0], *layout[1], layout[2])):
        return None  # symbolic: the layout is only known per shape signature
    return layout


def _replayed(root: fx.Node, chain: list) -> tuple[tuple, tuple, int] | None:
    """(size, stride, storage offset relative to the root) of the chain's result, from replaying
    the view ops on a meta tensor of the root's traced layout (traced values keep sizes and
    strides, but not always a view's storage offset)."""
    base = _layout(root)
    return None if base is None else _replay(base[0], base[1], root.meta["val"].dtype, chain)


def _replay(size: tuple, stride: tuple, dtype: torch.dtype, chain) -> tuple[tuple, tuple, int] | None:
    """(size, stride, storage offset delta) of the chain's result on a root of this layout, or
    None if the ops refuse it (a view that needs a copy there)."""
    try:
        # plain meta tensors, outside the fake mode the graph was traced in (Dynamo's is still
        # active when lowering): a fake dispatch per view op made this the larger part of lowering
        with unset_fake_temporarily():
            probe = torch.empty_strided(size, stride, dtype=dtype, device="meta")
            out = probe
            for op, args, kwargs in chain:
                out = op(out, *args, **kwargs)
            return tuple(out.shape), tuple(out.stride()), out.storage_offset() - probe.storage_offset()
    except Exception:
        return None


_UNSEEN = object()


class FoldedView:
    """One chain of views from ``root``: re-strides the root when its layout is the traced one.

    A root can arrive in another layout than traced (a vendor kernel whose output strides differ
    from its meta function's, e.g. an attention kernel's): the chain's result for that layout is
    worked out once on a meta tensor and re-strided from then on, instead of replaying the view
    ops (a dispatch each) on every call; a layout the ops refuse replays them (they raise)."""

    MAX_LAYOUTS = 8  # other root layouts remembered

    def __init__(self, size: tuple, stride: tuple, delta: int, root_stride: tuple,
                 chain: tuple[tuple[Any, tuple, dict], ...]):
        self.size, self.stride, self.delta, self.root_stride, self.chain = size, stride, delta, root_stride, chain
        self._layouts: dict[tuple, tuple | None] = {}
        self.__name__ = "folded_view"

    def __call__(self, root: torch.Tensor) -> torch.Tensor:
        stride = root.stride()
        if stride == self.root_stride:
            return reinterpret_tensor(root, self.size, self.stride, self.delta)
        layout = self._layouts.get(stride, _UNSEEN)
        if layout is _UNSEEN:
            layout = _replay(tuple(root.shape), stride, root.dtype, self.chain)
            if len(self._layouts) < self.MAX_LAYOUTS:
                self._layouts[stride] = layout
        if layout is not None:
            return reinterpret_tensor(root, *layout)
        out = root
        for op, args, kwargs in self.chain:
            out = op(out, *args, **kwargs)
        return out


def fold_views(gm: fx.GraphModule) -> int:
    """fold_view_chains on ``gm``'s graph, then its code regenerated."""
    folded = fold_view_chains(gm.graph)
    gm.recompile()
    return folded


# Multi-output views: ``getitem(split(x, ...), i)`` is a slice of x, ``getitem(unbind(x, d), i)``
# a select; rewritten as those first, so that they fold like any other view.
SPLIT_OPS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int})


def _pieces_as_views(graph: fx.Graph) -> None:
    """Each getitem of a split or unbind of static layout becomes the slice or select it is; the
    split itself goes once nothing reads it."""
    for split in list(graph.nodes):
        if split.op != "call_function" or split.target not in SPLIT_OPS or not isinstance(split.args[0], fx.Node):
            continue
        pieces, base = split.meta.get("val"), _layout(split.args[0])
        users = list(split.users)
        if base is None or not isinstance(pieces, (list, tuple)) or not all(
                u.op == "call_function" and u.target is operator.getitem and type(u.args[1]) is int for u in users):
            continue
        unbind = split.target is aten.unbind.int
        at = 1 if unbind else 2  # where the dim argument sits
        dim = (split.args[at] if len(split.args) > at else split.kwargs.get("dim", 0)) % len(base[0])
        starts = [0]
        for piece in pieces:
            starts.append(starts[-1] + (1 if unbind else int(piece.shape[dim])))
        for u in users:
            i = u.args[1]
            if unbind:
                op, args = aten.select.int, (split.args[0], dim, i)
            else:
                op, args = aten.slice.Tensor, (split.args[0], dim, starts[i], starts[i + 1])
            with graph.inserting_before(u):
                view = graph.call_function(op, args)
            view.meta = dict(u.meta)
            u.replace_all_uses_with(view)
            graph.erase_node(u)
        graph.erase_node(split)


def fold_view_chains(graph: fx.Graph) -> int:
    """Replace each view node of static layout that something other than a view reads by one
    FoldedView call on the root of its chain; the views are removed. Returns the number of calls."""
    _pieces_as_views(graph)

    def foldable(n: fx.Node) -> bool:
        return (n.op == "call_function" and n.target in VIEW_OPS and n.args and isinstance(n.args[0], fx.Node)
                and _layout(n) is not None
                and not any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())))

    # Chains are read off the original graph first, so that each folded call starts at the root
    # (the first value that is not a foldable view) however the chain's views are shared.
    chains: dict[fx.Node, tuple[fx.Node, list]] = {}
    for n in graph.nodes:
        if foldable(n):
            root, chain = n.args[0], [(n.target, tuple(n.args[1:]), dict(n.kwargs))]
            if root in chains:
                root, chain = chains[root][0], chains[root][1] + chain
            chains[n] = (root, chain)
    folded = 0
    for n, (root, chain) in chains.items():
        if all(u in chains for u in n.users):
            continue  # read only by other views: those fold from the root themselves
        layout = _replayed(root, chain)
        if layout is None or layout[:2] != _layout(n)[:2]:
            continue  # the root's layout is unknown, or the replay disagrees with the trace
        size, stride, delta = layout
        call = FoldedView(size, stride, delta, _layout(root)[1], tuple(chain))
        with graph.inserting_before(n):
            new = graph.call_function(call, (root,))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        folded += 1
    for n in reversed(list(chains)):  # the views themselves, once nothing reads them
        if not n.users:
            graph.erase_node(n)
    graph.lint()
    return folded
