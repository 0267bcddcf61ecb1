"""aten.histc: a histogram of a float tensor over equal-width bins, counted as ATen counts.

ATen (aten/src/ATen/native/Histogram.cpp, cpu/HistogramKernel.cpp, LINEAR_INTERPOLATION):
- range: min/max as doubles; if equal (both 0 by default) the data's min/max; if those are equal
  too, min-1 and max+1; a non-finite range or min > max is an error. The edges are then rounded to
  the input dtype (linspace in that dtype; Scalar -> dtype goes through float).
- an element x counts when lo <= x <= hi (NaN never does), in bin
  ``int((x - lo) * bins / (hi - lo))`` evaluated in the input dtype — for fp16/bf16 every step
  rounds to that type (c10::Half/BFloat16 arithmetic) — with x == hi going to the last bin.
The kernels repeat that arithmetic step by step (fp32 ops with a rounding to the half type after
each, IEEE division), so counts match torch.histc on CPU exactly, not just up to edge cases.

Kernels: each program takes ITERS blocks of BLOCK elements, bins them and adds its counts to
the output with atomics: variant "shared" counts in shared memory first (ATen's algorithm; inline
PTX, see below) and "local" in a per-program tl.histogram; both then issue one global atomic per
non-empty bin. Variant "atomic" issues one global atomic per element (for many bins). A
data-derived range first runs a min/max kernel whose programs each store a partial range (min,
-max, a NaN flag) and zero the counts; each histogram program reduces those partials (at most
MAX_PARTIALS) itself. So nothing needs initialising: a call is two launches (fp32) and no fills.
ONE_LAUNCH=P makes that one launch of P persistent programs instead (a grid-synchronized launch, see
program.py): each takes blocks pid, pid + P, ..., stores its partial range, waits at a grid barrier,
then counts the same blocks last-first (the last ones read are still in L2). It is there for the
host: a compiled call's host time per launch exceeded the GPU time of a data range's two kernels
on slower hosts (H200: 0.086 ms of host time for two launches, 0.043 ms on the GPU).
Counts accumulate straight into an fp32 output (float atomics, as ATen's CUDA kernel: exact while
a bin holds fewer than 2^24); fp16/bf16 outputs count in an int32 temp that a last small kernel
converts. Where ATen raises (NaN or inf in the data when the range comes from the data), the
output is NaN.

Each element is read once, so the histogram pass may read with an evict-first L2 policy (STREAM):
it then leaves L2's other lines in place -- a model's weights, or under do_bench the 256 MB flush
whose dirty lines the reads would otherwise write back (H200, 16M fp32: 0.027 against 0.030 ms).
With a range from the data, REVERSE has the histogram programs take the blocks last-first, so
that they start on what the range pass read last, while it is still in L2.

"shared": Triton has no shared-memory atomics, so the kernel's counting helpers are inline PTX
(a static ``.shared`` array, ``red.shared.add``, barriers; see _shared_helpers). The interpreter
runs no PTX: the source names a tl.histogram twin of each helper (INTERPRETER_TWINS), which CPU
tests run; fill_cache validates the PTX itself on the GPU, like every candidate. ptxas turns the
increments into warp-aggregated ATOMS.POPC.INC: ~11 SASS instructions per element per thread,
bin arithmetic included. H200, 16M fp32 in 256 bins: ~0.03 ms (do_bench, L2 flushed) against
0.071 ms for "local" and 0.089 ms for ATen; COPIES (lane-interleaved copies of each counter, to
spread bank conflicts) changed little there.

Speed (sm_90): tl.histogram is a warp-ballot histogram (a ballot per bit of the bin index, then a
popcount per bin a lane owns: for 256 bins ~55 SASS instructions per 32 elements at 32 elements
per thread, ~80 at 8), and it dominates; the exact division costs ~16 more (a fixed range whose
width is a power of two multiplies by the exact inverse instead: the same single rounding, so the
same bins). Seeds therefore give each thread 32 elements per tl.histogram call; ITERS blocks per
program keep the global atomics (one per non-empty bin and program) few.

Variant "dot" counts on the tensor cores instead, because "local" is bound by tl.histogram (H200:
0.068 ms for 16M fp32 elements in 256 bins, against a 0.016 ms memory floor): the bin b = hi * LO + lo
(LO, HI powers of two >= 16, tl.dot's minimum; [16, 16] up to 256 bins, at most [64, 64]) and
counts[HI, LO] += one_hot(hi)^T @ one_hot(lo) over the BLOCK elements (the dot's K; elements without
a bin get all-zero one-hot columns). One-hots are int8 (int32 accumulation) or fp16 (ONEHOT key; fp32
accumulation, exact below 2^24 per program); both are exact in the interpreter too. The epilogue is
"local"'s. Caveat, from sm_90 SASS compiled here (ptxas, no GPU): Triton builds each one-hot entry
with a compare, a select and a byte store to shared memory (the operand's way into the MMA layout),
32 entries per element, so ~136 instructions per 32 elements against ~69 for "local" (bin arithmetic
included in both) — and on the H200 fill_cache's search kept "local" (third session); the one-hots take (HI + LO) * BLOCK bytes (x2 fp16)
of shared memory, capped at 128 KiB.
"""
from __future__ import annotations

import math

import torch

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import SMS, Config, KernelFamily, sample_tensor, to_device
from torch_kernelize.core.program import PHASE, Buffer, KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec

LOCAL_MAX_BINS = 1024     # tl.histogram keeps next_pow2(bins) counters per program (registers/smem)
DOT_MAX_SIDE = 64         # "dot": a [HI, LO] count tile, HI, LO <= 64 (at most 4096 bins, 32 regs/thread at 4 warps)
DOT_MAX_SMEM = 128 * 1024  # "dot": the one-hots pass through shared memory whole, (HI + LO) * BLOCK elements
ONEHOTS = ("int8", "float16")  # "dot" one-hot dtype: int8 dots accumulate in int32, fp16 dots in fp32
SHARED_MAX_WORDS = 10240  # "shared": _shared_words int32 counters in static shared memory (40 KiB of 48)
SHARED_COPIES = (1, 8, 32)
# STREAM: the cache policy of the histogram pass's reads (each element is read once): "" the
# default, "evict_first" (the lines it brings into L2 are the first evicted; Triton takes no ".cs")
STREAMS = ("", "evict_first")
VARIANTS = ("shared", "local", "dot", "atomic")
MAX_PARTIALS = 1024       # a data range: partial ranges (per range-kernel program) each histogram program reduces


# The interpreter truncates fp32 -> bf16 (GPUs round to nearest even): round by hand, exactly
# and the same on both, where the counts depend on it.
BF16_ROUND = '''
@triton.jit
def _round_bf16(v):
    # v rounded to the nearest bfloat16 (ties to even), returned as fp32
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)
'''


def _shared_helpers(bins: int, nb: int, copies: int) -> str:
    """The "shared" variant's counting helpers (inline PTX) and their interpreter twins.

    Triton has no shared-memory atomics, so these declare a static ``.shared`` array of
    ``_shared_words`` counters (static: the driver sizes it from the binary, apart from Triton's
    own dynamic shared memory, which these never touch), zero it, add 1 per element with
    ``red.shared.add`` (ptxas makes it a warp-aggregated ATOMS.POPC.INC; an element without a bin
    counts in the spare counter ``bins``, so no branch), and after a barrier read the first ``nb``
    bins back, summing their copies. Counter ``bin * copies + lane % copies``: with 32 copies
    every lane of a warp has its own bank (random bins otherwise collide in ~3-4 of 32 banks, and
    the atomics serialise); fewer copies trade bank conflicts for shared memory. The counts
    accumulator is the twins' (the PTX helpers pass it through).
    """
    words = _shared_words(bins, copies)
    zero = _p2(words)
    index = (" mov.u32 a, $1;" if copies == 1 else
             f" mov.u32 l, %laneid; and.b32 l, l, {copies - 1}; mad.lo.u32 a, $1, {copies}, l;")
    counters = (f"tl.arange(0, {nb})" if copies == 1 else
                f"tl.arange(0, {nb})[:, None] * {copies} + tl.arange(0, {copies})[None, :]")
    read = ('tl.inline_asm_elementwise("{ .reg .u32 a; mov.u32 a, tk_shist; mad.lo.u32 a, $1, 4, a; '
            f'ld.shared.u32 $0, [a]; }}",\n        "=r,r", [{counters}], dtype=tl.int32, is_pure=False, pack=1)')
    if copies > 1:  # the bin's copies summed
        read = f"tl.sum({read}, axis=1)"
    return f'''
# Counting in shared memory, as ATen does: inline PTX (Triton has no shared-memory atomics), run by
# the compiled kernel; the interpreter runs no PTX and calls the twins (tl.histogram) instead.
# Counter of bin b: tk_shist[b * {copies} + lane % {copies}]; bin {bins} is the spare counter.
INTERPRETER_TWINS = {{"_shist_init": "_shist_init_twin", "_shist_add": "_shist_add_twin",
                     "_shist_counts": "_shist_counts_twin"}}


@triton.jit
def _shist_init():
    # one declaration per program (a scalar asm: emitted once), zeroed, then a barrier
    tl.inline_asm_elementwise(".shared .align 16 .b32 tk_shist[{words}];\\n\\tmov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise("{{ .reg .u32 a; .reg .pred p; setp.lt.u32 p, $1, {words}; mov.u32 a, tk_shist; mad.lo.u32 a, $1, 4, a; @p st.shared.u32 [a], 0; mov.u32 $0, 0; }}",
                              "=r,r", [tl.arange(0, {zero})], dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise("bar.sync 0;\\n\\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    return tl.zeros([{nb}], dtype=tl.int32)


@triton.jit
def _shist_add(counts, pos):
    tl.inline_asm_elementwise("{{ .reg .u32 a, l, s;{index} mov.u32 s, tk_shist; mad.lo.u32 a, a, 4, s; red.shared.add.u32 [a], 1; mov.u32 $0, 0; }}",
                              "=r,r", [pos], dtype=tl.int32, is_pure=False, pack=1)
    return counts


@triton.jit
def _shist_counts(counts):
    tl.inline_asm_elementwise("bar.sync 0;\\n\\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    return {read}


@triton.jit
def _shist_init_twin():
    return tl.zeros([{nb}], dtype=tl.int32)


@triton.jit
def _shist_add_twin(counts, pos):
    return counts + tl.histogram(pos, {nb}, mask=pos < {nb})


@triton.jit
def _shist_counts_twin(counts):
    return counts
'''


def _round_expr(v: str, dtype: str) -> str:
    if dtype == "bfloat16":
        return f"_round_bf16({v})"
    if dtype == "float16":
        return f"{v}.to(tl.float16).to(tl.float32)"
    return v


def _to_dtype(v: float, dtype: str) -> float:
    """ATen's Scalar -> dtype conversion (through float) of a double, as a Python float."""
    return float(torch.tensor(v, dtype=torch.float64).to(torch.float32).to(getattr(torch, dtype)).item())


class HistcFamily(KernelFamily):
    name = "histc"
    ops = frozenset({"aten.histc.default"})
    edge_kinds = ("zeros", "large", "negative", "special")

    # --- analysis ---------------------------------------------------------------------------
    def _analyse(self, spec: KernelSpec) -> dict | str:
        args, x = cg.operand(spec, "self", cg.FLOAT_TYPES)
        bins = args.get("bins", 100)
        if not isinstance(bins, int) or isinstance(bins, bool) or bins <= 0:
            return f"bins must be a positive int, got {bins!r}"
        lo, hi = cg.scalar_value(args.get("min", 0)), cg.scalar_value(args.get("max", 0))
        if lo is None or hi is None:
            return "min/max must be numbers"
        lo, hi = float(lo), float(hi)
        if len(spec.outputs) != 1 or tuple(spec.outputs[0].shape) != (bins,) or spec.outputs[0].dtype != x.dtype:
            return f"output {spec.outputs} is not a [{bins}] {x.dtype} histogram"
        if x.numel == 0:
            return "empty input"
        exact_ints = {"float32": 2**24, "float16": 2048, "bfloat16": 256}[x.dtype]
        if bins > exact_ints:
            # ATen rounds the bin position to the dtype: above this it can round past the last bin
            # and write out of bounds (undefined behaviour, seen corrupting memory on CPU)
            return f"histc with {bins} bins in {x.dtype}: ATen's bin index can exceed the histogram (over {exact_ints})"
        if bins >= 2**31 - 1 or x.numel >= 2**31 - 1:
            return "more than 2^31 bins or counts do not fit the int32 counters"
        plan = {"bins": bins, "dtype": x.dtype, "N": x.numel, "data_range": lo == hi,
                "out_stride": spec.outputs[0].stride[0]}
        if lo != hi:
            if not (math.isfinite(lo) and math.isfinite(hi)):
                return "ATen refuses a non-finite range"
            if lo > hi:
                return "ATen refuses min > max"
            lo_t, hi_t = _to_dtype(lo, x.dtype), _to_dtype(hi, x.dtype)
            if not lo_t < hi_t or not math.isfinite(hi_t - lo_t):
                return f"range [{lo}, {hi}] collapses or overflows in {x.dtype} (ATen's bin arithmetic divides by 0)"
            # ATen bins with the edges in the dtype; the float64 reference with the doubles
            plan.update(lo=lo_t, hi=hi_t, lo64=lo, hi64=hi, width=_to_dtype(hi_t - lo_t, x.dtype))
        sizes, strides = cg.simplify(x.shape, [x.stride], order_by=0)
        plan.update(sizes=sizes, strides=strides)
        return plan

    # --- configs ------------------------------------------------------------------------------
    def _valid(self, plan: dict, c: Config) -> bool:
        b, it, w, v = c["BLOCK"], c["ITERS"], c["num_warps"], c["VARIANT"]
        if v not in VARIANTS or w not in (1, 2, 4, 8, 16):
            return False
        if v == "local" and plan["bins"] > LOCAL_MAX_BINS:
            return False
        if (c.get("COPIES") is not None) != (v == "shared"):  # COPIES only (and always) with "shared"
            return False
        if v == "shared" and (c["COPIES"] not in SHARED_COPIES or _shared_words(plan["bins"], c["COPIES"]) > SHARED_MAX_WORDS):
            return False
        if (c.get("ONEHOT") is not None) != (v == "dot"):  # ONEHOT only (and always) with "dot"
            return False
        if v == "dot":
            if max(_dot_tile(plan["bins"])) > DOT_MAX_SIDE or c["ONEHOT"] not in ONEHOTS or w > 8:
                return False
            if sum(_dot_tile(plan["bins"])) * b * (1 if c["ONEHOT"] == "int8" else 2) > DOT_MAX_SMEM:
                return False
            if c["ONEHOT"] == "float16" and b * it >= 2**24:  # fp32 sums of ones are exact below 2^24
                return False
        if c.get("STREAM", "") not in STREAMS or c.get("REVERSE", False) not in (True, False):
            return False
        if c.get("REVERSE") and not plan["data_range"]:
            return False  # the reversed order reuses what the range pass left in L2
        p = c.get("ONE_LAUNCH", 0)
        if p:  # programs walk their blocks (ITERS 1) and always take them last-first (no REVERSE)
            if not plan["data_range"] or isinstance(p, bool) or not isinstance(p, int) or c.get("REVERSE") \
                    or c["ITERS"] != 1:
                return False
            if not 1 <= p <= min(MAX_PARTIALS, -(-plan["N"] // b)):
                return False
        cap = max(128, min(16384, _p2(plan["N"])))
        if not (_is_pow2(b) and 128 <= b <= cap and b >= 32 * w):
            return False
        return _is_pow2(it) and it <= 64 and (it == 1 or (it // 2) * b < plan["N"])

    def _cfg(self, plan: dict, block: int, warps: int, variant: str, programs: int = 528, **extra) -> Config:
        n = plan["N"]
        block = max(128, min(block, _p2(n), 16384))
        warps = max(1, min(warps, block // 32))
        iters = 1
        while iters < 64 and -(-n // (block * iters * 2)) >= programs:  # keep ~programs programs
            iters *= 2
        return Config.of(BLOCK=block, ITERS=iters, num_warps=warps, VARIANT=variant, **extra)

    def _one_launch(self, plan: dict, block: int, warps: int, programs: int, **extra) -> Config:
        """A ONE_LAUNCH config of at most ``programs`` programs (no more than there are blocks)."""
        c = self._cfg(plan, block, warps, extra.pop("VARIANT"), **extra)
        return c.replace(ITERS=1, ONE_LAUNCH=max(1, min(programs, -(-plan["N"] // c["BLOCK"]))))

    def _seeds(self, spec: KernelSpec, plan: dict) -> list[Config]:
        seeds = []
        # "shared" first (H200, 16M fp32 in 256 bins: ~0.03 ms against 0.071 for "local"; the
        # copies hardly matter there: 0.029-0.032 ms over 1, 8 and 32), reading with evict_first
        # (under do_bench's L2 flush: 0.027 against 0.030 ms; the data range: 0.054 against 0.056)
        fits = [k for k in SHARED_COPIES[::-1] if _shared_words(plan["bins"], k) <= SHARED_MAX_WORDS]
        if fits and _inline_ptx():
            order = {"REVERSE": True} if plan["data_range"] else {}
            if plan["data_range"]:
                # One launch (range pass, grid barrier, histogram): on a slow host a data range's two
                # launches cost more host time than the GPU time they take (H200: 0.086 ms of host
                # time against 0.043 on the GPU). Swept on the H200 (16M fp32, 256 bins, L2 flushed):
                # 4-6 programs of 8 warps per SM 0.052-0.053 ms (two launches: 0.055), 2 per SM
                # 0.062-0.064, 1 per SM 0.110
                seeds += [self._one_launch(plan, 2048, 8, 4 * SMS, VARIANT="shared", COPIES=fits[-1],
                                           STREAM="evict_first"),
                          self._one_launch(plan, 1024, 8, 6 * SMS, VARIANT="shared", COPIES=fits[-1],
                                           STREAM="evict_first")]
                # the two-launch sweep's best (0.054 ms): smaller blocks, 16 per program
                seeds.append(self._cfg(plan, 2048, 8, "shared", 512, COPIES=fits[-1], STREAM="evict_first"))
            seeds += [self._cfg(plan, 8192, 8, "shared", 512, COPIES=fits[0], STREAM="evict_first"),
                      self._cfg(plan, 4096, 8, "shared", 256, COPIES=fits[-1], STREAM="evict_first", **order),
                      self._cfg(plan, 4096, 16, "shared", 512, COPIES=fits[0]),
                      self._cfg(plan, 8192, 8, "shared", 512, COPIES=fits[min(1, len(fits) - 1)], STREAM="evict_first")]
        if plan["bins"] <= LOCAL_MAX_BINS:
            # tl.histogram's cost per call falls with the elements each thread bins per call
            # (sm_90 SASS: ~81 instructions per 32 elements at 8 per thread, ~55 at 32 per thread)
            seeds += [self._cfg(plan, 4096, 4, "local"), self._cfg(plan, 8192, 8, "local"),
                      self._cfg(plan, 2048, 8, "local"), self._cfg(plan, 1024, 4, "local", 1056)]
        # "dot": BLOCK elements per tl.dot (its K); ~1000 programs at 16M elements
        seeds += [self._cfg(plan, 1024, 4, "dot", ONEHOT="int8"), self._cfg(plan, 4096, 8, "dot", ONEHOT="int8"),
                  self._cfg(plan, 2048, 8, "dot", ONEHOT="float16")]
        seeds += [self._cfg(plan, 1024, 4, "atomic")]
        return seeds

    def _steps(self, plan: dict, c: Config) -> list[Config]:
        cands = [c.replace(BLOCK=c["BLOCK"] * 2), c.replace(BLOCK=c["BLOCK"] // 2),
                 c.replace(ITERS=c["ITERS"] * 2), c.replace(ITERS=max(1, c["ITERS"] // 2)),
                 c.replace(num_warps=c["num_warps"] * 2), c.replace(num_warps=max(1, c["num_warps"] // 2))]
        cands += [c.replace(STREAM=h) for h in STREAMS] + [c.replace(REVERSE=not c.get("REVERSE", False))]
        p = c.get("ONE_LAUNCH", 0)
        cands += ([c.replace(ONE_LAUNCH=p * 2), c.replace(ONE_LAUNCH=max(1, p // 2)), c.replace(ONE_LAUNCH=0)] if p
                  else [self._one_launch(plan, c["BLOCK"], c["num_warps"], 4 * SMS,
                                         **{k: v for k, v in c.params if k not in ("BLOCK", "num_warps", "ITERS", "REVERSE")})])
        base = {k: v for k, v in c.params if k not in ("VARIANT", "ONEHOT", "COPIES")}
        cands += [Config.of(**base, VARIANT=v) for v in ("local", "atomic")]
        cands += [Config.of(**base, VARIANT="shared", COPIES=k) for k in SHARED_COPIES if _inline_ptx()]
        cands += [Config.of(**base, VARIANT="dot", ONEHOT=o) for o in ONEHOTS]
        return [_canonical(x) for x in cands]

    # --- generation ---------------------------------------------------------------------------
    def generate(self, spec: KernelSpec, config: Config) -> KernelProgram:
        return _HistcWriter(spec, self.checked_plan(spec, config), config).program()

    # --- validation inputs --------------------------------------------------------------------
    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Inputs whose bins do not depend on precision.

        The float64 reference bins in double; ATen (and this kernel) bin in the input dtype, so an
        element within rounding distance of a bin edge may land one bin apart, legitimately. Such
        elements are moved to the middle of their bin (the exact-match test against torch.histc on
        unrestricted data covers edges).
        """
        plan = self.plan(spec)
        g = torch.Generator().manual_seed(seed)
        m = spec.inputs[0]
        x = sample_tensor(m, g, kind)
        if isinstance(plan, str) or not m.numel:
            return [to_device(x, device)]
        span = 1 + sum((n - 1) * st for n, st in zip(m.shape, m.stride))
        flat = torch.as_strided(x, (span,), (1,), x.storage_offset())
        flat.copy_(_unambiguous(flat.clone(), plan))
        return [to_device(x, device)]


class _HistcWriter:
    """The program of one histc spec under one config (``HistcFamily.generate``): the kernels of
    the module docstring, written piece by piece into one source. The values derived from the
    plan and the config are attributes; each method emits one piece of kernel code."""

    def __init__(self, spec: KernelSpec, plan: dict, config: Config):
        self.spec, self.plan, self.config = spec, plan, config
        self.block, self.iters, self.warps = int(config["BLOCK"]), int(config["ITERS"]), int(config["num_warps"])
        self.variant = config["VARIANT"]
        self.bins, self.dtype, self.n = plan["bins"], plan["dtype"], plan["N"]
        self.data_range = plan["data_range"]
        self.half = self.dtype != "float32"
        self.direct = not self.half            # fp32: count into the output (float atomics, as ATen)
        self.nb = max(32, _p2(self.bins))
        self.per_prog = self.block * self.iters
        self.grid = (-(-self.n // self.per_prog),)
        # a data range: histc_range_kernel's programs each take r_iters blocks, so that the
        # histogram's programs read at most MAX_PARTIALS partial ranges
        self.r_iters = self.iters
        while -(-self.n // (self.block * self.r_iters)) > MAX_PARTIALS:
            self.r_iters *= 2
        self.parts = -(-self.n // (self.block * self.r_iters))
        # ONE_LAUNCH: a data range in one launch of sync_p persistent programs (a grid barrier
        # between the range and the histogram), each taking blocks pid, pid + sync_p, ...
        self.sync_p = int(config.get("ONE_LAUNCH", 0))
        if self.sync_p:
            self.parts, self.r_iters = self.sync_p, 1
        self.wide = cg.needs_int64(plan["sizes"], plan["strides"], slack=self.block * self.r_iters)
        self.ostride = plan["out_stride"]
        self.T = cg.tl_type(self.dtype)
        self.inf = cg.float_literal(math.inf)
        self.launches: list[Launch] = []
        self.temps: list[Buffer] = []
        self.counts_arg = ("out", 0) if self.direct else ("tmp", 1 if self.data_range else 0)
        self.cstride = self.ostride if self.direct else 1
        self.s = cg.Source()

    def program(self) -> KernelProgram:
        self.head()
        if self.sync_p:
            return self.one_launch()
        # 1. range from the data
        if self.data_range:
            self.range_kernel()
        # 2. the histogram
        self.histogram_kernel()
        # 3. exact integer counts -> output dtype (NaN where ATen would have raised)
        if not self.direct:
            self.finish_kernel()
        return KernelProgram(self.s.text(), tuple(self.launches),
                             output_init=(0,) if self.direct and not self.data_range else (), temps=tuple(self.temps))

    def head(self) -> None:
        """The module's header comments and helpers."""
        s, n, bins, parts, sync_p = self.s, self.n, self.bins, self.parts, self.sync_p
        s(cg.HEADER, cg.describe_spec(self.spec))
        s(f"# {n} elements over sizes {list(self.plan['sizes'])}, strides {list(self.plan['strides'][0])}; {bins} bins")
        if sync_p:
            s(f"# one launch of {sync_p} programs, each taking blocks pid, pid + {sync_p}, ...: the range pass, a grid",
              "# barrier, the histogram; range_ptr = per program [min], [-max], [NaN flag (-1 = NaN seen)]")
        else:
            s(f"# each program bins {self.iters} block(s) of BLOCK elements ({self.per_prog} in all)")
        if self.data_range and not sync_p:
            s(f"# range from the data: histc_range_kernel -> tmp0 = per program [min] * {parts}, [-max] * {parts},",
              f"# [NaN flag (-1 = NaN seen)] * {parts}; the programs after it reduce those partials")
        s.blank()
        if self.dtype == "bfloat16":
            s(BF16_ROUND.strip("\n")).blank()
        if self.variant == "shared":
            s(_shared_helpers(bins, self.nb, int(self.config["COPIES"])).strip("\n")).blank()

    # --- pieces of the passes -----------------------------------------------------------------
    def elements(self, iters: int | None = None, blk: str = "pid", hint: str = "") -> str | None:
        """Emit idx/mask/offset lines for block ``it`` of ``iters`` of program block ``blk``, and
        the load of x (cache policy ``hint``); returns the mask name (or None)."""
        s, wide = self.s, self.wide
        iters = self.iters if iters is None else iters
        s(f"idx = ({blk}{'.to(tl.int64)' if wide else ''} * {iters} + it) * BLOCK + tl.arange(0, BLOCK)"
          if iters > 1 else f"idx = {blk}{'.to(tl.int64)' if wide else ''} * BLOCK + tl.arange(0, BLOCK)")
        mask = None
        if self.n % (self.block * iters):
            s(f"mask = idx < {self.n}")
            mask = "mask"
        lines, offs = cg.decompose("idx", self.plan["sizes"], self.plan["strides"], "i")
        for line in lines:
            s(line)
        kw = f", mask={mask}, other=0.0" if mask else ""
        kw += f", eviction_policy={hint!r}" if hint else ""
        conv = "" if self.dtype == "float32" else ".to(tl.float32)"
        # one element per lane, always: a 0-d, one-element or broadcast input has the offset "0"
        s(f"x = tl.load(in0_ptr + {cg.as_block(offs[0], 'idx')}{kw}){conv}")
        return mask

    def loop_header(self, iters: int | None = None, reverse: bool = False) -> None:
        iters = self.iters if iters is None else iters
        if iters > 1 and reverse:
            self.s(f"for it0 in range({iters}):").indent()(f"it = {iters - 1} - it0")
        elif iters > 1:
            self.s(f"for it in range({iters}):").indent()

    def loop_end(self, iters: int | None = None) -> None:
        if (self.iters if iters is None else iters) > 1:
            self.s.dedent()

    def read_range(self, fresh: bool = False) -> None:
        """Emit mn, mx and nan_seen: the data's range, reduced from the programs' partials;
        ``fresh``: written in this launch (behind a grid barrier), so read from L2, not L1."""
        parts, inf = self.parts, self.inf
        p2 = max(2, _p2(parts))
        kw = f", mask=r < {parts}, other=" if p2 != parts else None
        cg_ = ', cache_modifier=".cg"' if fresh else ""
        self.s(f"r = tl.arange(0, {p2})",
               f"mn = tl.min(tl.load(range_ptr + r{kw + inf if kw else ''}{cg_}), 0)",
               f"mx = -tl.min(tl.load(range_ptr + {parts} + r{kw + inf if kw else ''}{cg_}), 0)",
               f"nan_seen = tl.min(tl.load(range_ptr + {2 * parts} + r{kw + '0.0' if kw else ''}{cg_}), 0)")

    def bins_slice(self, programs: int) -> str:
        """Emit zb/zmask: this program's share of the bins (for zeroing or NaN-filling them)."""
        bins = self.bins
        share = -(-bins // programs)
        self.s(f"zb = pid * {share} + tl.arange(0, {_p2(share)})",
               f"zmask = zb < {bins}" if _p2(share) == share else
               f"zmask = (tl.arange(0, {_p2(share)}) < {share}) & (zb < {bins})")
        return "zmask"

    def range_pass(self, blocks: int | None = None) -> None:
        """Emit this program's partial range (min, -max, a NaN flag) into range_ptr[pid] and the
        zeroing of its share of the counts; ``blocks``: iterate pid, pid + P, ... over that many
        blocks (one launch), else the program's r_iters blocks."""
        s, parts, inf = self.s, self.parts, self.inf
        s(f"lo = tl.full([BLOCK], {inf}, dtype=tl.float32)",
          f"neg_hi = tl.full([BLOCK], {inf}, dtype=tl.float32)",
          "nan_seen = tl.zeros([BLOCK], dtype=tl.float32)")
        if blocks is None:
            self.loop_header(self.r_iters)
            mask = self.elements(self.r_iters)
        else:
            s(f"for blk in range(pid, {blocks}, {parts}):").indent()
            mask = self.elements(1, blk="blk")
        ok = f"{mask} & (x == x)" if mask else "x == x"
        s(f"lo = tl.minimum(lo, tl.where({ok}, x, {inf}))",
          f"neg_hi = tl.minimum(neg_hi, tl.where({ok}, -x, {inf}))",
          f"nan_seen = tl.minimum(nan_seen, tl.where({(mask + ' & ') if mask else ''}(x != x), -1.0, 0.0))")
        if blocks is None:
            self.loop_end(self.r_iters)
        else:
            s.dedent()
        s("tl.store(range_ptr + pid, tl.min(lo, 0))",
          f"tl.store(range_ptr + {parts} + pid, tl.min(neg_hi, 0))",
          f"tl.store(range_ptr + {2 * parts} + pid, tl.min(nan_seen, 0))",
          "# the counts start at zero (every program adds to them after this)")
        zmask = self.bins_slice(parts)
        s(f"tl.store(hist_ptr + {cg.scaled('zb', self.cstride)}, {'0.0' if self.direct else '0'}, mask={zmask})")

    def data_edges(self, fresh: bool) -> None:
        """Emit lo, hi, valid and width from the partial ranges (ATen's arithmetic)."""
        dtype, inf = self.dtype, self.inf
        self.read_range(fresh)
        self.s("# ATen: an empty data range widens by 1 each way (in double), then edges round to the dtype",
               "lo64 = tl.where(mn == mx, mn.to(tl.float64) - 1.0, mn.to(tl.float64))",
               "hi64 = tl.where(mn == mx, mx.to(tl.float64) + 1.0, mx.to(tl.float64))",
               f"lo = {_round_expr('lo64.to(tl.float32)', dtype)}",
               f"hi = {_round_expr('hi64.to(tl.float32)', dtype)}",
               "# where ATen raises (NaN or inf in the data) the range is made empty: nothing counts",
               f"valid = (nan_seen == 0.0) & (lo > -{inf}) & (hi < {inf})",
               f"lo = tl.where(valid, lo, {inf})",
               f"hi = tl.where(valid, hi, -{inf})")
        width = ("_round_bf16(hi - lo)" if dtype == "bfloat16" else f"(hi - lo).to({self.T}).to(tl.float32)"
                 if self.half else "hi - lo")
        self.s(f"width = {width}")

    # --- the histogram pass -------------------------------------------------------------------
    def histogram_pass(self, blocks: int | None = None) -> None:
        """Emit the counting of this program's elements into hist_ptr; ``blocks`` as in
        range_pass (then walked last-first, so it starts on what the range pass read last)."""
        edges = self.edges(blocks)
        self.counts_init()
        mask = self.walk(blocks)
        self.bin_position(mask, *edges)
        self.count()
        if blocks is not None:
            self.s.dedent()
        else:
            self.loop_end()
        self.flush_counts(blocks)

    def edges(self, blocks: int | None) -> tuple[str, str, str]:
        """Emit the range's edges where they come from the data; (lo, hi, width) as expressions."""
        plan, dtype = self.plan, self.dtype
        if self.data_range:
            self.data_edges(fresh=blocks is not None)
            return "lo", "hi", "width"
        lo_e, hi_e, width_e = (cg.float_literal(plan[k]) for k in ("lo", "hi", "width"))
        lo_e = f"({lo_e})" if lo_e.startswith("-") else lo_e
        self.s(f"# range [{plan['lo']!r}, {plan['hi']!r}] in {dtype}; width hi - lo = {plan['width']!r} in {dtype}")
        return lo_e, hi_e, width_e

    def counts_init(self) -> None:
        """Emit the program's counts, zero (variants "local", "shared", "dot")."""
        s, variant = self.s, self.variant
        if variant == "local":
            s(f"counts = tl.zeros([{self.nb}], dtype=tl.int32)")
        elif variant == "shared":
            s("counts = _shist_init()")
        elif variant == "dot":
            nhi, nlo = _dot_tile(self.bins)
            int8 = self.config["ONEHOT"] == "int8"
            s(f"# bin = hi * {nlo} + lo: counts[hi, lo] += one_hot(hi)^T @ one_hot(lo) on the tensor cores",
              f"counts = tl.zeros([{nhi}, {nlo}], dtype={'tl.int32' if int8 else 'tl.float32'})")

    def walk(self, blocks: int | None) -> str | None:
        """Emit the loop over this program's blocks and the load of x in it; returns the mask."""
        s, parts = self.s, self.parts
        stream = self.config.get("STREAM", "")
        if blocks is not None:
            s(f"count = ({blocks - 1} - pid) // {parts} + 1  # this program's blocks: pid, pid + {parts}, ...",
              "for i in range(count):").indent()
            s(f"blk = pid + (count - 1 - i) * {parts}")
            return self.elements(1, blk="blk", hint=stream)
        reverse = bool(self.config.get("REVERSE", False))
        if reverse:
            s("# blocks in reverse order: the first programs read what the range pass read last, while",
              "# it is still in L2")
            s(f"blk = {self.grid[0] - 1} - pid")
        self.loop_header(reverse=reverse)
        return self.elements(blk="blk" if reverse else "pid", hint=stream)

    def bin_position(self, mask: str | None, lo_e: str, hi_e: str, width_e: str) -> None:
        """Emit keep (x counts) and pos (its bin), in ATen's arithmetic."""
        s, dtype, bins = self.s, self.dtype, self.bins
        bins_f = float(bins) if not self.half else _to_dtype(float(bins), dtype)
        keep = " & ".join(([mask] if mask else []) + [f"(x >= {lo_e})", f"(x <= {hi_e})"])
        s(f"keep = {keep}  # NaN fails both comparisons")
        inv = None if self.data_range else _exact_inverse(self.plan["width"])
        if inv is not None:
            s(f"# the width is a power of two: q * {inv!r} is q / width exactly (the same single rounding)")
        div = (lambda q: f"tl.div_rn({q}, {width_e})") if inv is None else (lambda q: f"({q} * {cg.float_literal(inv)})")
        if self.half:
            T = self.T
            rnd = (lambda v: f"_round_bf16({v})") if dtype == "bfloat16" else (lambda v: f"({v}).to({T}).to(tl.float32)")
            s(f"# ATen's {dtype} arithmetic rounds after every step",
              f"d = {rnd(f'x - {lo_e}')}",
              f"q = {rnd(f'd * {cg.float_literal(bins_f)}')}",
              f"pos = {rnd(div('q'))}.to(tl.int32)")
        else:
            s(f"pos = {div(f'((x - {lo_e}) * {cg.float_literal(bins_f)})')}.to(tl.int32)")
        s(f"pos = tl.minimum(tl.maximum(pos, 0), {bins - 1})  # x == max lands in the last bin")

    def count(self) -> None:
        """Emit the counting of the block's positions (per variant)."""
        s, variant, bins = self.s, self.variant, self.bins
        if variant == "local":
            s(f"counts += tl.histogram(pos, {self.nb}, mask=keep)")
        elif variant == "shared":
            s(f"counts = _shist_add(counts, tl.where(keep, pos, {bins}))  # no bin: the spare counter {bins}")
        elif variant == "dot":
            nhi, nlo = _dot_tile(bins)
            int8 = self.config["ONEHOT"] == "int8"
            oh = "tl.int8" if int8 else "tl.float16"
            s(f"sel = tl.where(keep, pos >> {nlo.bit_length() - 1}, -1)  # no bin: an all-zero one-hot column",
              "# one-hots as [HI|LO, BLOCK]: with BLOCK minor each element's bin stays in one thread",
              "# ([BLOCK, 16] made Triton recompute the bin arithmetic in 16 threads: ~4x the SASS)",
              f"oh_hi = (sel[None, :] == tl.arange(0, {nhi})[:, None]).to({oh})",
              f"oh_lo = ((pos & {nlo - 1})[None, :] == tl.arange(0, {nlo})[:, None]).to({oh})",
              f"counts = tl.dot(oh_hi, tl.trans(oh_lo), counts{', out_dtype=tl.int32' if int8 else ''})")
        else:
            s(f"tl.atomic_add(hist_ptr + {cg.scaled('pos', self.cstride)}, {'1.0' if self.direct else '1'}, "
              "mask=keep, sem=\"relaxed\")")

    def flush_counts(self, blocks: int | None) -> None:
        """Emit the program's counts added to hist_ptr after its blocks (and the NaN bins where
        ATen would have raised)."""
        s, variant, bins, cstride, direct = self.s, self.variant, self.bins, self.cstride, self.direct
        if variant == "shared":
            s("counts = _shist_counts(counts)  # after a barrier: the program's counts from shared memory")
        if variant != "atomic":  # one atomic per non-empty bin; counts[hi, lo] is bin hi * LO + lo
            if variant in ("local", "shared"):
                s(f"b = tl.arange(0, {self.nb})")
            else:
                nhi, nlo = _dot_tile(bins)
                s(f"b = tl.arange(0, {nhi})[:, None] * {nlo} + tl.arange(0, {nlo})[None, :]")
            int8 = variant == "dot" and self.config["ONEHOT"] == "int8"
            cast = ".to(tl.float32)" if direct else "" if variant != "dot" or int8 else ".to(tl.int32)"
            s(f"tl.atomic_add(hist_ptr + {cg.scaled('b', cstride)}, "
              f"counts{cast}, mask=(b < {bins}) & (counts > 0), sem=\"relaxed\")")
        if self.data_range and direct:
            s("# where ATen raises, every bin is NaN (nothing was counted: the range was made empty)")
            zmask = self.bins_slice(self.parts if blocks is not None else self.grid[0])
            s(f"tl.store(hist_ptr + {cg.scaled('zb', cstride)}, float('nan'), mask={zmask} & (valid == 0))")

    def finish(self, counts: str, b: str, bmask: str | None, fresh: bool = False) -> None:
        """Emit the conversion of the exact int32 counts at ``counts`` + bins ``b`` to the output
        dtype (NaN where ATen would have raised)."""
        s = self.s
        kw = f", mask={bmask}" if bmask else ""
        kw += ', cache_modifier=".cg"' if fresh else ""
        s(f"y = tl.load({counts} + {b}{kw}).to(tl.float32)")
        if self.data_range:
            self.read_range(fresh)
            s(f"valid = (nan_seen == 0.0) & (mn > -{self.inf}) & (mx < {self.inf})",
              "y = tl.where(valid, y, float('nan'))")
        v = {"float32": "y", "float16": "y.to(tl.float16)",
             "bfloat16": "_round_bf16(y).to(tl.bfloat16)"}[self.dtype]
        s(f"tl.store(out0_ptr + {cg.scaled(b, self.ostride)}, {v}{f', mask={bmask}' if bmask else ''})")

    # --- the kernels ---------------------------------------------------------------------------
    def one_launch(self) -> KernelProgram:
        """One launch of sync_p programs: the range pass, a grid barrier, the histogram pass
        (and for fp16/bf16 another barrier, then the conversion of the counts)."""
        s, sync_p, direct, parts = self.s, self.sync_p, self.direct, self.parts
        phases = 2 if direct else 3
        nblk = -(-self.n // self.block)
        s(cg.grid_barrier_source(sync_p).strip("\n")).blank()
        self.temps.append(Buffer((3 * parts,), "float32", None))
        if not direct:
            self.temps.append(Buffer((self.bins,), "int32", None))
        params = ["in0_ptr", "hist_ptr", "range_ptr", "sync_ptr"] + ([] if direct else ["out0_ptr"])
        s("@triton.jit", f"def histc_kernel({', '.join(params)}, BLOCK: tl.constexpr, PHASE: tl.constexpr):").indent()
        s("# PHASE 0: every phase, with grid barriers between them (the GPU); k: phase k alone (the",
          "# interpreter launches phase after phase)",
          "pid = tl.program_id(0)",
          "if PHASE == 0 or PHASE == 1:").indent()
        s("# 1. this program's share of the range; zero its share of the counts")
        self.range_pass(nblk)
        s.dedent()("if PHASE == 0:").indent()("_grid_barrier(sync_ptr)").dedent()
        s("if PHASE == 0 or PHASE == 2:").indent()
        s("# 2. the histogram, with the range reduced from every program's partial")
        self.histogram_pass(nblk)
        s.dedent()
        if not direct:
            s("if PHASE == 0:").indent()("_grid_barrier(sync_ptr)").dedent()
            s("if PHASE == 0 or PHASE == 3:").indent()("# 3. the exact counts to the output dtype")
            self.bins_slice(parts)
            self.finish("hist_ptr", "zb", "zmask", fresh=True)
            s.dedent()
        s.dedent().blank()
        args = (("in", 0), self.counts_arg, ("tmp", 0), ("state", 0)) + (() if direct else (("out", 0),))
        self.launches.append(Launch("histc_kernel", (sync_p,), args, {"BLOCK": self.block, PHASE: 0}, self.warps, 1,
                                    phases))
        return KernelProgram(s.text(), tuple(self.launches), temps=tuple(self.temps),
                             state=(Buffer((1,), "int32", 0),))

    def range_kernel(self) -> None:
        """The range from the data, as partial ranges per program, no atomics: nothing to
        initialise, so a call makes two launches (three for fp16/bf16) and no fills. This kernel
        also zeroes the counts."""
        s = self.s
        s("@triton.jit", "def histc_range_kernel(in0_ptr, range_ptr, hist_ptr, BLOCK: tl.constexpr):").indent()
        s("pid = tl.program_id(0)")
        self.range_pass()
        s.dedent().blank()
        self.temps.append(Buffer((3 * self.parts,), "float32", None))
        self.launches.append(Launch("histc_range_kernel", (self.parts,), (("in", 0), ("tmp", 0), self.counts_arg),
                                    {"BLOCK": self.block}, self.warps, 1))

    def histogram_kernel(self) -> None:
        s, data_range = self.s, self.data_range
        if not self.direct:  # zeroed by the range kernel, when there is one
            self.temps.append(Buffer((self.bins,), "int32", None if data_range else 0))
        params = ["in0_ptr", "hist_ptr"] + (["range_ptr"] if data_range else []) + ["BLOCK: tl.constexpr"]
        s("@triton.jit", f"def histc_kernel({', '.join(params)}):").indent()
        s("pid = tl.program_id(0)")
        self.histogram_pass()
        s.dedent().blank()
        args = (("in", 0), self.counts_arg) + ((("tmp", 0),) if data_range else ())
        self.launches.append(Launch("histc_kernel", self.grid, args, {"BLOCK": self.block}, self.warps, 1))

    def finish_kernel(self) -> None:
        """The exact integer counts converted to the output dtype (NaN where ATen would have raised)."""
        s, bins, data_range = self.s, self.bins, self.data_range
        fb = min(_p2(bins), 1024)
        params = ["counts_ptr", "out0_ptr"] + (["range_ptr"] if data_range else []) + ["BLOCK: tl.constexpr"]
        s("@triton.jit", f"def histc_finish_kernel({', '.join(params)}):").indent()
        s("b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)")
        bmask = bins % fb != 0
        if bmask:
            s(f"bmask = b < {bins}")
        self.finish("counts_ptr", "b", "bmask" if bmask else None)
        s.dedent()
        args = (("tmp", len(self.temps) - 1), ("out", 0)) + ((("tmp", 0),) if data_range else ())
        self.launches.append(Launch("histc_finish_kernel", (-(-bins // fb),), args, {"BLOCK": fb},
                                    4 if fb >= 512 else 1, 1))


def _bin_positions(x32: torch.Tensor, lo: float, hi: float, bins: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, pos) as ATen computes them in ``dtype`` (x32: the values as float32)."""
    t = getattr(torch, dtype)
    r = (lambda v: v.to(t).to(torch.float32)) if dtype != "float32" else (lambda v: v)
    lo32, hi32 = torch.tensor(lo, dtype=torch.float32), torch.tensor(hi, dtype=torch.float32)
    width = r(hi32 - lo32)
    bins_t = torch.tensor(_to_dtype(float(bins), dtype) if dtype != "float32" else float(bins), dtype=torch.float32)
    d = r(x32 - lo32)
    q = r(d * bins_t)
    pos = r(q / width)
    keep = (x32 >= lo32) & (x32 <= hi32)
    pos = torch.where(keep, pos, torch.zeros_like(pos)).to(torch.int64).clamp(0, bins - 1)
    return keep, pos


def _data_ranges(x: torch.Tensor, plan: dict) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """((lo, hi) in the dtype as ATen uses them, (lo, hi) as the float64 reference uses them)."""
    finite = x[x.isfinite()]
    if finite.numel() != x.numel():
        return None  # ATen raises: no bins to protect
    mn, mx = float(x.min()), float(x.max())
    if mn == mx:
        return (_to_dtype(mn - 1, plan["dtype"]), _to_dtype(mx + 1, plan["dtype"])), (mn - 1, mx + 1)
    return (mn, mx), (mn, mx)


def _unambiguous(flat: torch.Tensor, plan: dict) -> torch.Tensor:
    bins, dtype = plan["bins"], plan["dtype"]
    if plan["data_range"]:
        r = _data_ranges(flat, plan)
        if r is None:
            return flat
        (lo, hi), (lo64, hi64) = r
        fallback = lo                   # the data's min: bin 0 in both
    else:
        lo, hi, lo64, hi64 = plan["lo"], plan["hi"], plan["lo64"], plan["hi64"]
        fallback = float("nan")         # skipped by both
    for _ in range(4):
        x32 = flat.to(torch.float32)
        keep, pos = _bin_positions(x32, lo, hi, bins, dtype)
        x64 = flat.to(torch.float64)
        keep64 = (x64 >= lo64) & (x64 <= hi64)
        pos64 = torch.where(keep64, ((x64 - lo64) * bins / (hi64 - lo64)), torch.zeros_like(x64)).to(torch.int64)
        pos64 = pos64.clamp(0, bins - 1)
        bad = (keep != keep64) | (keep & (pos != pos64))
        if not bool(bad.any()):
            return flat
        # move them to the middle of the bin the reference chose (or of bin 0 if it skipped them)
        centre = lo64 + (pos64.to(torch.float64) + 0.5) * (hi64 - lo64) / bins
        flat = torch.where(bad, centre.to(flat.dtype), flat)
    return torch.where(bad, torch.full_like(flat, fallback), flat)


def _exact_inverse(width: float) -> float | None:
    """1 / width when width is a power of two whose inverse fp32 holds exactly, else None."""
    if width <= 0 or not math.isfinite(width) or math.frexp(width)[0] != 0.5:
        return None
    inv = 1.0 / width
    return inv if 2.0 ** -149 <= inv <= 2.0 ** 127 else None


def _canonical(c: Config) -> Config:
    """The same config without the optional keys at their defaults (one key per candidate)."""
    d = dict(c.params)
    for k, default in (("STREAM", ""), ("REVERSE", False), ("ONE_LAUNCH", 0)):
        if d.get(k, default) == default:
            d.pop(k, None)
    return Config.of(**d)


def _inline_ptx() -> bool:
    """Whether "shared" (inline PTX) can build here: NVIDIA (or the interpreter, on its twins); not ROCm."""
    return torch.version.hip is None


def _shared_words(bins: int, copies: int) -> int:
    """The "shared" variant's counters: ``copies`` per bin, for the spare bin too and for every
    bin the read-back touches (next_pow2(bins), at least 32)."""
    return max(max(32, _p2(bins)), bins + 1) * copies


def _dot_tile(bins: int) -> tuple[int, int]:
    """(HI, LO) of the "dot" count tile: powers of two, both >= 16 (tl.dot's minimum), HI * LO >= bins."""
    lo = max(16, _p2(math.isqrt(bins - 1) + 1))
    return max(16, _p2(-(-bins // lo))), lo


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(v) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


FAMILY = HistcFamily()
