"""conv1d (stride 1, groups 1, fp16/bf16, contiguous NCL) as a CUDA C++ implicit GEMM: bulk
copies and a transposed input slab in shared memory (conv1d_bulk.cu). The conv1d family
(conv1d.py) offers these configurations (``IMPL="cuda"``) beside its Triton ones for specs on a
CUDA device, where CUDA C++ can be built and run (building/nvcc.py's available()); fill_cache keeps
whichever validates and runs fastest.

Why CUDA C++: a tap at shift s reads the input s positions over, which in NCL memory is an
unaligned 2-byte offset. Triton 3.6 and Gluon gave no layout that is both vectorized and free of
bank conflicts under such a shift (benchmarks/CHANGELOG.md, sessions 7-9: 0.137 ms at
best on B2048 C96 L200 k3, against 0.086 needed for 4x eager). This kernel computes its own
shared-memory addresses: each batch element's input is transposed to [position][Cin + 8] rows,
so a shift is a whole-row offset, and the padded row stride keeps every ldmatrix conflict-free.
Every global transfer is a bulk copy (the copy engine) of one batch element, in flight while the
tensor cores (mma.sync m16n8k16, fp32 accumulators) work on the previous one.

Configuration:
  WARPS_M  warps over output channels (Cout / (16 * WARPS_M) m16 tiles each)
  WARPS_N  warps over positions (ceil(Lout / (8 * WARPS_N)) n8 tiles each)
  IN_BUFS  batch elements' inputs in flight (1 or 2; shared memory permitting)
  GRID     persistent programs, each walking the batch elements with a grid stride
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.base import SMS, Config, unique
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.spec import KernelSpec

if TYPE_CHECKING:
    from torch_kernelize.lowering.kernels.conv1d import _Plan

SOURCE = Path(__file__).with_name("conv1d_bulk.cu")
SHARED_LIMIT = 227 * 1024   # dynamic shared memory a block may opt into on sm_90 (H100/H200)
SHARED_PER_SM = 228 * 1024  # what one SM holds (1 KB of it reserved per block)
MAX_THREADS = 512
MAX_ACC = 128               # fp32 accumulators per thread: more spill
MAX_TAPS = 32               # taps are unrolled


def reason(plan: "_Plan") -> str | None:
    """Why the kernel cannot compute ``plan``'s convolution, or None when it can."""
    p = plan
    if p.dtype not in ("float16", "bfloat16"):
        return f"{p.dtype}: the CUDA C++ kernel is fp16/bf16 (mma.sync m16n8k16)"
    if p.stride != 1 or p.G != 1:
        return f"stride {p.stride}, groups {p.G}: the CUDA C++ kernel is stride 1, groups 1"
    if p.Cin % 16 or p.Cout % 16:
        return f"channels {p.Cin} -> {p.Cout}: the CUDA C++ kernel needs multiples of 16"
    if p.L % 8 or p.Lout % 2 or (p.Cout * p.Lout) % 8:
        return f"length {p.L} -> {p.Lout}: bulk copies move whole 16-byte units of each batch element"
    if p.K > MAX_TAPS:
        return f"{p.K} taps > {MAX_TAPS}"
    if p.x_strides != (p.Cin * p.L, p.L, 1) or p.w_strides != (p.Cin * p.K, p.K, 1) \
            or p.out_strides != (p.Cout * p.Lout, p.Lout, 1) or (p.bias is not None and p.bias_stride != 1):
        return "the CUDA C++ kernel reads and writes contiguous tensors (one bulk copy per batch element)"
    if p.N >= 2 ** 31:
        return f"batch {p.N} does not fit the kernel's int"
    if not any(valid(p, c) for c in _space(p)):
        return f"no tiling fits {SHARED_LIMIT} B of shared memory and {MAX_ACC} accumulators per thread"
    return None


def tiles(plan: "_Plan", config: Config) -> tuple[int, int]:
    """(m16 tiles over output channels, n8 tiles over positions) per warp."""
    return plan.Cout // (16 * config["WARPS_M"]), -(-plan.Lout // (8 * config["WARPS_N"]))


def shared_bytes(plan: "_Plan", config: Config) -> int:
    """Dynamic shared memory of a program: barriers, weights and slab (rows of Cin + 8), the
    inputs in flight and the output staging (as conv1d_bulk.cu lays them out)."""
    p, bufs = plan, config["IN_BUFS"]
    npos = config["WARPS_N"] * tiles(p, config)[1] * 8
    rows = npos + (p.K - 1) * p.dil
    return 16 * bufs + 2 * ((p.K * p.Cout + rows) * (p.Cin + 8) + bufs * p.Cin * p.L + p.Cout * p.Lout)


def valid(plan: "_Plan", c: Config) -> bool:
    if c.get("IMPL") != "cuda" or set(dict(c.params)) != {"IMPL", "WARPS_M", "WARPS_N", "IN_BUFS", "GRID"}:
        return False
    wm, wn, bufs, grid = c["WARPS_M"], c["WARPS_N"], c["IN_BUFS"], c["GRID"]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (wm, wn, bufs, grid)):
        return False
    if wm < 1 or wn < 1 or (plan.Cout // 16) % wm or bufs not in (1, 2) or grid < 1:
        return False
    threads = 32 * wm * wn
    mt, nt = tiles(plan, c)
    if not 64 <= threads <= MAX_THREADS or (wn - 1) * nt * 8 >= plan.Lout:  # every warp has positions
        return False
    if 4 * mt * nt > min(MAX_ACC, 65536 // threads - 48):  # registers for fragments and addresses
        return False
    return shared_bytes(plan, c) <= SHARED_LIMIT


def _space(plan: "_Plan") -> list[Config]:
    """Every (WARPS_M, WARPS_N, IN_BUFS) with one program per SM."""
    return [Config.of(IMPL="cuda", WARPS_M=wm, WARPS_N=wn, IN_BUFS=b, GRID=SMS)
            for wm in range(1, plan.Cout // 16 + 1) if (plan.Cout // 16) % wm == 0
            for wn in range(1, MAX_THREADS // (32 * wm) + 1) for b in (2, 1)]


def _per_sm(plan: "_Plan", c: Config) -> int:
    return max(1, min(2, SHARED_PER_SM // (shared_bytes(plan, c) + 1024)))


def seeds(plan: "_Plan") -> list[Config]:
    """The tilings nearest the H200's best on B2048 C96 L200 k3 (12 warps as 3 x 4, two m16 and
    seven n8 tiles each, two inputs in flight: 0.082 ms; 8 warps as 2 x 4: 0.084), inputs double
    buffered where they fit; the grid is what fits on the SMs at once."""
    ok = [c for c in _space(plan) if valid(plan, c)]

    def distance(c: Config) -> tuple:
        mt, nt = tiles(plan, c)
        return (abs(c["WARPS_M"] * c["WARPS_N"] - 12) + 4 * abs(mt - 2) + abs(nt - 7), -c["IN_BUFS"])
    best = sorted(ok, key=distance)[:3]
    return unique([c.replace(GRID=SMS * _per_sm(plan, c)) for c in best])


def neighbours(plan: "_Plan", c: Config) -> list[Config]:
    wm, wn, grid = c["WARPS_M"], c["WARPS_N"], c["GRID"]
    cands = [c.replace(WARPS_M=wm * 2), c.replace(WARPS_M=max(1, wm // 2)), c.replace(WARPS_M=wm + 1),
             c.replace(WARPS_M=max(1, wm - 1)), c.replace(WARPS_N=wn + 1), c.replace(WARPS_N=max(1, wn - 1)),
             c.replace(WARPS_N=wn * 2), c.replace(WARPS_N=max(1, wn // 2)), c.replace(IN_BUFS=3 - c["IN_BUFS"]),
             c.replace(GRID=grid * 2), c.replace(GRID=max(1, grid // 2))]
    return unique([x for x in cands if x.key != c.key and valid(plan, x)])


def generate(spec: KernelSpec, plan: "_Plan", config: Config) -> KernelProgram:
    p, c = plan, config
    a = cg.bind(spec)
    xi, wi = cg.tensor_index(a["input"]), cg.tensor_index(a["weight"])
    mt, nt = tiles(p, c)
    defines = {"CIN": p.Cin, "COUT": p.Cout, "L": p.L, "LOUT": p.Lout, "KT": p.K, "PAD": p.pad, "DIL": p.dil,
               "WARPS_M": c["WARPS_M"], "WARPS_N": c["WARPS_N"], "M_TILES": mt, "N_TILES": nt,
               "IN_BUFS": c["IN_BUFS"], "HAS_BIAS": p.bias is not None, "DTYPE_BF16": p.dtype == "bfloat16"}
    args = (("in", xi), ("in", wi), ("in", p.bias if p.bias is not None else xi), ("out", 0), ("i32", p.N))
    launch = Launch("conv1d_bulk", (min(p.N, c["GRID"]),), args, defines, num_warps=c["WARPS_M"] * c["WARPS_N"],
                    num_stages=1, shared=shared_bytes(p, c))
    return KernelProgram(SOURCE.read_text(), (launch,), language="cuda")
