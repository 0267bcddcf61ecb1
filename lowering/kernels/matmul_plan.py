"""The analysis of one GEMM spec (mm, addmm, bmm, or a "matmul" region: node 0 the GEMM, the rest
its pointwise epilogue) into a Plan: operands and their strides, sizes, addmm's scaling, each
epilogue node resolved, and the checks that decline what the kernel does not generate."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch

from torch_kernelize.core.region_graph import node_arg, node_ref
from torch_kernelize.core.spec import KernelSpec, TensorMeta
from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.elementwise import OPS, PointwiseOp

MM_OPS = {"aten.mm.default": "mm", "aten.addmm.default": "addmm", "aten.bmm.default": "bmm"}


@dataclasses.dataclass
class Node:
    """One epilogue node, resolved: how to compute it from earlier values."""
    index: int
    op: str
    pw: PointwiseOp
    args: dict[str, Any]                       # bound arguments (encoded)
    operands: list[tuple[str, Any]]            # ("node", j) | ("input", i) | ("scalar", number)
    dtype: str                                 # the node's output dtype
    compare_dtype: str | None = None           # compare: the operands' common dtype


@dataclasses.dataclass
class Plan:
    op: str                                    # mm | addmm | bmm
    dtype: str                                 # operand dtype (= node 0 dtype)
    B: int
    M: int
    N: int
    K: int
    a: int                                     # input index of A, and its (batch, m, k) strides
    a_strides: tuple[int, int, int]
    b: int                                     # input index of B, and its (batch, k, n) strides
    b_strides: tuple[int, int, int]
    bias: int | None                           # addmm's self (None when beta == 0)
    beta: float
    alpha: float
    nodes: list[Node]                          # the epilogue, in order (node indices 1..)
    outputs: list[int]                         # node index of each spec output
    tile_inputs: dict[int, tuple[int, int, int]]   # input -> (batch, m, n) strides over C
    helpers: list[str]
    region: bool


def pad3(strides: tuple[int, ...]) -> tuple[int, int, int]:
    return (0,) * (3 - len(strides)) + tuple(strides)


def spec_graph(spec: KernelSpec, family: str) -> dict[str, Any] | str:
    """The spec as a region graph ({"kind", "nodes", "outputs"}): a lone mm/addmm/bmm as a
    "matmul" graph of one node; a region's own graph (a "matmul_group" as it is: its members are
    checked one by one); else why the family does not take it."""
    if spec.graph is None:
        if spec.op not in MM_OPS:
            return f"{family} does not handle {spec.op}"
        if len(spec.outputs) != 1:
            return f"expected one output, got {len(spec.outputs)}"
        nodes = [{"op": spec.op, "args": node_arg(spec.args),
                  "kwargs": {k: node_arg(v) for k, v in spec.kwargs.items()},
                  "meta": spec.outputs[0].to_json()}]
        return {"kind": "matmul", "nodes": nodes, "outputs": [0]}
    if spec.op != "region":
        return f"{family} does not handle {spec.op}"
    graph = json.loads(spec.graph)
    if graph.get("kind") == "matmul_group":
        return graph
    if graph.get("kind") != "matmul":
        return f"{graph.get('kind')} regions are not matmul regions"
    nodes, outputs = graph["nodes"], list(graph["outputs"])
    if len(outputs) != len(spec.outputs):
        return f"{len(spec.outputs)} outputs for {len(outputs)} graph outputs"
    return {"kind": "matmul", "nodes": nodes, "outputs": outputs}


def gemm_plan(spec: KernelSpec, nodes: list[dict[str, Any]], outputs: list[int]) -> Plan | str:
    """The plan of a "matmul" graph (node 0 the GEMM, the others its epilogue, ``outputs`` the
    node of each spec output), or why it is not generated."""
    if not nodes or nodes[0]["op"] not in MM_OPS:
        return "node 0 is not mm/addmm/bmm"
    operands = _operands(nodes[0])
    if isinstance(operands, str):
        return operands
    op0, args0, refs = operands
    sizes = _sizes(spec, op0, refs, TensorMeta.from_json(nodes[0]["meta"]))
    if isinstance(sizes, str):
        return sizes
    dtype, B, M, N, K = sizes
    out_shape = (B, M, N) if op0 == "bmm" else (M, N)
    tile_inputs: dict[int, tuple[int, int, int]] = {}
    scaling = _scaling(spec, op0, args0, refs, out_shape, tile_inputs)
    if isinstance(scaling, str):
        return scaling
    beta, alpha, bias = scaling
    epilogue = _epilogue(spec, nodes, dtype, out_shape, tile_inputs)
    if isinstance(epilogue, str):
        return epilogue
    epi, held, helpers = epilogue
    if (problem := _outputs_problem(spec, nodes, outputs, out_shape, held)) is not None:
        return problem
    a_i, b_i = refs[0][1], refs[1][1]
    return Plan(op0, dtype, B, M, N, K, a_i, pad3(spec.inputs[a_i].stride), b_i, pad3(spec.inputs[b_i].stride),
                bias, beta, alpha, epi, outputs, tile_inputs, helpers, spec.graph is not None)


def _operands(node0: dict[str, Any]) -> tuple[str, dict[str, Any], list[tuple[str, int] | None]] | str:
    """The GEMM node's kind (mm | addmm | bmm), its bound arguments, and the input refs of A, B and
    addmm's self (None for mm and bmm)."""
    op0 = MM_OPS[node0["op"]]
    args0 = cg.bind_arguments(node0["op"], node0["args"], node0["kwargs"])
    names = {"mm": ("self", "mat2", None), "bmm": ("self", "mat2", None), "addmm": ("mat1", "mat2", "self")}[op0]
    refs = [node_ref(args0[n]) if n else None for n in names]
    if any(r is None or r[0] != "input" for r in refs[:2]) or (names[2] and (refs[2] is None or refs[2][0] != "input")):
        return "matmul operands must be tensors (inputs of the kernel)"
    return op0, args0, refs


def _sizes(spec: KernelSpec, op0: str, refs: list[tuple[str, int] | None],
           meta0: TensorMeta) -> tuple[str, int, int, int, int] | str:
    """The operand dtype and B, M, N, K, checked against the output ``meta0``; or why not."""
    am, bm_ = spec.inputs[refs[0][1]], spec.inputs[refs[1][1]]
    dtype = am.dtype
    dtypes = {am.dtype, bm_.dtype, meta0.dtype} | ({spec.inputs[refs[2][1]].dtype} if refs[2] else set())
    if any(cg.is_int(d) or d == "bool" for d in dtypes):
        return f"integer matmul ({sorted(dtypes)}) is not generated"
    if "float64" in dtypes:
        return "float64 matmul is not generated"
    if len(dtypes) != 1 or dtype not in cg.FLOAT_TYPES:
        return f"mixed or unsupported dtypes {sorted(dtypes)}"
    rank = 3 if op0 == "bmm" else 2
    if len(am.shape) != rank or len(bm_.shape) != rank:
        return f"{op0} needs {rank}-d operands, got {am.shape} and {bm_.shape}"
    if rank == 3:
        B, M, K = am.shape
        B2, K2, N = bm_.shape
        if B2 != B:
            return f"batch sizes differ: {am.shape} @ {bm_.shape}"
    else:
        (M, K), (K2, N), B = am.shape, bm_.shape, 1
    if K2 != K:
        return f"inner sizes differ: {am.shape} @ {bm_.shape}"
    out_shape = (B, M, N) if rank == 3 else (M, N)
    if tuple(meta0.shape) != out_shape:
        return f"matmul output {meta0.shape} is not {out_shape}"
    if M * N * B == 0:
        return "empty output: nothing to compute"
    if K == 0:
        return "K == 0 (an empty sum) is not generated"
    if B > 65535:
        return f"batch {B} exceeds the grid's second axis (65535)"
    if any(m.device != am.device for m in spec.inputs + spec.outputs):
        return "input and output devices differ"
    return dtype, B, M, N, K


def _tile_strides(spec: KernelSpec, i: int, out_shape: tuple[int, ...]) -> tuple[int, int, int] | str:
    """Input ``i``'s (batch, m, n) strides broadcast over C, or why it does not broadcast."""
    try:
        return pad3(cg.broadcast_strides(spec.inputs[i], out_shape))
    except ValueError as e:
        return str(e)


def _scaling(spec: KernelSpec, op0: str, args0: dict[str, Any], refs: list[tuple[str, int] | None],
             out_shape: tuple[int, ...], tile_inputs: dict[int, tuple[int, int, int]]) -> tuple[float, float, int | None] | str:
    """addmm's beta, alpha and bias input (None when beta == 0: self is not read), the bias's
    strides recorded in ``tile_inputs``; (1, 1, None) for mm and bmm."""
    beta, alpha, bias = 1.0, 1.0, None
    if op0 == "addmm":
        beta_v, alpha_v = cg.scalar_value(args0.get("beta", 1)), cg.scalar_value(args0.get("alpha", 1))
        if beta_v is None or alpha_v is None:
            return "addmm beta/alpha must be numbers"
        beta, alpha = float(beta_v), float(alpha_v)
        if not (math.isfinite(beta) and math.isfinite(alpha)):
            return "non-finite addmm beta/alpha"
        if alpha == 0:
            return "addmm with alpha == 0 is not generated"
        if beta != 0:
            bias = refs[2][1]
            st = _tile_strides(spec, bias, out_shape)
            if isinstance(st, str):
                return f"addmm bias: {st}"
            tile_inputs[bias] = st
    return beta, alpha, bias


def _epilogue(spec: KernelSpec, nodes: list[dict[str, Any]], dtype: str, out_shape: tuple[int, ...],
              tile_inputs: dict[int, tuple[int, int, int]]) -> tuple[list[Node], dict[int, str], list[str]] | str:
    """The epilogue nodes resolved, the dtype of every node's value, and the helpers they call."""
    epi: list[Node] = []
    held: dict[int, str] = {0: dtype}     # node -> dtype of its value
    helpers: list[str] = []
    for j, nd in enumerate(nodes[1:], 1):
        node = epilogue_node(j, nd, spec, out_shape, held, tile_inputs)
        if isinstance(node, str):
            return f"epilogue node {j} ({nd['op']}): {node}"
        epi.append(node)
        held[j] = node.dtype
        helpers += [h for h in node.pw.helpers if h not in helpers]
    return epi, held, helpers


def _outputs_problem(spec: KernelSpec, nodes: list[dict[str, Any]], outputs: list[int], out_shape: tuple[int, ...],
                     held: dict[int, str]) -> str | None:
    """Why an output is not the value of the node it names (or overlaps itself); None if none."""
    for o, j in enumerate(outputs):
        if not 0 <= j < len(nodes):
            return f"output {o} names node {j}, which does not exist"
        m = spec.outputs[o]
        if tuple(m.shape) != out_shape or m.dtype != held[j]:
            return f"output {o} {m.short()} is not node {j}'s value ({held[j]} {list(out_shape)})"
        if not cg.non_overlapping(m):
            return f"output {o} strides overlap (some elements share memory)"
    return None


def epilogue_node(j: int, nd: dict[str, Any], spec: KernelSpec, out_shape: tuple[int, ...], held: dict[int, str],
                   tile_inputs: dict[int, tuple[int, int, int]]) -> Node | str:
    """Epilogue node ``j`` resolved (its inputs' strides recorded in ``tile_inputs``), or why not."""
    op = nd["op"]
    if op not in OPS:
        return "not a pointwise op the epilogue covers (elementwise.OPS)"
    pw = OPS[op]
    meta = TensorMeta.from_json(nd["meta"])
    if tuple(meta.shape) != out_shape:
        return f"shape {meta.shape} is not the matmul output's {out_shape}"
    if meta.dtype not in cg.FLOAT_TYPES + ("bool",):
        return f"{meta.dtype} values are not generated in an epilogue (fp32/fp16/bf16/bool only)"
    args = cg.bind_arguments(op, nd["args"], nd["kwargs"])
    if pw.check is not None and (why := pw.check(args)):
        return why
    for k in ("alpha", "min", "max", "min_val", "max_val", "negative_slope"):
        if k in args and args[k] is not None and cg.scalar_value(args[k]) is None:
            return f"argument {k}={args[k]!r} must be a number"
    resolved = _node_operands(j, pw, args, spec, out_shape, held, tile_inputs)
    if isinstance(resolved, str):
        return resolved
    operands, kinds = resolved
    node = Node(j, op, pw, args, operands, meta.dtype)
    tensor_kinds = [k for k in kinds if k != "scalar"]
    if not tensor_kinds:
        return "no tensor operand"
    problem = _kind_problem(node, kinds, meta, spec, out_shape)
    return node if problem is None else problem


def _node_operands(j: int, pw: PointwiseOp, args: dict[str, Any], spec: KernelSpec, out_shape: tuple[int, ...],
                   held: dict[int, str], tile_inputs: dict[int, tuple[int, int, int]]
                   ) -> tuple[list[tuple[str, Any]], list[str]] | str:
    """Node ``j``'s operands (earlier nodes, inputs broadcast over C, numbers) and the dtype of
    each ("scalar" for numbers); or why one is not generated."""
    operands: list[tuple[str, Any]] = []
    kinds: list[str] = []      # dtype of each operand ("scalar" for numbers)
    for name in pw.operands:
        v = args.get(name)
        r = node_ref(v)
        if r is None:
            s = cg.scalar_value(v)
            if s is None:
                return f"argument {name}={v!r} is neither a tensor nor a number"
            operands.append(("scalar", s))
            kinds.append("scalar")
            continue
        if r[0] == "node":
            if not 0 <= r[1] < j:
                return f"reads node {r[1]}, which is not computed before it"
            operands.append(r)
            kinds.append(held[r[1]])
        else:
            i = r[1]
            if not 0 <= i < len(spec.inputs):
                return f"reads input {i}, which does not exist"
            dt = spec.inputs[i].dtype
            if dt not in cg.FLOAT_TYPES + ("bool",):
                return f"input {i} of dtype {dt} is not generated in an epilogue"
            st = _tile_strides(spec, i, out_shape)
            if isinstance(st, str):
                return f"input {i}: {st}"
            tile_inputs[i] = st
            operands.append(r)
            kinds.append(dt)
    return operands, kinds


def _kind_problem(node: Node, kinds: list[str], meta: TensorMeta, spec: KernelSpec,
                  out_shape: tuple[int, ...]) -> str | None:
    """The rules of the node's op kind (copy, float, arith, compare, logical, select) for its
    value ``meta``: why the node is not generated, or None (a comparison's common dtype is set on
    ``node``)."""
    op, pw, args = node.op, node.pw, node.args
    if pw.kind == "copy":
        if op == "aten._to_copy.default":
            if args.get("layout") not in (None, {"layout": "strided"}):
                return f"_to_copy to layout {args.get('layout')}"
            dev = args.get("device")
            if dev is not None and dev != {"device": meta.device}:
                return f"_to_copy to another device {dev}"
            if args.get("pin_memory"):
                return "_to_copy with pin_memory"
        if meta.dtype == "bool":
            return "a cast to bool is not generated in an epilogue"
    elif pw.kind in ("float", "arith"):
        if meta.dtype == "bool":
            return f"{op} producing bool is not generated"
    elif pw.kind == "compare":
        if meta.dtype != "bool":
            return "a comparison must produce bool"
        vals = []
        for (kind, v), dt in zip(node.operands, kinds):
            if kind == "scalar":
                vals.append(v)
            elif kind == "node":
                vals.append(torch.empty(out_shape, dtype=getattr(torch, dt), device="meta"))
            else:
                vals.append(torch.empty(spec.inputs[v].shape, dtype=getattr(torch, dt), device="meta"))
        common = str(torch.result_type(vals[0], vals[1])).removeprefix("torch.")
        if common not in cg.FLOAT_TYPES:
            return f"comparison in {common} is not generated"
        node.compare_dtype = common
    elif pw.kind == "logical":
        if meta.dtype != "bool":
            return "logical ops produce bool"
    elif pw.kind == "select":
        if kinds[0] != "bool":
            return "where needs a bool condition tensor"
        if meta.dtype == "bool":
            return "where selecting bools is not generated"
    else:
        return f"op kind {pw.kind!r} is not generated in an epilogue"
    return None
