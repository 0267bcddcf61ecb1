"""Experiment: conv1d (stride 1, groups 1) as a CUDA C++ implicit GEMM on mma.sync.

Why it exists: three sessions showed that Triton and Gluon 3.6 cannot give conv1d's shifted taps
both vectorized and bank-conflict-free shared-memory access (benchmarks/README.md, seventh to
ninth sessions), and named a kernel that computes its own shared-memory addresses as what would
close the target (0.086 ms for B2048 C96 L200 k3 fp16). Two such kernels, both holding each
batch element's input as a slab [position][Cin + 8] in shared memory (a tap's shift is then a
shift by whole rows, and the odd number of 16-byte units per row keeps every ldmatrix
conflict-free), with weights resident and mma.sync m16n8k16 on fp32 accumulators:

- ``mma`` (conv1d_mma.cu, beside this script): every thread reads 8x8 blocks of the input with
  16-byte loads, transposes them with byte permutes and stores them as 16-byte rows; outputs go
  straight from the accumulators to global memory (4-byte stores). PREFETCH keeps the next
  element's loads in flight in registers; STAGES leaves a stage out, to place the time.
- ``bulk`` (lowering/kernels/conv1d_bulk.cu, the conv1d family's CUDA C++ configuration): every
  global transfer is one bulk copy per batch element (the copy engine, completing on an
  mbarrier), the next one or two inputs in flight; the output is staged in shared memory.

Measured on the H200 (2026-11-30, torch 2.11, triton 3.6; eager 0.340 ms, Inductor 0.281, a
157 MB copy 0.042; results/2026-11-30-h200-session10-conv1d-cuda-*.json). Every variant is
correct (max rel. error 2.6e-4 against float64), as are the other shapes in CHECKS:

    kernel  warps (M x N)  per SM  variant            ms
    mma     3 x 2          2       -                  0.140
    mma     3 x 2          2       no input load      0.096
    mma     3 x 2          2       no MMA             0.131
    mma     3 x 2          2       no output store    0.097
    mma     3 x 2          2       store only         0.117
    mma     3 x 2          1       PREFETCH           0.117
    bulk    3 x 2          1       1 input in flight  0.105
    bulk    3 x 4          1       1 input in flight  0.090
    bulk    3 x 4          1       2 inputs           0.082
    bulk    2 x 4          1       2 inputs           0.084

The register path is bound by its global stores and loads (each stage left out saves about 0.04
ms); the bulk copies take both off the threads.

Usage (GPU): python benchmarks/experiments/conv1d_mma_cuda.py --out DIR
       (CPU with nvcc): python benchmarks/experiments/conv1d_mma_cuda.py --compile-only
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCES = {"mma": Path(__file__).with_name("conv1d_mma.cu"),
           # the bulk-copy kernel became the conv1d family's CUDA C++ configuration
           "bulk": Path(__file__).resolve().parents[2] / "lowering" / "kernels" / "conv1d_bulk.cu"}
SHAPE = dict(N=2048, CIN=96, COUT=96, L=200, KT=3, PAD=1, DIL=1)
# warps over Cout x warps over positions, m16 tiles and n8 tiles per warp, programs per SM;
# PREFETCH: the next element's input in flight during the MMAs; LDG_HINT 1: ld.global.nc reads;
# STAGES < 7 leaves a stage out (1 load, 2 MMAs, 4 store), to place the time by differences.
BASE = dict(KERNEL="mma", WARPS_M=3, WARPS_N=2, M_TILES=2, N_TILES=13, MIN_BLOCKS=2)
VARIANTS = [
    BASE,
    {**BASE, "STAGES": 6},
    {**BASE, "STAGES": 5},
    {**BASE, "STAGES": 3},
    {**BASE, "STAGES": 4},
    {**BASE, "MIN_BLOCKS": 1, "PREFETCH": 1},
] + [dict(KERNEL="bulk", WARPS_M=wm, WARPS_N=wn, M_TILES=mt, N_TILES=nt, IN_BUFS=bufs)
     for wm, wn, mt, nt, bufs in [(3, 2, 2, 13, 1), (3, 2, 2, 13, 2), (3, 4, 2, 7, 1), (3, 4, 2, 7, 2),
                                  (2, 4, 3, 7, 1), (2, 4, 3, 7, 2), (2, 2, 3, 13, 1)]]
# other shapes, checked for correctness only: taps, padding, dilation, bias, bf16
CHECKS = [
    dict(N=3, CIN=64, COUT=128, L=96, KT=5, PAD=2, DIL=1, WARPS_M=4, WARPS_N=2, M_TILES=2, N_TILES=6,
         HAS_BIAS=0, DTYPE_BF16=0),
    dict(N=5, CIN=32, COUT=48, L=40, KT=3, PAD=2, DIL=2, WARPS_M=3, WARPS_N=1, M_TILES=1, N_TILES=5,
         HAS_BIAS=1, DTYPE_BF16=1),
    dict(N=7, CIN=96, COUT=96, L=200, KT=3, PAD=0, DIL=1, WARPS_M=3, WARPS_N=2, M_TILES=2, N_TILES=13,
         HAS_BIAS=1, DTYPE_BF16=0),
]
CHECKS = [{**c, "KERNEL": "mma", "MIN_BLOCKS": 1} for c in CHECKS] + [{**c, "KERNEL": "bulk", "IN_BUFS": 2} for c in CHECKS]


def lout(s: dict) -> int:
    return s["L"] + 2 * s["PAD"] - s["DIL"] * (s["KT"] - 1)


def smem_bytes(s: dict) -> int:
    rs = s["CIN"] + 8
    rows = s["WARPS_N"] * s["N_TILES"] * 8 + (s["KT"] - 1) * s["DIL"]
    slab = 2 * rs * (s["KT"] * s["COUT"] + rows)
    if s["KERNEL"] == "mma":
        return slab
    bufs = s["IN_BUFS"]
    return 16 * bufs + slab + 2 * (bufs * s["CIN"] * s["L"] + s["COUT"] * lout(s))


def build(s: dict, directory: Path, name: str) -> tuple[bytes, str]:
    """nvcc -> sm_90a cubin; returns it and ptxas's register/spill report."""
    defs = {"HAS_BIAS": 1, "DTYPE_BF16": 0, **{k: v for k, v in s.items() if k not in ("N", "KERNEL")}, "LOUT": lout(s)}
    out = directory / f"{name}.cubin"
    from torch_kernelize.cuda_cxx import nvcc
    cmd = [nvcc() or "nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-Xptxas", "-v",
           *[f"-D{k}={int(v)}" for k, v in defs.items()], str(SOURCES[s["KERNEL"]]), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    report = " ".join(l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l)
    return out.read_bytes(), report


class Kernel:
    """A cubin's kernel loaded through the driver API (ctypes), launched on torch's stream."""

    def __init__(self, cubin: bytes, smem: int, name: str):
        import torch
        torch.cuda.init()
        torch.empty(1, device="cuda")  # make torch's primary context current on this thread
        self.cu = ctypes.CDLL("libcuda.so.1")
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cu.cuModuleLoadData(ctypes.byref(mod), cubin))
        self._check(self.cu.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()))
        self._check(self.cu.cuFuncSetAttribute(fn, 8, smem))  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.mod, self.fn, self.smem = mod, fn, smem

    def _check(self, rc: int) -> None:
        if rc:
            msg = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"CUDA driver error {rc}: {msg.value.decode() if msg.value else '?'}")

    def occupancy(self, threads: int) -> int:
        n = ctypes.c_int()
        self._check(self.cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self.fn, threads,
                                                                         ctypes.c_size_t(self.smem)))
        return n.value

    def __call__(self, grid: int, threads: int, x, w, b, y, n: int) -> None:
        import torch
        ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (x, w, b, y)]
        nn = ctypes.c_int(n)
        args = (ctypes.c_void_p * 5)(*[ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in ptrs],
                                     ctypes.cast(ctypes.byref(nn), ctypes.c_void_p))
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.cu.cuLaunchKernel(self.fn, grid, 1, 1, threads, 1, 1, self.smem, stream, args, None))


def tensors(s: dict, dtype):
    import torch
    x = torch.randn(s["N"], s["CIN"], s["L"], device="cuda", dtype=dtype)
    w = torch.randn(s["COUT"], s["CIN"], s["KT"], device="cuda", dtype=dtype) / (s["CIN"] * s["KT"]) ** 0.5
    b = torch.randn(s["COUT"], device="cuda", dtype=dtype)
    return x, w, b


def run_variant(s: dict, work: Path, name: str, x, w, b, ref, sms: int) -> tuple[dict, object]:
    import torch
    cubin, report = build(s, work, name)
    threads = 32 * s["WARPS_M"] * s["WARPS_N"]
    k = Kernel(cubin, smem_bytes(s), f"conv1d_{s['KERNEL']}")
    occ = k.occupancy(threads)
    grid = min(s["N"], occ * sms)
    y = torch.empty(s["N"], s["COUT"], lout(s), device="cuda", dtype=x.dtype)
    call = lambda: k(grid, threads, x, w, b, y, s["N"])
    call()
    torch.cuda.synchronize()
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item() if s.get("STAGES", 7) == 7 else None
    return {"ptxas": report, "smem": smem_bytes(s), "occupancy": occ, "grid": grid, "max_rel_err": err}, call


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write results.json here (GPU run)")
    p.add_argument("--compile-only", action="store_true", help="build every variant, print ptxas's report")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="conv1d_mma_"))
    if args.compile_only:
        for i, v in enumerate(VARIANTS + CHECKS):
            print(v, build({**SHAPE, **v}, work, f"v{i}")[1], flush=True)
        return 0

    import torch
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": SHAPE, "checks": [], "variants": []}
    for i, c in enumerate(CHECKS):
        dtype = torch.bfloat16 if c["DTYPE_BF16"] else torch.float16
        x, w, b = tensors(c, dtype)
        ref = F.conv1d(x.double(), w.double(), b.double() if c["HAS_BIAS"] else None, padding=c["PAD"],
                       dilation=c["DIL"])
        row = dict(c)
        try:
            row.update(run_variant(c, work, f"c{i}", x, w, b, ref, sms)[0])
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = f"{type(e).__name__}: {e}"
        print(row, flush=True)
        res["checks"].append(row)

    s = SHAPE
    x, w, b = tensors(s, torch.float16)
    ref = F.conv1d(x.double(), w.double(), b.double(), padding=s["PAD"])
    conv = lambda x, w, b: F.conv1d(x, w, b, padding=1)
    compiled = torch.compile(conv)
    res["eager_ms"] = do_bench(lambda: conv(x, w, b))
    res["inductor_ms"] = do_bench(lambda: compiled(x, w, b))
    res["copy_ms"] = do_bench(lambda: torch.empty_like(x).copy_(x))
    print({k: v for k, v in res.items() if k.endswith("_ms")}, flush=True)
    for i, v in enumerate(VARIANTS):
        row = dict(v)
        try:
            info, call = run_variant({**s, **v}, work, f"v{i}", x, w, b, ref, sms)
            row.update(info)
            row["ms"] = do_bench(call)
            row["vs_eager"] = res["eager_ms"] / row["ms"]
            row["vs_inductor"] = res["inductor_ms"] / row["ms"]
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = f"{type(e).__name__}: {e}"
        print(row, flush=True)
        res["variants"].append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
