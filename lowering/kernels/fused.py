"""Fused regions (torch_kernelize/compiling/regions.py) of kind "pointwise" and "rowwise": one kernel computes the
whole region. A "graph" region (torch_kernelize/compiling/graph_regions.py) that is one loop is generated as one of
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

Modules: this one is the family (what it claims, configs, shape buckets, ``generate_plan``);
fused_plan.py holds the plan's data model, fused_analysis.py the analysis of a region
(``analyse``), fused_emit.py the shared and the pointwise emitter, fused_emit_rowwise.py the
rowwise emitter.
"""
from __future__ import annotations

import copy
import json
import math
from typing import Any, Sequence

from torch_kernelize.lowering.kernels.base import Config, KernelFamily, doubled_and_halved, next_pow2, unique
from torch_kernelize.lowering.kernels.fused_analysis import EXPAND_OP, GRAPH_KIND, KINDS, _inline_layer_norms, analyse
from torch_kernelize.lowering.kernels.fused_emit import _PointwiseEmitter
from torch_kernelize.lowering.kernels.fused_emit_rowwise import _RowwiseEmitter
from torch_kernelize.lowering.kernels.fused_plan import _Plan
from torch_kernelize.core.buckets import product, unbucketable
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.spec import KernelSpec, TensorMeta

MAX_TILE = 16384        # elements of one [BLOCK_M, BLOCK_N] tile (a row of up to 16K stays in registers)
MAX_PASSES = 4          # looped variant: passes over the row


# --- generation --------------------------------------------------------------------------------

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
    if bm * bn > MAX_TILE:
        return False
    # a tile of fewer than 32 * num_warps elements only where one warp's tile holds the whole
    # region (tiny shapes: [3x4], [1x5]), as the sort family's
    if bm * bn < 32 * w and not (w == 1 and bm >= plan.M and bn >= plan.N):
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
