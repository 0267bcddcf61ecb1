"""Regions as large as a compiler's: kind "graph".

Inductor partitions an ATen graph at its extern kernels (GEMMs, convolutions, attention, random
and data-dependent ops, collectives, mutations) and fuses everything between them: pointwise
ops, reductions, norms, softmax, broadcasts, views and casts. A "graph" region is one such
partition piece: a maximal connected group of those ops, formed once per graph (shape-independent)
like the other kinds (compiling/regions.py). Its spec is the canonical JSON of its nodes like any
region's; a generator that compiles a whole graph (Inductor, offline) serves any of them with as
many kernels as it needs, and the fused family serves those that are one loop (pointwise, or
reductions over the last dim).

Rules (Inductor's partition is the model; inside a region its scheduler decides the loops):
  * a node joins the groups of its producers unless that closes a cycle through an outside node
    (a region runs as one call that needs all its inputs), or the group would exceed
    MAX_GRAPH_NODES nodes or MAX_GRAPH_INPUTS inputs; a GEMM's epilogue is thus in the region
    after it, its prologue in the region before it (the GEMM itself is a boundary);
  * tuple-valued ops (var_mean, native_layer_norm and its backward) come with their getitems;
  * views never start or end a region: a view of an outside value, or one whose readers are
    all outside, leaves it (it costs nothing there; the region reads the view), and a region
    output that is a broadcast view (stride 0: no kernel can write it) is cut off with what
    follows it;
  * a region is connected and needs two computing nodes; one whose nodes an existing region holds
    all of is not formed (that region does as much or more: a GEMM with this very epilogue).
  * where a region reduces rows (over the last dim) and also over other dims at its ends (a norm's
    weight and bias gradients), its row loop alone is a second region, tried after it;
Serving tries these regions before the pointwise/rowwise/matmul regions inside them (lower.py):
a miss or "vendor wins" leaves their nodes to those smaller regions, then to the nodes.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from torch_kernelize.compiling.op_classes import NodeClass, classify, is_random, is_view_op
from torch_kernelize.compiling.regions import Region, is_tensor_node, pointwise_ops, reads_from, tensor_args
from torch_kernelize.core.targets import op_name

aten = torch.ops.aten

MAX_GRAPH_NODES = 160    # nodes (views included): a decoder block's backward chain between two GEMMs fits
MAX_GRAPH_INPUTS = 32    # external tensors a region reads (each one pointer argument of its kernels)

REDUCTIONS = frozenset({
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
    aten.amin.default, aten.var.correction, aten.var_mean.correction, aten.std.correction, aten.prod.dim_int,
    aten.any.dim, aten.any.dims, aten.all.dim, aten.all.dims, aten.logsumexp.default,
    aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default, aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default})
# data movement a compiler fuses as indexing (no data-dependent addresses)
LAYOUT_OPS = frozenset({aten.cat.default, aten.slice_scatter.default, aten.select_scatter.default,
                        aten.constant_pad_nd.default})
TUPLE_OPS = frozenset({aten.var_mean.correction, aten.native_layer_norm.default,
                       aten.native_layer_norm_backward.default})


def graph_role(node: fx.Node, pointwise: frozenset[str]) -> str | None:
    """"compute" | "view" | None (a boundary): what ``node`` is to a graph region."""
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    klass = classify(node)[0]
    if klass not in (NodeClass.COMPUTE, NodeClass.VIEW) or not _values_ok(node):
        return None
    target = node.target
    if klass is NodeClass.VIEW:
        # a factory makes memory from nothing but sizes: it stays outside, an input of the region
        # (so do an op with empty outputs and an input's write-back: allocations and copies, not views)
        return "view" if is_view_op(target) and any(is_tensor_node(a) for a in node.all_input_nodes) else None
    if is_random(target, node.args, node.kwargs):
        return None
    if target in REDUCTIONS or target in LAYOUT_OPS:
        return "compute"
    if torch.Tag.pointwise in target.tags or op_name(target) in pointwise:
        if target is aten._to_copy.default and _changes_device(node):
            return None
        return "compute"
    return None


def _values_ok(node: fx.Node) -> bool:
    """A tensor (or, for TUPLE_OPS, a tuple of tensors and Nones) whose sizes do not depend on data."""
    v = node.meta.get("val")
    vals = v if node.target in TUPLE_OPS and isinstance(v, (tuple, list)) else [v]
    tensors = [t for t in vals if t is not None]
    return bool(tensors) and all(isinstance(t, torch.Tensor) and not free_unbacked_symbols(t) for t in tensors)


def _changes_device(node: fx.Node) -> bool:
    src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    return src is None or src.device != node.meta["val"].device


def find_graph_regions(gm: fx.GraphModule, existing: Sequence[Region] = ()) -> list[Region]:
    """The graph regions of ``gm``, in graph order (see the module docstring)."""
    pointwise = pointwise_ops()
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    role = {n: graph_role(n, pointwise) for n in nodes}
    group_of: dict[fx.Node, int] = {}
    groups: dict[int, list[fx.Node]] = {}
    start: dict[int, int] = {}
    reads: dict[int, set[fx.Node]] = {}   # the outside nodes each group reads

    def depends_on(node: fx.Node, gids: set[int]) -> bool:
        """Whether ``node`` (outside the groups) reads, directly or not, a value of the groups."""
        return reads_from(node, lambda a: group_of.get(a) in gids, order, min(start[g] for g in gids))

    for node in nodes:
        if node.target is operator.getitem and node.args and group_of.get(node.args[0]) is not None:
            g = group_of[node.args[0]]  # a piece of a tuple goes with the op that makes it
            groups[g].append(node)
            group_of[node] = g
            continue
        if role[node] is None:
            continue
        t: int | None = None
        own = set(node.all_input_nodes)
        for g in sorted({group_of[a] for a in own if a in group_of}, key=start.get):
            gids = {g} if t is None else {t, g}
            outside = {a for a in own.union(*(reads[k] for k in gids)) if group_of.get(a) not in gids}
            if sum(len(groups[k]) for k in gids) + 1 > MAX_GRAPH_NODES or len(outside) > MAX_GRAPH_INPUTS:
                continue
            if any(depends_on(b, gids) for b in own if group_of.get(b) not in gids):
                continue
            if t is not None and (any(depends_on(b, {t}) for b in reads[g] if group_of.get(b) != t)
                                  or any(depends_on(b, {g}) for b in reads[t] if group_of.get(b) != g)):
                continue
            if t is not None:  # merge g into t
                for n in groups[g]:
                    group_of[n] = t
                groups[t] = sorted(groups[t] + groups.pop(g), key=order.get)
                start[t] = min(start[t], start.pop(g))
                del reads[g]
            t = g if t is None else t
            reads[t] = outside
        if t is None:
            t = order[node]
            groups[t], start[t], reads[t] = [], order[node], own
        groups[t].append(node)
        group_of[node] = t

    taken = [set(r.nodes) for r in existing]
    regions = []
    pieces = [p for g in sorted(groups, key=start.get) for p in _components(_trimmed(groups[g], role))]
    for members in sorted(pieces, key=lambda p: min(order[n] for n in p)):
        # the region, then its row loop alone (tried after it: what a miss of it splits into first)
        for part in [members] + _components(_trimmed(_row_core(members), role)):
            if sum(role.get(n) == "compute" for n in part) < 2 or any(part <= r for r in taken) or (
                    part is not members and part == members):
                continue
            ordered = sorted(part, key=order.get)
            inputs = list(dict.fromkeys(a for n in ordered for a in tensor_args(n) if a not in part))
            outputs = [n for n in ordered if any(u not in part for u in n.users)]
            if outputs:
                regions.append(Region("graph", ordered, inputs, outputs))
    return regions


def _reduces(node: fx.Node) -> str | None:
    """"rows" for a reduction over the last dim only, "other" for one over other dims (or all),
    None for a node that does not reduce."""
    target = node.target
    if target not in REDUCTIONS:
        return None
    if target in (aten.native_layer_norm.default, aten.native_layer_norm_backward.default):
        return "rows"  # (the op's own weight and bias gradients stay inside it)
    x = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if target in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
        dims = node.args[2]
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or dims is None:
        return "other"
    dims = [dims] if isinstance(dims, int) else list(dims)
    return "rows" if len(dims) == 1 and dims[0] in (-1, x.dim() - 1) else "other"


def _row_core(members: set[fx.Node]) -> set[fx.Node]:
    """``members`` without the reductions over other dims than the last that end it (a norm's
    weight and bias gradients: sums over the rows), where it reduces rows too: the rows are one
    loop, those sums another (Inductor's scheduler makes them two kernels). Nothing left out
    otherwise. Only nodes no member reads leave: no cycle through outside nodes appears."""
    kinds = {_reduces(n) for n in members}
    if not {"rows", "other"} <= kinds:
        return set(members)
    core = set(members)
    changed = True
    while changed:
        changed = False
        for n in list(core):
            if _reduces(n) == "other" and not any(u in core for u in n.users):
                core.discard(n)
                changed = True
    return core


def _trimmed(group: list[fx.Node], role: dict[fx.Node, str | None]) -> set[fx.Node]:
    """``group`` without the views that would start or end it, and without what follows an output no
    kernel can write (a broadcast view). Both keep the group free of cycles through outside
    nodes: only nodes none of the group's nodes read leave it."""
    members = set(group)
    changed = True
    while changed:
        changed = False
        for n in list(members):
            if role.get(n) == "view" and (not any(u in members for u in n.users)
                                          or not any(a in members for a in n.all_input_nodes)):
                members.discard(n)
                changed = True
        for n in [n for n in group if n in members]:
            if role.get(n) == "view" and _broadcast(n) and any(u not in members for u in n.users):
                stack = [n]
                while stack:
                    m = stack.pop()
                    if m in members:
                        members.discard(m)
                        stack.extend(u for u in m.users if u in members)
                changed = True
                break
    # a tuple op's getitems go with it
    return {n for n in members if n.target is not operator.getitem or n.args[0] in members}


def _components(members: set[fx.Node]) -> list[set[fx.Node]]:
    """The connected pieces of ``members`` (trimming views can leave a group in pieces: clones of
    three views of one tensor). Each piece of a group without cycles through outside nodes has none."""
    pieces, seen = [], set()
    for n in members:
        if n in seen:
            continue
        piece, stack = set(), [n]
        while stack:
            m = stack.pop()
            if m in piece:
                continue
            piece.add(m)
            stack.extend(x for x in (*m.all_input_nodes, *m.users) if x in members and x not in piece)
        seen |= piece
        pieces.append(piece)
    return pieces


def _broadcast(node: fx.Node) -> bool:
    """A view with a stride-0 dim of more than one element (a symbolic size counts as more)."""
    v = node.meta.get("val")

    def expr(x: Any) -> Any:
        return x.node.expr if isinstance(x, torch.SymInt) else x
    return isinstance(v, torch.Tensor) and any(expr(st) == 0 and expr(sz) != 1 for sz, st in zip(v.shape, v.stride()))
