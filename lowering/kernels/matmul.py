"""Matrix multiplies: mm, addmm, bmm, and fused "matmul" regions (a matmul plus its pointwise epilogue).

One tiled GEMM kernel. A program owns a BLOCK_M x BLOCK_N tile of C (of one batch element for
bmm) and walks K in BLOCK_K steps: a loop of K // BLOCK_K unmasked steps (K is concrete, so the
bounds are literals and Triton software-pipelines the loop over num_stages) and, when BLOCK_K does
not divide K, one masked tail step. A and B are read through their real strides (nn.Linear's
weight arrives as a permuted [K, N] view: no copy is made). Program ids are swizzled in groups of
GROUP_M row blocks so that neighbouring programs share B column blocks in L2.

fp16/bf16 run on tensor cores with fp32 accumulation; fp32 uses input_precision="ieee" (ATen's fp32
matmul does not use TF32 here and the tolerances are tight). DOT_UPCAST converts fp16/bf16 tiles to
fp32 before the dot: a slower variant that exists because Triton's CPU interpreter computes bf16
dots wrongly; the search keeps whichever variant validates on the target.

Edges of M and N: a dim that is contiguous in its operand is masked (keeps vector loads); any
other dim is wrapped (``rm % M``: loads stay in bounds without masks; the extra rows are never
stored).

ALIGN: compiled without alignment facts about its pointers, Triton neither vectorizes loads nor
pipelines them through cp.async (one stage of shared memory, twice the registers). When the build
compiles pointer arguments as 16-byte aligned (tt.divisibility, with a launch-time check) the plain
body has those facts and ALIGN=False is the variant to use. With ALIGN the kernel itself tests its
pointers once and calls a body compiled with ``tl.multiple_of`` hints on its pointer tiles (valid
when the base is 16-byte aligned and the other strides are multiples of 16 bytes), or the plain
body otherwise: correct for any pointer, but both bodies are compiled (code size, registers).

Shape buckets (``generate_bucketed``): M, the rows of A and C (a model's tokens), is a run-time
argument; the rows are always masked by it, the GROUP_M swizzle counts its row blocks from it,
and the grid is a size expression of it; bmm's batch is the grid's second axis. K and N (the
weights) stay literals, so the K loop keeps its literal bounds. Every other decision (tile caps,
int64 offsets, alignment hints) is taken at the bucket's upper edge, which holds for every
smaller M; a contiguous [B, M, *] tensor's batch stride is written as a multiple of M. A matmul
group is bucketed when every member's M is the same variable (a layer's projections of the same
tokens): every member then owns ``cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)`` programs, so the members'
first programs and the grid are computed from M too.

Epilogue (regions): node 0 is the matmul; the following nodes are pointwise ops on tensors of its
shape (elementwise.OPS gives each node's expression). They run on the fp32 accumulator tile in
registers, node by node as the graph says: the matmul's own fp16/bf16 output is rounded to that
type first (as a vendor GEMM stores it: what follows reads exactly eager's values, which keeps
discrete decisions such as an MoE router's top-k the same), every later node computes in fp32
(ATen's opmath), and an explicit cast (_to_copy/clone to fp16/bf16) rounds the value
(``.to(tl.float16).to(tl.float32)``) before later nodes read it. Other intermediates stay fp32, as
in Inductor's fused pointwise code. Extra region inputs (a bias [N], a residual
[M, N], a scalar) are loaded once per tile, broadcast by their strides. Every region output is
stored (rounded once) with its own dtype and strides.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch

from torch_kernelize.core.buckets import Dim, contiguous_strides, product, unbucketable
from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import SMS, Config, KernelFamily, next_pow2
from torch_kernelize.lowering.kernels.elementwise import HELPERS, OPS, PointwiseOp
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.region_graph import node_arg, node_ref
from torch_kernelize.core.spec import KernelSpec, TensorMeta

MM_OPS = {"aten.mm.default": "mm", "aten.addmm.default": "addmm", "aten.bmm.default": "bmm"}
SMEM_BYTES = 232448          # sm_90: 227 KB of shared memory per block
MAX_ACC_REGS = 128           # fp32 accumulator registers per thread a config may use
GROUPS = (1, 4, 8, 16)


@dataclasses.dataclass
class _Node:
    """One epilogue node, resolved: how to compute it from earlier values."""
    index: int
    op: str
    pw: PointwiseOp
    args: dict[str, Any]                       # bound arguments (encoded)
    operands: list[tuple[str, Any]]            # ("node", j) | ("input", i) | ("scalar", number)
    dtype: str                                 # the node's output dtype
    compare_dtype: str | None = None           # compare: the operands' common dtype


@dataclasses.dataclass
class _Plan:
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
    nodes: list[_Node]                         # the epilogue, in order (node indices 1..)
    outputs: list[int]                         # node index of each spec output
    tile_inputs: dict[int, tuple[int, int, int]]   # input -> (batch, m, n) strides over C
    helpers: list[str]
    region: bool


def _pad3(strides: tuple[int, ...]) -> tuple[int, int, int]:
    return (0,) * (3 - len(strides)) + tuple(strides)


@dataclasses.dataclass
class _Group:
    """A matmul_group region: its members' plans, each in its own numbering (member specs), and
    the maps from a member's input / output numbers to the group's."""
    spec: KernelSpec
    members: list[_Plan]
    member_specs: list[KernelSpec]
    in_maps: list[list[int]]
    out_maps: list[list[int]]

    @property
    def template(self) -> int:
        """The member whose code every member runs: one with the largest M (a member of one row
        may carry any stride along M, or 0 for its broadcast inputs; the template's must be real)."""
        return max(range(len(self.members)), key=lambda j: self.members[j].M)

    @property
    def rep(self) -> _Plan:
        """The template's plan: tile sizes are checked against the largest M."""
        return self.members[self.template]

    def tiles(self, bm: int, bn: int) -> int:
        return sum(-(-m.M // bm) * -(-m.N // bn) for m in self.members)


@dataclasses.dataclass(frozen=True)
class _Varying:
    """The sizes a bucketed GEMM takes at run time: the variable (buckets.py) that is M, the one
    that is bmm's batch, and the tensors whose batch stride is a multiple of M (a contiguous
    [B, M, *] tensor): pointer tile name ("a", "in<i>", "out<o>") -> that multiple."""
    m: int | None
    batch: int | None
    m_scaled: dict[str, int]


def _member_specs(spec: KernelSpec, graph: dict[str, Any]) -> list[tuple[KernelSpec, list[int], list[int]]] | str:
    """Each member of a matmul_group graph as a matmul region spec of its own (inputs numbered
    by first use), with its input and output maps into the group's numbering."""
    members, nodes, outputs = graph.get("members"), graph["nodes"], list(graph["outputs"])
    if not members or len(members) < 2:
        return "a matmul group needs two members or more"
    if sorted(j for m in members for j in m) != list(range(len(nodes))):
        return "the members do not partition the group's nodes"
    out = []
    for idxs in members:
        local = {j: k for k, j in enumerate(idxs)}
        ins: list[int] = []

        def enc(a: Any) -> Any:
            r = node_ref(a)
            if r is not None and r[0] == "input" and "input" in a:
                if r[1] not in ins:
                    ins.append(r[1])
                return {"input": ins.index(r[1])}
            if r is not None and r[0] == "node":
                if r[1] not in local:
                    raise ValueError(f"a member reads node {r[1]} of another member")
                return {"node": local[r[1]]}
            return [enc(x) for x in a] if isinstance(a, list) else a

        try:
            sub = [{"op": nodes[j]["op"], "args": enc(nodes[j]["args"]),
                    "kwargs": {k: enc(v) for k, v in nodes[j]["kwargs"].items()}, "meta": nodes[j]["meta"]}
                   for j in idxs]
        except ValueError as e:
            return str(e)
        outs = [o for o, j in enumerate(outputs) if j in local]
        sub_graph = {"kind": "matmul", "nodes": sub, "outputs": [local[outputs[o]] for o in outs]}
        out.append((KernelSpec("region", [], {}, tuple(spec.inputs[i] for i in ins), tuple(spec.outputs[o] for o in outs),
                               len(outs) > 1, json.dumps(sub_graph, sort_keys=True, separators=(",", ":"))), ins, outs))
    if sorted(o for _, _, outs in out for o in outs) != list(range(len(spec.outputs))):
        return "the members do not partition the group's outputs"
    return out


def _shape_free(plan: _Plan, spec: KernelSpec, one_row: bool = False) -> tuple:
    """Everything the generated GEMM bakes in, except M: members that agree here share a body.
    ``one_row``: leave out the strides along M too (a member of one row reads row 0 only)."""
    m = (lambda st, i: st[:i] + (None,) + st[i + 1:]) if one_row else (lambda st, i: tuple(st))
    nodes = tuple((n.index, n.op, json.dumps(n.args, sort_keys=True, default=str), tuple(n.operands), n.dtype,
                   n.compare_dtype) for n in plan.nodes)
    return (plan.op, plan.dtype, plan.B, plan.N, plan.K, plan.a, m(plan.a_strides, 1), plan.b, plan.b_strides,
            plan.bias, plan.beta, plan.alpha, nodes, tuple(plan.outputs),
            tuple(sorted((i, m(st, 1)) for i, st in plan.tile_inputs.items())), tuple(plan.helpers),
            tuple((o.dtype, m(tuple(o.stride), 0)) for o in spec.outputs),
            tuple((i.dtype, tuple(i.shape[1:]), i.device) for i in spec.inputs))


class MatmulFamily(KernelFamily):
    name = "matmul"
    ops = frozenset(MM_OPS) | {"region"}
    edge_kinds = ("zeros", "large", "negative", "special")

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> _Plan | _Group | str:
        if spec.graph is None:
            if spec.op not in MM_OPS:
                return f"{self.name} does not handle {spec.op}"
            if len(spec.outputs) != 1:
                return f"expected one output, got {len(spec.outputs)}"
            nodes = [{"op": spec.op, "args": node_arg(spec.args),
                      "kwargs": {k: node_arg(v) for k, v in spec.kwargs.items()},
                      "meta": spec.outputs[0].to_json()}]
            outputs = [0]
        else:
            if spec.op != "region":
                return f"{self.name} does not handle {spec.op}"
            graph = json.loads(spec.graph)
            if graph.get("kind") == "matmul_group":
                return self._group_plan(spec, graph)
            if graph.get("kind") != "matmul":
                return f"{graph.get('kind')} regions are not matmul regions"
            nodes, outputs = graph["nodes"], list(graph["outputs"])
            if len(outputs) != len(spec.outputs):
                return f"{len(spec.outputs)} outputs for {len(outputs)} graph outputs"
        if not nodes or nodes[0]["op"] not in MM_OPS:
            return "node 0 is not mm/addmm/bmm"
        op0 = MM_OPS[nodes[0]["op"]]
        args0 = cg.bind_arguments(nodes[0]["op"], nodes[0]["args"], nodes[0]["kwargs"])
        names = {"mm": ("self", "mat2", None), "bmm": ("self", "mat2", None), "addmm": ("mat1", "mat2", "self")}[op0]
        refs = [node_ref(args0[n]) if n else None for n in names]
        if any(r is None or r[0] != "input" for r in refs[:2]) or (names[2] and (refs[2] is None or refs[2][0] != "input")):
            return "matmul operands must be tensors (inputs of the kernel)"
        a_i, b_i = refs[0][1], refs[1][1]
        am, bm_ = spec.inputs[a_i], spec.inputs[b_i]
        meta0 = TensorMeta.from_json(nodes[0]["meta"])
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

        beta, alpha, bias = 1.0, 1.0, None
        tile_inputs: dict[int, tuple[int, int, int]] = {}

        def tile_strides(i: int) -> tuple[int, int, int] | str:
            try:
                return _pad3(cg.broadcast_strides(spec.inputs[i], out_shape))
            except ValueError as e:
                return str(e)

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
                st = tile_strides(bias)
                if isinstance(st, str):
                    return f"addmm bias: {st}"
                tile_inputs[bias] = st

        # the epilogue
        epi: list[_Node] = []
        held: dict[int, str] = {0: dtype}     # node -> dtype of its value
        helpers: list[str] = []
        for j, nd in enumerate(nodes[1:], 1):
            node = self._epilogue_node(j, nd, spec, out_shape, held, tile_inputs, tile_strides)
            if isinstance(node, str):
                return f"epilogue node {j} ({nd['op']}): {node}"
            epi.append(node)
            held[j] = node.dtype
            helpers += [h for h in node.pw.helpers if h not in helpers]
        for o, j in enumerate(outputs):
            if not 0 <= j < len(nodes):
                return f"output {o} names node {j}, which does not exist"
            m = spec.outputs[o]
            if tuple(m.shape) != out_shape or m.dtype != held[j]:
                return f"output {o} {m.short()} is not node {j}'s value ({held[j]} {list(out_shape)})"
            if not cg.non_overlapping(m):
                return f"output {o} strides overlap (some elements share memory)"
        return _Plan(op0, dtype, B, M, N, K, a_i, _pad3(am.stride), b_i, _pad3(bm_.stride), bias, beta, alpha,
                     epi, outputs, tile_inputs, helpers, spec.graph is not None)

    def _group_plan(self, spec: KernelSpec, graph: dict[str, Any]) -> _Group | str:
        parts = _member_specs(spec, graph)
        if isinstance(parts, str):
            return parts
        plans = []
        for j, (sub, _, _) in enumerate(parts):
            plan = self.plan(sub)
            if isinstance(plan, str):
                return f"member {j}: {plan}"
            if plan.B != 1:
                return f"member {j}: batched (bmm) GEMMs are not grouped"
            plans.append(plan)
        group = _Group(spec, plans, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts])
        t = group.template
        for j in range(len(plans)):
            one = plans[j].M == 1
            if _shape_free(plans[j], parts[j][0], one) != _shape_free(plans[t], parts[t][0], one):
                return f"member {j} differs from member {t} in more than M (operands, strides, epilogue or sizes)"
        return group

    def _epilogue_node(self, j: int, nd: dict[str, Any], spec: KernelSpec, out_shape: tuple[int, ...],
                       held: dict[int, str], tile_inputs: dict[int, tuple[int, int, int]], tile_strides) -> _Node | str:
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
                st = tile_strides(i)
                if isinstance(st, str):
                    return f"input {i}: {st}"
                tile_inputs[i] = st
                operands.append(r)
                kinds.append(dt)
        node = _Node(j, op, pw, args, operands, meta.dtype)
        tensor_kinds = [k for k in kinds if k != "scalar"]
        if not tensor_kinds:
            return "no tensor operand"
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
            for (kind, v), dt in zip(operands, kinds):
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
        return node

    # --- configs ------------------------------------------------------------------------------
    @staticmethod
    def _caps(plan: _Plan) -> tuple[int, int, int]:
        return (max(16, next_pow2(plan.M)), max(16, next_pow2(plan.N)), max(16, next_pow2(plan.K)))

    def _valid(self, plan: _Plan | _Group, c: Config) -> bool:
        if isinstance(plan, _Group):
            # no ALIGN body: a group selects its pointers at run time (the build compiles them
            # 16-byte aligned, with a launch-time check)
            return not c.get("ALIGN", False) and self._valid(plan.rep, c)
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        if not all(16 <= v <= 256 and v & (v - 1) == 0 for v in (bm, bn, bk)):
            return False
        cm, cn, ck = self._caps(plan)
        if bm > cm or bn > cn or bk > ck:
            return False
        if c["GROUP_M"] not in GROUPS or c["num_warps"] not in (4, 8) or not 2 <= c["num_stages"] <= 5:
            return False
        if c["DOT_UPCAST"] not in (True, False) or (c["DOT_UPCAST"] and plan.dtype == "float32"):
            return False
        if c.get("ALIGN", False) not in (True, False):
            return False
        if bm * bn > MAX_ACC_REGS * 32 * c["num_warps"]:
            return False
        elt = torch.finfo(getattr(torch, plan.dtype)).bits // 8
        return c["num_stages"] * (bm * bk + bk * bn) * elt <= SMEM_BYTES

    def _fit(self, plan: _Plan, bm: int, bn: int, bk: int, warps: int, stages: int, upcast: bool = False,
             group: int = 8, align: bool = False) -> Config:
        cm, cn, ck = self._caps(plan)
        bm, bn, bk = min(bm, cm), min(bn, cn), min(bk, ck)
        if bm * bn <= 64 * 64:
            warps = 4
        elt = torch.finfo(getattr(torch, plan.dtype)).bits // 8
        while stages > 2 and stages * (bm * bk + bk * bn) * elt > SMEM_BYTES:
            stages -= 1
        return Config.of(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages,
                         DOT_UPCAST=bool(upcast and plan.dtype != "float32"), ALIGN=align)

    def _filling(self, plan: _Plan, tiles: Any = None) -> list[Config]:
        """A tile small enough to give every SM a program, where 128x128 tiles would leave most of
        them idle (an MoE expert's [~1000, 1024] x [1024, 512] makes 32 such tiles for 132 SMs):
        the largest of 128x64, 64x128, 64x64 that makes at least SMS tiles, else 64x64.
        ``tiles(bm, bn)``: the launch's tile count (a group's, over its members)."""
        tiles = tiles or (lambda bm, bn: plan.B * -(-plan.M // bm) * -(-plan.N // bn))
        if tiles(128, 128) * 2 > SMS:
            return []
        for bm, bn in ((128, 64), (64, 128), (64, 64)):
            if tiles(bm, bn) >= SMS:
                break
        return [self._fit(plan, bm, bn, 64, 4, 4)]

    def _seeds(self, spec: KernelSpec, plan: _Plan | _Group) -> list[Config]:
        group = plan if isinstance(plan, _Group) else None
        plan = group.rep if group else plan
        filling = self._filling(plan, group.tiles if group else None)
        if plan.dtype == "float32":
            # ieee fp32 dots run on FMA units, not tensor cores: moderate tiles, shallow pipelines
            seeds = [self._fit(plan, 64, 64, 32, 4, 3), self._fit(plan, 128, 64, 32, 8, 3),
                     self._fit(plan, 128, 128, 32, 8, 2), self._fit(plan, 64, 128, 32, 4, 3),
                     self._fit(plan, 32, 32, 32, 4, 2), self._fit(plan, 64, 64, 32, 4, 3, align=True)]
        else:
            # classic Hopper tensor-core tiles (Triton's tutorial / Inductor's mm configs), clipped
            # to the problem; a small tile for tiny shapes; the first with the run-time alignment
            # test (for builds that compile without alignment facts); fp32-upcast variants of the
            # first and the small one (the interpreter's bf16 dot is wrong; the search keeps what
            # validates on the target)
            seeds = [self._fit(plan, 128, 128, 64, 8, 3), *filling, self._fit(plan, 128, 256, 64, 8, 3),
                     self._fit(plan, 64, 128, 32, 4, 4), self._fit(plan, 128, 64, 32, 4, 4),
                     self._fit(plan, 256, 128, 64, 8, 3), self._fit(plan, 32, 32, 32, 4, 2),
                     self._fit(plan, 128, 128, 64, 8, 3, align=True),
                     self._fit(plan, 128, 128, 64, 8, 3, upcast=True), self._fit(plan, 32, 32, 32, 4, 2, upcast=True)]
        return seeds

    def _steps(self, plan: _Plan | _Group, c: Config) -> list[Config]:
        cands = []
        for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            cands += [c.replace(**{k: c[k] * 2}), c.replace(**{k: c[k] // 2})]
        g = GROUPS.index(c["GROUP_M"]) if c["GROUP_M"] in GROUPS else 2
        cands += [c.replace(GROUP_M=GROUPS[x]) for x in (g - 1, g + 1) if 0 <= x < len(GROUPS)]
        cands += [c.replace(num_warps=8 if c["num_warps"] == 4 else 4)]
        cands += [c.replace(num_stages=c["num_stages"] + 1), c.replace(num_stages=c["num_stages"] - 1)]
        cands += [c.replace(DOT_UPCAST=not c["DOT_UPCAST"]), c.replace(ALIGN=not c.get("ALIGN", False))]
        return cands

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        if isinstance(plan, _Group):
            return _Gen(plan.member_specs[plan.template], plan.rep, config, plan).program()
        return _Gen(spec, plan, config).program()

    # --- shape buckets ------------------------------------------------------------------------
    def bucket_support(self, spec: KernelSpec, dims: tuple[Dim, ...]) -> str | None:
        """M varies (the rows of A and C: tokens), and for bmm the batch; K and N are the weights'
        sizes and stay literal. Every tensor of M rows (or of the batch) must vary with it."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return plan
        varying = _varying(spec, plan, dims)
        return varying if isinstance(varying, str) else None

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims: tuple[Dim, ...]) -> KernelProgram:
        """The kernel of ``generate`` with M a run-time argument (rows masked by it, the GROUP_M
        swizzle and the grid computed from it) and bmm's batch the grid's second axis: one binary
        serves every size of the bucket. ``spec`` is the representative, the bucket's upper edge:
        the int64 decision is taken there, where offsets reach furthest."""
        plan = self.checked_plan(spec, config)
        varying = _varying(spec, plan, dims)
        if isinstance(varying, str):
            raise ValueError(f"{spec.describe()} cannot be bucketed: {varying}")
        if isinstance(plan, _Group):
            return _Gen(plan.member_specs[plan.template], plan.rep, config, plan, varying=varying).program()
        return _Gen(spec, plan, config, varying=varying).program()


def _varying(spec: KernelSpec, plan: _Plan | _Group, dims: tuple[Dim, ...]) -> _Varying | str:
    """What of ``plan`` varies with ``dims``, or why the kernel cannot take those sizes at run time."""
    if isinstance(plan, _Group):
        return _group_varying(plan, dims)
    rank = 3 if plan.op == "bmm" else 2
    if plan.a == plan.b and any(s == "in" and i == plan.a for s, i, _, _ in dims):
        return "A and B are one tensor: its sizes would vary as both M and K"
    gemm = lambda rows, cols: {rank - 2: rows, rank - 1: cols, **({0: "batch"} if rank == 3 else {})}
    # each pointer tile of the kernel: its tensor, and the role of each of that tensor's dims
    tiles: list[tuple[str, tuple[str, int], dict[int, str]]] = [
        ("a", ("in", plan.a), gemm("M", "K")), ("b", ("in", plan.b), gemm("K", "N"))]
    for i, (sb, sm, sn) in plan.tile_inputs.items():
        r = len(spec.inputs[i].shape)
        tiles.append((f"in{i}", ("in", i), {d: role for d, role, st in ((r - 3, "batch", sb), (r - 2, "M", sm),
                                                                        (r - 1, "N", sn)) if d >= 0 and st}))
    tiles += [(f"out{o}", ("out", o), gemm("M", "N")) for o in range(len(spec.outputs))]
    roles: dict[tuple[str, int, int], str] = {}
    for _, (side, i), rs in tiles:
        for d, role in rs.items():
            if roles.setdefault((side, i, d), role) != role and "M" in (role, roles[(side, i, d)]):
                return f"{side}put {i} dim {d} is M of one operand and {role} of another"
    read = {t for _, t, _ in tiles}
    var_of: dict[str, int] = {}
    for side, i, d, v in dims:
        if (side, i) not in read:
            continue   # an input the kernel does not read (addmm's self when beta == 0)
        role = roles.get((side, i, d))
        if role in ("K", "N"):
            return (f"{role} varies ({side}put {i} dim {d}): the kernel takes M (and bmm's batch) at run time, "
                    f"K and N are literals (a model's weights)")
        if role is None:
            return unbucketable(spec, dims) or f"{side}put {i} dim {d} varies, but the kernel broadcasts that dim"
        if var_of.setdefault(role, v) != v:
            return f"{role} is two variables ({var_of[role]} and {v})"
    if (problem := unbucketable(spec, dims)) is not None:   # (after K and N: the clearer reason)
        return problem
    if "M" in var_of and var_of["M"] == var_of.get("batch"):
        return "the batch and M are one variable"
    if any(v not in var_of.values() for *_, v in dims):
        return "a variable sizes only inputs the kernel does not read"
    marked = {(side, i, d) for side, i, d, _ in dims}
    for (side, i, d), role in roles.items():
        if role in var_of and (side, i, d) not in marked:
            return f"{side}put {i} has {role} in dim {d}, but that dim does not vary with {role}"
    m_scaled: dict[str, int] = {}
    for name, (side, i), rs in tiles:
        m_dim = next((d for d, role in rs.items() if role == "M"), None)
        if "M" in var_of and m_dim is not None and m_dim > 0:
            # a contiguous [B, M, *] tensor: its batch stride is M times the rest
            shape = (spec.inputs if side == "in" else spec.outputs)[i].shape
            m_scaled[name] = contiguous_strides(shape[:m_dim] + (1,) + shape[m_dim + 1:])[0]
    return _Varying(var_of.get("M"), var_of.get("batch"), m_scaled)


def _group_varying(group: _Group, dims: tuple[Dim, ...]) -> _Varying | str:
    """A group serves a bucket when every member's M is one variable (the tokens every projection
    of a layer reads): each member is checked as a GEMM of its own, its dims renumbered."""
    if (problem := unbucketable(group.spec, dims)) is not None:
        return problem
    node_maps = json.loads(group.spec.graph)["members"]
    found: list[_Varying] = []
    for j, (sub, plan, ins, outs, idxs) in enumerate(zip(group.member_specs, group.members, group.in_maps,
                                                         group.out_maps, node_maps)):
        local = {"in": ins, "out": outs, "node": idxs}
        sub_dims = tuple((side, local[side].index(i), d, v) for side, i, d, v in dims if i in local[side])
        v = _varying(sub, plan, sub_dims) if sub_dims else None
        if isinstance(v, str):
            return f"member {j}: {v}"
        if v is None or v.m is None:
            return f"member {j}: its M does not vary (a group's members take one run-time M)"
        found.append(v)
    if len({v.m for v in found}) > 1:
        return f"the members' M are different variables ({sorted({v.m for v in found})}): one launch takes one M"
    if len({m.M for m in group.members}) > 1:
        return f"the members' M differ at the representative ({[m.M for m in group.members]}) though one variable sizes them"
    return found[group.template]


# --- code generation -------------------------------------------------------------------------


def _term(expr: str, stride: int | str) -> str:
    return expr if stride == 1 else f"{expr} * {stride}"


def _join(terms: list[str]) -> str:
    terms = [t for t in terms if t]
    return " + ".join(terms) if terms else "0"


class _Gen:
    """The kernel of one GEMM (a plan), or of a group: then ``spec`` and ``plan`` are the template
    member's (in its own numbering), and ``program`` adds the selection of each member's pointers
    and M. ``varying``: a bucketed kernel's run-time sizes (``plan`` is the bucket's upper edge)."""

    def __init__(self, spec: KernelSpec, plan: _Plan, config: Config, group: _Group | None = None,
                 varying: _Varying | None = None):
        self.spec, self.p, self.c, self.group, self.varying = spec, plan, config, group, varying
        self.runtime_m = varying is not None and varying.m is not None
        self.bm, self.bn, self.bk = int(config["BLOCK_M"]), int(config["BLOCK_N"]), int(config["BLOCK_K"])
        self.mb, self.nb = -(-plan.M // self.bm), -(-plan.N // self.bn)
        self.src = cg.Source()
        p = plan
        # int64 offsets when any tensor's reach (with the padded tile edges) passes int32
        mbs = [-(-m.M // self.bm) for m in group.members] if group else [self.mb]
        pm, pn, pk = max(mbs) * self.bm, self.nb * self.bn, -(-p.K // self.bk) * self.bk
        reach = [cg.max_offset((p.B, pm, pk), p.a_strides), cg.max_offset((p.B, pk, pn), p.b_strides)]
        reach += [cg.max_offset((p.B, pm, pn), st) for st in p.tile_inputs.values()]
        reach += [cg.max_offset((p.B, pm, pn), _pad3(m.stride)) for m in spec.outputs]
        self.wide = max(reach) > cg.INT32_MAX
        # a group's programs: member g owns [starts[g], starts[g + 1])
        self.starts = [sum(mbs[:g]) * self.nb for g in range(len(mbs) + 1)]

    def program(self) -> KernelProgram:
        if self.group:
            return self.group_program()
        p, s = self.p, self.src
        s(cg.HEADER)
        self.header()
        for h in p.helpers:
            s.blank()(HELPERS[h].strip("\n"))
        s.blank()("")
        inputs = sorted({p.a, p.b} | set(p.tile_inputs))
        ptrs = [f"in{i}_ptr" for i in inputs] + [f"out{o}_ptr" for o in range(len(p.outputs))]
        ptrs += ["M"] if self.runtime_m else []   # (not a pointer: the run-time size after them)
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"]
        kname = ("region_" if p.region else "") + p.op + "_kernel"
        pids = ["pid"] + (["pid_b"] if p.B > 1 else [])
        hinted = self.hinted_pointers() if self.c.get("ALIGN", False) else []
        if hinted:
            # one body, compiled twice: with alignment hints when every hinted pointer is 16-byte
            # aligned (vector loads, cp.async pipelining), plain otherwise; the kernel picks at run time
            s("@triton.jit",
              f"def {kname}_body({', '.join(ptrs + pids + [c + ': tl.constexpr' for c in consts + ['ALIGNED']])}):").indent()
            self.body(hints=True)
            s.dedent().blank()("")
        s("@triton.jit", f"def {kname}({', '.join(ptrs + [c + ': tl.constexpr' for c in consts])}):").indent()
        s("pid = tl.program_id(0)")
        if p.B > 1:
            s(f"pid_b = tl.program_id(1){'.to(tl.int64)' if self.wide else ''}")
        if hinted:
            bits = " | ".join(f"{x}.to(tl.int64)" for x in hinted)
            call = ", ".join(ptrs + pids + consts)
            s("# 16-byte vector loads/stores and cp.async need 16-byte aligned pointers: test them once",
              f"aligned = (({bits}) % 16) == 0",
              "if aligned:").indent()(f"{kname}_body({call}, True)").dedent()
            s("else:").indent()(f"{kname}_body({call}, False)").dedent()
        else:
            self.body(hints=False)
        s.dedent()
        grid = (self.mb * self.nb,) + ((p.B,) if p.B > 1 else ())
        args = tuple(("in", i) for i in inputs) + tuple(("out", o) for o in range(len(p.outputs)))
        args += (("i32", p.M),) if self.runtime_m else ()
        launch = Launch(kname, grid, args,
                        {"BLOCK_M": self.bm, "BLOCK_N": self.bn, "BLOCK_K": self.bk, "GROUP_M": int(self.c["GROUP_M"])},
                        num_warps=int(self.c["num_warps"]), num_stages=int(self.c["num_stages"]),
                        runtime_sizes=self.runtime_sizes(len(args)))
        return KernelProgram(s.text(), (launch,))

    def runtime_sizes(self, n_args: int) -> dict[str, Any]:
        """A bucketed launch's grid and M argument as functions of the bucket's variables."""
        v, p = self.varying, self.p
        if v is None:
            return {}
        members = len(self.group.members) if self.group else 1
        grid: list[Any] = [product([["cdiv", f"v{v.m}", self.bm], self.nb * members]) if self.runtime_m
                           else self.mb * self.nb]
        if p.B > 1:
            grid.append(f"v{v.batch}" if v.batch is not None else p.B)
        return {"grid": grid, **({"args": {str(n_args - 1): f"v{v.m}"}} if self.runtime_m else {})}

    def m_factor(self, tile: str, stride: int) -> int | None:
        """Where pointer tile ``tile``'s batch stride ``stride`` is a multiple of the run-time M
        (a contiguous [B, M, *] tensor of a bucketed bmm): that multiple."""
        return self.varying.m_scaled.get(tile) if self.runtime_m and stride else None

    def batch_stride(self, tile: str, stride: int) -> int | str:
        """The batch stride of pointer tile ``tile``: a literal, or an expression of the run-time M."""
        factor = self.m_factor(tile, stride)
        return stride if factor is None else "M" if factor == 1 else f"M * {factor}"

    def group_program(self) -> KernelProgram:
        """One launch for every member: program ``pid`` finds its member (a chain of comparisons
        with the members' first programs), takes that member's pointers and M under the template's
        names, and runs the GEMM body on its tile ``pid - start``. Bucketed, M is the kernel's
        argument (every member's) and the members' first programs are multiples of its tile count."""
        p, s, g = self.p, self.src, self.group
        s(cg.HEADER)
        ms = "M, a run-time size (one for every member)" if self.runtime_m else f"M = {[m.M for m in g.members]}"
        s(f"# matmul group: {len(g.members)} GEMMs of one structure, {ms}")
        self.header()
        for h in p.helpers:
            s.blank()(HELPERS[h].strip("\n"))
        s.blank()("")
        n_in, n_out = len(g.spec.inputs), len(g.spec.outputs)
        params = [f"g_in{i}_ptr" for i in range(n_in)] + [f"g_out{o}_ptr" for o in range(n_out)]
        params += ["M"] if self.runtime_m else []
        consts = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"]
        s("@triton.jit", f"def region_group_{p.op}_kernel({', '.join(params + [c + ': tl.constexpr' for c in consts])}):").indent()
        s(f"pid = tl.program_id(0){'.to(tl.int64)' if self.wide else ''}")
        local = sorted({p.a, p.b} | set(p.tile_inputs))
        if self.runtime_m:
            # every member has the run-time M rows: member j owns programs [j * tiles, (j + 1) * tiles)
            s(f"mb = (M + {self.bm - 1}) // BLOCK_M", f"tiles = mb * {self.nb}")
        # a fixed-size group's M is a run-time value too (``pid * 0 + m``: a tensor, which the
        # if-blocks may rebind; a literal would be a constexpr)
        for j, (member, ins, outs) in enumerate(zip(g.members, g.in_maps, g.out_maps)):
            # (``pid * 0 + ``: every branch binds ``start`` with pid's type, int64 where it is wide)
            start = f"pid * 0 + {j} * tiles" if self.runtime_m else str(self.starts[j])
            assign = [f"in{i}_ptr = g_in{ins[i]}_ptr" for i in local] + \
                     [f"out{o}_ptr = g_out{outs[o]}_ptr" for o in range(len(outs))] + \
                     ([] if self.runtime_m else [f"M = pid * 0 + {member.M}"]) + [f"start = {start}"]
            if j == 0:
                s(f"# member 0: programs [0, {'tiles' if self.runtime_m else self.starts[1]})", *assign)
            else:
                s(f"if pid >= {start}:  # member {j}").indent()(*assign).dedent()
        if not self.runtime_m:
            s(f"mb = (M + {self.bm - 1}) // BLOCK_M")
        s("pid = pid - start")
        self.body(hints=False)
        s.dedent()
        args = tuple(("in", i) for i in range(n_in)) + tuple(("out", o) for o in range(n_out))
        args += (("i32", p.M),) if self.runtime_m else ()
        launch = Launch(f"region_group_{p.op}_kernel", (self.starts[-1],), args,
                        {"BLOCK_M": self.bm, "BLOCK_N": self.bn, "BLOCK_K": self.bk, "GROUP_M": int(self.c["GROUP_M"])},
                        num_warps=int(self.c["num_warps"]), num_stages=int(self.c["num_stages"]),
                        runtime_sizes=self.runtime_sizes(len(args)))
        return KernelProgram(s.text(), (launch,))

    # alignment hints ---------------------------------------------------------------------------
    @staticmethod
    def _hint(sm: int, sn: int, sb: int, elt: int, batched: bool) -> list[int] | None:
        """tl.multiple_of values for a [rows, cols] pointer tile whose base is 16-byte aligned: the
        first element of every contiguous run is then 16-byte aligned too (strides in bytes % 16)."""
        if batched and (sb * elt) % 16:
            return None
        if sn == 1 and (sm * elt) % 16 == 0:
            return [1, 16]
        if sm == 1 and (sn * elt) % 16 == 0:
            return [16, 1]
        return None

    def hints(self) -> dict[str, list[int] | None]:
        """Hint per pointer tile: "a", "b", "in<i>" (epilogue inputs), "out<o>"."""
        p = self.p
        elt = lambda dt: 1 if dt == "bool" else torch.finfo(getattr(torch, dt)).bits // 8
        (asb, asm, ask), (bsb, bsk, bsn) = p.a_strides, p.b_strides
        e = elt(p.dtype)
        # a batch stride that is a multiple of a run-time M is a multiple of 16 bytes for every M
        # exactly when its factor is: the hints test that factor
        sb_ = lambda tile, sb: self.m_factor(tile, sb) or sb
        out = {"a": self._hint(asm, ask, sb_("a", asb), e, p.B > 1), "b": self._hint(bsk, bsn, bsb, e, p.B > 1)}
        for i, (sb, sm, sn) in p.tile_inputs.items():
            out[f"in{i}"] = None if (sm, sn) == (0, 0) else self._hint(sm, sn, sb_(f"in{i}", sb),
                                                                       elt(self.spec.inputs[i].dtype), p.B > 1)
        for o, m in enumerate(self.spec.outputs):
            sb, sm, sn = _pad3(m.stride)
            out[f"out{o}"] = self._hint(sm, sn, sb_(f"out{o}", sb), elt(m.dtype), p.B > 1)
        return out

    def hinted_pointers(self) -> list[str]:
        h = self.hints()
        names = {"a": f"in{self.p.a}_ptr", "b": f"in{self.p.b}_ptr"}
        ptrs = []
        for k, v in h.items():
            if v is not None:
                name = names.get(k, f"{k}_ptr")
                if name not in ptrs:
                    ptrs.append(name)
        return ptrs

    def pointer(self, var: str, expr: str, key: str) -> str:
        """Emit ``var = expr`` (a pointer tile), with its alignment hint in the ALIGNED body."""
        self.src(f"{var} = {expr}")
        hint = self.hint_of.get(key) if self.use_hints else None
        if hint is not None:
            self.src("if ALIGNED:").indent()(f"{var} = tl.multiple_of({var}, {hint})").dedent()
        return var

    def header(self) -> None:
        s, p, spec = self.src, self.p, self.spec
        if p.region:
            from torch_kernelize.core.region_graph import describe_region
            s(f"# {describe_region(spec)}")
            for n in json.loads(spec.graph)["nodes"]:
                s(f"#   {n['op']} args={json.dumps(n['args'])} kwargs={json.dumps(n['kwargs'])} -> {n['meta']['dtype']}")
            s(f"# outputs: nodes {p.outputs}")
            for i, m in enumerate(spec.inputs):
                s(f"# in{i}: {m.dtype} shape {list(m.shape)} stride {list(m.stride)}")
            for i, m in enumerate(spec.outputs):
                s(f"# out{i}: {m.dtype} shape {list(m.shape)} stride {list(m.stride)}")
        else:
            s(cg.describe_spec(spec))

    # the kernel body ---------------------------------------------------------------------------
    def body(self, hints: bool) -> None:
        p, s = self.p, self.src
        self.use_hints, self.hint_of = hints, self.hints()
        batch = f"batch {p.B} x " if p.op == "bmm" else ""
        # M is a run-time value in a group and in a bucketed kernel (whose upper edge is p.M: where
        # that fits one row block, every M of the bucket does)
        if self.group:
            M, mb = "M", "mb"
        elif self.runtime_m:
            M, mb = "M", 1 if self.mb == 1 else "mb"
        else:
            M, mb = p.M, self.mb
        (asb, asm, ask), (bsb, bsk, bsn) = p.a_strides, p.b_strides
        s(f"# C[{batch}M={M}, N={p.N}] = A[{M}, K={p.K}] @ B[{p.K}, {p.N}], fp32 accumulation; "
          f"{mb} x {self.nb} tiles")
        s(f"# strides (batch, row, col): A [{self.batch_stride('a', asb)}, {asm}, {ask}], B {list(p.b_strides)}")
        if self.runtime_m:
            s(f"# M is a run-time size (at most {p.M}, the bucket's upper edge): rows are masked by it")
            if mb != 1 and self.nb != 1 and not self.group:
                s(f"mb = (M + {self.bm - 1}) // BLOCK_M")
        if mb == 1:
            s("pid_m = 0", "pid_n = pid")
        elif self.nb == 1:
            s("pid_m = pid", "pid_n = 0")
        else:
            s("# grouped order: GROUP_M row blocks walk the column blocks together (A and B stay in L2)",
              f"width = GROUP_M * {self.nb}",
              "first_m = (pid // width) * GROUP_M",
              f"rows = tl.minimum({mb} - first_m, GROUP_M)",
              "pid_m = first_m + (pid % width) % rows",
              "pid_n = (pid % width) // rows")
        cast = ".to(tl.int64)" if self.wide else ""
        s(f"rm = {'' if mb == 1 else 'pid_m * BLOCK_M + '}tl.arange(0, BLOCK_M){cast}",
          f"rn = {'' if self.nb == 1 else 'pid_n * BLOCK_N + '}tl.arange(0, BLOCK_N){cast}",
          "rk = tl.arange(0, BLOCK_K)")
        ms = [m.M for m in self.group.members] if self.group else [p.M]
        self.m_masked, self.n_masked = self.runtime_m or any(m % self.bm for m in ms), p.N % self.bn != 0
        if self.m_masked:
            s(f"m_mask = rm < {M}")
        if self.n_masked:
            s(f"n_mask = rn < {p.N}")
        # operand rows/cols at the edges: contiguous dims are masked, others wrapped into range

        def edge(index: str, masked: bool, stride: int, mask: str, wrapped: str, n: int, what: tuple[str, str]):
            """An operand's indices along a masked edge: masked where contiguous, else wrapped."""
            if not masked:
                return index, None
            if stride == 1:
                return index, mask
            s(f"{wrapped} = {index} % {n}  # {what[0]} past {what[1]} re-read valid {what[0]}; they are never stored")
            return wrapped, None
        a_rows, a_mask = edge("rm", self.m_masked, asm, "m_mask[:, None]", "ram", M, ("rows", "M"))
        b_cols, b_mask = edge("rn", self.n_masked, bsn, "n_mask[None, :]", "rbn", p.N, ("columns", "N"))
        a_b = _term("pid_b", self.batch_stride("a", asb)) if p.B > 1 and asb else ""
        b_b = _term("pid_b", bsb) if p.B > 1 and bsb else ""
        # (a zero stride keeps its "* 0": the pointer tile must keep both dims for the dot)
        self.pointer("a_ptrs", f"in{p.a}_ptr + {_join([a_b, _term(f'{a_rows}[:, None]', asm), _term('rk[None, :]', ask)])}", "a")
        self.pointer("b_ptrs", f"in{p.b}_ptr + {_join([b_b, _term('rk[:, None]', bsk), _term(f'{b_cols}[None, :]', bsn)])}", "b")
        s("acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)")
        full, rem = divmod(p.K, self.bk)
        if full:
            s(f"for k in range(0, {full}):  # K = {p.K}: {full} full step(s) of BLOCK_K").indent()
            self.step(a_mask, b_mask)
            s(f"a_ptrs += BLOCK_K * {ask}", f"b_ptrs += BLOCK_K * {bsk}")
            s.dedent()
        if rem:
            s(f"# the last {rem} of K")
            s(f"k_mask = rk < {rem}")
            am = "k_mask[None, :]" if a_mask is None else f"{a_mask} & k_mask[None, :]"
            bmask = "k_mask[:, None]" if b_mask is None else f"k_mask[:, None] & {b_mask}"
            self.step(am, bmask)
        self.epilogue()

    def step(self, a_mask: str | None, b_mask: str | None) -> None:
        s, p = self.src, self.p
        s(f"a = tl.load(a_ptrs{f', mask={a_mask}, other=0.0' if a_mask else ''})",
          f"b = tl.load(b_ptrs{f', mask={b_mask}, other=0.0' if b_mask else ''})")
        if p.dtype == "float32":
            s('acc = tl.dot(a, b, acc, input_precision="ieee")')
        elif self.c["DOT_UPCAST"]:
            s('acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")')
        else:
            s("acc = tl.dot(a, b, acc)")

    # epilogue ----------------------------------------------------------------------------------
    def tile_offset(self, strides: tuple[int, int, int], tile: str) -> tuple[str, str | None]:
        """Offset expression of a (batch, m, n)-strided tensor over the tile, and its mask."""
        sb, sm, sn = strides
        terms, masks = [], []
        if self.p.B > 1 and sb:
            terms.append(_term("pid_b", self.batch_stride(tile, sb)))
        if sm:
            terms.append(_term("rm[:, None]", sm))
            if self.m_masked:
                masks.append("m_mask[:, None]")
        if sn:
            terms.append(_term("rn[None, :]", sn))
            if self.n_masked:
                masks.append("n_mask[None, :]")
        return _join(terms), " & ".join(masks) or None

    def epilogue(self) -> None:
        s, p = self.src, self.p
        nodes = {n.index: n for n in p.nodes}
        users: dict[int, int] = {}
        for n in p.nodes:
            for kind, v in n.operands:
                if kind == "node":
                    users[v] = users.get(v, 0) + 1
        self.loaded: dict[int, str] = {}
        s("# epilogue on the fp32 accumulator tile")
        # node 0
        v0 = "acc"
        if p.op == "addmm":
            alpha = "" if p.alpha == 1 else f" * {cg.float_literal(p.alpha)}"
            if p.bias is not None:
                bias = self.load_input(p.bias)
                beta = "" if p.beta == 1 else f" * {cg.float_literal(p.beta)}"
                s(f"acc = acc{alpha} + {bias}{beta}  # addmm: beta * self + alpha * (mat1 @ mat2)")
            elif alpha:
                s(f"acc = acc{alpha}  # addmm with beta == 0: self is ignored")
        if nodes and p.dtype in cg.HALF:
            # The graph's matmul node produces fp16/bf16: its epilogue reads rounded values, as eager
            # and a vendor GEMM followed by separate kernels do. (Keeping the fp32 accumulator would be
            # closer to the float64 reference, but can flip discrete decisions downstream, e.g. an
            # MoE router's top-k on near-tied logits.)
            s(f"acc = acc.to({cg.HALF[p.dtype]}).to(tl.float32)  # the matmul's {p.dtype} output")
        self.values = {0: v0}
        for j in sorted(nodes):
            self.emit_node(nodes[j], users)
        s("# outputs")
        for o, j in enumerate(p.outputs):
            m = self.spec.outputs[o]
            off, mask = self.tile_offset(_pad3(m.stride), f"out{o}")
            value = self.values[j]
            if m.dtype in cg.HALF:
                value = f"{value}.to({cg.HALF[m.dtype]})"
            ptr = self.pointer(f"o{o}_ptrs", f"out{o}_ptr + {off}", f"out{o}")
            s(f"tl.store({ptr}, {value}{f', mask={mask}' if mask else ''})")

    def load_input(self, i: int) -> str:
        if i in self.loaded:
            return self.loaded[i]
        m = self.spec.inputs[i]
        off, mask = self.tile_offset(self.p.tile_inputs[i], f"in{i}")
        var = f"x{i}"
        kw = f", mask={mask}, other={'0' if m.dtype == 'bool' else '0.0'}" if mask else ""
        conv = ".to(tl.float32)" if m.dtype in cg.HALF else ""
        s = self.src
        ptr = f"in{i}_ptr + {off}"
        if self.use_hints and self.hint_of.get(f"in{i}") is not None:
            ptr = self.pointer(f"x{i}_ptrs", ptr, f"in{i}")
        s(f"{var} = tl.load({ptr}{kw}){conv}  # in{i} {m.dtype} {list(m.shape)}")
        self.loaded[i] = var
        return var

    def operand(self, kind: str, v: Any, want: str) -> str:
        """An operand as an expression: want "f32" (arithmetic) or "raw" (bool stays bool)."""
        if kind == "scalar":
            if want == "raw" and isinstance(v, bool):
                return str(int(v))
            return cg.float_literal(float(v))
        if kind == "node":
            expr, dt = self.values[v], (self.p.dtype if v == 0 else next(n.dtype for n in self.p.nodes if n.index == v))
        else:
            expr, dt = self.load_input(v), self.spec.inputs[v].dtype
        if dt == "bool" and want == "f32":
            return f"{expr}.to(tl.float32)"
        return expr

    def emit_node(self, n: _Node, users: dict[int, int]) -> None:
        s = self.src
        kind = n.pw.kind
        if kind in ("float", "arith", "copy"):
            ops = [self.operand(k, v, "f32") for k, v in n.operands]
            expr = n.pw.body(ops, n.args, "float32")
        elif kind == "compare":
            ops = []
            for k, v in n.operands:
                if k == "scalar" and n.compare_dtype in cg.HALF:
                    # a number compared with a half tensor is converted to the tensor's type first
                    v = float(torch.tensor(float(v), dtype=getattr(torch, n.compare_dtype)))
                ops.append(self.operand(k, v, "f32"))
            expr = n.pw.body(ops, n.args, "float32")
        elif kind == "logical":
            expr = n.pw.body([self.operand(k, v, "raw") for k, v in n.operands], n.args, "bool")
        else:  # select
            cond = self.operand(*n.operands[0], "raw")
            expr = n.pw.body([cond] + [self.operand(k, v, "f32") for k, v in n.operands[1:]], n.args, "float32")
        var = f"v{n.index}"
        s(f"{var} = {expr}  # {n.op} -> {n.dtype}")
        self.values[n.index] = var
        if kind == "copy" and n.dtype in cg.HALF and users.get(n.index):
            s(f"{var} = {var}.to({cg.HALF[n.dtype]}).to(tl.float32)  # the cast rounds: later nodes read {n.dtype} values")


FAMILY = MatmulFamily()
