"""transformers' grouped matmul of a Mixture-of-Experts layer (``transformers::grouped_mm_fallback``).

The op: ``input`` [S, K] holds the routed tokens sorted by expert, ``weight`` [E, K, N] the
experts' projections, ``offs`` [E] the end of each expert's rows (``offs[e-1]`` its start, 0 for
the first); rows past ``offs[-1]`` belong to no expert and stay zero. transformers runs it (for
weights that are not bfloat16 under torch.compile: Mixtral in float16) as a loop of ``torch.mm``
over ``offs.tolist()``: two host syncs per layer, so the call waits for the GPU there and a
CUDA-graph capture is cut there (serving/graph_split.py). This kernel reads ``offs`` on the
device: one launch, no sync.

Grid: one axis of (cdiv(S, BLOCK_M) + E) x cdiv(N, BLOCK_N) programs: row-tile slots (the most
row tiles E groups of S rows can need) by column tiles, slots taken GROUP_M at a time so that the
programs running together share a few experts' input rows and weight columns in L2 (Triton's
matmul tutorial orders its tiles the same way). A slot finds its tile from ``offs`` in registers
(E is a literal, padded to a power of two): each expert's row count (its end less the end before
it, at least 0, both clamped to S, as slicing clamps), its tiles cdiv(rows, BLOCK_M), their
running sum; its expert is the number of running sums <= the slot, its tile the slot less the
tiles before that expert. A tile is an ordinary GEMM tile: input rows [start + t * BLOCK_M, ...)
masked at the expert's end, times weight[e] through its strides (transformers passes a transposed
view), K in BLOCK_K steps with fp32 accumulation (fp32 operands: input_precision "ieee", as ATen's
fp32 mm), stored in the output's dtype. DOT_UPCAST converts 16-bit tiles to fp32 before the dot
(Triton's CPU interpreter computes bf16 dots wrongly; matmul.py has the same variant).

Rows of no expert, [last end, S), are zeroed by the slots past the last tile, not by zero-filling
the whole output first (the op's ``torch.zeros``: a write of every output byte, 184 MB per call of
Mixtral's gate/up in the suite, that the tiles then overwrite). There are always enough: with ends
non-decreasing in [0, S] (the op's contract: a cumulative count; the input domain draws them so)
every row below the last end is some expert's, and sum_e cdiv(rows_e, BM) + cdiv(S - last, BM)
<= cdiv(S, BM) + E (E + 1 pieces of S rows, each rounded up by less than one tile; where BM
divides S and some piece is not a whole number of tiles, the pieces' whole tiles are one fewer).
The spare slots still stride over the tail, so a shortfall would cost time, not rows.

The TMA variant (config ``TMA``, where the input's rows and the weight's rows along K or N are
contiguous with 16-byte strides): PROGRAMS programs (the GPU's SM count) take the tiles in turn,
persistently, and load them through tensor descriptors (Hopper's TMA): the input as [S, K], the
weight as [E, N, K] (transformers' transposed view) or [E, K, N], one expert per block, so that a
tile reads zeros past K and N (the descriptor's bounds). A tile that reads past its expert's rows
reads the next expert's, and stores only its own: rows below its expert's end. Then they zero the
rows of no expert, the same way in turn. On the H100 (2026-12-06, Mixtral's suite layers, graphed),
a scratch version of it (2-D descriptors, launched by Triton's JIT) ran gate/up in 0.668 ms and
down in 0.363, against the pointer kernel's 0.729 / 0.402 and the op's cuBLAS loop's 0.684 /
0.345. Tensor descriptors need 16-byte aligned bases: no binary for unaligned views is built
(``KernelProgram.aligned_only``), and Triton's launcher takes a per-program scratch for them
(serving/triton_binaries.py gives it one).

``aten._grouped_mm(self, mat2, offs)`` (what transformers calls instead for bfloat16 weights,
and torch's own MoE code) is the same product in its 2-D by 3-D form with offsets: the same
kernels serve it, where it has no bias and its output's dtype is the input's (its other forms,
3-D by 3-D or 2-D by 2-D, are refused by the shapes). It leaves the rows of no expert unwritten
(cuBLAS), so the zeros the kernels write there are one of its answers; its float64 reference
(core/float64_references.py: the op takes no float64) writes zeros there too.

Shape buckets (core/buckets.py): S (the routed tokens, dim 0 of a contiguous input and output)
may vary; the kernel then takes it as the argument ``S`` and computes the slot count from it, the
grid is a SizeExpr of it. K, N and E (the weights' and offs' sizes) stay literal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch_kernelize.core.buckets import unbucketable
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import Config, KernelFamily

OP = "transformers.grouped_mm_fallback.default"
ATEN_OP = "aten._grouped_mm.default"  # what transformers calls for bfloat16 experts (module docstring)
MAX_EXPERTS = 1024  # the experts' ends are held in registers, one vector per program
FLOATS = ("float16", "bfloat16", "float32")
# BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: the first is the quick fill's (budget 1), a tile for
# the thousands of rows an MoE layer routes. On the H200 (2026-12-05, Mixtral's suite layers: 8192
# rows, K 2048 / N 11264 and K 5632 / N 2048), 128x256x64 took 0.80 / 0.40 ms against 0.86 / 0.45
# for 128x128x64, and the op's loop of cuBLAS calls 0.69 / 0.34: the fill keeps the loop there
# (those kernels zero-filled the output first and ordered their tiles by row within a column)
GROUP_M = 8  # slots per group of the tile order (the fill's steps try 4 and 16)
SEEDS = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 32, 4, 3), (32, 64, 32, 4, 2))
# the TMA variant's seed, first where it applies (module docstring), so the quick fill (budget 1)
# takes it: on the H100 (2026-12-06, benchmarks/results/2026-12-06-h100-grouped-mm-tiles-2.json, the
# stored kernel through write_program/load_program) 0.665 / 0.337 ms against the pointer kernel's
# 0.738 / 0.374 and the op's cuBLAS loop 0.688 / 0.344 (gate/up, down; the seed graphed, queued behind
# other work: 0.530 / 0.230). Its loop flattened, its K loop warp-specialized and five other TMA tiles
# were no faster on the H100 (2026-12-07, benchmarks/results/2026-12-07-h100-grouped-mm-loop-options.log)
TMA_SEED = (128, 256, 64, 8, 3)
TMA_MAX_BOX = 256  # a tensor descriptor's block: at most 256 elements along each dimension
PROGRAMS_WITHOUT_GPU = 4  # the persistent grid where no GPU tells its SM count (the interpreter)


# the role of each (side, tensor, dim) of the op: a bucket varies S only
ROLES = {("in", 0, 0): "S", ("in", 0, 1): "K", ("in", 1, 0): "E", ("in", 1, 1): "K", ("in", 1, 2): "N",
         ("in", 2, 0): "E", ("out", 0, 0): "S", ("out", 0, 1): "N"}


@dataclass(frozen=True)
class Plan:
    S: int
    K: int
    N: int
    E: int
    dtype: str
    a: tuple[int, int]          # input strides (row, k)
    w: tuple[int, int, int]     # weight strides (expert, k, n)
    c: tuple[int, int]          # output strides (row, n)
    tma: str | None = None      # the weight as TMA reads it: "nk" ([E, N, K]), "kn" ([E, K, N]), None: not at all


class Epilogue(Protocol):
    """What a kernel of the grouped_mm_glu family (grouped_mm_glu.py) does instead of storing the
    product: the weight's columns are two halves of ``width`` (gate [0, width), up [width, 2 width)),
    a tile computes both (``acc``, ``acc2``: fp32 [BLOCK_M, BLOCK_N] over the same output columns)
    and ``lines`` make the stored ``value`` from them."""
    width: int      # the output's columns (the plan's N is the weight's: 2 * width)
    params: str     # the pointers of the region's other inputs, e.g. "in3_ptr, in4_ptr, "
    helpers: str    # the module-level functions its lines call (elementwise.EPILOGUE_HELPERS)

    def lines(self, rows: str, S: str) -> str:
        """The lines from ``acc``, ``acc2`` to ``value`` for the rows ``rows`` (int64 [BLOCK_M],
        those >= ``S`` out of range) and the columns ``cols`` (``col_ok``)."""


def _tma_layout(a: tuple, w: tuple, itemsize: int) -> str | None:
    """How a tensor descriptor reads the weight, where both operands have a contiguous last
    dimension and 16-byte strides otherwise (TMA's rule); else None."""
    if a[1] != 1 or (a[0] * itemsize) % 16 or (w[0] * itemsize) % 16:
        return None
    if w[1] == 1 and (w[2] * itemsize) % 16 == 0:
        return "nk"
    if w[2] == 1 and (w[1] * itemsize) % 16 == 0:
        return "kn"
    return None


def _sm_count() -> int:
    """The persistent grid: one program per SM of the current GPU."""
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return PROGRAMS_WITHOUT_GPU


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cap(n: int) -> int:
    """The largest block worth trying along a dim of ``n`` (tl.dot takes 16 at least)."""
    return max(16, _p2(n))


class GroupedMatmulFamily(KernelFamily):
    name = "grouped_mm"
    sums_products = True  # (validate judges an edge trial's cancelling elements by their terms)
    ops = frozenset({OP, ATEN_OP})
    edge_kinds = ("zeros", "large", "negative", "special")
    seeds, tma_seeds = SEEDS, (TMA_SEED,)

    def _analyse(self, spec: KernelSpec) -> Plan | str:
        if len(spec.inputs) != 3 or len(spec.outputs) != 1:
            return "grouped_mm takes (input, weight, offs) and gives one output (no bias)"
        a, w, offs = spec.inputs
        out = spec.outputs[0]
        if len(a.shape) != 2 or len(w.shape) != 3 or len(offs.shape) != 1:
            return f"grouped_mm wants input [S, K], weight [E, K, N], offs [E]; got {a.shape}, {w.shape}, {offs.shape}"
        if a.dtype not in FLOATS or w.dtype != a.dtype or out.dtype != a.dtype:
            return f"grouped_mm of {a.dtype} x {w.dtype} -> {out.dtype} (one float dtype throughout)"
        if offs.dtype not in ("int32", "int64"):
            return f"offs of {offs.dtype}: an integer tensor expected"
        (S, K), (E, K2, N) = a.shape, w.shape
        if K2 != K or offs.shape[0] != E or tuple(out.shape) != (S, N):
            return f"grouped_mm sizes do not match: {a.shape} x {w.shape} by {offs.shape} -> {out.shape}"
        if not 0 < E <= MAX_EXPERTS:
            return f"{E} experts (1 to {MAX_EXPERTS} are held in registers)"
        if min(S, K, N) == 0:
            return "an empty grouped_mm"
        itemsize = 4 if a.dtype == "float32" else 2
        return Plan(S, K, N, E, a.dtype, tuple(a.stride), tuple(w.stride), tuple(out.stride),
                    _tma_layout(tuple(a.stride), tuple(w.stride), itemsize))

    def _valid(self, plan: Plan, c: Config) -> bool:
        caps = {"BLOCK_M": _cap(plan.S), "BLOCK_N": _cap(plan.N), "BLOCK_K": _cap(plan.K)}
        return (all(16 <= c[k] <= cap and c[k] & (c[k] - 1) == 0 for k, cap in caps.items())
                and c["num_warps"] in (2, 4, 8) and c["num_stages"] in (1, 2, 3, 4)
                and c["GROUP_M"] in (1, 2, 4, 8, 16, 32)
                and (not c["DOT_UPCAST"] or plan.dtype != "float32")
                and (not c.get("TMA") or (plan.tma is not None and c["PROGRAMS"] >= 1
                                          and plan.S + c["BLOCK_M"] <= cg.INT32_MAX  # (32-bit coordinates)
                                          and max(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) <= TMA_MAX_BOX)))

    def _seeds(self, spec: KernelSpec, plan: Plan) -> list[Config]:
        upcasts = (False, True) if plan.dtype == "bfloat16" else (False,)
        tiles = [(seed, False) for seed in self.seeds]
        if plan.tma:
            tiles[:0] = [(seed, True) for seed in self.tma_seeds]
        programs = _sm_count() if plan.tma else 0
        return [Config.of(BLOCK_M=min(bm, _cap(plan.S)), BLOCK_N=min(bn, _cap(plan.N)), BLOCK_K=min(bk, _cap(plan.K)),
                          num_warps=warps, num_stages=stages, DOT_UPCAST=up, GROUP_M=GROUP_M, TMA=t,
                          PROGRAMS=programs if t else 0)
                for (bm, bn, bk, warps, stages), t in tiles for up in upcasts]

    def _steps(self, plan: Plan, c: Config) -> list[Config]:
        out = []
        for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            out += [c.replace(**{k: c[k] * 2}), c.replace(**{k: c[k] // 2})]
        out += [c.replace(num_warps=w) for w in (4, 8)] + [c.replace(num_stages=s) for s in (2, 3, 4)]
        out += [c.replace(GROUP_M=c["GROUP_M"] * 2), c.replace(GROUP_M=c["GROUP_M"] // 2)]
        if plan.tma:  # the other variant at the same tile
            out.append(c.replace(TMA=False, PROGRAMS=0) if c.get("TMA") else c.replace(TMA=True, PROGRAMS=_sm_count()))
        return out

    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        return self._program(spec, self.checked_plan(spec, config), config)

    def _program(self, spec: KernelSpec, p: Plan, config: Config, rows: Any = None,
                 epi: Epilogue | None = None) -> KernelProgram:
        """The program of ``generate``; ``rows``, a bucketed kernel's S as a SizeExpr, makes S the
        run-time argument ``S`` (i64 where the representative's S needs it) and the grid a SizeExpr.
        ``epi``: a grouped_mm_glu kernel's (the spec a region whose inputs 3.. the epilogue reads)."""
        bm, bn = config["BLOCK_M"], config["BLOCK_N"]
        slots, n_tiles = -(-p.S // bm) + p.E, -(-(epi.width if epi else p.N) // bn)
        tma = bool(config.get("TMA"))
        args, sizes = tuple(("in", i) for i in range(len(spec.inputs))) + (("out", 0),), {}
        if rows is not None:
            args += (("i64" if p.S + bm > cg.INT32_MAX else "i32", p.S),)
            sizes = {"args": {str(len(args) - 1): rows}}
            if not tma:  # (the persistent grid does not depend on S)
                sizes["grid"] = [["mul", ["add", ["cdiv", rows, bm], p.E], n_tiles]]
        constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": config["BLOCK_K"], "GROUP_M": config["GROUP_M"]}
        if tma:
            constexprs["PROGRAMS"] = config["PROGRAMS"]
        grid = (config["PROGRAMS"],) if tma else (slots * n_tiles,)
        launch = Launch("grouped_mm_kernel", grid, args, constexprs, config["num_warps"], config["num_stages"],
                        runtime_sizes=sizes)
        source = (_source_tma if tma else _source)(spec, p, config, rows is not None, epi)
        return KernelProgram(source, (launch,))

    # --- shape buckets ------------------------------------------------------------------------
    def bucket_support(self, spec: KernelSpec, dims) -> str | None:
        """Buckets over S, the routed tokens: dim 0 of the input and the output, one variable, both
        contiguous. K, N and the experts are the weights' (and offs') sizes, literal in the kernel."""
        plan = self.plan(spec)
        if isinstance(plan, str):
            return plan
        for side, i, d, _ in dims:
            role = ROLES.get((side, i, d))
            if role is not None and role != "S":
                return (f"{role} varies ({side}put {i} dim {d}): the kernel takes S at run time; K, N and the "
                        f"experts are the weights' sizes, literal in the kernel")
        if problem := unbucketable(spec, dims):   # (after K, N and E: the clearer reason)
            return problem
        if sorted((s, i, d) for s, i, d, _ in dims) != [("in", 0, 0), ("out", 0, 0)] or len({v for *_, v in dims}) > 1:
            return "only S may vary, as one variable in both the input's and the output's dim 0"
        return None

    def generate_bucketed(self, spec: KernelSpec, config: Config, dims) -> KernelProgram:
        """The kernel of ``generate`` with S a run-time argument: one binary serves every S of the
        bucket. ``spec`` is the representative (the upper edge): the i64 decision is taken there."""
        if problem := self.bucket_support(spec, dims):
            raise ValueError(f"{spec.describe()} cannot be bucketed: {problem}")
        return self._program(spec, self.checked_plan(spec, config), config, f"v{dims[0][3]}")


def _texts(p: Plan, config: Config, runtime_s: bool, epi: Epilogue | None) -> dict[str, str]:
    """The pieces both kernels' text share: S (a literal, or the argument ``S``), the dot's dtype
    handling, the output's columns, the parameters, and the expert lookup (each expert's rows and
    tiles from ``offs``; a slot's expert, its first row and its expert's end)."""
    S = "S" if runtime_s else str(p.S)
    upcast = ".to(tl.float32)" if config["DOT_UPCAST"] else ""
    width = epi.width if epi else p.N
    return {
        "S": S, "params": f"in0_ptr, in1_ptr, in2_ptr, {epi.params if epi else ''}out0_ptr, {'S, ' if runtime_s else ''}",
        "out_t": cg.tl_type(p.dtype), "upcast": upcast, "n_tiles": str(-(-width // config["BLOCK_N"])),
        "precision": ', input_precision="ieee"' if p.dtype == "float32" or config["DOT_UPCAST"] else "",
        "col_ok": f"cols < {width}" if width % config["BLOCK_N"] else "tl.full([BLOCK_N], 1, tl.int1)",
        "experts": f"""    # each expert's rows, from its end and the end before it (clamped to the {S} rows, as slicing is)
    e = tl.arange(0, {_p2(p.E)})
    ends = tl.minimum(tl.load(in2_ptr + e, mask=e < {p.E}, other=0).to(tl.int32), {S})
    starts = tl.minimum(tl.load(in2_ptr + e - 1, mask=(e >= 1) & (e < {p.E}), other=0).to(tl.int32), {S})
    tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    through = tl.cumsum(tiles, 0)
    used = tl.sum(tiles, 0)
""",
        "tile": """expert = tl.sum((through <= slot).to(tl.int32), 0)
before = tl.sum(tl.where(e < expert, tiles, 0), 0)
start = tl.sum(tl.where(e == expert, starts, 0), 0)
end = tl.sum(tl.where(e == expert, ends, 0), 0)
row0 = start + (slot - before) * BLOCK_M
""",
    }


def _indent(text: str, spaces: int) -> str:
    return "".join(" " * spaces + line + "\n" for line in text.splitlines())


def _stored(epi: Epilogue | None, rows: str, S: str, acc: str, out_t: str, indent: int) -> tuple[str, str]:
    """The lines before a store of the rows ``rows`` and the value it stores: the product ``acc``,
    or the epilogue's ``value`` (of zero products where ``acc`` is "": the rows of no expert), as ``out_t``."""
    if epi is None:
        return "", f"{acc}.to({out_t})" if acc else f"tl.zeros([BLOCK_M, BLOCK_N], dtype={out_t})"
    zeros = "" if acc else "acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)\nacc2 = acc\n"
    return _indent(zeros + epi.lines(rows, S), indent), f"value.to({out_t})"


def _source(spec: KernelSpec, p: Plan, config: Config, runtime_s: bool, epi: Epilogue | None = None) -> str:
    """The pointer kernel's module: S and the slot count literals, or (``runtime_s``) the argument
    ``S`` and the slot count computed from it; the text is otherwise the same. ``epi``: two
    accumulators (the weight's halves) and the epilogue's value stored."""
    t = _texts(p, config, runtime_s, epi)
    S, n_tiles, out_t = t["S"], t["n_tiles"], t["out_t"]
    bk = config["BLOCK_K"]
    if runtime_s:
        slots, slots_doc = "slots", f"cdiv(S, BLOCK_M) + {p.E}"
        slots_line = f"    slots = (S + BLOCK_M - 1) // BLOCK_M + {p.E}\n"
    else:
        slots_line, slots = "", str(-(-p.S // config["BLOCK_M"]) + p.E)
        slots_doc = slots
    # masks only where a block passes the end of K or N (literals: most MoE sizes divide)
    k_cols = f" & (k < {p.K})[None, :]" if p.K % bk else ""
    k_step = "        k = k0 + ks\n" if p.K % bk else ""
    width = epi.width if epi else p.N
    b_masks = ([f"(k < {p.K})[:, None]"] if p.K % bk else []) + (["col_ok[None, :]"] if width % config["BLOCK_N"] else [])
    b_mask = f",\n                    mask={' & '.join(b_masks)}, other=0.0" if b_masks else ""
    tail_lines, tail_value = _stored(epi, "tail", S, "", out_t, 12)
    tile_lines, tile_value = _stored(epi, "rows", S, "acc", out_t, 4)
    # the up half: the same columns a half further (a second accumulator)
    acc2 = "    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)\n" if epi else ""
    dot2 = (f"        b = tl.load(b_ptrs + {epi.width * p.w[2]}{b_mask}){t['upcast']}\n"
            f"        acc2 += tl.dot(a, b{t['precision']})\n") if epi else ""
    return f'''import triton
import triton.language as tl

# {spec.describe()}
{epi.helpers if epi else ""}

@triton.jit
def grouped_mm_kernel({t["params"]}BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # this program's row-tile slot and column tile: {slots_doc} slots by {n_tiles} columns, GROUP_M slots at a time
    pid = tl.program_id(0)
{slots_line}    first = pid // (GROUP_M * {n_tiles}) * GROUP_M
    size = tl.minimum({slots} - first, GROUP_M)
    slot = first + (pid % (GROUP_M * {n_tiles})) % size
    pid_n = (pid % (GROUP_M * {n_tiles})) // size
{t["experts"]}    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = {t["col_ok"]}
    if slot >= used:
        # a spare slot: zero the rows of no expert, [last end, {S}), striding over their tiles
        last = tl.max(ends, 0)
        for t in range(slot - used, (({S} - last) + BLOCK_M - 1) // BLOCK_M, {slots} - used):
            tail = (last + t * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
{tail_lines}            tl.store(out0_ptr + tail[:, None] * {p.c[0]} + cols[None, :] * {p.c[1]},
                     {tail_value}, mask=(tail < {S})[:, None] & col_ok[None, :])
        return
{_indent(t["tile"], 4)}    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    # pointers advanced by BLOCK_K per step (as Triton's matmul tutorial), not recomputed from k
    a_ptrs = in0_ptr + rows[:, None] * {p.a[0]} + ks[None, :] * {p.a[1]}
    b_ptrs = in1_ptr + expert.to(tl.int64) * {p.w[0]} + ks[:, None] * {p.w[1]} + cols[None, :] * {p.w[2]}
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
{acc2}    for k0 in range(0, {p.K}, BLOCK_K):
{k_step}        a = tl.load(a_ptrs, mask=row_ok[:, None]{k_cols}, other=0.0){t["upcast"]}
        b = tl.load(b_ptrs{b_mask}){t["upcast"]}
        acc += tl.dot(a, b{t["precision"]})
{dot2}        a_ptrs += BLOCK_K * {p.a[1]}
        b_ptrs += BLOCK_K * {p.w[1]}
{tile_lines}    tl.store(out0_ptr + rows[:, None] * {p.c[0]} + cols[None, :] * {p.c[1]}, {tile_value},
             mask=row_ok[:, None] & col_ok[None, :])
'''


def _source_tma(spec: KernelSpec, p: Plan, config: Config, runtime_s: bool, epi: Epilogue | None = None) -> str:
    """The TMA variant's module (module docstring): PROGRAMS persistent programs take the experts'
    tiles in turn, in the pointer kernel's order, then the rows of no expert."""
    t = _texts(p, config, runtime_s, epi)
    S, n_tiles, out_t, up, precision = t["S"], t["n_tiles"], t["out_t"], t["upcast"], t["precision"]
    # the weight as [E, N, K] (transformers' transposed view) or [E, K, N], one expert a block,
    # so that a tile past K or N reads zeros, not the next expert's weights (0 * inf is NaN)
    if p.tma == "nk":
        b_desc = f"shape=[{p.E}, {p.N}, {p.K}], strides=[{p.w[0]}, {p.w[2]}, 1], block_shape=[1, BLOCK_N, BLOCK_K]"
        b_load = "b_desc.load([expert, {n0}pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)" + up
        dot = f"tl.dot(a, b.T, {{acc}}{precision})"
    else:
        b_desc = f"shape=[{p.E}, {p.K}, {p.N}], strides=[{p.w[0]}, {p.w[1]}, 1], block_shape=[1, BLOCK_K, BLOCK_N]"
        b_load = "b_desc.load([expert, k0, {n0}pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)" + up
        dot = f"tl.dot(a, b, {{acc}}{precision})"
    # the up half (a grouped_mm_glu kernel's): the same columns a half further, a second accumulator
    halves = [("acc", "")] + ([("acc2", f"{epi.width} + ")] if epi else [])
    k_body = "".join(f"            b = {b_load.format(n0=n0)}\n            {acc} = {dot.format(acc=acc)}\n"
                     for acc, n0 in halves)
    accs = "".join(f"        {acc} = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)\n" for acc, _ in halves)
    tail_lines, tail_value = _stored(epi, "tail", S, "", out_t, 8)
    tile_lines, tile_value = _stored(epi, "rows", S, "acc", out_t, 8)
    return f'''import triton
import triton.language as tl

# {spec.describe()}
{epi.helpers if epi else ""}

@triton.jit
def grouped_mm_kernel({t["params"]}BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr):
{t["experts"]}    # the operands through tensor descriptors (TMA): a tile past the tensor reads zeros
    a_desc = tl.make_tensor_descriptor(in0_ptr, shape=[{S}, {p.K}], strides=[{p.a[0]}, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(in1_ptr, {b_desc})
    # the experts' tiles (their row tiles by {n_tiles} column tiles, GROUP_M row tiles at a time): program p
    # takes tiles p, p + PROGRAMS, ...
    for tile in range(tl.program_id(0), used * {n_tiles}, PROGRAMS):
        first = tile // (GROUP_M * {n_tiles}) * GROUP_M
        size = tl.minimum(used - first, GROUP_M)
        slot = first + (tile % (GROUP_M * {n_tiles})) % size
        pid_n = (tile % (GROUP_M * {n_tiles})) // size
{_indent(t["tile"], 8)}{accs}        for k0 in range(0, {p.K}, BLOCK_K):
            a = a_desc.load([row0, k0]){up}
{k_body}        # only this expert's rows and the real columns are this tile's
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = {t["col_ok"]}
{tile_lines}        tl.store(out0_ptr + rows[:, None] * {p.c[0]} + cols[None, :] * {p.c[1]}, {tile_value},
                 mask=(rows < end)[:, None] & col_ok[None, :])
    # then the rows of no expert, [last end, {S}), zeroed tile by tile in turn
    last = tl.max(ends, 0)
    for tile in range(tl.program_id(0), (({S} - last) + BLOCK_M - 1) // BLOCK_M * {n_tiles}, PROGRAMS):
        tail = (last + tile // {n_tiles} * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (tile % {n_tiles} * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = {t["col_ok"]}
{tail_lines}        tl.store(out0_ptr + tail[:, None] * {p.c[0]} + cols[None, :] * {p.c[1]},
                 {tail_value}, mask=(tail < {S})[:, None] & col_ok[None, :])
'''


FAMILY = GroupedMatmulFamily()
