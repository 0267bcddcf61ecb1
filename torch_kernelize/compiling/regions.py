"""Fused regions: groups of ATen nodes that one kernel computes, keyed like a single op.

A region is an overlay on the planned graph. ``find_regions`` forms the candidates once per
graph (shape-independent); at each shape signature the runtime builds the region's KernelSpec
(op "region", ``graph`` = the canonical JSON of its nodes) and looks it up like any spec: a hit
replaces the region's nodes by one launch, a miss leaves each node to its own decision and is
recorded (for fill_cache) like any miss.

Region kinds (the ``kind`` field of the canonical graph):
  pointwise   connected pointwise nodes over one iteration shape (inputs may broadcast), and
              ``cat``: a cat starts a group and takes in the pointwise groups that compute only
              its pieces (RoPE's ``-x2``), which the kernel evaluates where it reads that piece;
  rowwise     pointwise nodes around reductions over the last dim (RMSNorm, LayerNorm, softmax
              with their neighbours): full-shape [.., N] and row-shape [.., 1] values;
  matmul      mm / addmm / bmm followed by a chain of pointwise epilogue nodes on its output;
  matmul_group  independent matmul regions (or lone mm/addmm nodes) of one structure that differ
              only in their row count M: an MoE's expert GEMMs, attention's Q/K/V projections.
              One launch computes them all (horizontal fusion; ``group_matmuls``). Groups are
              tried before their members: a group miss leaves each member to its own lookup.
  graph       a compiler's fusion group: everything between two boundary ops (GEMMs, convolutions,
              attention, random ops, ...): compiling/graph_regions.py. Tried before the kinds
              above; a miss or "vendor wins" leaves its nodes to them.
  grouped_mm_glu  an MoE's gate/up grouped GEMM, its product split in halves and the pointwise
              nodes joining them (SiLU(gate) * up): compiling/glu_regions.py. Tried before all.

Canonical graph format (JSON, part of the spec key):
  {"kind": ..., "nodes": [{"op": "aten.mul.Tensor", "args": [...], "kwargs": {...},
                           "meta": TensorMeta json}, ...],
   "outputs": [node index, ...]}
plus, for a matmul_group, "members": [[node index, ...], ...] (each member's nodes, in order).
A tuple-valued node (var_mean, native_layer_norm) has a list of metas (None for a missing piece),
and its pieces are nodes {"op": "getitem", "args": [{"node": j}, i]}; outputs are tensors.
where an argument is {"input": i} (region input i), {"node": j} (value of node j) or a constant
encoded as in KernelSpec (spec.encode_arg).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.op_classes import NodeClass, classify
from torch_kernelize.core.targets import Target, op_name
from torch_kernelize.core.shapes import concrete_meta, concrete_value
from torch_kernelize.core.spec import KernelSpec, TensorMeta, encode_arg

aten = torch.ops.aten

MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
ROW_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
                  aten._softmax.default, aten._log_softmax.default, aten.var_mean.correction}
MAX_REGION_NODES = 64


def pointwise_ops() -> frozenset[str]:
    from torch_kernelize.lowering.kernels.elementwise import FAMILY
    return frozenset(FAMILY.ops)


@dataclasses.dataclass
class Region:
    kind: str
    nodes: list[fx.Node]          # topological order
    inputs: list[fx.Node]         # external tensor inputs, in order of first use
    outputs: list[fx.Node]        # nodes whose values are used outside the region
    members: list[list[fx.Node]] | None = None  # matmul_group: the nodes of each member GEMM
    stretch: str = ""  # whole: a stretch of the graph, not all of it (whole_graph.py: BROKEN, CUT)

    @property
    def names(self) -> set[str]:
        return {n.name for n in self.nodes}


# --- formation -----------------------------------------------------------------------------------

def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def is_tensor_node(n: Any) -> bool:
    return isinstance(n, fx.Node) and isinstance(_val(n), torch.Tensor)


def _reduces_last_dim(node: fx.Node) -> bool:
    x = _val(node.args[0])
    if x is None or x.dim() == 0:
        return False
    if node.target in (aten._softmax.default, aten._log_softmax.default):
        return node.args[1] in (-1, x.dim() - 1) and not node.args[2]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or len(dims) != 1:
        return False
    keepdim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    return dims[0] in (-1, x.dim() - 1) and bool(keepdim) and not node.kwargs.get("dtype")


def _cat_pieces_ok(node: fx.Node) -> bool:
    """cat of tensors of the output's rank and dtype (the fused family checks the sizes)."""
    pieces, v = node.args[0] if node.args else None, _val(node)
    return (isinstance(pieces, (list, tuple)) and len(pieces) > 1 and all(is_tensor_node(a) for a in pieces)
            and all(_val(a).dim() == v.dim() and _val(a).dtype == v.dtype for a in pieces))


def _role(node: fx.Node, pointwise: frozenset[str], target: Target) -> str | None:
    """pointwise | reduction | matmul | cat | None (not fusible)."""
    if node.op != "call_function" or classify(node)[0] is not NodeClass.COMPUTE:
        return None
    if not is_tensor_node(node):
        return None
    if node.target in MATMUL_OPS:
        return "matmul"
    if node.target in ROW_REDUCTIONS and node.target is not aten.var_mean.correction and _reduces_last_dim(node):
        return "reduction"
    if op_name(node.target) in pointwise:
        return "pointwise"
    if node.target is aten.cat.default and _cat_pieces_ok(node):
        return "cat"
    return None


def _e(x: Any) -> Any:
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


def _dims_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(sympy.simplify(_e(x) - _e(y)) == 0 for x, y in zip(a, b))


def _same_shape(a: Any, b: Any) -> bool:
    return _dims_equal(a.shape, b.shape)


def _row_shape_of(full: Any, v: Any) -> bool:
    """v has the shape of ``full`` with the last dim reduced to 1."""
    return v.dim() == full.dim() and _dims_equal(v.shape[:-1], full.shape[:-1]) and _e(v.shape[-1]) == 1


def reads_from(node: fx.Node, inside: Callable[[fx.Node], bool], order: dict[fx.Node, int], stop: int) -> bool:
    """Whether ``node`` reads, directly or through nodes after position ``stop`` of ``order`` (where
    the group starts: nothing earlier can depend on it), a node for which ``inside`` holds."""
    seen, stack = set(), [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if inside(a):
                return True
            if a not in seen and order[a] > stop:
                seen.add(a)
                stack.append(a)
    return False


def find_regions(gm: fx.GraphModule, target: Target) -> list[Region]:
    """Greedy formation in topological order: a fusible node joins (and merges) the compatible
    groups of its producers, unless that would close a cycle through an outside node."""
    pointwise = pointwise_ops()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    group_of: dict[fx.Node, int] = {}
    groups: dict[int, dict[str, Any]] = {}

    def depends_on(node: fx.Node, gids: set[int]) -> bool:
        """Whether ``node`` (outside the groups) reads, directly or not, a value of the groups."""
        return reads_from(node, lambda a: group_of.get(a) in gids, order, min(groups[g]["start"] for g in gids))

    def external_inputs(g: int) -> set[fx.Node]:
        return {a for n in groups[g]["nodes"] for a in n.all_input_nodes if group_of.get(a) != g}

    def take_pieces(cat: fx.Node, t: int) -> None:
        """Pointwise groups whose values only this cat reads join its group (as its pieces), if
        they read nothing that another piece reads (the kernel loads an input in one piece)."""
        seen = {a for a in cat.args[0] if a not in group_of}
        for a in dict.fromkeys(cat.args[0]):
            g = group_of.get(a)
            if g is None or g == t:
                continue
            piece = groups[g]
            members = set(piece["nodes"])
            reads = external_inputs(g)
            if piece["kind"] != "pointwise" or piece["cat"] or piece["seed"] == "matmul" \
                    or any(u not in members and u is not cat for n in piece["nodes"] for u in n.users) \
                    or reads & seen or len(piece["nodes"]) + len(groups[t]["nodes"]) >= MAX_REGION_NODES:
                continue
            seen |= reads
            for n in piece["nodes"]:
                group_of[n] = t
            groups[t]["nodes"] = sorted(groups[t]["nodes"] + piece["nodes"], key=order.get)
            groups[t]["start"] = min(groups[t]["start"], piece["start"])
            del groups[g]

    for node in gm.graph.nodes:
        role = _role(node, pointwise, target)
        if role is None:
            continue
        t = None
        if role not in ("matmul", "cat"):  # a cat's pieces are its region's inputs
            producer_groups = sorted({group_of[a] for a in node.all_input_nodes if a in group_of},
                                     key=lambda g: groups[g]["start"])
            for g in producer_groups:
                if not _compatible(groups[g], node, role):
                    continue
                members = {g} if t is None else {t, g}
                if t is not None and (groups[g]["seed"] == "matmul" or groups[t]["seed"] == "matmul"
                                      or not _same_shape(groups[g]["full"], groups[t]["full"])
                                      or _cat_in_rowwise(groups[g], groups[t])):
                    continue
                if len(groups[g]["nodes"]) + (len(groups[t]["nodes"]) if t is not None else 0) >= MAX_REGION_NODES:
                    continue
                outside = [b for b in node.all_input_nodes if group_of.get(b) not in members]
                if any(depends_on(b, members) for b in outside):
                    continue
                if t is not None and (any(depends_on(b, {t}) for b in external_inputs(g))
                                      or any(depends_on(b, {g}) for b in external_inputs(t))):
                    continue
                if t is None:
                    t = g
                else:  # merge g into t
                    for n in groups[g]["nodes"]:
                        group_of[n] = t
                    groups[t]["nodes"] = sorted(groups[t]["nodes"] + groups[g]["nodes"], key=order.get)
                    groups[t]["start"] = min(groups[t]["start"], groups[g]["start"])
                    if groups[g]["kind"] == "rowwise":
                        groups[t]["kind"] = "rowwise"
                    groups[t]["cat"] = groups[t]["cat"] or groups[g]["cat"]
                    del groups[g]
        if t is None:
            full = _val(node.args[0]) if role == "reduction" else _val(node)
            t = len(group_of) + len(groups) + 1 + max(groups, default=0)
            groups[t] = {"kind": {"matmul": "matmul", "reduction": "rowwise"}.get(role, "pointwise"),
                         "full": full, "nodes": [], "start": order[node], "seed": role, "cat": role == "cat"}
        groups[t]["nodes"].append(node)
        if role == "reduction":
            groups[t]["kind"] = "rowwise"
        group_of[node] = t
        if role == "cat":
            take_pieces(node, t)

    regions = []
    for g in sorted(groups.values(), key=lambda g: g["start"]):
        nodes = g["nodes"]
        # one node is no fusion, except a cat the vendor cannot run: no family generates it alone
        if len(nodes) < 2 and not (g["cat"] and not target.vendor_runs(nodes[0].target)):
            continue
        members = set(nodes)
        inputs: list[fx.Node] = []
        for n in nodes:
            for a in tensor_args(n):
                if a not in members and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        if outputs:
            regions.append(Region(g["kind"], nodes, inputs, outputs))
    return regions


def _cat_in_rowwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Rowwise regions do not take cat (only the pointwise variant generates it)."""
    return (a["cat"] and b["kind"] == "rowwise") or (b["cat"] and a["kind"] == "rowwise")


def _compatible(group: dict[str, Any], node: fx.Node, role: str) -> bool:
    full, v = group["full"], _val(node)
    if group["seed"] == "matmul":
        # epilogue: pointwise on the matmul output's shape, a chain (one new node at a time)
        return role == "pointwise" and _same_shape(v, full)
    if role == "reduction":
        x = _val(node.args[0])
        return group["kind"] in ("pointwise", "rowwise") and not group["cat"] and _same_shape(x, full)
    if _same_shape(v, full):
        return True
    return group["kind"] == "rowwise" and _row_shape_of(full, v)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    flat, _ = pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    return [a for a in flat if is_tensor_node(a)]


# --- horizontal groups of GEMMs ----------------------------------------------------------------

MAX_GROUP_MEMBERS = 32   # pointer arguments grow with the members (each 2-5 tensors)
GROUPED_MM = {aten.mm.default, aten.addmm.default}


def group_matmuls(gm: fx.GraphModule, regions: Sequence[Region], target: Target) -> list[Region]:
    """Groups of independent GEMMs of one structure (matmul regions, or lone mm/addmm nodes) that
    differ only in their row count M, as ``matmul_group`` regions.

    A unit joins the open group of its structure unless either reads, directly or not, a value
    the other computes (one launch computes them all: none may wait for another). The structure
    is the unit's canonical graph with M abstracted (``_structure``); the kernel family checks the
    rest. Groups of fewer than two members are dropped."""
    pointwise = pointwise_ops()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    in_region = {n for r in regions for n in r.nodes}
    units: list[Region] = [r for r in regions if r.kind == "matmul"]
    for node in gm.graph.nodes:
        if node not in in_region and node.target in GROUPED_MM and _role(node, pointwise, target) == "matmul":
            units.append(Region("matmul", [node], tensor_args(node), [node]))
    units.sort(key=lambda u: order[u.nodes[0]])

    def reads(unit: Region, nodes: set[fx.Node]) -> bool:
        """Whether ``unit``'s inputs depend on any of ``nodes``."""
        stop = min(order[n] for n in nodes)
        seen, stack = set(), list(unit.inputs)
        while stack:
            a = stack.pop()
            if a in nodes:
                return True
            if a not in seen and order[a] > stop:
                seen.add(a)
                stack.extend(a.all_input_nodes)
        return False

    open_groups: dict[str, list[Region]] = {}
    closed: list[list[Region]] = []
    for u in units:
        key = _structure(u)
        if key is None:
            continue
        group = open_groups.get(key)
        if group is not None:
            nodes = {n for m in group for n in m.nodes}
            if len(group) >= MAX_GROUP_MEMBERS or reads(u, nodes) or any(reads(m, set(u.nodes)) for m in group):
                closed.append(group)
                group = None
        if group is None:
            open_groups[key] = group = []
        group.append(u)
    closed += open_groups.values()

    out = []
    for group in closed:
        if len(group) < 2:
            continue
        nodes = sorted({n for m in group for n in m.nodes}, key=order.get)
        inputs = list(dict.fromkeys(a for m in group for a in m.inputs))
        outputs = [o for m in group for o in m.outputs]
        out.append(Region("matmul_group", nodes, inputs, outputs, [list(m.nodes) for m in group]))
    return sorted(out, key=lambda r: order[r.nodes[0]])


def closes_cycle(region: Region, fused: Sequence[Region]) -> bool:
    """Whether running ``region`` as one call, beside the ``fused`` regions (each one call that
    needs all its inputs), would make a call wait for itself: some input of ``region`` depends on
    a node of it. Each region is acyclic alone; two groups can still wait for each other (group
    X's member a feeds group Y's member b while Y's c feeds X's d)."""
    owner = {n: r for r in fused for n in r.nodes}
    mine = set(region.nodes)
    seen: set[fx.Node] = set()
    stack = list(region.inputs)
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if a in mine:
            return True
        r = owner.get(a)
        stack.extend(r.inputs if r is not None else a.all_input_nodes)
    return False


def _structure(unit: Region) -> str | None:
    """The unit's graph as a string with its row count M abstracted (None: not groupable): ops,
    argument wiring, dtypes, strides, and every size but a leading dim equal to M."""
    mm = unit.nodes[0]
    out = _val(mm)
    if mm.target not in GROUPED_MM or out is None or out.dim() != 2:
        return None
    M = str(out.shape[0])
    index = {n: i for i, n in enumerate(unit.nodes)}
    inputs = {n: i for i, n in enumerate(unit.inputs)}
    weight = mm.args[1] if mm.target is aten.mm.default else mm.args[2]   # its rows are K, not M

    def meta(v: Any, rows: bool = True) -> Any:
        if not isinstance(v, torch.Tensor):
            return None
        shape = [str(d) for d in v.shape]
        if rows and shape and shape[0] == M:
            shape[0] = "M"
        return [str(v.dtype), shape, [str(st) for st in v.stride()]]

    def enc(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return {"node": index[a]} if a in index else {"input": inputs[a]} if a in inputs else repr(_val(a))
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        return repr(a)

    try:
        return json.dumps({"nodes": [[op_name(n.target), enc(list(n.args)), enc(sorted(n.kwargs.items())), meta(_val(n))]
                                     for n in unit.nodes],
                           "inputs": [meta(_val(a), a is not weight) for a in unit.inputs],
                           "outputs": [index[o] for o in unit.outputs]}, sort_keys=True)
    except (KeyError, TypeError):
        return None


# --- specs ---------------------------------------------------------------------------------------

def region_spec(region: Region, bindings: dict) -> KernelSpec | None:
    """The concrete KernelSpec of a region under ``bindings``; None if a size is data-dependent."""
    index = {n: i for i, n in enumerate(region.nodes)}
    inputs = {n: i for i, n in enumerate(region.inputs)}
    in_metas = [concrete_meta(_val(n), bindings) for n in region.inputs]
    if any(m is None for m in in_metas):
        return None
    nodes = []
    for n in region.nodes:
        meta = _node_meta(_val(n), bindings)
        if meta is None:
            return None

        def enc(a: Any) -> Any:
            if isinstance(a, fx.Node):
                if a in index:
                    return {"node": index[a]}
                if a in inputs:
                    return {"input": inputs[a]}
                return encode_arg(concrete_value(_val(a), bindings))  # a SymInt computed outside
            if isinstance(a, (list, tuple)):
                return [enc(x) for x in a]
            return encode_arg(a)

        nodes.append({"op": op_name(n.target), "args": [enc(a) for a in n.args],
                      "kwargs": {k: enc(v) for k, v in sorted(n.kwargs.items())}, "meta": meta})
    graph = {"kind": region.kind, "nodes": nodes, "outputs": [index[o] for o in region.outputs]}
    if region.members is not None:
        graph["members"] = [[index[n] for n in m] for m in region.members]
    outs = tuple(TensorMeta.from_json(nodes[i]["meta"]) for i in graph["outputs"])
    return KernelSpec("region", [], {}, tuple(in_metas), outs, len(outs) > 1,
                      json.dumps(graph, sort_keys=True, separators=(",", ":")))


def _node_meta(val: Any, bindings: dict) -> Any:
    """A node's meta in the canonical graph: TensorMeta JSON, or a list of them (None for a
    missing piece) for a tuple-valued op; None if a size is data-dependent."""
    if isinstance(val, (tuple, list)):
        # a piece that is no tensor (cuDNN attention's max_q, a SymInt) is a missing piece too:
        # the op still runs whole, and a getitem of it would be a node without a meta (no region)
        tensors = [isinstance(v, (torch.Tensor, tuple, list)) for v in val]
        metas = [_node_meta(v, bindings) if t else None for v, t in zip(val, tensors)]
        return None if any(m is None for m, t in zip(metas, tensors) if t) else metas
    meta = concrete_meta(val, bindings) if isinstance(val, torch.Tensor) else None
    return meta.to_json() if meta is not None else None
