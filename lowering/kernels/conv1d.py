"""1-D convolution (aten.convolution.default with a 3-D input) as an implicit GEMM on tensor cores.

    out[n, co, l] = bias[co] + sum_{ci < Cin/groups, k < K} w[co, ci, k] * x[n, g*Cin/groups + ci, l*stride + k*dilation - padding]

The output is tiled over positions x output channels; the reduction over (ci, k) runs as K
shifted dots per input-channel chunk: for each BLOCK_CI chunk of input channels and each tap k,
the input tile at positions ``l*stride + k*dilation - padding`` is loaded with a mask (zero
padding at both ends, no im2col buffer) and multiplied by the weight slice w[co, ci, k]. Triton
cannot slice a register tile, so the K taps re-load shifted copies of the same input rows; after
the first tap those loads hit L1, and DRAM reads the input about once.

Configuration:
  BLOCK_L    positions per tile (16..256)
  FLAT       positions numbered over N*Lout (no padding waste when Lout is not a multiple of
             BLOCK_L; a tile may span two batch elements), else (n, l-tile) tiles of one batch
             element
  LAYOUT     "LC": acc[BLOCK_L, BLOCK_CO] = x^T @ w^T (positions are the MMA's M: wgmma-sized tiles
             even for few channels); "CL": acc[BLOCK_CO, BLOCK_L] = w @ x
  BLOCK_CO   output channels per dot; CO_PROG of them per program (CO_PROG * BLOCK_CO covering
             Cout/groups means one program computes every output channel of its positions, so
             the input tile is read once, and a channel count like 96 runs as 3 exact chunks of
             32 instead of a masked 128)
  BLOCK_CI   input channels per reduction step
  TILES      position tiles per program; above 1 the program loads all its weights once (in
             registers) before walking its tiles, and the tile loop is what num_stages pipelines
  GRID       0, or a persistent grid of GRID programs (one channel program per position tile
             only) that walk the tiles with a grid stride: the weights are loaded once per program
             and the loop, pipelined num_stages deep, keeps the next tiles' loads in flight while
             the tensor cores work on the current one (without it one program per SM waits on
             each tile's loads: the kernel is latency-bound far below the bandwidth)
  DOT_UPCAST fp16/bf16 tiles upcast to fp32 before the dot (the CPU interpreter's bf16 dot is
             wrong; the search keeps what validates), num_warps, num_stages
  LOADS_FIRST  issue every tap's input tile of a position tile before the first dot (the shifted
             taps are unaligned: plain 2-byte loads that Triton does not pipeline, whose latencies
             otherwise add up one after another); with unrolled channel chunks only
  GATHER     the taps at shift -1/+1 (stride 1) are the aligned shift-0 tile moved by one row
             (tl.gather: warp shuffles) plus a one-position halo load, instead of unaligned loads:
             the unaligned 2-byte loads of the other taps bound the kernel on L1 traffic (ncu on
             the H200: L1/TEX 64% busy, DRAM 15%)
  ALIGN      for builds that compile without alignment facts (no vector accesses then): test
             x/out for 16-byte alignment once at run time and run a body whose output tile and
             centre-tap input tile carry tl.multiple_of / tl.max_contiguous hints (16-byte vector
             stores along positions), or the plain body; with 16-byte aligned pointer arguments
             (tt.divisibility) the plain body (ALIGN=False) gets the same facts

For specs on a CUDA device, where CUDA C++ can be built and run (sm_90 and nvcc), the family also offers the configurations
of conv1d_bulk.py (``IMPL="cuda"``: bulk copies and a transposed input slab, for stride 1, groups 1,
fp16/bf16); the search compares them with the Triton ones.

Accumulation is fp32; the bias is added in fp32 and the result rounded once to the output dtype,
stored through the output's own strides (contiguous NCL normally). fp32 dots use
input_precision="ieee".
"""
from __future__ import annotations

import dataclasses
import math


from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels import conv1d_bulk
from torch_kernelize.lowering.kernels.base import SMS, Config, KernelFamily, next_pow2, unique
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec

MAX_ACC_REGS = 128         # fp32 accumulator registers per thread
MAX_W_REGS = 96            # 32-bit registers per thread for weights held across tiles (TILES > 1)
MAX_DOTS = 96              # dots written out in one program (code size)
MAX_TAPS = 64


@dataclasses.dataclass
class _Plan:
    dtype: str
    N: int
    Cin: int
    L: int
    Cout: int
    K: int
    stride: int
    pad: int
    dil: int
    G: int
    Cin_g: int
    Cout_g: int
    Lout: int
    x_strides: tuple[int, int, int]
    w_strides: tuple[int, int, int]
    bias: int | None
    bias_stride: int
    out_strides: tuple[int, int, int]


def _one(v, name: str) -> int | str:
    if isinstance(v, (list, tuple)):
        if len(v) != 1:
            return f"{name}={v} is not 1-d"
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        return f"{name}={v!r} is not an integer"
    return v


class Conv1dFamily(KernelFamily):
    name = "conv1d"
    ops = frozenset({"aten.convolution.default"})
    edge_kinds = ("zeros", "large", "negative", "special")

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> _Plan | str:
        if spec.graph is not None:
            return f"{self.name} does not handle {spec.op}"
        a = cg.bind(spec)
        xi, wi, bi = cg.tensor_index(a.get("input")), cg.tensor_index(a.get("weight")), cg.tensor_index(a.get("bias"))
        if xi is None or wi is None:
            return "input and weight must be tensors"
        if a.get("bias") is not None and bi is None:
            return f"bias {a.get('bias')!r} is not a tensor"
        x, w = spec.inputs[xi], spec.inputs[wi]
        if len(x.shape) != 3:
            return f"input is {len(x.shape)}-d; conv1d needs (N, Cin, L)"
        if len(w.shape) != 3:
            return f"weight is {len(w.shape)}-d"
        if a.get("transposed"):
            return "transposed convolution is not generated"
        vals = {}
        for name in ("stride", "padding", "dilation", "output_padding"):
            v = _one(a.get(name), name)
            if isinstance(v, str):
                return v
            vals[name] = v
        if vals["output_padding"] != 0:
            return "output_padding != 0"
        groups = a.get("groups")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            return f"groups={groups!r}"
        stride, pad, dil = vals["stride"], vals["padding"], vals["dilation"]
        if stride < 1 or dil < 1 or pad < 0:
            return f"stride={stride} dilation={dil} padding={pad}"
        if len(spec.outputs) != 1:
            return f"expected one output, got {len(spec.outputs)}"
        out = spec.outputs[0]
        dtypes = {x.dtype, w.dtype, out.dtype} | ({spec.inputs[bi].dtype} if bi is not None else set())
        if "float64" in dtypes:
            return "float64 convolution is not generated"
        if len(dtypes) != 1 or x.dtype not in cg.FLOAT_TYPES:
            return f"dtypes {sorted(dtypes)}: conv1d generates one of fp32/fp16/bf16 throughout"
        N, Cin, L = x.shape
        Cout, Cin_g, K = w.shape
        if Cin % groups or Cout % groups or Cin_g != Cin // groups:
            return f"weight {w.shape} does not match input {x.shape} with groups={groups}"
        Lout = (L + 2 * pad - dil * (K - 1) - 1) // stride + 1
        if tuple(out.shape) != (N, Cout, Lout):
            return f"output {out.shape} is not {(N, Cout, Lout)}"
        if N * Cout * Lout == 0 or Cin_g == 0 or K == 0:
            return "empty convolution: nothing to compute"
        if K > MAX_TAPS:
            return f"kernel size {K} > {MAX_TAPS} taps (each tap is written out)"
        if any(m.device != x.device for m in spec.inputs + spec.outputs):
            return "input and output devices differ"
        if bi is not None and tuple(spec.inputs[bi].shape) != (Cout,):
            return f"bias {spec.inputs[bi].shape} is not [{Cout}]"
        dims = sorted((st, s) for s, st in zip(out.shape, out.stride) if s > 1)
        reach = 1
        for st, s in dims:
            if st < reach:
                return "output strides overlap (some elements share memory)"
            reach = st * s
        return _Plan(x.dtype, N, Cin, L, Cout, K, stride, pad, dil, groups, Cin_g, Cout // groups, Lout,
                     tuple(x.stride), tuple(w.stride), bi, spec.inputs[bi].stride[0] if bi is not None else 0,
                     tuple(out.stride))

    # --- configs ------------------------------------------------------------------------------
    @staticmethod
    def _l_cap(plan: _Plan, flat: bool) -> int:
        return max(16, next_pow2(plan.N * plan.Lout if flat else plan.Lout))

    def _valid(self, plan: _Plan, c: Config) -> bool:
        if c.get("IMPL") is not None:  # another implementation's configuration
            return conv1d_bulk.valid(plan, c)
        bl, bco, bci, cop, tiles = c["BLOCK_L"], c["BLOCK_CO"], c["BLOCK_CI"], c["CO_PROG"], c["TILES"]
        pow2 = lambda v: v >= 1 and v & (v - 1) == 0
        if not (pow2(bl) and pow2(bco) and pow2(bci)) or not 16 <= bl <= 256 or not 16 <= bco <= 256 \
                or not 16 <= bci <= 128:
            return False
        if c["FLAT"] not in (True, False) or c["LAYOUT"] not in ("LC", "CL") or tiles not in (1, 2, 4, 8):
            return False
        grid = c.get("GRID", 0)
        if isinstance(grid, bool) or not isinstance(grid, int) or grid < 0:
            return False
        if grid and (tiles != 1 or plan.G != 1 or cop * bco < plan.Cout_g):
            return False  # persistent programs each own every output channel of their tiles
        if c["num_warps"] not in (4, 8) or not 1 <= c["num_stages"] <= 4:
            return False
        # Two warpgroups on an MMA whose M is 64: on the H200 (Triton 3.6) such a candidate made an
        # illegal memory access (BLOCK_L=64, LC, num_warps=8); M is BLOCK_L in LC, BLOCK_CO in CL.
        if c["num_warps"] == 8 and (c["BLOCK_L"] if c["LAYOUT"] == "LC" else c["BLOCK_CO"]) < 128:
            return False
        if c["DOT_UPCAST"] not in (True, False) or (c["DOT_UPCAST"] and plan.dtype == "float32"):
            return False
        if c.get("ALIGN", False) not in (True, False) or c.get("LOADS_FIRST", False) not in (True, False):
            return False
        if c.get("GATHER", False) not in (True, False):
            return False
        if c.get("GATHER") and not (plan.stride == 1 and all(abs(k * plan.dil - plan.pad) <= 1 for k in range(plan.K))
                                    and (plan.Lout == plan.L or not c["FLAT"])):
            return False  # shifts of one position, inside a row of the flattened numbering
        if c.get("LOADS_FIRST") and not (tiles > 1 or grid or -(-plan.Cin_g // bci) == 1):
            return False  # only where the channel chunks are unrolled
        if bl > self._l_cap(plan, c["FLAT"]) or bco > max(16, next_pow2(plan.Cout_g)) \
                or bci > max(16, next_pow2(plan.Cin_g)):
            return False
        if not 1 <= cop <= min(8, -(-plan.Cout_g // bco)):
            return False
        threads = 32 * c["num_warps"]
        if cop * bco * bl > MAX_ACC_REGS * threads:
            return False
        chunks = -(-plan.Cin_g // bci)
        hoist = tiles > 1 or grid > 0
        dots = plan.K * cop * (chunks if hoist else 1)
        if dots > MAX_DOTS:
            return False
        if hoist:
            elt = 4 if plan.dtype == "float32" else 2
            if chunks * plan.K * cop * bco * bci * elt / 4 > MAX_W_REGS * threads:
                return False
        return True

    def _fit(self, plan: _Plan, bl: int, bco: int, cop: int | None, bci: int, warps: int, stages: int,
             flat: bool = True, layout: str = "LC", tiles: int = 1, upcast: bool = False, align: bool = False,
             grid: int = 0, loads_first: bool = False, gather: bool = False) -> Config:
        bl = max(16, min(bl, self._l_cap(plan, flat)))
        bco = max(16, min(bco, next_pow2(plan.Cout_g)))
        cop = min(8, -(-plan.Cout_g // bco)) if cop is None else max(1, min(cop, -(-plan.Cout_g // bco)))
        bci = max(16, min(bci, next_pow2(plan.Cin_g)))
        while cop * bco * bl > MAX_ACC_REGS * 32 * warps and bl > 16:
            bl //= 2
        c = Config.of(BLOCK_L=bl, BLOCK_CO=bco, CO_PROG=cop, BLOCK_CI=bci, FLAT=flat, LAYOUT=layout, TILES=tiles,
                      num_warps=warps, num_stages=stages, DOT_UPCAST=bool(upcast and plan.dtype != "float32"),
                      ALIGN=align, GRID=grid, LOADS_FIRST=loads_first, GATHER=gather)
        if (tiles > 1 or grid) and not self._valid(plan, c):
            c = c.replace(TILES=1, GRID=0, LOADS_FIRST=False)  # the weights do not fit registers
        return c

    def seed_configs(self, spec: KernelSpec) -> list[Config]:
        return unique(self._cuda_seeds(spec, self.planned(spec)) + super().seed_configs(spec))

    def _seeds(self, spec: KernelSpec, plan: _Plan) -> list[Config]:
        # channel chunks that divide the channel counts exactly where they can (96 = 3 x 32)
        bco = next((b for b in (32, 16) if plan.Cout_g % b == 0 and plan.Cout_g // b <= 8), None) \
            or min(128, next_pow2(plan.Cout_g))
        bci = next((b for b in (32, 64, 16) if plan.Cin_g % b == 0), None) or min(64, next_pow2(plan.Cin_g))
        big_co = min(128, next_pow2(plan.Cout_g))
        row = plan.Lout % 64 == 0  # position tiles fit the rows exactly: plain (n, l) tiles
        seeds = [
            # all output channels per program, positions as the MMA's M (wgmma m64 x n32 tiles), one
            # persistent program per SM, shifted taps gathered from the aligned tile (the H200's best:
            # 0.139 ms on N=2048 C=96 L=200, against 0.196 with unaligned tap loads)
            self._fit(plan, 128, bco, None, bci, 8, 3, flat=not row, grid=SMS, loads_first=True, gather=True),
            self._fit(plan, 256, bco, None, bci, 8, 3, flat=not row, grid=SMS, gather=True),
            # the same without the persistent grid / the gather
            self._fit(plan, 128, bco, None, bci, 8, 3, flat=not row),
            # the same, input channels in one masked/covering step and a longer position tile
            self._fit(plan, 256, bco, None, bci, 8, 2, flat=not row),
            # one wide channel tile (96 -> 128 masked), channels as the MMA's M
            self._fit(plan, 128, big_co, 1, bci, 8, 3, flat=not row, layout="CL"),
            # persistent grids, the whole [Cout, Cin/groups * K] weight in registers (1 and 2
            # programs per SM of an H100/H200; the search moves GRID, and TILES as the alternative)
            self._fit(plan, 128, bco, None, bci, 8, 3, flat=not row, grid=SMS),
            self._fit(plan, 64, bco, None, bci, 4, 3, flat=not row, grid=2 * SMS),
            # one program per (n, whole row) even when rows do not fill the tile: no n/l division
            # in the addresses, so the centre tap's loads stay contiguous and vectorize
            self._fit(plan, 256, bco, None, bci, 8, 2, flat=False),
            # the first with the run-time alignment test (for builds without alignment facts)
            self._fit(plan, 128, bco, None, bci, 8, 3, flat=not row, align=True),
            # fp32-upcast dots (what the interpreter validates for bf16)
            self._fit(plan, 128, bco, None, bci, 8, 3, flat=not row, upcast=True),
            self._fit(plan, 64, bco, None, bci, 4, 2, flat=True, upcast=True),
        ]
        return seeds

    @staticmethod
    def _cuda_seeds(spec: KernelSpec, plan: _Plan) -> list[Config]:
        """CUDA C++ candidates first (on the H200 they beat every Triton one: 0.082 against 0.137
        ms on B2048 C96 L200 k3), for a spec on a CUDA device where they can be built and run."""
        if spec.inputs[0].device != "cuda" or conv1d_bulk.reason(plan) is not None:
            return []
        from torch_kernelize.building import nvcc
        return conv1d_bulk.seeds(plan) if nvcc.available() else []

    def _steps(self, plan: _Plan, c: Config) -> list[Config]:
        if c.get("IMPL") is not None:
            return conv1d_bulk.neighbours(plan, c)
        cands = []
        for k in ("BLOCK_L", "BLOCK_CO", "BLOCK_CI", "TILES"):
            cands += [c.replace(**{k: c[k] * 2}), c.replace(**{k: c[k] // 2})]
        grid = c.get("GRID", 0)
        cands += [c.replace(GRID=g, TILES=1) for g in ((grid * 2, grid // 2, grid + SMS // 2) if grid else (SMS, 2 * SMS))]
        cands += [c.replace(BLOCK_CO=c["BLOCK_CO"] * 2, CO_PROG=max(1, c["CO_PROG"] // 2)),
                  c.replace(BLOCK_CO=c["BLOCK_CO"] // 2, CO_PROG=c["CO_PROG"] * 2),
                  c.replace(CO_PROG=c["CO_PROG"] + 1), c.replace(CO_PROG=c["CO_PROG"] - 1)]
        cands += [c.replace(num_warps=8 if c["num_warps"] == 4 else 4),
                  c.replace(num_stages=c["num_stages"] + 1), c.replace(num_stages=c["num_stages"] - 1),
                  c.replace(FLAT=not c["FLAT"]), c.replace(LAYOUT="CL" if c["LAYOUT"] == "LC" else "LC"),
                  c.replace(DOT_UPCAST=not c["DOT_UPCAST"]), c.replace(ALIGN=not c.get("ALIGN", False)),
                  c.replace(LOADS_FIRST=not c.get("LOADS_FIRST", False)), c.replace(GATHER=not c.get("GATHER", False))]
        return cands

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        plan = self.checked_plan(spec, config)
        if config.get("IMPL") is not None:
            return conv1d_bulk.generate(spec, plan, config)
        return _Gen(spec, plan, config).program()


# --- code generation -------------------------------------------------------------------------


def _t(expr: str, stride: int) -> str:
    return expr if stride == 1 else f"{expr} * {stride}"


def wrap(expr: str) -> str:
    """Parenthesize a mask expression before indexing it ([:, None]) unless it is one term."""
    return f"({expr})" if " & " in expr else expr


def _sum(*terms: str) -> str:
    terms = [t for t in terms if t and t != "0"]
    return " + ".join(terms) if terms else "0"


class _Gen:
    def __init__(self, spec: KernelSpec, plan: _Plan, config: Config):
        p, c = plan, config
        self.spec, self.p, self.c = spec, plan, config
        self.bl, self.bco, self.bci = int(c["BLOCK_L"]), int(c["BLOCK_CO"]), int(c["BLOCK_CI"])
        self.cop, self.tiles, self.flat, self.lc = int(c["CO_PROG"]), int(c["TILES"]), bool(c["FLAT"]), c["LAYOUT"] == "LC"
        self.chunks = -(-p.Cin_g // self.bci)
        self.co_span = self.bco * self.cop                         # output channels per program
        self.ct = -(-p.Cout_g // self.co_span)                     # channel programs per group
        self.co_progs = p.G * self.ct
        self.lt = -(-p.Lout // self.bl)                            # row mode: l tiles per batch element
        self.pos_tiles = -(-(p.N * p.Lout) // self.bl) if self.flat else p.N * self.lt
        self.grid = int(c.get("GRID", 0))
        if self.grid:  # grid-stride loop: every tile a program visits exists
            self.pos_progs, self.over = min(self.grid, self.pos_tiles), False
        else:
            self.pos_progs = -(-self.pos_tiles // self.tiles)
            self.over = self.pos_progs * self.tiles != self.pos_tiles  # the last program runs past the end
        # chunks of output channels that exist (CO_PROG never exceeds the channels when ct == 1)
        self.co_chunks = [j for j in range(self.cop) if self.ct > 1 or j * self.bco < p.Cout_g]
        self.co_masked = p.Cout_g % self.co_span != 0
        self.ci_masked = p.Cin_g % self.bci != 0
        self.hoist = self.tiles > 1 or self.grid > 0
        self.gather = bool(c.get("GATHER", False))
        # int64 when an offset of a valid element (plus a block of slack) or a position index can pass int32
        metas = [spec.inputs[i] for i in range(len(spec.inputs))] + [spec.outputs[0]]
        slack = (self.bl + p.K * p.dil + p.pad) * p.stride * max(p.x_strides[2], 1) + self.co_span + self.bci
        reach = max(cg.max_offset(m.shape, m.stride) for m in metas) + slack
        positions = max(self.pos_progs * self.tiles, self.pos_tiles) * self.bl + self.bl
        self.wide = max(reach, positions, p.N * p.Lout * p.stride) > cg.INT32_MAX
        self.src = cg.Source()

    def program(self) -> KernelProgram:
        p, s, spec = self.p, self.src, self.spec
        s(cg.HEADER, cg.describe_spec(spec))
        s.blank()("")
        a = cg.bind(spec)
        xi, wi = cg.tensor_index(a["input"]), cg.tensor_index(a["weight"])
        self.x, self.w = f"in{xi}_ptr", f"in{wi}_ptr"
        ins = sorted({xi, wi} | ({p.bias} if p.bias is not None else set()))
        ptrs = [f"in{i}_ptr" for i in ins] + ["out0_ptr"]
        consts = ["BLOCK_L", "BLOCK_CO", "BLOCK_CI"]
        self.hint_x, self.hint_out = self.hints()
        hinted = [n for n, h in ((self.x, self.hint_x), ("out0_ptr", self.hint_out)) if h]
        if hinted:
            # one body, compiled twice: with alignment hints when the hinted pointers are 16-byte
            # aligned (vector stores and centre-tap loads), plain otherwise; chosen at run time
            s("@triton.jit",
              f"def conv1d_body({', '.join(ptrs + ['pid'] + [c + ': tl.constexpr' for c in consts + ['ALIGNED']])}):").indent()
            self.body()
            s.dedent().blank()("")
        s("@triton.jit", f"def conv1d_kernel({', '.join(ptrs + [c + ': tl.constexpr' for c in consts])}):").indent()
        s(f"pid = tl.program_id(0){'.to(tl.int64)' if self.wide else ''}")
        if hinted:
            bits = " | ".join(f"{x}.to(tl.int64)" for x in hinted)
            call = ", ".join(ptrs + ["pid"] + consts)
            s("# 16-byte vector accesses need 16-byte aligned pointers: test them once",
              f"aligned = (({bits}) % 16) == 0",
              "if aligned:").indent()(f"conv1d_body({call}, True)").dedent()
            s("else:").indent()(f"conv1d_body({call}, False)").dedent()
        else:
            self.body()
        s.dedent()
        launch = Launch("conv1d_kernel", (self.pos_progs * self.co_progs,),
                        tuple(("in", i) for i in ins) + (("out", 0),),
                        {"BLOCK_L": self.bl, "BLOCK_CO": self.bco, "BLOCK_CI": self.bci},
                        num_warps=int(self.c["num_warps"]), num_stages=int(self.c["num_stages"]))
        return KernelProgram(s.text(), (launch,))

    def hints(self) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """(contiguity, 16) along positions for the centre-tap input tile and the output tile, when
        a 16-byte aligned base makes every contiguous run of positions start 16-byte aligned."""
        p = self.p
        if not self.c.get("ALIGN", False):
            return None, None
        elt = 4 if p.dtype == "float32" else 2
        # positions run contiguously in groups of `run` that start at multiples of `run`
        run = self.bl if not self.flat else math.gcd(self.bl, p.Lout & -p.Lout)
        if (run * elt) % 16:
            return None, None
        ok = lambda *strides: all((st * elt) % 16 == 0 for st in strides)
        xs, os_ = p.x_strides, p.out_strides
        hx = (run, 16) if (p.stride == 1 and xs[2] == 1 and ok(xs[0], xs[1])
                           and any(k * p.dil == p.pad for k in range(p.K))) else None
        ho = (run, 16) if os_[2] == 1 and ok(os_[0], os_[1]) else None
        return hx, ho

    def hinted(self, var: str, expr: str, hint: tuple[int, int] | None) -> str:
        """Emit a pointer tile with its alignment hint (positions axis) in the ALIGNED body."""
        if hint is None:
            return expr
        run, div = hint
        ax = lambda v: f"[{v}, 1]" if self.lc else f"[1, {v}]"
        self.src(f"{var} = {expr}", "if ALIGNED:").indent()(
            f"{var} = tl.max_contiguous(tl.multiple_of({var}, {ax(div)}), {ax(run)})").dedent()
        return var

    # pieces ------------------------------------------------------------------------------------
    def body(self) -> None:
        p, s = self.p, self.src
        s(f"# out[n, co, l] = bias[co] + sum(ci < {p.Cin_g}, k < {p.K}) w[co, ci, k] * "
          f"x[n, g * {p.Cin_g} + ci, l * {p.stride} + k * {p.dil} - {p.pad}]  (zero outside [0, {p.L}))",
          f"# N={p.N} Cin={p.Cin} L={p.L} -> Cout={p.Cout} Lout={p.Lout}, groups={p.G}; strides x {list(p.x_strides)}, "
          f"w {list(p.w_strides)}, out {list(p.out_strides)}",
          f"# program = {f'tiles pp, pp + {self.pos_progs}, ... of ' if self.grid else 'TILES=' + str(self.tiles) + ' x ' if self.tiles > 1 else ''}{self.bl} "
          f"{'flattened (n, l)' if self.flat else 'l'} positions x {self.co_span} output channels "
          f"({len(self.co_chunks)} dot(s) of {self.bco}); acc[{'BLOCK_L, BLOCK_CO' if self.lc else 'BLOCK_CO, BLOCK_L'}]")
        if self.co_progs > 1:
            s(f"cop = pid % {self.co_progs}  # channel programs of one position tile are neighbours (x stays in L2)",
              f"pp = pid // {self.co_progs}")
        else:
            s("pp = pid")
        # channels of this program
        g = ct = None
        if p.G > 1 and self.ct > 1:
            s(f"g = cop // {self.ct}", f"ct = cop % {self.ct}")
            g, ct = "g", "ct"
        elif p.G > 1:
            g = "cop"
        elif self.ct > 1:
            ct = "cop"
        self.xg = _t(f"{g} * {p.Cin_g}", p.x_strides[1]) if g else ""      # input channel base offset
        co_base = _sum(f"{g} * {p.Cout_g}" if g else "", f"{ct} * {self.co_span}" if ct else "")
        local_base = f"{ct} * {self.co_span}" if ct else ""
        s(f"rci = tl.arange(0, BLOCK_CI){'.to(tl.int64)' if self.wide else ''}")
        if self.gather:
            s("rl = tl.arange(0, BLOCK_L)  # tile rows, for the shifted (gathered) taps")
        for j in self.co_chunks:
            off = j * self.bco
            rco = "tl.arange(0, BLOCK_CO)" + (".to(tl.int64)" if self.wide else "")
            s(f"co{j} = {_sum(co_base, str(off) if off else '', rco)}")
            if self.co_masked and (self.ct > 1 or (j + 1) * self.bco > p.Cout_g):
                local = _sum(local_base, str(off) if off else '', 'tl.arange(0, BLOCK_CO)')
                s(f"com{j} = {local} < {p.Cout_g}")
        if self.hoist:
            s(f"# the weights of these channels, loaded once for the program's {'tiles' if self.grid else self.tiles}"
              f"{'' if self.grid else ' tiles'}")
            for c in range(self.chunks):
                self.ci_vars(f"{c * self.bci} + rci" if c else "rci", c)
                for k in range(p.K):
                    for j in self.co_chunks:
                        self.load_w(f"w{c}_{k}_{j}", c, k, j)
            if self.grid:
                s(f"for tile in range(pp, {self.pos_tiles}, {self.pos_progs}):").indent()
            else:
                s(f"for t in range({self.tiles}):").indent()
                s(f"tile = pp * {self.tiles} + t")
        else:
            s("tile = pp")
        self.positions()
        for j in self.co_chunks:
            s(f"acc{j} = tl.zeros([{'BLOCK_L, BLOCK_CO' if self.lc else 'BLOCK_CO, BLOCK_L'}], dtype=tl.float32)")
        if self.hoist or self.chunks == 1:
            if not self.hoist:
                self.ci_vars("rci", 0)
            if self.c.get("LOADS_FIRST", False):
                s("# every tap's input tile first: the unaligned (shifted) loads are plain loads, not",
                  "# pipelined copies, so their latencies overlap only when they are issued together")
                for c in range(self.chunks):
                    self.reduce_chunk(c, dots=False)
                for c in range(self.chunks):
                    self.reduce_chunk(c, loads=False)
            else:
                for c in range(self.chunks):
                    self.reduce_chunk(c)
        else:
            s(f"for c in range({self.chunks}):  # Cin/groups = {p.Cin_g}: {self.chunks} chunks of BLOCK_CI").indent()
            self.ci_vars("c * BLOCK_CI + rci", "")
            self.reduce_chunk("")
            s.dedent()
        self.epilogue()
        if self.hoist:
            s.dedent()

    def ci_vars(self, expr: str, c) -> None:
        s = self.src
        s(f"ci{c} = {expr}")
        if self.ci_masked and (c == "" or (c + 1) * self.bci > self.p.Cin_g):
            s(f"cim{c} = ci{c} < {self.p.Cin_g}")

    def ci_mask(self, c) -> str | None:
        return f"cim{c}" if self.ci_masked and (c == "" or (c + 1) * self.bci > self.p.Cin_g) else None

    def co_mask(self, j: int) -> str | None:
        p = self.p
        return f"com{j}" if self.co_masked and (self.ct > 1 or (j + 1) * self.bco > p.Cout_g) else None

    def positions(self) -> None:
        """Emit n, l (and pmask) of the current tile, and xpos / opos (offsets without channels)."""
        p, s = self.p, self.src
        NL = p.N * p.Lout
        self.pmask = None
        self.nmask = None
        if self.flat:
            s("p = tile * BLOCK_L + tl.arange(0, BLOCK_L)  # flattened (n, l)")
            if NL % self.bl or self.over:
                s(f"pmask = p < {NL}")
                self.pmask = "pmask"
            s(f"n = p // {p.Lout}", f"l = p % {p.Lout}")
            self.l_max = p.Lout - 1
        else:
            if self.lt > 1:
                s(f"n = tile // {self.lt}", f"l = (tile % {self.lt}) * BLOCK_L + tl.arange(0, BLOCK_L)")
            else:
                s("n = tile", "l = tl.arange(0, BLOCK_L)")
            if p.Lout % self.bl or self.over:
                cond = [f"(l < {p.Lout})"] if p.Lout % self.bl else []
                if self.over:
                    cond.append(f"(n < {p.N})")
                s(f"pmask = {' & '.join(cond)}")
                self.pmask = "pmask"
            if self.over:
                self.nmask = "pmask"   # past the last batch element nothing may be read
            self.l_max = self.lt * self.bl - 1
        self.ls = "l"
        if p.stride != 1:
            s(f"ls = l * {p.stride}  # first input position of each output (tap shift 0)")
            self.ls = "ls"
        xs = p.x_strides
        s(f"xpos = {_sum(_t('n', xs[0]), self.xg, _t(self.ls, xs[2]))}")
        os_ = p.out_strides
        self.opos = f"{_sum(_t('n', os_[0]), _t('l', os_[2]))}"

    def tap_mask(self, k: int) -> str | None:
        """Positions whose input l*stride + k*dil - pad lies inside [0, L) (else zero padding)."""
        return self.shift_mask(k * self.p.dil - self.p.pad)

    def shift_mask(self, shift: int) -> str | None:
        p = self.p
        conds = []
        if shift < 0:
            conds.append(f"({self.ls} >= {-shift})")
        if self.l_max * p.stride + shift >= p.L:
            conds.append(f"({self.ls} < {p.L - shift})")
        if self.flat and self.pmask:
            conds.append(self.pmask)      # past the end n == N: nothing may be read
        elif self.nmask:
            conds.append(self.nmask)
        return " & ".join(conds) or None

    def load_w(self, var: str, c, k: int, j: int) -> None:
        p = self.p
        ws = p.w_strides
        ci, co = f"ci{c}", f"co{j}"
        koff = str(k * ws[2]) if k * ws[2] else ""
        if self.lc:   # [BLOCK_CI, BLOCK_CO]
            off = _sum(_t(f"{ci}[:, None]", ws[1]), _t(f"{co}[None, :]", ws[0]), koff)
            masks = [f"{m}[:, None]" for m in [self.ci_mask(c)] if m] + [f"{m}[None, :]" for m in [self.co_mask(j)] if m]
        else:         # [BLOCK_CO, BLOCK_CI]
            off = _sum(_t(f"{co}[:, None]", ws[0]), _t(f"{ci}[None, :]", ws[1]), koff)
            masks = [f"{m}[:, None]" for m in [self.co_mask(j)] if m] + [f"{m}[None, :]" for m in [self.ci_mask(c)] if m]
        kw = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
        self.src(f"{var} = tl.load({self.w} + {off}{kw})")

    def reduce_chunk(self, c, loads: bool = True, dots: bool = True) -> None:
        """The K taps of one input-channel chunk: shifted input tile x weight slice, per channel dot
        (loads only, or dots only on tiles loaded earlier, when the loads are issued first)."""
        p, s = self.p, self.src
        xs = p.x_strides
        xv = "x" if loads and dots else None
        for k in range(p.K):
            xt = xv or f"x{c}_{k}"
            if not loads:
                self.tap_dots(c, k, xt)
                continue
            if self.gather:
                self.gather_tap(c, k, xt)
                if dots:
                    self.tap_dots(c, k, xt)
                continue
            shift = (k * p.dil - p.pad) * xs[2]
            pos = f"(xpos + {shift})" if shift > 0 else f"(xpos - {-shift})" if shift < 0 else "xpos"
            tm, cm = self.tap_mask(k), self.ci_mask(c)
            if self.lc:  # [BLOCK_L, BLOCK_CI]
                off = f"{pos}[:, None] + {_t(f'ci{c}[None, :]', xs[1])}"
                masks = ([f"{wrap(tm)}[:, None]"] if tm else []) + ([f"{cm}[None, :]"] if cm else [])
            else:        # [BLOCK_CI, BLOCK_L]
                off = f"{_t(f'ci{c}[:, None]', xs[1])} + {pos}[None, :]"
                masks = ([f"{cm}[:, None]"] if cm else []) + ([f"{wrap(tm)}[None, :]"] if tm else [])
            kw = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
            ptr = self.hinted("x_ptrs", f"{self.x} + {off}", self.hint_x if shift == 0 else None)
            sh = k * p.dil - p.pad
            where = f"{self.ls}{f' + {sh}' if sh > 0 else f' - {-sh}' if sh < 0 else ''}"
            s(f"{xt} = tl.load({ptr}{kw})  # tap {k}: input position {where}")
            if dots:
                self.tap_dots(c, k, xt)

    def gather_tap(self, c, k: int, xt: str) -> None:
        """GATHER: the aligned tile at shift 0 is loaded once per chunk (vector loads, pipelined
        copies); the taps at shift -1/+1 are that tile moved by one position (tl.gather: warp
        shuffles) with the one position past the tile's edge loaded apart (the halo)."""
        p, s = self.p, self.src
        xs = p.x_strides
        sh = k * p.dil - p.pad
        cm = self.ci_mask(c)
        ax = 0 if self.lc else 1
        bt = f"xb{c}"
        par = lambda v: v if v.isidentifier() or (v[0] == "(" and v[-1] == ")") else f"({v})"
        row = lambda v: f"{par(v)}[:, None]" if self.lc else f"{par(v)}[None, :]"
        col = lambda v: f"{par(v)}[None, :]" if self.lc else f"{par(v)}[:, None]"
        if k == 0:  # the base tile: every shift is taken from it
            tm = self.shift_mask(0)
            off = f"{row('xpos')} + {col(_t(f'ci{c}', xs[1]))}"
            masks = ([f"{row(wrap(tm))}"] if tm else []) + ([col(cm)] if cm else [])
            kw = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
            ptr = self.hinted("x_ptrs", f"{self.x} + {off}", self.hint_x)
            s(f"{bt} = tl.load({ptr}{kw})  # positions {self.ls} (shift 0): aligned")
        if sh == 0:
            s(f"{xt} = {bt}  # tap {k}: shift 0")
            return
        shape = "BLOCK_L, BLOCK_CI" if self.lc else "BLOCK_CI, BLOCK_L"
        edge = "0" if sh < 0 else "BLOCK_L - 1"
        # the position just past the tile's edge, as a (n, l) pair
        if self.flat:
            s(f"hq = tile * BLOCK_L {'- 1' if sh < 0 else '+ BLOCK_L'}",
              f"hn = hq // {p.Lout}", f"hl = hq % {p.Lout}")
            inside = f"(hq >= 0)" if sh < 0 else f"(hq < {p.N * p.Lout})"
        else:
            s(f"hl = {f'(tile % {self.lt}) * BLOCK_L' if self.lt > 1 else '0'} {'- 1' if sh < 0 else '+ BLOCK_L'}",
              f"hn = {f'tile // {self.lt}' if self.lt > 1 else 'tile'}")
            inside = f"(hl >= 0)" if sh < 0 else f"(hl < {p.L})"
            if self.nmask:
                inside += f" & (hn < {p.N})"
        hpos = _sum(_t("hn", xs[0]), self.xg, _t("hl", xs[2]), _t(f"ci{c}", xs[1]))
        hm = f"{cm} & {inside}" if cm else inside
        sign = "-" if sh < 0 else "+"
        s(f"halo = tl.load({self.x} + {hpos}, mask={hm}, other=0.0)",
          f"gi = tl.broadcast_to({row(f'tl.minimum(tl.maximum(rl {sign} 1, 0), BLOCK_L - 1)')}, ({shape}))",
          f"{xt} = tl.where({row(f'rl == {edge}')}, {col('halo')}, tl.gather({bt}, gi, axis={ax}))")
        tm = self.shift_mask(sh)
        if tm:
            s(f"{xt} = tl.where({row(wrap(tm))}, {xt}, 0.0)  # tap {k}: shift {sh:+d}, zero padding")

    def tap_dots(self, c, k: int, xt: str) -> None:
        for j in self.co_chunks:
            w = f"w{c}_{k}_{j}"
            if not self.hoist:
                self.load_w("w", c, k, j)
                w = "w"
            a, b = (xt, w) if self.lc else (w, xt)
            self.src(self.dot(a, b, f"acc{j}"))

    def dot(self, a: str, b: str, acc: str) -> str:
        if self.p.dtype == "float32":
            return f'{acc} = tl.dot({a}, {b}, {acc}, input_precision="ieee")'
        if self.c["DOT_UPCAST"]:
            return f'{acc} = tl.dot({a}.to(tl.float32), {b}.to(tl.float32), {acc}, input_precision="ieee")'
        return f"{acc} = tl.dot({a}, {b}, {acc})"

    def epilogue(self) -> None:
        p, s = self.p, self.src
        os_ = p.out_strides
        for j in self.co_chunks:
            acc = f"acc{j}"
            cm = self.co_mask(j)
            if p.bias is not None:
                kw = f", mask={cm}, other=0.0" if cm else ""
                conv = ".to(tl.float32)" if p.dtype in cg.HALF else ""
                s(f"b = tl.load(in{p.bias}_ptr + {_t(f'co{j}', p.bias_stride)}{kw}){conv}")
                s(f"{acc} = {acc} + b{'[None, :]' if self.lc else '[:, None]'}")
            if self.lc:
                off = f"({self.opos})[:, None] + {_t(f'co{j}[None, :]', os_[1])}"
                masks = ([f"{self.pmask}[:, None]"] if self.pmask else []) + ([f"{cm}[None, :]"] if cm else [])
            else:
                off = f"{_t(f'co{j}[:, None]', os_[1])} + ({self.opos})[None, :]"
                masks = ([f"{cm}[:, None]"] if cm else []) + ([f"{self.pmask}[None, :]"] if self.pmask else [])
            value = f"{acc}.to({cg.HALF[p.dtype]})" if p.dtype in cg.HALF else acc
            kw = f", mask={' & '.join(masks)}" if masks else ""
            ptr = self.hinted("o_ptrs", f"out0_ptr + {off}", self.hint_out)
            s(f"tl.store({ptr}, {value}{kw})")


FAMILY = Conv1dFamily()
