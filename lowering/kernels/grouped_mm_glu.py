"""Gated experts: the grouped_mm_glu region (compiling/glu_regions.py) as one grouped GEMM kernel.

The region: node 0 transformers' grouped matmul of ``input`` [S, K] (inputs 0-2: input, weight
[E, K, 2I], offs) into the product [S, 2I]; pointwise nodes on the whole product (an MoE's
``where(mask, 0, .)`` on the rows of no expert); two slices of its last dim into halves, gate and
up [S, I] (the split, as compiling/glu_regions.halve_products writes it); pointwise nodes that join them into the one output (SiLU(gate) * up, GELU, ...).

The kernel is grouped_mm.py's (expert lookup, tile order, TMA or pointer loads, the rows of no
expert) with two accumulators: an output tile's columns c of the gate half and I + c of the up
half, over the same input rows (each weight byte is read once, as by the plain GEMM). After the K
loop the epilogue runs on them in registers, as matmul.py's does: the product is rounded to its
dtype first (the GEMM's stored values, which eager's pointwise kernels read), the nodes before
the split run on each half (their inputs read at its columns), the nodes after it on the
halves, every intermediate in fp32 but where an explicit cast rounds; only the [S, I] output is
stored. The rows of no expert are the epilogue of zero products (zero for SiLU * up, not for
every epilogue). Against the plain grouped GEMM and a pointwise kernel after it, this saves the
[S, 2I] product's store and its reading back: 2 x 184 MB per layer of Mixtral's suite layers.

Shape buckets: S varies, as for grouped_mm, in the input, the output, every node's value and any
other input whose dim 0 is S; the rest stays literal.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from torch_kernelize.core.buckets import unbucketable
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.region_graph import node_ref
from torch_kernelize.core.spec import KernelSpec, TensorMeta
from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.elementwise import EPILOGUE_HELPERS
from torch_kernelize.lowering.kernels.grouped_mm import ATEN_OP, OP, GroupedMatmulFamily, Plan, _cap
from torch_kernelize.lowering.kernels.matmul_plan import Node, epilogue_node, pad3
from torch_kernelize.lowering.kernels.matmul_source import node_lines

KIND = "grouped_mm_glu"
SLICE = "aten.slice.Tensor"
# two accumulators a tile. The first TMA seed's 128x128 pair holds as much as grouped_mm's 128x256
# tile, but with the epilogue it spills: compiled for sm_90 at Mixtral's suite size (S 8192, K 2048,
# I 5632, fp16; ptxas through cuobjdump -res-usage) it took 255 registers and 376 bytes of stack a
# thread, where grouped_mm's tile takes 222 and none; on the H100 the 8 GEMMs with it took 4.37 ms
# against 3.96 + 0.35 for the plain GEMMs and Inductor's SiLU (real-models-12). A mask of rows
# loaded once and one value a row (_operands) and the epilogue's approximate sigmoid
# (elementwise.EPILOGUE_HELPERS) leave 88 bytes. The second, a 128x64 pair, spills nothing (nor
# do the pointer seeds: test_kernels_grouped_mm_glu.py checks them all); a fill at --budget 2
# times both, and a region that still loses is set aside in its graph (fill_cache/region_judgment.py)
GLU_SEEDS = ((128, 64, 32, 8, 3), (64, 64, 32, 4, 3), (32, 32, 32, 4, 2))
GLU_TMA_SEEDS = ((128, 128, 64, 8, 3), (128, 64, 64, 8, 3))


@dataclass(frozen=True)
class Epilogue:
    """The region's nodes after the GEMM, resolved (grouped_mm.Epilogue: the text they make)."""
    width: int                                  # I: the output's columns, half the product's
    dtype: str                                  # the product's
    pre: tuple[Node, ...]                       # on the whole product, before the split (each half)
    halves: tuple[int, int]                     # the node indices of gate and up
    post: tuple[Node, ...]                      # on the halves
    out: int                                    # the output's node
    loads: tuple[tuple[int, str, tuple[int, int]], ...]   # (input, dtype, (row, column) strides)
    helper_names: tuple[str, ...]

    @property
    def params(self) -> str:
        return "".join(f"in{i}_ptr, " for i, _, _ in self.loads)

    @property
    def helpers(self) -> str:
        return "".join("\n" + EPILOGUE_HELPERS[h].strip("\n") + "\n" for h in self.helper_names)

    def lines(self, rows: str, S: str) -> str:
        out = []
        if self.dtype in cg.HALF:
            out += [f"acc = acc.to({cg.HALF[self.dtype]}).to(tl.float32)  # the product's {self.dtype} values",
                    f"acc2 = acc2.to({cg.HALF[self.dtype]}).to(tl.float32)"]
        users = _users(self.pre + self.post)
        loads = {i: (dt, st) for i, dt, st in self.loads}
        halves, loaded = [], {}  # (an input of one value a row is loaded once, for both halves)
        for h, (acc, offset) in enumerate((("acc", 0), ("acc2", self.width))):
            values = {0: acc}
            operand = _operands(values, self, loads, rows, S, offset, f"_{h}", out, loaded)
            for n in self.pre:
                out += node_lines(n, f"v{n.index}_{h}", operand, users)
                values[n.index] = f"v{n.index}_{h}"
            halves.append(values[max(values)])
        values = dict(zip(self.halves, halves))
        operand = _operands(values, self, loads, rows, S, 0, "", out, loaded)
        for n in self.post:
            out += node_lines(n, f"v{n.index}", operand, users)
            values[n.index] = f"v{n.index}"
        out.append(f"value = {values[self.out]}")
        return "\n".join(out) + "\n"

    def dtype_of(self, j: int) -> str:
        return self.dtype if j == 0 or j in self.halves else next(n.dtype for n in self.pre + self.post if n.index == j)


def _users(nodes: tuple[Node, ...]) -> dict[int, int]:
    users: dict[int, int] = {}
    for n in nodes:
        for kind, v in n.operands:
            if kind == "node":
                users[v] = users.get(v, 0) + 1
    return users


def _operands(values: dict[int, str], epi: Epilogue, loads: dict[int, tuple[str, tuple[int, int]]], rows: str,
              S: str, offset: int, suffix: str, out: list[str], shared: dict[int, str]):
    """``node_lines``' operand function: node values, inputs loaded once per half at its columns
    (their load lines appended to ``out``), numbers. An input the same in every column (an MoE's
    mask of rows, [S, 1]; a 0-d value) is loaded once for both halves (``shared``) and only as
    wide as it is: a [BLOCK_M, BLOCK_N] tile of it for each half took the registers that made the
    kernel spill."""
    loaded: dict[int, str] = {}

    def operand(kind: str, v: Any, want: str) -> str:
        if kind == "scalar":
            return str(int(v)) if want == "raw" and isinstance(v, bool) else cg.float_literal(float(v))
        if kind == "node":
            expr, dt = values[v], epi.dtype_of(v)
        else:
            dt, (sm, sn) = loads[v]
            held = loaded if sn else shared
            if v not in held:
                col = f"(cols + {offset})" if offset and sn else "cols"
                at = " + ".join(t for t in (f"{rows}[:, None] * {sm}" if sm else "",
                                            f"{col}[None, :] * {sn}" if sn else "") if t)
                mask = " & ".join(t for t in (f"({rows} < {S})[:, None]" if sm else "",
                                              "col_ok[None, :]" if sn else "") if t)
                other = "0" if dt == "bool" else "0.0"
                load = f"tl.load(in{v}_ptr + {at}, mask={mask}, other={other})" if at else f"tl.load(in{v}_ptr)"
                name = f"x{v}{suffix if sn else ''}"
                out.append(f"{name} = {load}{'.to(tl.float32)' if dt in cg.HALF else ''}  # in{v} {dt}")
                held[v] = name
            expr = held[v]
        return f"{expr}.to(tl.float32)" if dt == "bool" and want == "f32" else expr
    return operand


@dataclass(frozen=True)
class GluPlan:
    gemm: Plan           # the grouped GEMM (N the weight's 2I, c the output's strides)
    epi: Epilogue


def _gemm_spec(spec: KernelSpec, node0: dict[str, Any]) -> KernelSpec | str:
    """The region's GEMM as a spec of transformers' op (what the family's analysis reads: the
    same product where aten._grouped_mm is called with ``offs=`` and nothing else)."""
    operands = node0["args"] + [node0["kwargs"][k] for k in ("offs",) if k in node0["kwargs"]]
    if node0["op"] not in (OP, ATEN_OP) or set(node0["kwargs"]) - {"offs"} or len(operands) != 3 \
            or [node_ref(a) for a in operands] != [("input", i) for i in range(3)]:
        return f"node 0 is not {OP} (or {ATEN_OP} with offs) of inputs 0, 1 and 2"
    return KernelSpec(OP, [{"tensor": i} for i in range(3)], {}, tuple(spec.inputs[:3]),
                      (TensorMeta.from_json(node0["meta"]),), False)


def analyse(spec: KernelSpec, gemm_plan) -> GluPlan | str:
    """The plan of a grouped_mm_glu region spec, or why it is not generated. ``gemm_plan``: the
    grouped_mm family's analysis of a GEMM spec."""
    graph = json.loads(spec.graph)
    nodes, outputs = graph["nodes"], graph["outputs"]
    gemm = _gemm_spec(spec, nodes[0])
    if isinstance(gemm, str):
        return gemm
    plan = gemm_plan(gemm)
    if isinstance(plan, str):
        return plan
    cut = next((j for j, n in enumerate(nodes) if n["op"] == SLICE), None)
    if cut is None or len(outputs) != 1 or len(spec.outputs) != 1:
        return "no halves of the product, or not one output"
    width, out = plan.N // 2, spec.outputs[0]
    if plan.N % 2 or tuple(out.shape) != (plan.S, width) or out.dtype != plan.dtype:
        return f"the output {out.short()} is not one half of the {plan.dtype} product [{plan.S}, {plan.N}]"
    halves = _halves(nodes, cut, width)
    if isinstance(halves, str):
        return halves
    tile_inputs: dict[int, tuple[int, int, int]] = {}
    pre = _resolve(spec, nodes, range(1, cut), (plan.S, plan.N), {0: plan.dtype}, tile_inputs)
    if isinstance(pre, str):
        return pre
    held = {h: plan.dtype for h in halves}
    post = _resolve(spec, nodes, range(cut + 2, len(nodes)), (plan.S, width), held, tile_inputs)
    if isinstance(post, str):
        return post
    loads = tuple((i, spec.inputs[i].dtype, st[1:]) for i, st in sorted(tile_inputs.items()))
    helpers = tuple(dict.fromkeys(h for n in pre + post for h in n.pw.helpers))
    epi = Epilogue(width, plan.dtype, tuple(pre), halves, tuple(post), outputs[0], loads, helpers)
    return GluPlan(dataclasses.replace(plan, c=tuple(out.stride)), epi)


def _halves(nodes: list[dict[str, Any]], first: int, width: int) -> tuple[int, int] | str:
    """The node indices of gate and up: two slices of the product's last value (node ``first``
    less one) into [0, width) and [width, 2 width) of its last dim (glu_regions.halve_products)."""
    cuts = nodes[first:first + 2]
    last = {"node": first - 1}
    if [n["op"] for n in cuts] != [SLICE, SLICE] or \
            [n["args"] for n in cuts] not in ([[last, d, 0, width], [last, d, width, 2 * width]] for d in (-1, 1)):
        return "the product is not cut into two halves of its last dim after its last node"
    return first, first + 1


def _resolve(spec: KernelSpec, nodes: list[dict[str, Any]], js: range, shape: tuple[int, int], held: dict[int, str],
             tile_inputs: dict[int, tuple[int, int, int]]) -> list[Node] | str:
    out = []
    for j in js:
        for r in filter(None, map(node_ref, nodes[j]["args"] + list(nodes[j]["kwargs"].values()))):
            if r[0] == "node" and r[1] not in held:
                return f"node {j} reads node {r[1]}, not a value before it on its side of the cut"
        node = epilogue_node(j, nodes[j], spec, shape, held, tile_inputs)
        if isinstance(node, str):
            return f"node {j} ({nodes[j]['op']}): {node}"
        held[j] = node.dtype
        out.append(node)
    if any(i < 3 for i in tile_inputs):
        return "the epilogue reads an input of the GEMM"
    return out


class GroupedMatmulGluFamily(GroupedMatmulFamily):
    name = "grouped_mm_glu"
    ops = frozenset({"region"})
    seeds, tma_seeds = GLU_SEEDS, GLU_TMA_SEEDS

    def _analyse(self, spec: KernelSpec) -> GluPlan | str:
        if spec.graph is None or json.loads(spec.graph).get("kind") != KIND:
            return f"{self.name} takes {KIND} regions"
        return analyse(spec, super()._analyse)

    def _valid(self, plan: GluPlan, c: Config) -> bool:
        return super()._valid(plan.gemm, c) and c["BLOCK_N"] <= _cap(plan.epi.width)

    def _seeds(self, spec: KernelSpec, plan: GluPlan) -> list[Config]:
        cap = _cap(plan.epi.width)   # (grouped_mm's caps BLOCK_N at the product's columns)
        return [c.replace(BLOCK_N=min(c["BLOCK_N"], cap)) for c in super()._seeds(spec, plan.gemm)]

    def _steps(self, plan: GluPlan, c: Config) -> list[Config]:
        return super()._steps(plan.gemm, c)

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        return self._program(spec, plan.gemm, config, epi=plan.epi)

    def bucket_support(self, spec: KernelSpec, dims) -> str | None:
        """S varies: dim 0 of the input, the output, every node's value and any other input of S rows."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return plan
        rows = {("in", 0), ("out", 0)} | {("in", i) for i, _, (sm, _) in plan.epi.loads
                                          if spec.inputs[i].shape and spec.inputs[i].shape[0] == plan.gemm.S}
        for side, i, d, _ in dims:
            if d != 0 or (side != "node" and (side, i) not in rows):
                return (f"{side}put {i} dim {d} varies: the kernel takes S, the routed rows, at run time; "
                        f"the weights' sizes stay literal")
        if {("in", 0), ("out", 0)} - {(s, i) for s, i, *_ in dims} or len({v for *_, v in dims}) > 1:
            return "S must vary as one variable in the input's and the output's dim 0"
        return unbucketable(spec, dims)

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims) -> KernelProgram:
        if problem := self.bucket_support(spec, dims):
            raise ValueError(f"{spec.describe()} cannot be bucketed: {problem}")
        plan = self.checked_plan(spec, config)
        return self._program(spec, plan.gemm, config, f"v{dims[0][3]}", plan.epi)


FAMILY = GroupedMatmulGluFamily()
