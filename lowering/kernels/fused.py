"""Fused regions (lowering/regions.py) of kind "pointwise" and "rowwise": one kernel computes the
whole region. A "graph" region (lowering/graph_regions.py) that is one loop is generated as one of
the two (rowwise where it reduces).

The region graph is walked in node order and every node becomes one Triton variable ``v<j>``.
Pointwise nodes reuse the expressions and type rules of the elementwise family (``OPS``). Values
stay in registers in their compute type: fp32 for fp16/bf16/fp32 nodes (ATen's opmath), the
integer type for integers, int1 for bool. Intermediate results are not rounded to their node's
storage type (as Inductor does; closer to the float64 reference than node-by-node ATen); an
explicit ``_to_copy`` to fp16/bf16 does round (``.to(tl.float16).to(tl.float32)``), as the graph
says. Each region input is loaded once (per pass) with its own strides and broadcast; each output
is stored with its own dtype and strides.

pointwise  all nodes share one iteration shape, walked flat in the first output's memory order
           (dims merged where every tensor is contiguous), one program per BLOCK, as in
           elementwise.py; a broadcast input is indexed by div/mod, or loaded once (a scalar).
           ``cat``: each piece is loaded (masked) where the index along the cat dim falls in it,
           or computed there (the pointwise nodes only that piece reads, e.g. RoPE's ``-x2``, at
           the piece's shape, from inputs read at the index shifted by the piece's start), and
           the pieces are selected with tl.where: RoPE's rotated halves are read in place
           instead of being copied by a neg and a cat kernel first (the cat dim is kept apart
           from its neighbours when dims are merged, to know that index).
rowwise    the iteration shape is [rows, N], N the last dim. A program owns BLOCK_M rows; values
           are [BLOCK_M, BLOCK_N] tiles (full shape), [BLOCK_M, 1] (row shape: reductions and
           what follows them), [1, BLOCK_N] (an input broadcast over rows, e.g. a weight [N]) or
           scalars. Reductions are tl.sum / tl.max / tl.min along axis 1, kept as [BLOCK_M, 1].
  single   BLOCK_N >= N: the row stays in registers; every node once, in order.
  looped   BLOCK_N < N: pass p walks the row in BLOCK_N blocks, recomputing the full-shape nodes
           that the reductions of pass p need and storing the outputs ready by then (a node's
           level = the number of reductions on its longest path from the inputs). Softmax keeps
           a running max/sum (online softmax). RMSNorm takes two passes, a two-pass LayerNorm
           three; regions needing more than MAX_PASSES are refused in this variant.

Vectorization: 16-byte loads and stores need 16-byte aligned base pointers, which the
ahead-of-time compile cannot assume. With ALIGN the kernel tests its pointers once and runs a
body that asserts the alignment (tl.multiple_of) when they are aligned, a plain body otherwise:
correct for every pointer, vectorized for the usual allocator-aligned one.

The LayerNorm family (layernorm.py) builds a rowwise graph for native_layer_norm and uses the
same planner and emitter; for a shape bucket the rowwise emitter takes the number of rows at run
time (``generate_plan``'s ``runtime_rows``). A region in a shape bucket takes its rows (rowwise) or
its number of elements (pointwise) at run time likewise: the same kernel, the varying size an
argument (``bucket_support``).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from typing import Any, Sequence

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import Config, KernelFamily, doubled_and_halved, next_pow2, unique
from torch_kernelize.lowering.kernels.elementwise import HELPERS, OPS, PointwiseOp
from torch_kernelize.core.buckets import product, unbucketable
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.region_graph import node_ref
from torch_kernelize.core.spec import KernelSpec, TensorMeta

REDUCE_OPS = {"aten.sum.dim_IntList": "sum", "aten.mean.dim": "mean",
              "aten.amax.default": "amax", "aten.amin.default": "amin"}
SOFTMAX_OPS = {"aten._softmax.default": "softmax", "aten._log_softmax.default": "log_softmax"}
KINDS = ("pointwise", "rowwise")
GRAPH_KIND = "graph"    # a compiler-sized region: generated as one of KINDS when it is one loop
MAX_TILE = 16384        # elements of one [BLOCK_M, BLOCK_N] tile (a row of up to 16K stays in registers)
MAX_PASSES = 4          # looped variant: passes over the row
SCALAR_ARGS = ("alpha", "min", "max", "min_val", "max_val", "negative_slope", "exponent")
INF = "float('inf')"
CAT_OP = "aten.cat.default"
EXPAND_OP, CLONE_OP = "aten.expand.default", "aten.clone.default"
LAYER_NORM_OP, GETITEM_OP = "aten.native_layer_norm.default", "getitem"
HALF = ("float16", "bfloat16")

Ref = tuple  # ("input", i) | ("node", j) | ("const", number)


# --- analysis ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Node:
    index: int
    op: str
    role: str                     # "pointwise" | "reduce" | "softmax"
    meta: TensorMeta
    args: dict[str, Any]          # bound arguments (encoded)
    operands: list[Ref]           # pointwise: one per op operand; reduce/softmax: [x]
    vtype: str                    # type of the node's Triton variable
    ctype: str = ""               # pointwise: the type its arithmetic runs in
    pw: PointwiseOp | None = None
    reduce: str = ""              # sum mean amax amin softmax log_softmax
    shape: str = "full"           # "full" | "row"
    level: int = 0
    exact: bool = False           # the variable holds a value exactly representable in meta.dtype
    rounds: bool = False          # a cast to fp16/bf16: the value is rounded to it
    cat: tuple | None = None      # cat: (dim, ((piece ref, start, size), ...)) along the output


@dataclasses.dataclass
class _Tensor:
    """An input or output as the kernel addresses it."""
    name: str                     # in0 / out1
    meta: TensorMeta
    cls: str                      # rowwise: full row col scalar; pointwise: block scalar
    strides: tuple[int, ...]      # broadcast to the iteration shape
    row_off: str = "0"            # rowwise: offset of the row (expression over rows)
    col_stride: int = 0           # rowwise: stride of the last dim
    flat_off: str = "0"           # pointwise: offset expression over idx
    hint: bool = False            # 16-byte alignment of the base pointer implies aligned vectors
    piece: tuple[int, int] | None = None  # pointwise, read in a cat piece: (cat node, piece)
    shift: int = 0                # ... and the element offset of that piece's start


@dataclasses.dataclass
class _Plan:
    kind: str
    nodes: list[_Node]
    inputs: list[_Tensor]
    outputs: list[_Tensor]
    out_nodes: list[int]
    shape: tuple[int, ...]        # iteration shape (full)
    M: int = 1
    N: int = 1
    lead_sizes: tuple[int, ...] = ()
    lead_strides: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # inputs then outputs
    flat_sizes: tuple[int, ...] = ()
    flat_strides: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # outputs then inputs
    cat_coords: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # cat dim -> its
    # coordinate as a stride set over flat_sizes
    pieces: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)  # (cat, piece) ->
    # the nodes computed for that piece, in order
    passes: int = 1
    helpers: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _vtype(dtype: str) -> str:
    return "float32" if dtype in cg.FLOAT_TYPES else dtype


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
    """The kind a "graph" region (lowering/graph_regions.py) is generated as, if it is one loop:
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
        tensors = [r for r in operands if r[0] != "const"]
        if not tensors:
            return f"node {j}: no tensor operand"
        dtypes = {self.meta_of(r).dtype for r in tensors} | {meta.dtype}
        if "float64" in dtypes:
            return f"node {j}: float64 arithmetic is not generated"
        node = _Node(j, op, "pointwise", meta, args, operands, "", pw=pw)
        kind = pw.kind
        if kind == "copy":
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
        if kind == "select":
            c = operands[0]
            if c[0] == "const" or self.meta_of(c).dtype != "bool":
                return f"node {j}: where needs a bool condition tensor"
            node.ctype = node.vtype = _vtype(meta.dtype)
            return node
        if kind == "compare":
            if meta.dtype != "bool":
                return f"node {j}: a comparison must produce bool"
            vals = [torch.empty(self.meta_of(r).shape, dtype=self.meta_of(r).torch_dtype, device="meta")
                    if r[0] != "const" else r[1] for r in operands]
            common = str(torch.result_type(vals[0], vals[1])).removeprefix("torch.")
            if common not in cg.TL_TYPES or common == "float64":
                return f"node {j}: comparison in {common} is not generated"
            node.ctype, node.vtype, node.exact = cg.compute_type(common), "bool", True
            return node
        if kind == "logical":
            if meta.dtype != "bool":
                return f"node {j}: logical ops produce bool"
            node.ctype, node.vtype, node.exact = "bool", "bool", True
            return node
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


# --- code generation ---------------------------------------------------------------------------

def _convert(expr: str, src: str, dst: str) -> str:
    """A variable of type ``src`` as type ``dst`` (variable types: float32, integers, bool)."""
    if src == dst:
        return expr
    if dst == "bool":
        return f"({expr} != 0)"
    return f"{expr}.to({cg.tl_type(dst)})"


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


class _Emitter:
    """Writes the Triton module of a plan under one config."""

    def __init__(self, plan: _Plan, config: Config, header: str, kname: str):
        self.p, self.c, self.header, self.kname = plan, config, header, kname
        self.s = cg.Source()
        self.align = bool(config.get("ALIGN", False))
        self.evict = bool(config.get("EVICT", False))
        self.graph_nodes: list[dict[str, Any]] = []

    # shared pieces ------------------------------------------------------------------------
    def var(self, r: Ref) -> str:
        return f"x{r[1]}" if r[0] == "input" else f"v{r[1]}"

    def vtype(self, r: Ref) -> str:
        return _vtype(self.p.inputs[r[1]].meta.dtype) if r[0] == "input" else self.p.nodes[r[1]].vtype

    def describe(self, n: _Node) -> str:
        def show(a: Any) -> str:
            r = node_ref(a)
            if r:
                return self.var(r)
            if isinstance(a, list):
                return "[" + ", ".join(show(x) for x in a) + "]"
            return json.dumps(a) if not isinstance(a, (int, float)) or isinstance(a, bool) else repr(a)
        g = self.graph_nodes[n.index]
        parts = [show(a) for a in g.get("args", [])] + [f"{k}={show(v)}" for k, v in g.get("kwargs", {}).items()]
        return f"# {self.var(('node', n.index))} = {n.op.removeprefix('aten.')}({', '.join(parts)}) -> {n.meta.short()}"

    def pointwise_expr(self, n: _Node) -> str:
        pw, ctype = n.pw, n.ctype
        if pw.kind == "copy":
            r = n.operands[0]
            src, e = self.vtype(r), self.var(r)
            dst = n.meta.dtype
            if dst == "bool":
                return _convert(e, src, "bool")
            if dst in cg.FLOAT_TYPES:
                e = _convert(e, src, "float32")
                if n.rounds:
                    e = f"{e}.to({cg.tl_type(dst)}).to(tl.float32)"  # the cast rounds to {dst}
                return e
            return _convert(e, src, dst)
        exprs = []
        for k, r in enumerate(n.operands):
            if r[0] == "const":
                exprs.append(str(int(bool(r[1]))) if ctype == "bool" else cg.literal(r[1], ctype))
                continue
            raw = pw.kind == "logical" or (pw.kind == "select" and k == 0)
            exprs.append(self.var(r) if raw else _convert(self.var(r), self.vtype(r), ctype))
        e = pw.body(exprs, n.args, ctype)
        if n.vtype in ("int8", "int16", "uint8"):
            e = f"({e}).to({cg.tl_type(n.vtype)})"  # keep the narrow integer type (wraps as in ATen)
        return e

    def store_value(self, n: _Node, out: _Tensor) -> str:
        """The node's variable in the output's dtype (fp32 values are rounded once, here)."""
        return _convert(self.var(("node", n.index)), n.vtype, out.meta.dtype)

    def module_head(self) -> None:
        s = self.s
        s(cg.HEADER, self.header)
        for h in self.p.helpers:
            s.blank()(HELPERS[h].strip("\n"))
        s.blank()("")

    def params(self) -> list[str]:
        return [f"{t.name}_ptr" for t in self.p.inputs] + [f"{t.name}_ptr" for t in self.p.outputs]

    def wrap(self, consts: list[str], body) -> None:
        """The kernel: either the body inline, or an alignment test choosing between two bodies."""
        s = self.s
        ptrs = self.params()
        hinted = [t for t in self.p.inputs + self.p.outputs if t.hint]
        if not (self.align and hinted):
            s("@triton.jit", f"def {self.kname}({', '.join(ptrs + [c + ': tl.constexpr' for c in consts])}):").indent()
            s("pid = tl.program_id(0)")
            body(False)
            s.dedent()
            return
        s("@triton.jit", f"def {self.kname}_body({', '.join(ptrs + ['pid'] + [c + ': tl.constexpr' for c in consts + ['ALIGNED']])}):").indent()
        body(True)
        s.dedent().blank()("")
        s("@triton.jit", f"def {self.kname}({', '.join(ptrs + [c + ': tl.constexpr' for c in consts])}):").indent()
        s("pid = tl.program_id(0)")
        bits = " | ".join(f"{t.name}_ptr.to(tl.int64)" for t in hinted)
        s("# 16-byte vector loads/stores need 16-byte aligned pointers: test them once, then run the body",
          "# that asserts it (tl.multiple_of), or the plain one",
          f"aligned = (({bits}) % 16) == 0")
        call = ", ".join(ptrs + ["pid"] + consts)
        s("if aligned:").indent()(f"{self.kname}_body({call}, True)").dedent()
        s("else:").indent()(f"{self.kname}_body({call}, False)").dedent()
        s.dedent()


class _PointwiseEmitter(_Emitter):
    """``runtime_elements``: a bucketed kernel's number of elements as a SizeExpr (core/buckets.py);
    the kernel then takes it as the argument ``n_elements``, masks every block, and the outermost
    dim of the flat walk (which holds every varying dim) is never reduced modulo its size."""
    runtime_elements: Any = None

    def params(self) -> list[str]:
        return super().params() + ([] if self.runtime_elements is None else ["n_elements"])

    def program(self, graph_nodes: list[dict[str, Any]]) -> KernelProgram:
        self.graph_nodes = graph_nodes
        p, s = self.p, self.s
        block, warps = int(self.c["BLOCK"]), int(self.c["num_warps"])
        sizes, strides = p.flat_sizes, p.flat_strides
        numel = math.prod(sizes)
        self.wide = cg.needs_int64(sizes, strides, slack=block)
        coords = list(p.cat_coords.items())
        self.coord_lines, offsets = cg.decompose("idx", sizes, list(strides) + [st for _, st in coords], "i")
        self.cat_index = {d: off for (d, _), off in zip(coords, offsets[len(strides):])}
        for t, off in zip(p.outputs + p.inputs, offsets):
            t.flat_off = off
            if t.cls == "cat":  # loaded inside the cat, off by its piece's start: never assumed aligned
                continue
            t.cls = "scalar" if off == "0" else "block"
            t.hint = off == "idx" and (block * _itemsize(t.meta.dtype)) % 16 == 0
        self.masked = numel % block != 0 or self.runtime_elements is not None
        self.module_head()
        count = f"{numel}" if self.runtime_elements is None else f"n_elements (a run-time size, at most {numel})"
        s(f"# {count} elements walked in the first output's memory order over sizes {list(sizes)};",
          "# strides: " + ", ".join(f"{t.name} {list(t.strides)}" for t in p.outputs + p.inputs))
        self.wrap(["BLOCK"], self.body)
        args = tuple(("in", i) for i in range(len(p.inputs))) + tuple(("out", k) for k in range(len(p.outputs)))
        sizes = {}
        if self.runtime_elements is not None:
            args, sizes = cg.runtime_size(args, numel, self.runtime_elements, block, self.wide)
        launch = Launch(self.kname, (-(-numel // block),), args, {"BLOCK": block}, num_warps=warps, num_stages=1,
                        runtime_sizes=sizes)
        return KernelProgram(s.text(), (launch,))

    def pointer(self, t: _Tensor, hinted: bool) -> str:
        ptr = f"{t.name}_ptr + {t.flat_off}"
        if hinted and t.hint:
            self.s(f"p_{t.name} = {ptr}", "if ALIGNED:").indent()(f"p_{t.name} = tl.multiple_of(p_{t.name}, 16)").dedent()
            return f"p_{t.name}"
        return ptr

    def body(self, hinted: bool) -> None:
        p, s = self.p, self.s
        s(f"idx = pid{'.to(tl.int64)' if self.wide else ''} * BLOCK + tl.arange(0, BLOCK)")
        mask = ""
        if self.masked:
            s(f"mask = idx < {math.prod(p.flat_sizes) if self.runtime_elements is None else 'n_elements'}")
            mask = ", mask=mask"
        for line in self.coord_lines:
            s(line)
        for i, t in enumerate(p.inputs):
            conv = "" if _vtype(t.meta.dtype) == t.meta.dtype else ".to(tl.float32)"
            if t.cls == "scalar":
                s(f"x{i} = tl.load({t.name}_ptr){conv}  # broadcast: one element")
            elif t.cls != "cat":
                s(f"x{i} = tl.load({self.pointer(t, hinted)}{mask}){conv}")
        in_pieces = {k for ns in p.pieces.values() for k in ns}
        for n in p.nodes:
            if n.index in in_pieces:
                continue  # computed inside its cat piece
            s(self.describe(n))
            if n.cat is not None:
                self.cat(n)
            else:
                s(f"v{n.index} = {self.pointwise_expr(n)}")
        for t, j in zip(p.outputs, p.out_nodes):
            v = self.store_value(p.nodes[j], t)
            if t.flat_off == "0" and self._scalar(("node", j)) and self.runtime_elements is None:
                s(f"tl.store({self.pointer(t, hinted)}, {v})")  # one element: a scalar to a scalar pointer
                continue
            if self._scalar(("node", j)):
                v = f"tl.broadcast_to({v}, (BLOCK,))"
            s(f"tl.store({self.pointer(t, hinted)}, {v}{mask})")

    def cat(self, n: _Node) -> None:
        """Each piece loaded where the index along the cat dim falls in it, then selected."""
        s, d = self.s, n.cat[0]
        c = f"c{n.index}"
        s(f"{c} = {self.cat_index[d]}  # index along the cat dim ({d})")
        ends = []
        for b, (ref, start, size) in enumerate(n.cat[1]):
            conds = ([f"({c} >= {start})"] if start else []) + ([f"({c} < {start + size})"] if start + size < n.meta.shape[d] else [])
            if self.masked:
                conds.append("mask")
            kw = f", mask={' & '.join(conds)}, other=0" if conds else ""
            s(f"# piece {b}: [{start}, {start + size}) along dim {d}")
            for i, t in enumerate(self.p.inputs):
                if t.piece != (n.index, b):
                    continue
                conv = "" if _vtype(t.meta.dtype) == t.meta.dtype else ".to(tl.float32)"
                if t.flat_off == "0":  # broadcast over the piece: one element
                    s(f"x{i} = tl.load({t.name}_ptr){conv}")
                    continue
                ptr = f"{t.name}_ptr + {t.flat_off}" + (f" - {t.shift}" if t.shift else "")
                s(f"x{i} = tl.load({ptr}{kw}){conv}")
            for k in self.p.pieces.get((n.index, b), []):  # where no element of the piece is, the
                s(self.describe(self.p.nodes[k]))           # loads give 0: those values are dropped
                s(f"v{k} = {self.pointwise_expr(self.p.nodes[k])}")
            ends.append((_convert(self.var(ref), self.vtype(ref), n.vtype), start + size))
        expr = ends[-1][0]
        for v, end in reversed(ends[:-1]):
            expr = f"tl.where({c} < {end}, {v}, {expr})"
        s(f"v{n.index} = {expr}")

    def _scalar(self, r: Ref) -> bool:
        """Whether a value is a scalar (computed only from inputs loaded as one element)."""
        if r[0] == "input":
            return self.p.inputs[r[1]].cls == "scalar"
        if r[0] == "const":
            return True
        return all(self._scalar(x) for x in self.p.nodes[r[1]].operands)


class _RowwiseEmitter(_Emitter):
    """``runtime_rows``: a bucketed kernel's number of rows as a SizeExpr (core/buckets.py); the
    kernel then takes it as the argument ``n_rows`` and masks every block of rows."""
    runtime_rows: Any = None

    def params(self) -> list[str]:
        return super().params() + ([] if self.runtime_rows is None else ["n_rows"])

    def program(self, graph_nodes: list[dict[str, Any]]) -> KernelProgram:
        self.graph_nodes = graph_nodes
        p, s = self.p, self.s
        self.bm, self.bn = int(self.c["BLOCK_M"]), int(self.c["BLOCK_N"])
        self.single = self.bn >= p.N
        sets = p.lead_strides
        self.wide = cg.needs_int64(p.lead_sizes, sets, slack=self.bm) or any(
            cg.max_offset(p.lead_sizes, st) + (p.N - 1 + self.bn) * abs(t.col_stride) > cg.INT32_MAX
            for st, t in zip(sets, p.inputs + p.outputs))
        self.module_head()
        rows = f"M={p.M}" if self.runtime_rows is None else f"n_rows (a run-time size, at most {p.M})"
        s(f"# rows: {rows} over sizes {list(p.lead_sizes)}; row length N={p.N}; "
          + ("one pass, the row in registers" if self.single else
             f"{p.passes} pass(es) over the row in blocks of {self.bn}"),
          "# row strides: " + ", ".join(f"{t.name} {list(st)}" for t, st in zip(p.inputs + p.outputs, sets)),
          "# last-dim strides: " + ", ".join(f"{t.name} {t.col_stride}" for t in p.inputs + p.outputs))
        self.wrap(["BLOCK_M", "BLOCK_N"], self.body)
        args = tuple(("in", i) for i in range(len(p.inputs))) + tuple(("out", k) for k in range(len(p.outputs)))
        sizes = {}
        if self.runtime_rows is not None:
            args, sizes = cg.runtime_size(args, p.M, self.runtime_rows, self.bm, p.M + self.bm > cg.INT32_MAX)
        launch = Launch(self.kname, (-(-p.M // self.bm),), args, {"BLOCK_M": self.bm, "BLOCK_N": self.bn},
                        num_warps=int(self.c["num_warps"]), num_stages=int(self.c["num_stages"]), runtime_sizes=sizes)
        return KernelProgram(s.text(), (launch,))

    # rows, columns, masks, pointers ---------------------------------------------------------
    def rows(self) -> None:
        p, s = self.p, self.s
        offs, self.row_mask = cg.block_offsets(s, "rows", "pid", "BLOCK_M", self.bm,
                                               p.M if self.runtime_rows is None else "n_rows", self.wide, "row_mask",
                                               p.lead_sizes, p.lead_strides, "m")
        self.col_mask = None
        named: dict[str, str] = {}
        for t, off in zip(p.inputs + p.outputs, offs):
            if " " in off:  # a compound offset: computed once, shared by the tensors with these strides
                if off not in named:
                    named[off] = f"row_off{len(named)}"
                    s(f"{named[off]} = {off}")
                off = named[off]
            t.row_off = off

    def cols(self, start: str | None) -> None:
        s = self.s
        base = "tl.arange(0, BLOCK_N)" if start is None else f"{start} + tl.arange(0, BLOCK_N)"
        if self.wide:
            base = f"({base}).to(tl.int64)"
        s(f"cols = {base}")
        self.col_mask = None
        if (self.single and self.bn != self.p.N) or (not self.single and self.p.N % self.bn):
            s(f"col_mask = cols < {self.p.N}")
            self.col_mask = "col_mask"

    def mask(self, cls: str) -> str | None:
        r = f"{self.row_mask}[:, None]" if self.row_mask else None
        c = f"{self.col_mask}[None, :]" if self.col_mask else None
        if cls == "full":
            return f"{r} & {c}" if r and c else (r or c)
        if cls == "row":
            return r
        if cls == "col":
            return c
        return None

    def pointer(self, t: _Tensor, cls: str, hinted: bool) -> str:
        row = f"({t.row_off})" if " " in t.row_off else t.row_off
        col = cg.scaled("cols", t.col_stride)
        col = f"({col})" if " " in col else col
        if cls == "row":
            return f"{t.name}_ptr + {row if t.row_off != '0' else '(rows * 0)'}[:, None]"
        if cls == "col":
            ptr = f"{t.name}_ptr + {col}[None, :]"
        else:
            ptr = f"{t.name}_ptr + {row if t.row_off != '0' else '(rows * 0)'}[:, None] + {col}[None, :]"
        if hinted and t.hint:
            self.s(f"p_{t.name} = {ptr}", "if ALIGNED:").indent()(
                f"p_{t.name} = tl.multiple_of(p_{t.name}, [1, 16])").dedent()
            return f"p_{t.name}"
        return ptr

    def load(self, i: int, hinted: bool, last_pass: bool) -> None:
        t = self.p.inputs[i]
        conv = "" if _vtype(t.meta.dtype) == t.meta.dtype else ".to(tl.float32)"
        if t.cls == "scalar":
            self.s(f"x{i} = tl.load({t.name}_ptr){conv}  # one element, broadcast")
            return
        ptr = self.pointer(t, t.cls, hinted)
        m = self.mask(t.cls)
        other = "0" if t.meta.dtype == "bool" or cg.is_int(t.meta.dtype) else "0.0"
        kw = f", mask={m}, other={other}" if m else ""
        if self.evict and t.cls != "row":
            kw += ", eviction_policy=" + ("'evict_first'" if t.cls == "full" and last_pass else "'evict_last'")
        note = {"row": "  # [BLOCK_M, 1]: one value per row", "col": "  # [1, BLOCK_N]: the same for every row"}.get(t.cls, "")
        self.s(f"x{i} = tl.load({ptr}{kw}){conv}{note}")

    def store(self, k: int, hinted: bool) -> None:
        t, j = self.p.outputs[k], self.p.out_nodes[k]
        ptr = self.pointer(t, t.cls, hinted)
        m = self.mask(t.cls)
        self.s(f"tl.store({ptr}, {self.store_value(self.p.nodes[j], t)}{', mask=' + m if m else ''})")

    def cls_of(self, r: Ref) -> str:
        if r[0] == "const":
            return "scalar"
        if r[0] == "input":
            return self.p.inputs[r[1]].cls
        n = self.p.nodes[r[1]]
        if n.role == "reduce":
            return "row"
        if n.role == "softmax":
            return self.widen(self.cls_of(n.operands[0]))
        cls = "scalar"
        for x in n.operands:
            cls = _join(cls, self.cls_of(x))
        return cls

    @staticmethod
    def widen(cls: str) -> str:
        return cls if cls in ("full", "col") else "full"

    def tile(self, r: Ref) -> str:
        """A full-shape operand of a reduction as a tile with a column axis."""
        v = self.var(r)
        return v if self.cls_of(r) in ("full", "col") else f"tl.broadcast_to({v}, (BLOCK_M, BLOCK_N))"

    # node emission ------------------------------------------------------------------------
    def reduce_single(self, n: _Node) -> None:
        s, v = self.s, self.var(("node", n.index))
        x = self.tile(n.operands[0])
        cm = f"{self.col_mask}[None, :]" if self.col_mask else None
        if n.reduce in ("sum", "mean"):
            t = f"tl.where({cm}, {x}, 0.0)" if cm else x
            total = f"tl.sum({t}, 1)[:, None]"
            s(f"{v} = {total}" if n.reduce == "sum" else f"{v} = tl.div_rn({total}, {cg.float_literal(self.p.N)})")
        elif n.reduce in ("amax", "amin"):
            init = "-" + INF if n.reduce == "amax" else INF
            red = "tl.max" if n.reduce == "amax" else "tl.min"
            if cm:
                s(f"t{n.index} = tl.where({cm}, {x}, {init})")
                x = f"t{n.index}"
            s(f"{v} = {red}({x}, 1)[:, None]",
              f"{v} += tl.sum(tl.where({x} != {x}, {x}, 0.0), 1)[:, None]  # a NaN in the row wins, as in ATen")
        else:  # softmax / log_softmax: statistics and value at once
            j = n.index
            if cm:
                s(f"t{j} = tl.where({cm}, {x}, -{INF})")
                x = f"t{j}"
            s(f"rmax{j} = tl.max({x}, 1)[:, None]", f"e{j} = tl.exp({x} - rmax{j})")
            if cm:
                s(f"e{j} = tl.where({cm}, e{j}, 0.0)  # padding: exp(-inf - -inf) would be NaN")
            s(f"rsum{j} = tl.sum(e{j}, 1)[:, None]")
            s(f"{v} = tl.div_rn(e{j}, rsum{j})" if n.reduce == "softmax"
              else f"{v} = {x} - rmax{j} - tl.log(rsum{j})")

    def softmax_value(self, n: _Node) -> str:
        j, x = n.index, self.var(n.operands[0])
        if n.reduce == "softmax":
            return f"tl.div_rn(tl.exp({x} - rmax{j}), rsum{j})"
        return f"{x} - rmax{j} - tl.log(rsum{j})"

    def body(self, hinted: bool) -> None:
        self.rows()
        if self.single:
            self.single_pass(hinted)
        else:
            self.looped(hinted)

    def single_pass(self, hinted: bool) -> None:
        p, s = self.p, self.s
        self.cols(None)
        outs = {j: k for k, j in enumerate(p.out_nodes)}
        loaded: set[int] = set()
        for n in p.nodes:
            # each input is loaded right before its first use (as Inductor does): a weight read after
            # the row's reduction holds no registers across it
            for r in n.operands:
                if r[0] == "input" and r[1] not in loaded:
                    loaded.add(r[1])
                    self.load(r[1], hinted, last_pass=True)
            s(self.describe(n))
            if n.role == "pointwise":
                s(f"v{n.index} = {self.pointwise_expr(n)}")
            else:
                self.reduce_single(n)
            if n.index in outs:
                self.store(outs[n.index], hinted)

    def looped(self, hinted: bool) -> None:
        p, s = self.p, self.s
        outs = {j: k for k, j in enumerate(p.out_nodes)}
        for i, t in enumerate(p.inputs):
            if t.cls in ("row", "scalar"):
                self.load(i, hinted, last_pass=False)
        self.row_nodes(0, outs, hinted)
        for pas in range(p.passes):
            reds = [n for n in p.nodes if n.role != "pointwise" and n.level == pas + 1]
            stores = [j for j in p.out_nodes if p.nodes[j].shape == "full" and p.nodes[j].level == pas]
            need = self.needed([n.operands[0] for n in reds] + [("node", j) for j in stores])
            s.blank()(f"# pass {pas + 1} of {p.passes}: " + ", ".join(
                [f"{n.reduce} v{n.index}" for n in reds] + [f"store v{j}" for j in stores]))
            for n in reds:
                j = n.index
                if n.reduce in ("sum", "mean"):
                    s(f"acc{j} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
                elif n.reduce in ("amax", "amin"):
                    s(f"acc{j} = tl.full([BLOCK_M, BLOCK_N], {'-' if n.reduce == 'amax' else ''}{INF}, dtype=tl.float32)")
                else:
                    s(f"m{j} = tl.full([BLOCK_M, BLOCK_N], -{INF}, dtype=tl.float32)",
                      f"s{j} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
            s(f"for c0 in range(0, {p.N}, BLOCK_N):").indent()
            self.cols("c0")
            for i, t in enumerate(p.inputs):
                if t.cls in ("full", "col") and ("input", i) in need:
                    self.load(i, hinted, last_pass=pas == p.passes - 1)
            for n in p.nodes:
                if ("node", n.index) in need:
                    s(self.describe(n))
                    s(f"v{n.index} = {self.pointwise_expr(n) if n.role == 'pointwise' else self.softmax_value(n)}")
            cm = f"{self.col_mask}[None, :]" if self.col_mask else None
            for n in reds:
                j, x = n.index, self.tile(n.operands[0])
                if n.reduce in ("sum", "mean"):
                    s(f"acc{j} += tl.where({cm}, {x}, 0.0)" if cm else f"acc{j} += {x}")
                elif n.reduce in ("amax", "amin"):
                    init, better = ("-" + INF, ">") if n.reduce == "amax" else (INF, "<")
                    if cm:
                        s(f"t{j} = tl.where({cm}, {x}, {init})")
                        x = f"t{j}"
                    s(f"acc{j} = tl.where(({x} {better} acc{j}) | ({x} != {x}), {x}, acc{j})  # NaN sticks")
                else:
                    if cm:
                        s(f"t{j} = tl.where({cm}, {x}, -{INF})")
                        x = f"t{j}"
                    s(f"m_new = tl.maximum(m{j}, {x})",
                      "# lanes that have only seen -inf keep sum 0 (exp(-inf - -inf) would be NaN)",
                      f"s{j} = s{j} * tl.where(m_new == -{INF}, 1.0, tl.exp(m{j} - m_new)) + "
                      f"tl.where(m_new == -{INF}, 0.0, tl.exp({x} - m_new))",
                      f"m{j} = m_new")
            for j in stores:
                self.store(outs[j], hinted)
            s.dedent()
            for n in reds:
                j, v = n.index, f"v{n.index}"
                if n.reduce == "sum":
                    s(f"{v} = tl.sum(acc{j}, 1)[:, None]")
                elif n.reduce == "mean":
                    s(f"{v} = tl.div_rn(tl.sum(acc{j}, 1)[:, None], {cg.float_literal(p.N)})")
                elif n.reduce in ("amax", "amin"):
                    s(f"{v} = {'tl.max' if n.reduce == 'amax' else 'tl.min'}(acc{j}, 1)[:, None]",
                      f"{v} += tl.sum(tl.where(acc{j} != acc{j}, acc{j}, 0.0), 1)[:, None]  # keep NaN")
                else:
                    s(f"rmax{j} = tl.max(m{j}, 1)[:, None]",
                      f"rsum{j} = tl.sum(tl.where(m{j} == -{INF}, 0.0, s{j} * tl.exp(m{j} - rmax{j})), 1)[:, None]")
            self.row_nodes(pas + 1, outs, hinted)

    def row_nodes(self, level: int, outs: dict[int, int], hinted: bool) -> None:
        """Row-shape values available after pass ``level`` (0: before the first): computed and stored."""
        for n in self.p.nodes:
            if n.shape == "row" and n.level == level:
                if n.role == "pointwise":
                    self.s(self.describe(n), f"v{n.index} = {self.pointwise_expr(n)}")
                if n.index in outs:
                    self.store(outs[n.index], hinted)

    def needed(self, roots: list[Ref]) -> set[Ref]:
        """Full-shape nodes (and inputs) a pass recomputes for ``roots``: row values are known."""
        seen: set[Ref] = set()
        stack = list(roots)
        while stack:
            r = stack.pop()
            if r in seen or r[0] == "const":
                continue
            if r[0] == "input":
                seen.add(r)
                continue
            n = self.p.nodes[r[1]]
            if n.shape == "row":
                continue
            seen.add(r)
            stack.extend(n.operands)
        return seen


def _join(a: str, b: str) -> str:
    order = {"scalar": 0, "row": 1, "col": 1, "full": 2}
    if {a, b} == {"row", "col"}:
        return "full"
    return a if order[a] >= order[b] else b


def region_header(graph: dict[str, Any], inputs: Sequence[TensorMeta], outputs: Sequence[TensorMeta]) -> str:
    ops = " ".join(n["op"].split(".")[1] for n in graph["nodes"])
    lines = [f"# fused {graph['kind']} region: {ops}"]
    lines += [f"# in{i}: {m.dtype} shape {list(m.shape)} stride {list(m.stride)}" for i, m in enumerate(inputs)]
    lines += [f"# out{k}: {m.dtype} shape {list(m.shape)} stride {list(m.stride)} (v{j})"
              for k, (m, j) in enumerate(zip(outputs, graph["outputs"]))]
    return "\n".join(lines)


def generate_plan(plan: _Plan, graph: dict[str, Any], config: Config, header: str, kname: str,
                  runtime_rows: Any = None, runtime_elements: Any = None) -> KernelProgram:
    """The program of an analysed plan. ``runtime_rows`` (rowwise plans whose ``rowwise_bucket_problem``
    is None): the number of rows as a SizeExpr of a shape bucket's variables, taken at run time;
    ``runtime_elements`` (pointwise plans whose varying dims merge into the flat walk's outermost
    dim, see ``_pointwise_bucket``): the number of elements, likewise."""
    # the emitters note offsets and alignment (per config) on the plan's tensors: they work on a
    # copy, so the plan the family keeps for a spec stays as analysed
    plan = copy.deepcopy(plan)
    emitter = (_RowwiseEmitter if plan.kind == "rowwise" else _PointwiseEmitter)(plan, config, header, kname)
    if runtime_rows is not None:
        if plan.kind != "rowwise" or rowwise_bucket_problem(plan) is not None:
            raise ValueError(f"rows at run time: {rowwise_bucket_problem(plan) or 'not a rowwise plan'}")
        emitter.runtime_rows = runtime_rows
    if runtime_elements is not None:
        if plan.kind != "pointwise":
            raise ValueError("elements at run time: not a pointwise plan")
        emitter.runtime_elements = runtime_elements
    return emitter.program(graph["nodes"])


def rowwise_bucket_problem(plan: _Plan) -> str | None:
    """Why the rows of a rowwise plan cannot be a run-time size (None: they can): every tensor's
    rows must be one strided run (or broadcast), so that a row's offset is its index times a
    stride that does not change with the number of rows."""
    if len(plan.lead_sizes) > 1:
        return "the rows are not one strided run in every tensor"
    return None


# --- shape buckets -----------------------------------------------------------------------------

def _what(side: str, i: int) -> str:
    return f"region node {i}'s value" if side == "node" else f"{side}put {i}"


def _iteration_vars(spec: KernelSpec, plan: _Plan, dims: Sequence[tuple[str, int, int, int]]) -> dict[int, int] | str:
    """Which dims of the region's iteration shape vary, and with which variable: every varying dim
    of an input, an output or a graph node's value, aligned with the iteration shape from the
    right (as it broadcasts); or why ``dims`` do not make one iteration shape vary. Each tensor
    that spans a varying dim must vary with it (else its size would stay the representative's)."""
    shape = plan.shape
    nodes = json.loads(spec.graph)["nodes"]
    metas = {"in": list(spec.inputs), "out": list(spec.outputs),
             "node": [TensorMeta.from_json(n["meta"]) if isinstance(n.get("meta"), dict) else None for n in nodes]}
    var_of: dict[int, int] = {}
    listed = set()
    for side, i, d, v in dims:
        m = metas[side][i]
        k = d + len(shape) - len(m.shape)
        if k < 0 or m.shape[d] != shape[k]:
            return f"{_what(side, i)} dim {d} varies but broadcasts over the region's iteration shape {list(shape)}"
        if var_of.setdefault(k, v) != v:
            return f"dim {k} of the region's iteration shape varies with two variables (v{var_of[k]} and v{v})"
        listed.add((side, i, d))
    for side, ms in metas.items():
        for i, m in enumerate(ms):
            if m is None:
                continue
            for d, size in enumerate(m.shape):
                k = d + len(shape) - len(m.shape)
                if k in var_of and size == shape[k] != 1 and (side, i, d) not in listed:
                    return (f"{_what(side, i)} dim {d} spans varying dim {k} of the region but is not a bucket dim "
                            f"(v{var_of[k]}): its size would stay {size}")
    for j, n in enumerate(nodes):
        if not isinstance(n.get("meta"), dict):
            return f"region node {j} ({n['op']}) has several outputs: their sizes are not bucketed"
        if n["op"] == EXPAND_OP and metas["node"][j] is not None and any(
                d + len(shape) - len(metas["node"][j].shape) in var_of for d in range(len(metas["node"][j].shape))):
            return f"region node {j} (expand) varies: its sizes are literal in its arguments"
    return var_of


def _rowwise_bucket(plan: _Plan, var_of: dict[int, int]) -> tuple[str | None, Any]:
    """(None, the number of rows as a SizeExpr) of a rowwise region whose leading dims vary, or
    (why not, None)."""
    last = len(plan.shape) - 1
    if last in var_of:
        return f"the row length (dim {last}, reduced) varies: it is literal in the kernel", None
    problem = rowwise_bucket_problem(plan)
    if problem is not None:
        return problem, None
    return None, product([f"v{var_of[k]}" if k in var_of else plan.shape[k] for k in range(last)])


def _pointwise_bucket(plan: _Plan, var_of: dict[int, int]) -> tuple[str | None, Any]:
    """(None, the number of elements as a SizeExpr) of a pointwise region, or (why it cannot be a
    run-time size, None): the flat walk splits its index over its (merged) sizes, and only the
    outermost one is never taken modulo its size, so every varying dim must be merged into it."""
    if cut := sorted(n.cat[0] for n in plan.nodes if n.cat and n.cat[0] in var_of):
        return f"the cat dim {cut[0]} varies: the pieces' bounds are literal in the kernel", None
    top = max(var_of)
    if math.prod(plan.flat_sizes[1:]) != math.prod(plan.shape[top + 1:]):
        return ("the varying dims do not merge into one run in every tensor (an input broadcast across them, "
                "or a cat dim inside them): the walk's inner sizes are literal"), None
    return None, product([f"v{var_of[k]}" if k in var_of else size for k, size in enumerate(plan.shape)])


# --- configs -----------------------------------------------------------------------------------

def _is_pow2(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


def rowwise_valid(plan: _Plan, c: Config) -> bool:
    bm, bn, w, st = c.get("BLOCK_M"), c.get("BLOCK_N"), c.get("num_warps"), c.get("num_stages")
    if not (_is_pow2(bm) and _is_pow2(bn)) or w not in (1, 2, 4, 8, 16) or st not in (1, 2, 3, 4):
        return False
    if bm > next_pow2(plan.M) or bn > next_pow2(plan.N) or bn < min(16, next_pow2(plan.N)):
        return False
    if bm * bn > MAX_TILE or bm * bn < 32 * w:
        return False
    if bn >= plan.N:
        return st == 1
    return plan.passes <= MAX_PASSES


def rowwise_seeds(plan: _Plan) -> list[Config]:
    bn = next_pow2(plan.N)
    pm = next_pow2(plan.M)
    seeds = []
    if bn <= MAX_TILE:
        # one pass, the row in registers: ~32 elements per thread (fp16: four 16-byte vectors);
        # short rows take several per program so that each moves a few KB
        bm = max(1, min(pm, 2048 // bn))
        w = max(1, min(16, bm * bn // 1024))
        for m, ww, evict in ((bm, w, False), (bm, 2 * w, False), (bm, w // 2, False), (2 * bm, 2 * w, False),
                             (bm, w, True)):
            m = max(1, min(m, pm, MAX_TILE // bn))
            ww = max(1, min(16, ww, m * bn // 32))
            seeds.append(Config.of(BLOCK_M=m, BLOCK_N=bn, num_warps=ww, num_stages=1, ALIGN=True, EVICT=evict))
    else:
        # long rows: one row per program in 8K/4K blocks; passes re-read the row (from L2)
        for n, ww, st, evict in ((8192, 16, 2, True), (4096, 8, 2, True), (8192, 8, 3, False), (2048, 4, 2, True)):
            seeds.append(Config.of(BLOCK_M=1, BLOCK_N=n, num_warps=ww, num_stages=st, ALIGN=True, EVICT=evict))
    return unique([c for c in seeds if rowwise_valid(plan, c)])


def rowwise_neighbours(plan: _Plan, c: Config) -> list[Config]:
    cands = doubled_and_halved(c, ("BLOCK_M", "BLOCK_N", "num_warps"))
    cands += [c.replace(num_stages=c["num_stages"] + 1), c.replace(num_stages=c["num_stages"] - 1),
              c.replace(ALIGN=not c.get("ALIGN", False)), c.replace(EVICT=not c.get("EVICT", False)),
              c.replace(BLOCK_M=c["BLOCK_M"] * 2, num_warps=c["num_warps"] * 2)]
    # a block that now covers the row is one pass (no stages); one that no longer does loops
    cands = [x.replace(num_stages=1) if x["BLOCK_N"] >= plan.N else
             (x.replace(num_stages=2) if x["num_stages"] == 1 and c["BLOCK_N"] >= plan.N else x) for x in cands]
    return unique([x for x in cands if x.key != c.key and rowwise_valid(plan, x)])


def _pointwise_max_block(plan: _Plan) -> int:
    return max(128, min(8192, next_pow2(plan.numel)))


def pointwise_valid(plan: _Plan, c: Config) -> bool:
    b, w = c.get("BLOCK"), c.get("num_warps")
    return _is_pow2(b) and 128 <= b <= _pointwise_max_block(plan) and w in (1, 2, 4, 8, 16) and b >= 32 * w


def pointwise_seeds(plan: _Plan) -> list[Config]:
    out = []
    for b, w in ((1024, 4), (4096, 8), (1024, 2), (512, 2)):
        b = min(b, _pointwise_max_block(plan))
        out.append(Config.of(BLOCK=b, num_warps=max(1, min(w, b // 32)), ALIGN=True))
    return unique([c for c in out if pointwise_valid(plan, c)])


def pointwise_neighbours(plan: _Plan, c: Config) -> list[Config]:
    b, w = c["BLOCK"], c["num_warps"]
    cands = [c.replace(BLOCK=b * 2), c.replace(BLOCK=b // 2), c.replace(num_warps=w * 2),
             c.replace(num_warps=max(1, w // 2)), c.replace(BLOCK=b * 2, num_warps=w * 2),
             c.replace(ALIGN=not c.get("ALIGN", False))]
    return unique([x for x in cands if x.key != c.key and pointwise_valid(plan, x)])


# --- the family --------------------------------------------------------------------------------

class FusedRegionFamily(KernelFamily):
    name = "fused"
    ops = frozenset({"region"})
    edge_kinds = ("zeros", "large", "negative", "special")

    def _analyse(self, spec: KernelSpec) -> tuple[_Plan, dict[str, Any]] | str:
        if spec.graph is None:
            return f"{self.name} handles fused regions, not {spec.op}"
        try:
            graph = json.loads(spec.graph)
        except ValueError:
            return "region graph is not JSON"
        if graph.get("kind") not in KINDS + (GRAPH_KIND,):
            return f"{self.name} does not handle {graph.get('kind')!r} regions"
        if graph["kind"] == GRAPH_KIND:
            graph = _inline_layer_norms(graph)
            if isinstance(graph, str):
                return graph
        plan = analyse(graph, spec.inputs, spec.outputs)
        return plan if isinstance(plan, str) else (plan, graph)

    def supports(self, spec: KernelSpec) -> str | None:
        got = self.plan(spec)
        if isinstance(got, str):
            return got
        plan, _ = got
        if plan.kind == "rowwise" and next_pow2(plan.N) > MAX_TILE and plan.passes > MAX_PASSES:
            return f"rows of {plan.N} need {plan.passes} passes (> {MAX_PASSES}) in the looped variant"
        return super().supports(spec)  # (and a configuration fits)

    def _valid(self, got: tuple[_Plan, dict[str, Any]], config: Config) -> bool:
        plan = got[0]
        return (rowwise_valid if plan.kind == "rowwise" else pointwise_valid)(plan, config)

    def _seeds(self, spec: KernelSpec, got: tuple[_Plan, dict[str, Any]]) -> list[Config]:
        plan = got[0]
        return rowwise_seeds(plan) if plan.kind == "rowwise" else pointwise_seeds(plan)

    def _steps(self, got: tuple[_Plan, dict[str, Any]], config: Config) -> list[Config]:
        plan = got[0]
        return rowwise_neighbours(plan, config) if plan.kind == "rowwise" else pointwise_neighbours(plan, config)

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan, graph = self.checked_plan(spec, config)
        return generate_plan(plan, graph, config, region_header(graph, spec.inputs, spec.outputs),
                             f"fused_{plan.kind}_kernel")

    # --- shape buckets ------------------------------------------------------------------------
    def _bucket(self, spec: KernelSpec, dims: Sequence[tuple[str, int, int, int]]) -> tuple[str | None, Any]:
        """(None, the run-time size of a bucketed region as a SizeExpr: rowwise, its rows;
        pointwise, its elements), or (why the region cannot take the sizes of ``dims`` at run
        time, None). (A SizeExpr may itself be a string, "v0".)"""
        problem = self.supports(spec) or unbucketable(spec, dims)
        if problem is not None:
            return problem, None
        plan = self.plan(spec)[0]
        var_of = _iteration_vars(spec, plan, dims)
        if isinstance(var_of, str):
            return var_of, None
        return (_rowwise_bucket if plan.kind == "rowwise" else _pointwise_bucket)(plan, var_of)

    def bucket_support(self, spec: KernelSpec, dims: Sequence[tuple[str, int, int, int]]) -> str | None:
        """Rowwise regions vary in their rows (leading dims) only; pointwise regions in dims that
        merge into the outermost run of the flat walk (inputs of the output's shape, one element,
        a static trailing bias or one value per row). Every tensor spanning a varying dim varies
        with it, contiguous, in inputs, outputs and the graph's node values alike."""
        return self._bucket(spec, dims)[0]

    def generate_bucketed(self, spec: KernelSpec, config: Config,
                          dims: Sequence[tuple[str, int, int, int]]) -> KernelProgram:
        """The kernel of ``generate`` with the number of rows (rowwise) or elements (pointwise) a
        run-time argument; int64 indexing is decided at the representative, the bucket's largest."""
        problem, size = self._bucket(spec, dims)
        if problem is not None:
            raise ValueError(f"{spec.describe()} cannot be bucketed: {problem}")
        plan, graph = self.checked_plan(spec, config)
        runtime = {"runtime_rows" if plan.kind == "rowwise" else "runtime_elements": size}
        return generate_plan(plan, graph, config, region_header(graph, spec.inputs, spec.outputs),
                             f"fused_{plan.kind}_kernel", **runtime)


FAMILY = FusedRegionFamily()
