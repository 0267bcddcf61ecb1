"""Experiment: conv1d (stride 1, k=3, padding 1, fp16) with the taps shifted on the accumulators.

Why it exists: the conv1d target (0.086 ms for B2048 C96 L200 k3) is missed by the Triton family
(0.137 ms) and by a Gluon kernel that stages the input in shared memory (0.140 ms). Both shift the
INPUT tile per tap, and that goes through shared memory: the tile must be rearranged into the MMA's
operand layout after the shift (ncu: L1/TEX 64-79% busy, DRAM 15-17%).

This kernel never shifts an input. Channels are the MMA's M and positions its N, so every dot reads
the same aligned input tile (16-byte loads, pipelined), and the tap k contributes
    Z_k = W_k @ X          [Cout, positions]
whose columns are then moved by one position: out[:, l] = Z_1[:, l] + Z_0[:, l-1] + Z_2[:, l+1].
In the MMA accumulator layout, a column shift stays inside a warp (columns are spread over the
4 lanes of a quad and each thread's registers), so `tl.gather` along positions lowers to warp
shuffles, once per output element and tap, after the whole channel reduction. The columns a
tile's edges need from its neighbours (x at p0-1 and p0+BL) come from a 16-column halo tile and
two small dots. Tiles are numbered over N*L positions (a tile may span two batch rows); a shifted
column that crosses a row boundary is masked (zero padding).

SHIFT selects how the columns move:
  gather  tl.gather on the fp32 accumulators (warp shuffles)
  dot     a 0/1 shift matrix on the tensor cores, applied to the accumulator split into two fp16
          halves (hi + lo: exact to ~2^-22 of it), for comparison

Measured on the H200 (2026-11-30, torch 2.11, triton 3.6, do_bench medians; eager 0.345 ms,
torch.compile 0.285 ms, a 157 MB device copy 0.043 ms; the conv1d family's kernel 0.137 ms).
Every variant is correct (max rel. error 3.6e-4 against float64). Results:
benchmarks/results/2026-11-30-h200-session9-conv1d-accshift.json.

    SHIFT   BL  warps  stages  grid   ms
    gather  64      8       2   132  0.279
    gather  64      4       2   264  0.249
    gather  64      4       3   132  0.313
    gather  32      4       3   264  0.261
    gather 128      8       2   132  0.240
    gather  64      8       3   132  0.254
    gather  64      8       2   264  0.317
    dot     64      8       2   132  0.245
    dot     32      4       3   264  0.241

So it is slower than the family by 1.8x at best, and the shift is not what costs: the `dot`
variant, which has no gather, runs as slowly. What every variant shares is the structure: Cout
(96) padded to an MMA M of 128 (a third more tensor-core work), 15 small wgmmas per tile, each
waited on before the next, and three [Cout, positions] fp32 accumulators live at once (the
4-warp BL=64 variants spill 42-52 registers, BL=128 and the 4-warp `dot` a few; --compile-only
shows it). `tl.gather` also
runs in a blocked layout, not in the MMA's, so each gathered tap converts its accumulator's layout
through shared memory twice. A negative result, kept as a data point: shifting the accumulators
does not close the conv1d gap in Triton.

Usage (GPU): python benchmarks/experiments/conv1d_accshift.py --out DIR
       (CPU):  python benchmarks/experiments/conv1d_accshift.py --compile-only   (SASS counts)
       (CPU):  python benchmarks/experiments/conv1d_accshift.py --check  (small shapes, interpreter)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def source(C: int, L: int, CP: int, BL: int, BCI: int, SHIFT: str, GRID: int, STAGES: int, **_) -> str:
    """The kernel's source for channel count C (== Cin == Cout), row length L."""
    nch = C // BCI
    assert nch * BCI == C
    s = []
    a = s.append
    a("import triton\nimport triton.language as tl\n\n")
    a("@triton.jit")
    a("def conv1d_accshift(x_ptr, w_ptr, b_ptr, o_ptr, NL):")
    a("    pid = tl.program_id(0)")
    a(f"    co = tl.arange(0, {CP})")
    a(f"    co_ok = co < {C}")
    a(f"    ci = tl.arange(0, {BCI})")
    a(f"    col = tl.arange(0, {BL})")
    a("    hj = tl.arange(0, 16)")
    a(f"    wrow = co[:, None] * {3 * C} + ci[None, :] * 3")
    for t in range(3):
        for c in range(nch):
            a(f"    w{t}_{c} = tl.load(w_ptr + wrow + {c * BCI * 3 + t}, mask=co_ok[:, None], other=0.0)")
    a("    bias = tl.load(b_ptr + co, mask=co_ok, other=0.0).to(tl.float32)")
    if SHIFT == "dot":
        a(f"    sh0 = (col[:, None] + 1 == col[None, :]).to(tl.float16)    # [BL, BL]: column k-1 -> k")
        a(f"    sh2 = (col[:, None] == col[None, :] + 1).to(tl.float16)    # column k+1 -> k")
    else:
        a(f"    i0 = tl.broadcast_to(tl.maximum(col - 1, 0)[None, :], ({CP}, {BL}))")
        a(f"    i2 = tl.broadcast_to(tl.minimum(col + 1, {BL - 1})[None, :], ({CP}, {BL}))")
    a(f"    n_tiles = tl.cdiv(NL, {BL})")
    a(f"    for tile in tl.range(pid, n_tiles, {GRID}, num_stages={STAGES}):")
    a(f"        p0 = tile * {BL}")
    a("        p = p0 + col")
    a(f"        n = p // {L}")
    a(f"        l = p - n * {L}")
    a("        ok = p < NL")
    # runs of 8 positions never cross a row (L % 8 == 0, p0 % 8 == 0): 16-byte vectors
    a(f"        xo = tl.max_contiguous(tl.multiple_of(n * {C * L} + l, 8), 8)")
    a("        hp = tl.where(hj == 0, p0 - 1, p0 + " + str(BL) + ")")
    a("        anchor = tl.where(hj == 0, p0, p0 + " + str(BL - 1) + ")")
    a(f"        hn = hp // {L}")
    a(f"        hok = (hj < 2) & (hp >= 0) & (hp < NL) & (hn == anchor // {L})")
    a(f"        ho = hn * {C * L} + (hp - hn * {L})")
    for c in range(nch):
        a(f"        x{c} = tl.load(x_ptr + xo[None, :] + (ci[:, None] + {c * BCI}) * {L}, mask=ok[None, :], other=0.0)")
        a(f"        h{c} = tl.load(x_ptr + ho[None, :] + (ci[:, None] + {c * BCI}) * {L}, mask=hok[None, :], other=0.0)")
    for t, name in ((1, "acc"), (0, "z0"), (2, "z2")):
        a(f"        {name} = tl.dot(w{t}_0, x0)")
        for c in range(1, nch):
            a(f"        {name} = tl.dot(w{t}_{c}, x{c}, {name})")
    for t in (0, 2):
        a(f"        zh{t} = tl.dot(w{t}_0, h0)")
        for c in range(1, nch):
            a(f"        zh{t} = tl.dot(w{t}_{c}, h{c}, zh{t})")
    a("        e0 = tl.sum(tl.where(hj[None, :] == 0, zh0, 0.0), axis=1)")
    a("        e2 = tl.sum(tl.where(hj[None, :] == 1, zh2, 0.0), axis=1)")
    if SHIFT == "dot":
        for t in (0, 2):
            a(f"        hi{t} = z{t}.to(tl.float16)")
            a(f"        lo{t} = (z{t} - hi{t}.to(tl.float32)).to(tl.float16)")
            a(f"        s{t} = tl.dot(lo{t}, sh{t}, tl.dot(hi{t}, sh{t}))")
    else:
        a("        s0 = tl.gather(z0, i0, 1)")
        a("        s2 = tl.gather(z2, i2, 1)")
    a("        s0 = tl.where(col[None, :] == 0, e0[:, None], s0)")
    a(f"        s2 = tl.where(col[None, :] == {BL - 1}, e2[:, None], s2)")
    a("        acc += tl.where((l != 0)[None, :], s0, 0.0)")
    a(f"        acc += tl.where((l != {L - 1})[None, :], s2, 0.0)")
    a("        y = (acc + bias[:, None]).to(tl.float16)")
    a(f"        tl.store(o_ptr + xo[None, :] + co[:, None] * {L}, y, mask=co_ok[:, None] & ok[None, :])")
    return "\n".join(s) + "\n"


def load_kernel(src: str, directory: Path, name: str):
    from torch_kernelize.launch import import_source
    path = directory / f"{name}.py"
    path.write_text(src)
    return import_source(path, f"{__name__}_{name}").conv1d_accshift


def compile_sm90(src: str, directory: Path, name: str, num_warps: int):
    """Compile for sm_90 without a GPU (Triton's bundled ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = load_kernel(src, directory, name)
    sig = {"x_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "o_ptr": "*fp16", "NL": "i32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    return triton.compile(ASTSource(fn, signature=sig, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def sass_counts(cubin: bytes) -> dict[str, int]:
    """Shared/global memory and MMA instructions in the SASS of ``cubin``, by opcode."""
    from torch_kernelize.cuda_binaries import sass_counts as counts
    return counts(cubin, suffixes=False)


SHAPE = dict(N=2048, C=96, L=200)
VARIANTS = [
    dict(CP=128, BL=64, BCI=32, SHIFT="gather", GRID=132, STAGES=2, num_warps=8),
    dict(CP=128, BL=64, BCI=32, SHIFT="gather", GRID=264, STAGES=2, num_warps=4),
    dict(CP=128, BL=64, BCI=32, SHIFT="gather", GRID=132, STAGES=3, num_warps=4),
    dict(CP=128, BL=32, BCI=32, SHIFT="gather", GRID=264, STAGES=3, num_warps=4),
    dict(CP=128, BL=128, BCI=32, SHIFT="gather", GRID=132, STAGES=2, num_warps=8),
    dict(CP=128, BL=64, BCI=32, SHIFT="gather", GRID=132, STAGES=3, num_warps=8),
    dict(CP=128, BL=64, BCI=32, SHIFT="gather", GRID=264, STAGES=2, num_warps=8),
    dict(CP=128, BL=64, BCI=32, SHIFT="dot", GRID=132, STAGES=2, num_warps=8),
    dict(CP=128, BL=32, BCI=32, SHIFT="dot", GRID=264, STAGES=3, num_warps=4),
]


def reference(x, w, b):
    import torch.nn.functional as F
    return F.conv1d(x.double(), w.double(), b.double(), padding=1)


def check_small(v: dict, directory: Path, name: str) -> float:
    """Max relative error of variant ``v``, scaled down, against float64 on the CPU interpreter:
    3 rows of 40 positions, so rows end inside tiles and tiles span rows."""
    import torch

    from torch_kernelize.launch import _interpreted
    torch.manual_seed(0)
    N, C, L = 3, 32, 40
    v = dict(v, CP=32, BCI=16, GRID=2)
    x = torch.randn(N, C, L, dtype=torch.float16)
    w = torch.randn(C, C, 3, dtype=torch.float16) * 0.1
    b = torch.randn(C, dtype=torch.float16)
    out = torch.empty(N, C, L, dtype=torch.float16)
    _interpreted(load_kernel(source(C=C, L=L, **v), directory, name))[(v["GRID"],)](x, w, b, out, N * L, num_warps=v["num_warps"])
    ref = reference(x, w, b)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write results.json here (GPU run)")
    p.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 and print SASS counts")
    p.add_argument("--check", action="store_true", help="check every variant on small shapes (CPU interpreter)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="conv1d_accshift_"))
    if args.compile_only:
        for i, v in enumerate(VARIANTS):
            c = compile_sm90(source(**SHAPE, **v), work, f"v{i}", v["num_warps"])
            print(v, f"smem {c.metadata.shared}", sass_counts(c.asm["cubin"]), flush=True)
        return 0

    if args.check:
        for i, v in enumerate(VARIANTS):
            err = check_small(v, work, f"c{i}")
            print(v, f"max rel err {err:.2e}", "OK" if err < 2e-3 else "WRONG", flush=True)
        return 0

    import torch
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench
    torch.manual_seed(0)
    s = SHAPE
    x = torch.randn(s["N"], s["C"], s["L"], device="cuda", dtype=torch.float16)
    w = torch.randn(s["C"], s["C"], 3, device="cuda", dtype=torch.float16) * 0.1
    b = torch.randn(s["C"], device="cuda", dtype=torch.float16)
    ref = reference(x, w, b).float()
    compiled = torch.compile(lambda x, w, b: F.conv1d(x, w, b, padding=1))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": s, "eager_ms": do_bench(lambda: F.conv1d(x, w, b, padding=1)),
           "inductor_ms": do_bench(lambda: compiled(x, w, b)),
           "copy_ms": do_bench(lambda: torch.empty_like(x).copy_(x)), "variants": []}
    print(res, flush=True)
    NL = s["N"] * s["L"]
    for i, v in enumerate(VARIANTS):
        row = dict(v)
        try:
            fn = load_kernel(source(**s, **v), work, f"v{i}")
            out = torch.empty_like(x)
            call = lambda: fn[(v["GRID"],)](x, w, b, out, NL, num_warps=v["num_warps"])
            call()
            row["max_rel_err"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            row["ms"] = do_bench(call)
        except Exception as e:  # noqa: BLE001 - record and go on to the next variant
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(row, flush=True)
        res["variants"].append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
