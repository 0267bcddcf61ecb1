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

Modules: matmul_plan.py analyses a GEMM spec into a Plan (operands, sizes, the epilogue);
matmul_group.py, a matmul group into a Group; matmul_configs.py holds the configuration space;
matmul_buckets.py, what a bucketed kernel takes at run time; matmul_source.py emits the Triton
source. This module is the family that joins them.
"""
from __future__ import annotations

from torch_kernelize.core.buckets import Dim
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.lowering.kernels import matmul_configs
from torch_kernelize.lowering.kernels.base import Config, KernelFamily
from torch_kernelize.lowering.kernels.matmul_buckets import varying_of
from torch_kernelize.lowering.kernels.matmul_group import Group, group_plan
from torch_kernelize.lowering.kernels.matmul_plan import MM_OPS, Plan, gemm_plan, spec_graph
from torch_kernelize.lowering.kernels.matmul_source import Gen


class MatmulFamily(KernelFamily):
    name = "matmul"
    sums_products = True  # (validate judges an edge trial's cancelling elements by their terms)
    ops = frozenset(MM_OPS) | {"region"}
    edge_kinds = ("zeros", "large", "negative", "special")

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> Plan | Group | str:
        graph = spec_graph(spec, self.name)
        if isinstance(graph, str):
            return graph
        if graph["kind"] == "matmul_group":
            return group_plan(spec, graph, self.plan)
        return gemm_plan(spec, graph["nodes"], graph["outputs"])

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: Plan | Group, c: Config) -> bool:
        return matmul_configs.valid(plan, c)

    def _seeds(self, spec: KernelSpec, plan: Plan | Group) -> list[Config]:
        return matmul_configs.seeds(plan)

    def _steps(self, plan: Plan | Group, c: Config) -> list[Config]:
        return matmul_configs.steps(plan, c)

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        if isinstance(plan, Group):
            return Gen(plan.member_specs[plan.template], plan.rep, config, plan).program()
        return Gen(spec, plan, config).program()

    # --- shape buckets ------------------------------------------------------------------------
    def bucket_support(self, spec: KernelSpec, dims: tuple[Dim, ...]) -> str | None:
        """M varies (the rows of A and C: tokens), and for bmm the batch; K and N are the weights'
        sizes and stay literal. Every tensor of M rows (or of the batch) must vary with it."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return plan
        varying = varying_of(spec, plan, dims)
        return varying if isinstance(varying, str) else None

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims: tuple[Dim, ...]) -> KernelProgram:
        """The kernel of ``generate`` with M a run-time argument (rows masked by it, the GROUP_M
        swizzle and the grid computed from it) and bmm's batch the grid's second axis: one binary
        serves every size of the bucket. ``spec`` is the representative, the bucket's upper edge:
        the int64 decision is taken there, where offsets reach furthest."""
        plan = self.checked_plan(spec, config)
        varying = varying_of(spec, plan, dims)
        if isinstance(varying, str):
            raise ValueError(f"{spec.describe()} cannot be bucketed: {varying}")
        if isinstance(plan, Group):
            return Gen(plan.member_specs[plan.template], plan.rep, config, plan, varying=varying).program()
        return Gen(spec, plan, config, varying=varying).program()


FAMILY = MatmulFamily()
