"""The analysis of a fused region (fused.py): a region graph (canonical JSON) and its tensor
metas -> a ``_Plan``, or the reason the region is not generated. A "graph" region's LayerNorms are
written out as rowwise nodes first, and its kind (pointwise or rowwise) chosen."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.elementwise import OPS
from torch_kernelize.lowering.kernels.fused_plan import Ref, _itemsize, _Node, _Plan, _Tensor, _vtype
from torch_kernelize.core.region_graph import node_ref
from torch_kernelize.core.spec import TensorMeta

REDUCE_OPS = {"aten.sum.dim_IntList": "sum", "aten.mean.dim": "mean",
              "aten.amax.default": "amax", "aten.amin.default": "amin"}
SOFTMAX_OPS = {"aten._softmax.default": "softmax", "aten._log_softmax.default": "log_softmax"}
KINDS = ("pointwise", "rowwise")
GRAPH_KIND = "graph"    # a compiler-sized region: generated as one of KINDS when it is one loop
SCALAR_ARGS = ("alpha", "min", "max", "min_val", "max_val", "negative_slope", "exponent")
CAT_OP = "aten.cat.default"
EXPAND_OP, CLONE_OP = "aten.expand.default", "aten.clone.default"
LAYER_NORM_OP, GETITEM_OP = "aten.native_layer_norm.default", "getitem"
HALF = ("float16", "bfloat16")


def _refs_in(v: Any) -> list[Ref]:
    if isinstance(v, (list, tuple)):
        return [r for x in v for r in _refs_in(x)]
    r = node_ref(v)
    return [r] if r else []


def _last_dim(dims: Any, ndim: int) -> bool:
    if isinstance(dims, int) and not isinstance(dims, bool):
        dims = [dims]
    return isinstance(dims, list) and len(dims) == 1 and isinstance(dims[0], int) and dims[0] in (-1, ndim - 1)


def _inline_layer_norms(graph: dict[str, Any]) -> dict[str, Any] | str:
    """``graph`` with each native_layer_norm over the last dim written out as rowwise nodes (its
    definition, as layernorm.py generates it: mean, the centred row, the biased variance of it,
    rstd, then weight and bias) and its getitems as the nodes that compute out, mean and rstd;
    or the reason it cannot be. Intermediate values are fp32 (a graph's own nodes are not rounded
    either); out, mean and rstd keep the metas the op gives them."""
    nodes = graph.get("nodes") or []
    if not any(n["op"] == LAYER_NORM_OP for n in nodes):
        return graph
    new: list[dict[str, Any]] = []
    where: dict[int, int] = {}            # old node index -> new index
    parts: dict[int, list[int]] = {}      # old layer norm index -> new indices of out, mean, rstd

    def remap(a: Any) -> Any:
        if isinstance(a, list):
            return [remap(x) for x in a]
        r = node_ref(a)
        return {"node": where[r[1]]} if r is not None and r[0] == "node" else a

    def add(op: str, args: list, meta: dict[str, Any]) -> dict[str, Any]:
        new.append({"op": op, "args": args, "kwargs": {}, "meta": meta})
        return {"node": len(new) - 1}

    for j, n in enumerate(nodes):
        if n["op"] == GETITEM_OP:
            owner = node_ref(n["args"][0])
            if owner is None or owner[1] not in parts:
                return f"node {j}: a piece of a node with several outputs is not generated"
            where[j] = parts[owner[1]][n["args"][1]]
            continue
        if n["op"] != LAYER_NORM_OP:
            where[j] = len(new)
            new.append(dict(n, args=remap(n["args"]), kwargs={k: remap(v) for k, v in n["kwargs"].items()}))
            continue
        args = cg.bind_arguments(LAYER_NORM_OP, remap(n["args"]), {k: remap(v) for k, v in n["kwargs"].items()})
        out, mean, rstd = n["meta"]
        if len(args["normalized_shape"]) != 1 or None in (out, mean, rstd):
            return f"node {j}: LayerNorm over {args['normalized_shape']} (the last dim only here)"
        shape, row = out["shape"], mean["shape"]
        full32 = TensorMeta(tuple(shape), tuple(cg.contiguous_strides(shape)), "float32").to_json()
        row32 = TensorMeta(tuple(row), tuple(cg.contiguous_strides(row)), "float32").to_json()
        x, eps = args["input"], args["eps"]
        m = add("aten.mean.dim", [x, [-1], True], mean)
        d = add("aten.sub.Tensor", [x, m], full32)
        var = add("aten.mean.dim", [add("aten.mul.Tensor", [d, d], full32), [-1], True], row32)
        r = add("aten.rsqrt.default", [add("aten.add.Tensor", [var, eps], row32)], rstd)
        y = add("aten.mul.Tensor", [d, r], full32)
        if args.get("weight") is not None:
            y = add("aten.mul.Tensor", [y, args["weight"]], full32)
        if args.get("bias") is not None:
            y = add("aten.add.Tensor", [y, args["bias"]], full32)
        new[y["node"]]["meta"] = out
        parts[j] = [y["node"], m["node"], r["node"]]
    outputs = [where[i] for i in graph["outputs"]]
    return dict(graph, nodes=new, outputs=outputs)


def _one_loop_kind(graph: dict[str, Any]) -> str:
    """The kind a "graph" region (torch_kernelize/compiling/graph_regions.py) is generated as, if it is one loop:
    rowwise where it reduces, else pointwise; or the reason it is neither. The analysis of that
    kind then checks the rest (reductions over the last dim, one iteration shape, ...)."""
    nodes = graph.get("nodes") or []
    if any(not isinstance(n.get("meta"), dict) for n in nodes):
        return "a node with several outputs (var_mean, native_layer_norm) is not generated in fused regions"
    reduces = any(n["op"] in REDUCE_OPS or n["op"] in SOFTMAX_OPS for n in nodes)
    if reduces and any(n["op"] == CAT_OP for n in nodes):
        return "cat next to a reduction is not generated (only the pointwise variant takes cat)"
    if not reduces and any(n["op"] == EXPAND_OP for n in nodes):
        return "expand is generated in rows only (a broadcast of a row value)"
    return "rowwise" if reduces else "pointwise"


class _Analysis:
    """Region graph (canonical JSON) + tensor metas -> _Plan, or the reason it cannot be generated."""

    def __init__(self, graph: dict[str, Any], inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]):
        self.graph, self.in_metas, self.out_metas = graph, list(inputs), list(outputs)
        self.nodes: list[_Node] = []

    # what a reference is --------------------------------------------------------------------
    def meta_of(self, r: Ref) -> TensorMeta:
        return self.in_metas[r[1]] if r[0] == "input" else self.nodes[r[1]].meta

    def vtype_of(self, r: Ref) -> str:
        return _vtype(self.in_metas[r[1]].dtype) if r[0] == "input" else self.nodes[r[1]].vtype

    def exact_of(self, r: Ref) -> bool:
        return r[0] == "input" or self.nodes[r[1]].exact

    def check_ref(self, r: Ref, j: int) -> str | None:
        if r[0] == "input" and not 0 <= r[1] < len(self.in_metas):
            return f"node {j}: input {r[1]} does not exist"
        if r[0] == "node" and not 0 <= r[1] < j:
            return f"node {j}: node {r[1]} is not computed before it"
        return None

    def run(self) -> _Plan | str:
        g = self.graph
        kind = g.get("kind")
        if kind == GRAPH_KIND:
            kind = _one_loop_kind(g)
            if kind not in KINDS:
                return kind
        if kind not in KINDS:
            return f"region kind {kind!r} is not pointwise/rowwise"
        metas = self.in_metas + self.out_metas
        if bad := sorted({m.dtype for m in metas} - set(cg.TL_TYPES)):
            return f"unsupported dtype(s) {bad}"
        if any(m.dtype == "float64" for m in metas):
            return "float64 is not generated in fused regions"
        if len({m.device for m in metas}) > 1:
            return "tensors on different devices"
        if not g.get("nodes") or not g.get("outputs"):
            return "empty region"
        for j, n in enumerate(g["nodes"]):
            node = self.node(j, n)
            if isinstance(node, str):
                return node
            if node.meta.dtype == "float64" or node.meta.dtype not in cg.TL_TYPES:
                return f"node {j} ({n['op']}) has dtype {node.meta.dtype}"
            self.nodes.append(node)
        out_nodes = [int(i) for i in g["outputs"]]
        if len(out_nodes) != len(self.out_metas) or len(set(out_nodes)) != len(out_nodes):
            return f"outputs {out_nodes} do not match {len(self.out_metas)} output metas"
        for i, m in zip(out_nodes, self.out_metas):
            if not 0 <= i < len(self.nodes):
                return f"output node {i} does not exist"
            nm = self.nodes[i].meta
            if tuple(nm.shape) != tuple(m.shape) or nm.dtype != m.dtype:
                return f"output meta {m.short()} does not match node {i}"
            if not cg.non_overlapping(m):
                return "output strides overlap (some elements share memory)"
        return self.rowwise(out_nodes) if kind == "rowwise" else self.pointwise(out_nodes)

    # one node -----------------------------------------------------------------------------
    def node(self, j: int, n: dict[str, Any]) -> _Node | str:
        op = n["op"]
        meta = TensorMeta.from_json(n["meta"])
        args = cg.bind_arguments(op, n.get("args", []), n.get("kwargs", {}))
        for r in _refs_in(list(args.values())):
            if why := self.check_ref(r, j):
                return why
        if op in REDUCE_OPS or op in SOFTMAX_OPS:
            return self.reduction(j, op, args, meta)
        if op == CAT_OP:
            return self.cat_node(j, args, meta)
        if op == EXPAND_OP:
            return self.expand_node(j, args, meta)
        if op not in OPS:
            return f"node {j}: {op} is not a pointwise op this family generates"
        return self.pointwise_node(j, op, args, meta)

    def reduction(self, j: int, op: str, args: dict[str, Any], meta: TensorMeta) -> _Node | str:
        x = node_ref(args.get("self"))
        if x is None:
            return f"node {j}: {op} of a non-tensor"
        xm = self.meta_of(x)
        if xm.dtype not in cg.FLOAT_TYPES or meta.dtype not in cg.FLOAT_TYPES:
            return f"node {j}: {op} of {xm.dtype} -> {meta.dtype} (fp32/fp16/bf16 only)"
        nd = len(xm.shape)
        if nd == 0:
            return f"node {j}: {op} of a 0-d tensor"
        if op in SOFTMAX_OPS:
            if not _last_dim(args.get("dim"), nd):
                return f"node {j}: {op} not over the last dim"
            if args.get("half_to_float"):
                return f"node {j}: half_to_float=True is not generated"
            if tuple(meta.shape) != tuple(xm.shape):
                return f"node {j}: {op} output shape {meta.shape} != input {xm.shape}"
            return _Node(j, op, "softmax", meta, args, [x], "float32", reduce=SOFTMAX_OPS[op])
        if not _last_dim(args.get("dim"), nd) or not args.get("keepdim"):
            return f"node {j}: {op} must reduce the last dim with keepdim=True"
        if args.get("dtype") is not None:
            return f"node {j}: {op} with dtype= is not generated"
        if tuple(meta.shape) != tuple(xm.shape[:-1]) + (1,):
            return f"node {j}: {op} output shape {meta.shape} is not the row shape of {xm.shape}"
        return _Node(j, op, "reduce", meta, args, [x], "float32", reduce=REDUCE_OPS[op], shape="row")

    def cat_node(self, j: int, args: dict[str, Any], meta: TensorMeta) -> _Node | str:
        pieces = args.get("tensors")
        refs = [node_ref(v) for v in pieces] if isinstance(pieces, list) else []
        if not refs or any(r is None for r in refs):
            return f"node {j}: cat pieces {pieces!r} are not tensors"
        ndim, d = len(meta.shape), args.get("dim", 0)
        if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim:
            return f"node {j}: cat dim {d!r}"
        d %= ndim
        start, branches = 0, []
        for r in refs:
            m = self.meta_of(r)
            if len(m.shape) != ndim or m.dtype != meta.dtype:
                return f"node {j}: cat piece {m.short()} is not of the output's rank and dtype"
            if any(a != b for k, (a, b) in enumerate(zip(m.shape, meta.shape)) if k != d):
                return f"node {j}: cat piece {m.short()} does not match {meta.short()} off dim {d}"
            if m.shape[d]:
                branches.append((r, start, m.shape[d]))
            start += m.shape[d]
        if start != meta.shape[d]:
            return f"node {j}: cat pieces add up to {start} along dim {d}, not {meta.shape[d]}"
        return _Node(j, CAT_OP, "pointwise", meta, args, [r for r, _, _ in branches],
                     _vtype(meta.dtype), exact=all(self.exact_of(r) for r, _, _ in branches), cat=(d, tuple(branches)))

    def expand_node(self, j: int, args: dict[str, Any], meta: TensorMeta) -> _Node | str:
        """A row value broadcast along the row (a mean's gradient in a norm's backward): the
        value itself, which the tiles it meets broadcast (graph regions that reduce only)."""
        x = node_ref(args.get("self"))
        if x is None:
            return f"node {j}: expand of a non-tensor"
        shape = tuple(self.meta_of(x).shape)
        if not meta.shape or shape not in (tuple(meta.shape), tuple(meta.shape[:-1]) + (1,)):
            return f"node {j}: expand of {shape} to {tuple(meta.shape)} is not a row broadcast"
        node = self.pointwise_node(j, CLONE_OP, {"self": args["self"]}, meta)
        if not isinstance(node, str):
            node.op = EXPAND_OP
        return node

    def pointwise_node(self, j: int, op: str, args: dict[str, Any], meta: TensorMeta) -> _Node | str:
        pw = OPS[op]
        if pw.check is not None and (why := pw.check(args)):
            return f"node {j}: {why}"
        operands = self.pointwise_operands(j, op, args)
        if isinstance(operands, str):
            return operands
        dtypes = {self.meta_of(r).dtype for r in operands if r[0] != "const"} | {meta.dtype}
        if "float64" in dtypes:
            return f"node {j}: float64 arithmetic is not generated"
        node = _Node(j, op, "pointwise", meta, args, operands, "", pw=pw)
        kind = pw.kind
        if kind == "copy":
            return self.copy_node(node)
        if kind == "select":
            c = operands[0]
            if c[0] == "const" or self.meta_of(c).dtype != "bool":
                return f"node {j}: where needs a bool condition tensor"
            node.ctype = node.vtype = _vtype(meta.dtype)
            return node
        if kind == "compare":
            return self.compare_node(node)
        if kind == "logical":
            if meta.dtype != "bool":
                return f"node {j}: logical ops produce bool"
            node.ctype, node.vtype, node.exact = "bool", "bool", True
            return node
        return self.arith_node(node)

    def pointwise_operands(self, j: int, op: str, args: dict[str, Any]) -> list[Ref] | str:
        """The operands of pointwise node ``j`` (tensors and numbers), its other arguments checked."""
        pw = OPS[op]
        operands: list[Ref] = []
        for name in pw.operands:
            v = args.get(name)
            r = node_ref(v)
            if r is not None:
                operands.append(r)
                continue
            s = cg.scalar_value(v)
            if s is None:
                return f"node {j}: argument {name}={v!r} is neither a tensor nor a number"
            operands.append(("const", s))
        for k, v in args.items():
            if k in pw.operands:
                continue
            if _refs_in(v):
                return f"node {j}: tensor argument {k} of {op} is not generated"
            if k in SCALAR_ARGS and v is not None and cg.scalar_value(v) is None:
                return f"node {j}: argument {k}={v!r} must be a number"
        if not [r for r in operands if r[0] != "const"]:
            return f"node {j}: no tensor operand"
        return operands

    def copy_node(self, node: _Node) -> _Node | str:
        """A copy (clone, _to_copy): its types, and whether it rounds."""
        j, op, args, meta, operands = node.index, node.op, node.args, node.meta, node.operands
        if op == "aten._to_copy.default":
            if args.get("layout") not in (None, {"layout": "strided"}):
                return f"node {j}: _to_copy to layout {args.get('layout')}"
            if args.get("device") is not None and args.get("device") != {"device": meta.device}:
                return f"node {j}: _to_copy to another device"
            if args.get("pin_memory"):
                return f"node {j}: _to_copy with pin_memory"
        src = self.meta_of(operands[0]).dtype
        if cg.is_float(src) and cg.is_int(meta.dtype):
            return (f"node {j}: {src} -> {meta.dtype} cast inside a region (undefined outside the integer "
                    "range, so it cannot be validated on computed values)")
        node.ctype = node.vtype = _vtype(meta.dtype)
        # only a cast to another dtype rounds (the float64 reference rounds there too); a clone or a
        # layout-only copy of an fp16 intermediate keeps the unrounded value, like every other node
        same = self.exact_of(operands[0]) and src == meta.dtype
        node.rounds = (op == "aten._to_copy.default" and args.get("dtype") is not None
                       and meta.dtype in HALF and not same)
        node.exact = meta.dtype not in HALF or node.rounds or same
        return node

    def compare_node(self, node: _Node) -> _Node | str:
        """A comparison: computed in the operands' common type, a bool result."""
        j, meta, operands = node.index, node.meta, node.operands
        if meta.dtype != "bool":
            return f"node {j}: a comparison must produce bool"
        vals = [torch.empty(self.meta_of(r).shape, dtype=self.meta_of(r).torch_dtype, device="meta")
                if r[0] != "const" else r[1] for r in operands]
        common = str(torch.result_type(vals[0], vals[1])).removeprefix("torch.")
        if common not in cg.TL_TYPES or common == "float64":
            return f"node {j}: comparison in {common} is not generated"
        node.ctype, node.vtype, node.exact = cg.compute_type(common), "bool", True
        return node

    def arith_node(self, node: _Node) -> _Node | str:
        """Arithmetic (kinds "float", "arith" and the rest): computed in the node's compute type;
        in integers, every scalar (and alpha) must be an integer of that type."""
        j, op, args, meta, operands = node.index, node.op, node.args, node.meta, node.operands
        kind = node.pw.kind
        ctype = cg.compute_type(meta.dtype)
        if kind == "float" and ctype != "float32":
            return f"node {j}: {op} computes in floating point; dtype {meta.dtype} is not fp32/fp16/bf16"
        if kind == "arith" and ctype not in ("float32",) + cg.INT_TYPES:
            return f"node {j}: {op} with dtype {meta.dtype} is not generated"
        if cg.is_int(ctype):
            for r in operands:
                if r[0] == "const":
                    if isinstance(r[1], float) and r[1] != int(r[1]):
                        return f"node {j}: fractional scalar {r[1]} with integer arithmetic"
                    info = torch.iinfo(getattr(torch, ctype))
                    if not info.min <= int(r[1]) <= info.max:
                        return f"node {j}: scalar {r[1]} does not fit {ctype}"
            alpha = cg.scalar_value(args.get("alpha")) if args.get("alpha") is not None else 1
            if float(alpha) != int(alpha):
                return f"node {j}: fractional alpha with integer arithmetic"
        node.ctype = node.vtype = ctype
        node.exact = ctype == meta.dtype
        return node

    # region kinds ---------------------------------------------------------------------------
    def piece_contexts(self, out_nodes: list[int]) -> dict[Ref, tuple[int, int]] | str:
        """Which values are computed inside a cat piece: the piece itself and what only it reads
        (each read by that piece alone, never a region output)."""
        users: dict[Ref, list[int]] = {}
        for n in self.nodes:
            for r in n.operands:
                if r[0] != "const":
                    users.setdefault(r, []).append(n.index)
        context: dict[Ref, tuple[int, int]] = {}
        for c in (n for n in self.nodes if n.cat):
            for b, (ref, _, _) in enumerate(c.cat[1]):
                members, stack = {ref}, [ref]
                while stack:
                    r = stack.pop()
                    for x in (self.nodes[r[1]].operands if r[0] == "node" else []):
                        if x[0] != "const" and x not in members:
                            members.add(x)
                            stack.append(x)
                inside = {r[1] for r in members if r[0] == "node"} | {c.index}
                for r in members:
                    if r[0] == "node" and self.nodes[r[1]].cat is not None:
                        return f"node {r[1]}: a cat inside a piece of cat {c.index} is not generated"
                    if r in context or (r[0] == "node" and r[1] in out_nodes):
                        return f"{r[0]} {r[1]} is read outside its cat piece"
                    if any(u not in inside for u in users[r]) or (r == ref and users[r].count(c.index) != 1):
                        return f"{r[0]} {r[1]} is read outside its cat piece"
                    context[r] = (c.index, b)
        return context

    def pointwise(self, out_nodes: list[int]) -> _Plan | str:
        shape = tuple(self.nodes[out_nodes[0]].meta.shape)
        context = self.piece_contexts(out_nodes)
        if isinstance(context, str):
            return context

        def piece_shape(where: tuple[int, int]) -> tuple[int, ...]:
            d, branches = self.nodes[where[0]].cat
            return shape[:d] + (branches[where[1]][2],) + shape[d + 1:]
        for n in self.nodes:
            if n.role != "pointwise":
                return f"node {n.index}: {n.op} in a pointwise region"
            want = piece_shape(context[("node", n.index)]) if ("node", n.index) in context else shape
            if tuple(n.meta.shape) != want:
                return f"node {n.index} has shape {n.meta.shape}, where it is computed the region iterates {want}"
        if math.prod(shape) == 0:
            return "empty region: nothing to compute"
        pieces: dict[tuple[int, int], list[int]] = {}
        for r, where in sorted(context.items()):
            if r[0] == "node":
                pieces.setdefault(where, []).append(r[1])
        ins = []
        for i, m in enumerate(self.in_metas):
            if ("input", i) in context:  # read where its piece is, through the cat's index remap
                where = context[("input", i)]
                try:
                    st = cg.broadcast_strides(m, piece_shape(where))
                except ValueError as e:
                    return f"input {i}: {e}"
                d, branches = self.nodes[where[0]].cat
                ins.append(_Tensor(f"in{i}", m, "cat", st, piece=where, shift=branches[where[1]][1] * st[d]))
                continue
            try:
                st = cg.broadcast_strides(m, shape)
            except ValueError as e:
                return f"input {i}: {e}"
            ins.append(_Tensor(f"in{i}", m, "block", st))
        outs = [_Tensor(f"out{k}", m, "block", tuple(0 if s == 1 else st for s, st in zip(m.shape, m.stride)))
                for k, m in enumerate(self.out_metas)]
        sets = [t.strides for t in outs] + [t.strides for t in ins]
        # a cat needs its dim's index: a unit stride set along it keeps that dim unmerged
        cat_dims = sorted({n.cat[0] for n in self.nodes if n.cat})
        coords = [tuple(int(k == d) for k in range(len(shape))) for d in cat_dims]
        sizes, strides = cg.simplify(shape, sets + coords, order_by=0)
        if not sizes:
            sizes, strides = (1,), [(0,) for _ in sets + coords]
        for t, st in zip(outs + ins, strides):
            t.strides = st
        plan = _Plan("pointwise", self.nodes, ins, outs, out_nodes, shape, flat_sizes=sizes,
                     flat_strides=strides[:len(sets)], cat_coords=dict(zip(cat_dims, strides[len(sets):])),
                     pieces={w: sorted(ns) for w, ns in pieces.items()})
        plan.helpers = _helpers(self.nodes)
        return plan

    def rowwise(self, out_nodes: list[int]) -> _Plan | str:
        reds = [n for n in self.nodes if n.role != "pointwise"]
        if not reds:
            return "rowwise region without a reduction"
        full = tuple(self.meta_of(reds[0].operands[0]).shape)
        N, lead = full[-1], full[:-1]
        row = lead + (1,)
        if N < 2:
            return f"rows of {N} element: nothing to reduce"
        if math.prod(full) == 0:
            return "empty region: nothing to compute"
        if why := self.row_shapes(full, row):
            return why
        # levels: reductions on the path; a reduction/softmax reads its operand in pass level(x)
        for n in self.nodes:
            lv = max([self.nodes[r[1]].level for r in n.operands if r[0] == "node"], default=0)
            n.level = lv + 1 if n.role != "pointwise" else lv
        passes = max([n.level for n in reds] + [self.nodes[i].level + 1 for i in out_nodes
                                                  if self.nodes[i].shape == "full"])
        ins = []
        for i, m in enumerate(self.in_metas):
            try:
                st = cg.broadcast_strides(m, full)
            except ValueError as e:
                return f"input {i}: {e}"
            ins.append(_Tensor(f"in{i}", m, _class(st), st, col_stride=st[-1]))
        outs = []
        for k, (i, m) in enumerate(zip(out_nodes, self.out_metas)):
            st = cg.broadcast_strides(m, full)
            outs.append(_Tensor(f"out{k}", m, "full" if self.nodes[i].shape == "full" else "row", st,
                                col_stride=st[-1]))
        sets = [t.strides[:-1] for t in ins + outs]
        sizes, lead_strides = cg.simplify(lead, sets, order_by=None)
        for t, st in zip(ins + outs, lead_strides):
            size = _itemsize(t.meta.dtype)
            # a row starts 16-byte aligned when the base pointer is (and the last dim is contiguous)
            t.hint = t.cls in ("full", "col") and t.col_stride == 1 and all((s * size) % 16 == 0 for s in st)
        plan = _Plan("rowwise", self.nodes, ins, outs, out_nodes, full, math.prod(lead), N, sizes,
                     lead_strides, passes=passes)
        plan.helpers = _helpers(self.nodes)
        return plan

    def row_shapes(self, full: tuple[int, ...], row: tuple[int, ...]) -> str | None:
        """Each node's shape in a rowwise region, "full" or "row" (noted on the node), or why a
        node's shape does not fit the region's rows."""
        for n in self.nodes:
            shape = tuple(n.meta.shape)
            if n.role == "pointwise":
                if shape == full:
                    n.shape = "full"
                elif shape == row:
                    n.shape = "row"
                else:
                    return f"node {n.index} has shape {shape}, neither {full} nor the row shape {row}"
                for r in n.operands:
                    if r[0] == "node" and self.nodes[r[1]].shape == "full" and n.shape == "row":
                        return f"node {n.index}: row-shape result of a full-shape operand"
                    if r[0] == "input":
                        try:
                            cg.broadcast_strides(self.in_metas[r[1]], shape)
                        except ValueError as e:
                            return f"node {n.index}: {e}"
            else:
                x = n.operands[0]
                if tuple(self.meta_of(x).shape) != full:
                    return f"node {n.index}: reduces {self.meta_of(x).shape}, the region's rows are {full}"
                if x[0] == "node" and self.nodes[x[1]].shape != "full":
                    return f"node {n.index}: reduces a row-shape value"
        return None


def _class(strides: Sequence[int]) -> str:
    lead_zero = all(s == 0 for s in strides[:-1])
    if lead_zero and strides[-1] == 0:
        return "scalar"
    if strides[-1] == 0:
        return "row"
    return "col" if lead_zero else "full"


def _helpers(nodes: Sequence[_Node]) -> tuple[str, ...]:
    out: list[str] = []
    for n in nodes:
        if n.pw is not None:
            out += [h for h in n.pw.helpers if h not in out]
    return tuple(out)


def analyse(graph: dict[str, Any], inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> _Plan | str:
    """The plan of a region graph, or the reason it is not generated."""
    try:
        return _Analysis(graph, inputs, outputs).run()
    except cg.Unsupported as e:
        return str(e)

