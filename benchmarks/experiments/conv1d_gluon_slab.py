"""Experiment: conv1d (stride 1, groups 1, fp16) in Gluon, with the input slab staged in shared memory.

Why it exists: the conv1d target (>= 4x eager, 0.086 ms for B2048 C96 L200 k3) is missed by the
Triton family (0.138 ms), and the analysis said explicit shared memory would close it: store one
aligned input slab per tile, read the shifted taps out of it. This script builds that kernel in
Gluon and measures it. It is not a kernel family: Gluon has no interpreter, so it could not be
validated in CI, and it does not beat the Triton kernel. Keep it as a measured data point.

How the kernel works:
- Positions are numbered in a padded flat space, q = n*LP + H + l, with H zero slots before each
  batch row. A tile of BL positions may span rows, and a tap's zero padding comes from the
  slots (masked loads), not from branches.
- Each tile's slab holds rows q0 - HALO .. q0 + BL + HALO: one position per row, channels
  contiguous. It is loaded with 16-byte vectors along positions, prefetched one tile ahead in
  registers, and stored to shared memory.
- Each tap is an A operand of `warpgroup_mma`, read from a window of the slab shifted by whole
  rows. Gluon refuses `slice` at offsets that are not multiples of the slice length, so the
  window is `slab._reinterpret([R, 1, C]).index(row)._reinterpret([BL, C])`: `index` takes any
  row.
- Knobs: the slab's shared layout (padded rows of C + PADN, or unswizzled), CV channels per
  thread in the load layout (8: 16-byte stores), and LOADT, which loads the slab as [C, BL] in
  an mma-shaped register layout so that the store to shared memory is a transposing `stmatrix`.
- The weights are B operands in shared memory, loaded once per persistent program. Channel
  counts are split into power-of-two chunks (96 = 64 + 32), because Gluon tensors and
  allocations must have power-of-two shapes.

Measured on the H200 (2026-11-30, torch 2.11, triton 3.6, do_bench medians; eager 0.345 ms,
torch.compile 0.283 ms, a 157 MB device copy 0.042 ms). Every variant is correct, with a max
relative error of 3.6e-4 against an fp32 reference. Results are in
benchmarks/results/2026-11-30-h200-session7-conv1d-gluon.json:

    slab layout, store            BL  warps  grid 132  grid 264
    padded +2, STS.U16           128      8     0.141     0.152
    padded +2, STS.U16            64      4     0.142     0.147
    padded +8, STS.U16           128      8     0.197     0.204
    unswizzled, STS.U16          128      8     0.229     0.236
    unswizzled, STS.128 (CV=8)   128      8     0.264     0.272
    unswizzled, STSM (LOADT)     128      8     0.181     0.191
    padded +2, LOADT             128      8     0.150     0.163

ncu (padded +2, BL 128, 8 warps):
- L1/TEX is 79% busy and DRAM 17%. MIO-scoreboard stalls take 35% of the cycles, and there is one
  CTA per SM (the register limit).
- The slab's transposing store and the tap loads bound the kernel. The tensor cores do not.
- Padded layouts stay conflict-free under a row shift, but they lower to scalar `STS.U16` and
  32-bit `LDS`. Unswizzled layouts vectorize (`STS.128`, `LDSM`), but their power-of-two row
  strides conflict on banks. Swizzled layouts give wrong results under a row shift.

Usage (GPU): python benchmarks/experiments/conv1d_gluon_slab.py --out DIR
       (CPU):  python benchmarks/experiments/conv1d_gluon_slab.py --compile-only   (SASS counts)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

VARIANTS = [
    dict(BL=128, num_warps=8, PADN=2),
    dict(BL=64, num_warps=4, PADN=2),
    dict(BL=128, num_warps=8, PADN=8),
    dict(BL=128, num_warps=8, PAD_SMEM=False),
    dict(BL=128, num_warps=8, PAD_SMEM=False, CV=8),
    dict(BL=128, num_warps=8, PAD_SMEM=False, LOADT=1),
    dict(BL=128, num_warps=8, PADN=2, LOADT=1),
]


def chunks(c: int) -> list[tuple[int, int]]:
    """(offset, size) power-of-two chunks covering ``c`` (a multiple of 16)."""
    out, off = [], 0
    for b in (256, 128, 64, 32, 16):
        while c - off >= b:
            out.append((off, b))
            off += b
    if off != c:
        raise ValueError(f"{c} channels: not a multiple of 16")
    return out


def geometry(L: int, K: int, pad: int, dil: int, vec: int = 8) -> dict:
    """The padded flat position space: H zero slots before each row (at least the taps' reach),
    row pitch LP, and HALO slab rows on either side of a tile."""
    lout = L + 2 * pad - dil * (K - 1)
    halo = -(-max(pad, dil * (K - 1) - pad) // vec) * vec
    lp = -(-(halo + max(L, lout)) // vec) * vec
    return dict(Lout=lout, HALO=halo, H=halo, LP=lp)


def source(*, N: int, Cin: int, Cout: int, L: int, K: int, pad: int, dil: int, BL: int, num_warps: int,
           PAD_SMEM: bool = True, PADN: int = 2, CV: int = 1, VEC: int = 8, LOADT: int = 0) -> str:
    """Gluon source of one variant for contiguous NCL input/output and contiguous weights."""
    g = geometry(L, K, pad, dil, VEC)
    lout, halo, lp = g["Lout"], g["HALO"], g["LP"]
    ci, co = chunks(Cin), chunks(Cout)
    taps = [halo + k * dil - pad for k in range(K)]
    if L % VEC or lout % VEC:
        raise ValueError(f"L={L}, Lout={lout}: the vector hints need multiples of {VEC}")
    rows = 2 * BL  # slab allocation rows: a power of two >= BL + 2*HALO
    if BL + 2 * halo > rows:
        raise ValueError(f"BL={BL} is too small for a halo of {halo}")
    n_tiles = -(-N * lp // BL)
    tp = min(32, BL // VEC)
    src = [
        "from triton.experimental import gluon",
        "from triton.experimental.gluon import language as gl",
        "from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait",
        "",
        "",
        "@gluon.jit",
        "def conv1d_gl(x_ptr, w_ptr, b_ptr, o_ptr, num_warps: gl.constexpr):",
        f"    BL: gl.constexpr = {BL}",
        f"    LP: gl.constexpr = {lp}",
        f"    H: gl.constexpr = {g['H']}",
        f"    HALO: gl.constexpr = {halo}",
        f"    ld: gl.constexpr = gl.BlockedLayout([{VEC}, 1], [{tp}, {32 // tp}], [1, num_warps], [0, 1])",
        f"    xl: gl.constexpr = gl.BlockedLayout([{VEC}, {CV}], [{tp}, {32 // tp}], [1, num_warps], [0, 1])" if not LOADT else
        f"    xl: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])",
        "    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], "
        "instr_shape=[16, 32, 16])",
        "    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)",
        "    wld: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])",
    ]
    a = src.append
    for j, (_, c) in enumerate(ci):
        if PAD_SMEM:  # rows of c + PADN elements: a whole-row shift keeps the layout
            for nm, shape in (("s", f"[{rows}, {c}]"), ("r", f"[1, {c}]"), ("t", f"[BL, {c}]")):
                a(f"    {nm}{j}_l: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[{c}, {PADN}]], {shape}, [1, 0])")
        else:
            a(f"    s{j}_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])")
            a(f"    r{j}_l: gl.constexpr = s{j}_l")
            a(f"    t{j}_l: gl.constexpr = s{j}_l")
        a(f"    slab{j} = gl.allocate_shared_memory(gl.float16, [{rows}, {c}], s{j}_l)")
    for k in range(K):  # B operands [ci chunk, co chunk] per tap, for the program's lifetime
        for j, (oi, cci) in enumerate(ci):
            for m, (oo, cco) in enumerate(co):
                a(f"    wr = gl.arange(0, {cci}, layout=gl.SliceLayout(1, wld))")
                a(f"    wc = gl.arange(0, {cco}, layout=gl.SliceLayout(0, wld))")
                a(f"    wv = gl.load(w_ptr + ({oo} + wc[None, :]) * {Cin * K} + ({oi} + wr[:, None]) * {K} + {k})")
                a(f"    w_{k}_{j}_{m} = gl.allocate_shared_memory(gl.float16, [{cci}, {cco}], "
                  f"gl.NVMMASharedLayout.get_default_for([{cci}, {cco}], gl.float16), wv)")
    for m, (oo, cco) in enumerate(co):
        a(f"    bias{m} = gl.load(b_ptr + {oo} + gl.arange(0, {cco}, layout=gl.SliceLayout(0, mma))).to(gl.float32)")
    pd, cd = (0, 1) if LOADT else (1, 0)
    a(f"    rm = gl.arange(0, BL, layout=gl.SliceLayout({pd}, xl))")
    a(f"    rt = gl.arange(0, {2 * halo}, layout=gl.SliceLayout({pd}, xl))")
    for j, (_, c) in enumerate(ci):
        a(f"    cc{j} = gl.arange(0, {c}, layout=gl.SliceLayout({cd}, xl))")
    a("    pid = gl.program_id(0)")
    a("    nprog = gl.num_programs(0)")

    def slab_loads(ind: str, tile: str) -> None:
        # slab row r holds position q = tile*BL - HALO + r: main rows [0, BL), tail [BL, BL + 2*HALO)
        for part, rv, off in (("m", "rm", "0"), ("t", "rt", "BL")):
            a(f"{ind}q = {tile} * BL - HALO + {off} + {rv}")
            a(f"{ind}n = q // LP")
            a(f"{ind}i = q % LP - H")
            a(f"{ind}ok = (q >= 0) & (n < {N}) & (i >= 0) & (i < {L})")
            a(f"{ind}po = gl.max_contiguous(gl.multiple_of(n * {Cin * L} + i, {VEC}), {VEC})")
            for j, (o, _) in enumerate(ci):
                if LOADT:
                    a(f"{ind}x{part}{j} = gl.load(x_ptr + po[None, :] + ({o} + cc{j}[:, None]) * {L}, "
                      f"mask=ok[None, :], other=0.0)")
                else:
                    a(f"{ind}x{part}{j} = gl.load(x_ptr + po[:, None] + ({o} + cc{j}[None, :]) * {L}, "
                      f"mask=ok[:, None], other=0.0)")

    slab_loads("    ", "pid")
    a(f"    for t in range(pid, {n_tiles}, nprog):")
    ind = " " * 8
    for j in range(len(ci)):
        if LOADT:
            a(f"{ind}slab{j}.slice(0, BL, dim=0).permute([1, 0]).store(xm{j})")
            a(f"{ind}slab{j}.slice(BL, {2 * halo}, dim=0).permute([1, 0]).store(xt{j})")
        else:
            a(f"{ind}slab{j}.slice(0, BL, dim=0).store(xm{j})")
            a(f"{ind}slab{j}.slice(BL, {2 * halo}, dim=0).store(xt{j})")
    slab_loads(ind, "(t + nprog)")  # the next tile's loads stay in flight during this tile's MMAs
    a(f"{ind}qo = t * BL + gl.arange(0, BL, layout=gl.SliceLayout(1, ld))")
    a(f"{ind}no = qo // LP")
    a(f"{ind}lo = qo % LP - H")
    a(f"{ind}oko = (no < {N}) & (lo >= 0) & (lo < {lout})")
    a(f"{ind}pq = gl.max_contiguous(gl.multiple_of(no * {Cout * lout} + lo, {VEC}), {VEC})")
    for m, (_, cco) in enumerate(co):
        a(f"{ind}acc{m} = gl.zeros([BL, {cco}], gl.float32, mma)")
    for k in range(K):
        for j, (_, cci) in enumerate(ci):
            a(f"{ind}av = slab{j}._reinterpret(gl.float16, [{rows}, 1, {cci}], r{j}_l).index({taps[k]})"
              f"._reinterpret(gl.float16, [BL, {cci}], t{j}_l).load(a_l)")
            for m in range(len(co)):
                a(f"{ind}acc{m} = warpgroup_mma(av, w_{k}_{j}_{m}, acc{m}, is_async=True)")
    accs = ", ".join(f"acc{m}" for m in range(len(co)))
    a(f"{ind}{accs}{',' if len(co) == 1 else ''} = warpgroup_mma_wait(num_outstanding=0, deps=({accs},))")
    for m, (oo, cco) in enumerate(co):
        a(f"{ind}y = gl.convert_layout((acc{m} + bias{m}[None, :]).to(gl.float16), ld)")
        a(f"{ind}oc = gl.arange(0, {cco}, layout=gl.SliceLayout(0, ld))")
        a(f"{ind}gl.store(o_ptr + pq[:, None] + ({oo} + oc[None, :]) * {lout}, y, mask=oko[:, None])")
    return "\n".join(src) + "\n"


def load_kernel(src: str, directory: Path, name: str):
    from torch_kernelize.launch import import_source
    path = directory / f"{name}.py"
    path.write_text(src)
    return import_source(path, f"{__name__}_{name}").conv1d_gl


def compile_sm90(src: str, directory: Path, name: str, num_warps: int):
    """Compile for sm_90 without a GPU (Triton's bundled ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = load_kernel(src, directory, name)
    sig = {"x_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "o_ptr": "*fp16", "num_warps": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    return triton.compile(GluonASTSource(fn, signature=sig, constexprs={"num_warps": num_warps}, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def sass_counts(cubin: bytes) -> dict[str, int]:
    """Shared/global memory and MMA instructions in the SASS of ``cubin``, by full name."""
    from torch_kernelize.cuda_binaries import sass_counts as counts
    return counts(cubin, ("LDS", "STS", "LDSM", "STSM", "LDG", "STG", "HGMMA"))


SHAPE = dict(N=2048, Cin=96, Cout=96, L=200, K=3, pad=1, dil=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write results.json here (GPU run)")
    p.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 and print SASS counts")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="conv1d_gluon_"))
    if args.compile_only:
        for i, v in enumerate(VARIANTS):
            c = compile_sm90(source(**SHAPE, **v), work, f"v{i}", v["num_warps"])
            print(v, f"smem {c.metadata.shared}", sass_counts(c.asm["cubin"]))
        return 0

    import torch
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench
    torch.manual_seed(0)
    s = SHAPE
    x = torch.randn(s["N"], s["Cin"], s["L"], device="cuda", dtype=torch.float16)
    w = torch.randn(s["Cout"], s["Cin"], s["K"], device="cuda", dtype=torch.float16) * 0.1
    b = torch.randn(s["Cout"], device="cuda", dtype=torch.float16)
    ref = F.conv1d(x.float(), w.float(), b.float(), padding=s["pad"], dilation=s["dil"])
    compiled = torch.compile(lambda x, w, b: F.conv1d(x, w, b, padding=s["pad"], dilation=s["dil"]))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shape": s, "eager_ms": do_bench(lambda: F.conv1d(x, w, b, padding=s["pad"], dilation=s["dil"])),
           "inductor_ms": do_bench(lambda: compiled(x, w, b)),
           "copy_ms": do_bench(lambda: torch.empty_like(x).copy_(x)), "variants": []}
    for i, v in enumerate(VARIANTS):
        fn = load_kernel(source(**s, **v), work, f"v{i}")
        out = torch.empty_like(ref, dtype=torch.float16)
        row = dict(v)
        for grid in (132, 264):
            fn[(grid,)](x, w, b, out, num_warps=v["num_warps"])
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            row[f"grid{grid}"] = {"ms": do_bench(lambda: fn[(grid,)](x, w, b, out, num_warps=v["num_warps"])),
                                  "max_rel_err": err}
        print(row, flush=True)
        res["variants"].append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
