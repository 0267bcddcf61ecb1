"""The conv1d family on the Triton interpreter: aten.convolution with a 3-d input, fp32/fp16/bf16,
stride/padding/dilation/groups combinations, bias or not, strided inputs, and every tiling variant
(flattened or per-row positions, LC/CL accumulator layouts, channel chunks per program, persistent
tiles with weights held in registers); validated against the float64 reference and compared with
eager. Also: the seeds of the H200 benchmark shape, and an sm_90 compile of them.

On a GPU machine, ``python test/test_kernels_conv1d.py`` times every seed config of the benchmark
shape (N=2048, C=96, L=200, k=3, fp16) against eager cuDNN.
"""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from kernel_testing import BenchRows, assert_valid, compare_eager, compile_sm90, run_validation, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.conv1d import FAMILY
from torch_kernelize.core.spec import KernelSpec, TensorMeta

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN edge trials

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
FLOATS = [F32, F16, BF16]


def conv(N=2, Cin=16, L=24, Cout=24, K=3, stride=1, pad=1, dil=1, groups=1, bias=True, dtype=F32, x=None) -> KernelSpec:
    x = torch.randn(N, Cin, L).to(dtype) if x is None else x
    w = torch.randn(Cout, Cin // groups, K).to(dtype)
    b = torch.randn(Cout).to(dtype) if bias else None
    return spec_of(aten.convolution.default, (x, w, b, [stride], [pad], [dil], False, [0], groups))


def interp_config(spec: KernelSpec, **changes) -> Config:
    """A seed the interpreter validates: with an fp32-upcast dot for bf16 (its bf16 dot is wrong)."""
    seeds = FAMILY.seed_configs(spec)
    c = next(c for c in seeds if c["DOT_UPCAST"]) if spec.inputs[0].dtype == "bfloat16" else seeds[0]
    return c.replace(**changes) if changes else c


def check(spec: KernelSpec, tmp_path, config: Config | None = None, **kw):
    assert FAMILY.supports(spec) is None, FAMILY.supports(spec)
    config = config or interp_config(spec)
    assert FAMILY._valid(FAMILY.plan(spec), config), config
    return assert_valid(FAMILY, spec, tmp_path, config, **kw)


CASES = {
    "k3_pad1": dict(),
    "stride2": dict(stride=2, pad=1),
    "dilation2_pad2": dict(dil=2, pad=2),
    "no_padding_k5": dict(K=5, pad=0),
    "big_padding": dict(K=3, pad=4),
    "stride3_dil2_k4": dict(K=4, stride=3, dil=2, pad=3, L=37),
    "groups2": dict(groups=2, Cin=32, Cout=32),
    "depthwise": dict(groups=8, Cin=8, Cout=8, K=5, pad=2, N=1),
    "k1_pointwise": dict(K=1, pad=0, Cin=24, Cout=40),
    "no_bias": dict(bias=False),
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_conv1d_arguments(case, dtype, tmp_path):
    check(conv(dtype=dtype, **CASES[case]), tmp_path)


@pytest.mark.parametrize("layout", ["nlc", "sliced", "batch_strided"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_strided_inputs(layout, dtype, tmp_path):
    x = {"nlc": torch.randn(2, 20, 16).to(dtype).transpose(1, 2),          # stored as (N, L, C)
         "sliced": torch.randn(2, 16, 40).to(dtype)[:, :, ::2],          # stride 2 along L
         "batch_strided": torch.randn(4, 16, 20).to(dtype)[::2]}[layout]
    spec = conv(Cin=16, L=20, x=x, dtype=dtype)
    assert spec.inputs[0].stride != (320, 20, 1)
    check(spec, tmp_path)


CONFIGS = {
    # name: (spec arguments, config changes)
    "row_tiles": (dict(L=40), dict(FLAT=False, BLOCK_L=16)),                 # 3 l-tiles per row, last masked
    "row_exact": (dict(L=32), dict(FLAT=False, BLOCK_L=16)),
    "flat_small_tiles": (dict(L=30), dict(FLAT=True, BLOCK_L=16)),           # tiles span two batch elements
    "layout_cl": (dict(), dict(LAYOUT="CL")),
    "co_chunks_masked": (dict(Cout=40), dict(BLOCK_CO=16, CO_PROG=3)),       # 16 + 16 + 8 (masked)
    "co_programs": (dict(Cout=40), dict(BLOCK_CO=16, CO_PROG=1)),            # 3 channel programs per tile
    "co_programs_groups": (dict(Cout=48, Cin=32, groups=2), dict(BLOCK_CO=16, CO_PROG=1)),
    "ci_loop_masked": (dict(Cin=40), dict(BLOCK_CI=16)),                      # runtime loop, 16 + 16 + 8
    "persistent_over": (dict(L=40, N=3), dict(TILES=4, BLOCK_L=16)),          # 8 tiles: 2 programs, last over
    "persistent_rows": (dict(L=40, N=3, Cin=40), dict(TILES=2, BLOCK_L=32, FLAT=False, BLOCK_CI=16)),
    "persistent_cl": (dict(Cout=40, stride=2), dict(TILES=2, LAYOUT="CL", BLOCK_L=16, BLOCK_CO=16, CO_PROG=3)),
    # grid-stride persistent programs: 8 tiles over 3 programs (uneven), rows in CL, more programs than tiles
    "grid_stride": (dict(L=40, N=3), dict(GRID=3, BLOCK_L=16)),
    "grid_rows_cl": (dict(L=40, N=3, Cout=40, pad=2, dil=2), dict(GRID=4, FLAT=False, BLOCK_L=16, LAYOUT="CL",
                                                                BLOCK_CO=16, CO_PROG=3)),
    "grid_over_tiles": (dict(L=20), dict(GRID=64, BLOCK_L=16, BLOCK_CI=16)),
    # taps at shift -1/+1 gathered from the shift-0 tile (+ halo): flattened tiles spanning rows,
    # rows in CL with masked channels, loop over channel chunks, a row tile past the end (K=2: Lout=L+1)
    "gather_flat": (dict(L=40, N=3), dict(GRID=3, BLOCK_L=16, GATHER=True)),
    "gather_rows_cl": (dict(L=40, N=3, Cin=40, Cout=40), dict(FLAT=False, BLOCK_L=16, LAYOUT="CL", BLOCK_CO=16,
                                                            CO_PROG=3, BLOCK_CI=16, TILES=2, GATHER=True)),
    "gather_ci_loop": (dict(Cin=40, L=30), dict(BLOCK_L=16, BLOCK_CI=16, GATHER=True, LOADS_FIRST=False)),
    "gather_k2_rows": (dict(K=2, pad=1, L=20), dict(FLAT=False, BLOCK_L=16, GATHER=True)),
    "loads_first": (dict(L=40, N=3, Cin=40), dict(GRID=5, BLOCK_L=16, BLOCK_CI=16, LOADS_FIRST=True)),
    "loads_first_tiles_cl": (dict(Cout=40, stride=2), dict(TILES=2, LAYOUT="CL", BLOCK_L=16, BLOCK_CO=16, CO_PROG=3,
                                                         LOADS_FIRST=True)),
}


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiling_variants(name, dtype, tmp_path):
    args, changes = CONFIGS[name]
    spec = conv(dtype=dtype, **args)
    base = Config.of(BLOCK_L=64, BLOCK_CO=32, CO_PROG=1, BLOCK_CI=16, FLAT=True, LAYOUT="LC", TILES=1,
                     num_warps=4, num_stages=2, DOT_UPCAST=False)
    check(spec, tmp_path, base.replace(**changes), seeds=(0,))


def test_bf16_persistent_upcast(tmp_path):
    spec = conv(dtype=BF16, Cout=40, L=40)
    config = Config.of(BLOCK_L=32, BLOCK_CO=16, CO_PROG=3, BLOCK_CI=16, FLAT=True, LAYOUT="LC", TILES=2,
                       num_warps=4, num_stages=2, DOT_UPCAST=True)
    check(spec, tmp_path, config, seeds=(0,))


def test_output_layout_follows_spec(tmp_path):
    """An (N, L, C)-strided output (what channels-last callers ask for) is written through its strides."""
    spec = conv(Cin=16, Cout=24, L=20)
    out = dataclasses.replace(spec.outputs[0], stride=(20 * 24, 1, 24))
    check(dataclasses.replace(spec, outputs=(out,)), tmp_path, eager=False)


# --- the benchmark shape --------------------------------------------------------------------------

def bench_spec(dtype: str = "float16") -> KernelSpec:
    """N=2048, Cin=Cout=96, L=200, k=3, padding=1, contiguous: the conv the lead times on the H200."""
    x = TensorMeta((2048, 96, 200), (96 * 200, 200, 1), dtype)
    w = TensorMeta((96, 96, 3), (288, 3, 1), dtype)
    b = TensorMeta((96,), (1,), dtype)
    return KernelSpec("aten.convolution.default", [{"tensor": 0}, {"tensor": 1}, {"tensor": 2}, [1], [1], [1], False, [0], 1],
                      {}, (x, w, b), (x,))


def src_gathers(src: str) -> int:
    return src.count("tl.gather(")


def test_benchmark_seeds():
    spec = bench_spec()
    assert family_for(spec) is FAMILY
    seeds = FAMILY.seed_configs(spec)
    first = seeds[0]
    # every output channel per program as 3 exact chunks of 32, positions flattened over N*L
    # (L=200 is no multiple of a power-of-2 tile), 128 positions x 32 input channels per dot
    assert (first["FLAT"], first["LAYOUT"], first["BLOCK_CO"], first["CO_PROG"], first["BLOCK_CI"], first["BLOCK_L"]) == \
        (True, "LC", 32, 3, 32, 128)
    assert first["GATHER"] and first["LOADS_FIRST"] and first["GRID"] == 132
    assert any(c["GRID"] > 0 for c in seeds) and any(c["LAYOUT"] == "CL" for c in seeds)
    persistent = FAMILY.generate(spec, next(c for c in seeds if c["GRID"] == 132))
    # a grid-stride loop over the 3200 tiles; the 27 weight tiles loaded once, before it
    assert persistent.launches[0].grid == (132,) and "for tile in range(pp, 3200, 132):" in persistent.source
    assert persistent.source.index("w2_2_2 = tl.load") < persistent.source.index("for tile in range")
    assert {c["DOT_UPCAST"] for c in seeds} == {True, False} and {c["ALIGN"] for c in seeds} == {True, False}
    aligned = FAMILY.generate(spec, next(c for c in seeds if c["ALIGN"])).source
    # output tile and centre-tap input: runs of 8 positions (gcd of the tile and L=200) start 16-byte aligned
    assert "tl.max_contiguous(tl.multiple_of(o_ptrs, [16, 1]), [8, 1])" in aligned
    assert "tl.max_contiguous(tl.multiple_of(x_ptrs, [16, 1]), [8, 1])" in aligned
    assert src_gathers(FAMILY.generate(spec, first).source) == 6  # 2 shifted taps x 3 channel chunks
    program = FAMILY.generate(spec, seeds[2])
    assert program.launches[0].grid == (2048 * 200 // 128,)
    src = program.source
    assert "pmask" not in src            # 409600 positions = 3200 whole tiles: no position mask
    assert src.count("tl.dot(") == 9     # 3 taps x 3 channel chunks inside the input-channel loop
    for n in FAMILY.neighbours(spec, first):
        assert n.key != first.key
        FAMILY.generate(spec, n)
    # the candidate that faulted the H200: 8 warps on a 64-row MMA is never proposed
    faulted = first.replace(BLOCK_L=64, num_warps=8)
    assert not FAMILY._valid(FAMILY.plan(spec), faulted)
    assert all(not (c["num_warps"] == 8 and c["BLOCK_L"] < 128 and c["LAYOUT"] == "LC")
               for s in seeds for c in [s, *FAMILY.neighbours(spec, s)])


def test_every_seed_config_validates(tmp_path):
    """The benchmark's channel structure at a size the interpreter runs (N=2, L=40)."""
    spec = conv(N=2, Cin=96, Cout=96, L=40, dtype=F16)
    seeds = FAMILY.seed_configs(spec)
    assert 3 <= len(seeds) <= 10  # a search budget of 16 still leaves room for neighbours
    for config in seeds:
        check(spec, tmp_path, config, seeds=(0,), eager=False, kinds=("special",))
    bf = conv(N=2, Cin=32, Cout=48, L=20, dtype=BF16, stride=2)
    for config in FAMILY.seed_configs(bf):
        program = FAMILY.generate(bf, config)
        rec = run_validation(FAMILY, bf, program, tmp_path, seeds=(0,), kinds=())
        assert rec.ok == config["DOT_UPCAST"], (config, rec.reason)  # the interpreter's bf16 dot is wrong


def test_sm90_compile(tmp_path):
    spec = bench_spec()
    seeds = FAMILY.seed_configs(spec)
    for config in seeds[:4]:   # the tensor-core variants: flat LC, long tile, CL, persistent
        compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)
    small = conv(groups=2, Cin=32, Cout=32, stride=2, dil=2, dtype=F32)
    compile_sm90(small, FAMILY.generate(small, FAMILY.seed_configs(small)[0]), tmp_path)
    # past 2^31 elements the offsets are int64
    x = TensorMeta((4096, 256, 4096), (256 * 4096, 4096, 1), "float16")
    big = KernelSpec("aten.convolution.default", [{"tensor": 0}, {"tensor": 1}, None, [1], [1], [1], False, [0], 1], {},
                     (x, TensorMeta((256, 256, 3), (768, 3, 1), "float16")), (x,))
    program = FAMILY.generate(big, FAMILY.seed_configs(big)[0])
    assert "tl.program_id(0).to(tl.int64)" in program.source
    compile_sm90(big, program, tmp_path)


# --- broken programs and refusals -------------------------------------------------------------

def _broken(program, old: str, new: str):
    assert old in program.source, program.source
    return dataclasses.replace(program, source=program.source.replace(old, new, 1))


@pytest.mark.parametrize("what", ["padding_mask", "tap_offset", "store_mask", "bias", "channel_mask"])
def test_broken_programs_fail_validation(what, tmp_path):
    spec = conv(L=30)
    base = Config.of(BLOCK_L=16, BLOCK_CO=16, CO_PROG=2, BLOCK_CI=16, FLAT=True, LAYOUT="LC", TILES=1,
                     num_warps=4, num_stages=2, DOT_UPCAST=False)
    program = FAMILY.generate(spec, base)
    old, new = {
        "padding_mask": ("(l >= 1)", "(l >= 0)"),        # reads x[l - 1] at l = 0 instead of the zero padding
        "tap_offset": ("(xpos + 1)", "(xpos + 2)"),      # the last tap reads one position too far
        "store_mask": ("pmask = p < 60", "pmask = p < 59"),   # the last position stays poisoned
        "bias": ("acc0 = acc0 + b", "acc0 = acc0 - b"),
        "channel_mask": ("com1 = 16 + tl.arange(0, BLOCK_CO) < 24", "com1 = 16 + tl.arange(0, BLOCK_CO) < 23"),
    }[what]
    assert not run_validation(FAMILY, spec, _broken(program, old, new), tmp_path, seeds=(0,)).ok


def test_refusals():
    x, w = torch.randn(2, 8, 16), torch.randn(8, 8, 3)
    s = lambda *a: spec_of(aten.convolution.default, a)
    assert "transposed" in FAMILY.supports(s(x, w.transpose(0, 1).contiguous(), None, [1], [1], [1], True, [0], 1))
    assert "float64" in FAMILY.supports(s(x.double(), w.double(), None, [1], [1], [1], False, [0], 1))
    assert "4-d" in FAMILY.supports(s(x[:, :, None], w[:, :, None], None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
    spec = s(x, w, None, [1], [1], [1], False, [0], 1)
    assert FAMILY.supports(spec) is None
    assert "output_padding" in FAMILY.supports(dataclasses.replace(spec, args=spec.args[:7] + [[1], 1]))
    half_w = dataclasses.replace(spec, inputs=(spec.inputs[0], dataclasses.replace(spec.inputs[1], dtype="float16")))
    assert "dtypes" in FAMILY.supports(half_w)
    ints = dataclasses.replace(spec, inputs=tuple(dataclasses.replace(m, dtype="int32") for m in spec.inputs),
                               outputs=(dataclasses.replace(spec.outputs[0], dtype="int32"),))
    assert FAMILY.supports(ints)
    assert FAMILY.supports(spec_of(aten.mm.default, (torch.randn(4, 4), torch.randn(4, 4))))


def test_unaligned_input_view(tmp_path):
    """An input view starting at an odd element (no 16-byte alignment) still computes right."""
    x = torch.randn(2 * 16 * 24 + 1)[1:].view(2, 16, 24)
    spec = conv(x=x)
    program = check(spec, tmp_path, eager=False)
    compare_eager(FAMILY, spec, program, tmp_path, inputs=[x, torch.randn(24, 16, 3), torch.randn(24)])


# --- GPU timing (run by hand on the GPU machine) ------------------------------------------------

def gpu_bench(out: str | None = None) -> list[dict]:
    """Median time of every seed config (and their neighbours with --neighbours) on the benchmark
    shape against eager cuDNN. Needs CUDA; launches through Triton's JIT (kernel_testing.jit_runner)."""
    import json
    import tempfile
    from pathlib import Path

    from triton.testing import do_bench

    from kernel_testing import jit_runner

    torch.manual_seed(0)
    x = torch.randn(2048, 96, 200, device="cuda", dtype=F16)
    w = torch.randn(96, 96, 3, device="cuda", dtype=F16) * 0.1
    b = torch.randn(96, device="cuda", dtype=F16)
    args = (x, w, b, [1], [1], [1], False, [0], 1)
    spec = bench_spec()
    eager = do_bench(lambda: aten.convolution.default(*args), warmup=25, rep=200)
    want = aten.convolution.default(*args).float()
    configs = [c for c in FAMILY.seed_configs(spec) if not c.get("DOT_UPCAST")]
    if "--neighbours" in sys.argv:
        configs += [n for c in list(configs) for n in FAMILY.neighbours(spec, c) if not n.get("DOT_UPCAST")]
    if "--sweep" in sys.argv:  # persistent grids x pipelining depth x tile shapes around the seeds
        plan = FAMILY.plan(spec)
        base = configs[0]
        grid = [dict(GRID=132, GATHER=True, LOADS_FIRST=True, num_stages=st, BLOCK_CO=bco, CO_PROG=-(-96 // bco),
                     BLOCK_CI=bci, BLOCK_L=bl, num_warps=8 if bl >= 128 else 4)
                for st in (3, 4) for bco in (32, 128) for bci in (32, 64, 128) for bl in (64, 128)]
        grid += [dict(GRID=264, GATHER=True, LOADS_FIRST=True, num_stages=3, BLOCK_CO=128, CO_PROG=1, BLOCK_CI=bci)
                 for bci in (32, 128)]
        configs += [c for c in (base.replace(TILES=1, **kw) for kw in grid) if FAMILY._valid(plan, c)]
        configs += [base.replace(TILES=t, GRID=0) for t in (1, 4, 8)]
    only = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")), None)
    if only is not None:  # one config (its str()), launched a few times: for ncu
        value = lambda v: int(v) if v.isdigit() else {"True": True, "False": False}.get(v, v)
        configs = [Config.of(**{k: value(v) for k, v in (kv.split("=") for kv in only.split() if "=" in kv)})]
    rows, seen = BenchRows(), set()
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            if config.key in seen:
                continue
            seen.add(config.key)
            runner = jit_runner(Path(tmp), spec, FAMILY.generate(spec, config))
            try:
                got = runner.run_poisoned([x, w, b])[0]
            except Exception as e:  # e.g. OutOfResources (shared memory) for deep pipelines
                print(json.dumps({"config": str(config), "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
                continue
            err = float((got.float() - want).abs().max())
            outs, temps = runner.allocate(x.device)
            if only is not None:
                for _ in range(3):
                    runner.launch([x, w, b], outs, temps)
                torch.cuda.synchronize()
                continue
            t = do_bench(lambda: runner.launch([x, w, b], outs, temps), warmup=25, rep=200)
            rows.add(config=str(config), ms=round(t, 4), eager_ms=round(eager, 4), speedup=round(eager / t, 2),
                     max_abs_err=err)
    return rows.save(out)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    gpu_bench(next((a for a in sys.argv[1:] if not a.startswith("--")), None))
