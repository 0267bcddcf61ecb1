"""The histc family on the Triton interpreter: fixed and data-derived ranges, fp32/fp16/bf16,
every variant; counts equal torch.histc on CPU exactly, and validation against float64 passes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_testing import assert_mutant_fails, assert_valid, aten_counts, compare_eager, compile_sm90, load, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.core.program import Buffer
from torch_kernelize.lowering.kernels.histc import FAMILY, _dot_tile

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy casting NaN in masked lanes

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

CASES = {
    "fixed_16": (16, -2.0, 2.0),
    "fixed_offset": (7, -0.3, 1.7),
    "fixed_1bin": (1, -1.0, 1.0),
    "fixed_many_bins": (1500, -3.0, 3.0),   # above the local-histogram limit: atomics only
    "data_range": (10, 0, 0),
    "data_range_equal_args": (25, 3.0, 3.0),  # min == max (not 0) also means "from the data"
}


DOT = Config.of(BLOCK=128, ITERS=2, num_warps=4, VARIANT="dot", ONEHOT="int8")


def inputs(dtype, layout="contiguous", n=(23, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*n, generator=g) * 1.3
    return {"contiguous": x, "transposed": x.t(), "sliced": x[:, ::3]}[layout].to(dtype)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_histc_matches_torch_exactly(case, dtype, layout, tmp_path):
    bins, lo, hi = CASES[case]
    x = inputs(dtype, layout)
    if dtype == BF16 and bins > 256:  # ATen's bf16 bin index can pass the last bin (out-of-bounds write)
        x = x[:2, :2].contiguous()     # (not even run in eager here: it can corrupt memory)
        assert "exceed" in FAMILY.supports(spec_of(aten.histc.default, (x, bins, lo, hi)))
        return
    spec = spec_of(aten.histc.default, (x, bins, lo, hi))
    program = assert_valid(FAMILY, spec, tmp_path, eager=False)
    runner = load(tmp_path, spec, program)
    for seed in range(3):  # unrestricted data (edge cases included) against ATen's own arithmetic
        xs = torch.empty_strided(x.shape, x.stride(), dtype=dtype).copy_(inputs(dtype, layout, seed=seed) * (1 + seed))
        got, want = runner.run_poisoned([xs])[0], aten_counts(xs, bins, lo, hi)
        assert torch.equal(got, want), f"seed {seed}: {(got - want).nonzero().flatten().tolist()}"
        if want.max() <= 256:  # no saturation in ATen's own accumulation: equal to torch.histc itself
            assert torch.equal(got, torch.histc(xs, bins, lo, hi))


@pytest.mark.parametrize("config", [
    dict(BLOCK=128, ITERS=4, num_warps=4, VARIANT="local"),
    dict(BLOCK=256, ITERS=2, num_warps=2, VARIANT="atomic"),
    dict(BLOCK=128, ITERS=1, num_warps=1, VARIANT="local"),
    dict(BLOCK=256, ITERS=4, num_warps=2, VARIANT="dot", ONEHOT="int8"),
    dict(BLOCK=128, ITERS=1, num_warps=1, VARIANT="dot", ONEHOT="float16"),
    dict(BLOCK=128, ITERS=4, num_warps=4, VARIANT="shared", COPIES=1),
    dict(BLOCK=256, ITERS=1, num_warps=8, VARIANT="shared", COPIES=32),
], ids=["iters4", "atomic_iters2", "small", "dot_iters4", "dot_fp16_small", "shared_iters4", "shared_copies32"])
@pytest.mark.parametrize("case", ["fixed_16", "data_range"])
def test_histc_configs(case, config, tmp_path):
    bins, lo, hi = CASES[case]
    x = inputs(BF16 if case == "data_range" else F16)
    spec = spec_of(aten.histc.default, (x, bins, lo, hi))
    program = assert_valid(FAMILY, spec, tmp_path, Config.of(**config), eager=False)
    assert torch.equal(load(tmp_path, spec, program).run_poisoned([x])[0], aten_counts(x, bins, lo, hi))


def test_every_seed_config_and_neighbours(tmp_path):
    x = inputs(F32, n=(64, 70))
    spec = spec_of(aten.histc.default, (x, 64, -2, 2))
    configs = FAMILY.seed_configs(spec)
    assert {c["VARIANT"] for c in configs} == {"shared", "local", "atomic", "dot"}
    assert {c["ONEHOT"] for c in configs if c["VARIANT"] == "dot"} == {"int8", "float16"}
    assert {c["COPIES"] for c in configs if c["VARIANT"] == "shared"} == {1, 8, 32}
    for config in configs:
        program = assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=False)
        compare_eager(FAMILY, spec, program, tmp_path, exact=True, inputs=[x])
        for n in FAMILY.neighbours(spec, config):
            FAMILY.generate(spec, n)
    assert {c["VARIANT"] for c in FAMILY.seed_configs(spec_of(aten.histc.default, (x, 2000, -2, 2)))} == {"shared", "dot", "atomic"}
    assert {c["VARIANT"] for c in FAMILY.seed_configs(spec_of(aten.histc.default, (x, 5000, -2, 2)))} == {"shared", "atomic"}
    many = spec_of(aten.histc.default, (x, 20000, -2, 2))
    assert {c["VARIANT"] for c in FAMILY.seed_configs(many)} == {"atomic"}


def test_all_equal_and_edges(tmp_path):
    """All-equal data widens to [v-1, v+1]; values exactly at min/max; out-of-range and NaN skipped."""
    spec = spec_of(aten.histc.default, (torch.full((50,), 2.5), 4, 0, 0))
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    compare_eager(FAMILY, spec, program, tmp_path, exact=True)
    compare_eager(FAMILY, spec, FAMILY.generate(spec, DOT.replace(ITERS=1)), tmp_path, exact=True)
    x = torch.tensor([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 1.5, float("nan"), float("inf"), -float("inf"), 0.999999])
    for dtype in (F32, F16, BF16):
        spec = spec_of(aten.histc.default, (x.to(dtype), 4, -0.5, 1.0))
        for config in (FAMILY.seed_configs(spec)[-1], DOT.replace(ITERS=1, ONEHOT="float16")):
            compare_eager(FAMILY, spec, FAMILY.generate(spec, config), tmp_path, exact=True, inputs=[x.to(dtype)])


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_power_of_two_width_multiplies_exactly(dtype, tmp_path):
    """A width of 2^k: the kernel multiplies by the exact inverse; bins equal ATen's, edges included."""
    edges = torch.linspace(-4.0, 4.0, 65)
    x = torch.cat([edges, torch.nextafter(edges, torch.tensor(-9.0)), torch.nextafter(edges, torch.tensor(9.0)),
                   torch.randn(3000) * 2]).to(dtype)
    spec = spec_of(aten.histc.default, (x, 64, -4.0, 4.0))
    for config in FAMILY.seed_configs(spec)[:2]:
        program = FAMILY.generate(spec, config)
        assert "div_rn" not in program.source and "* 0.125)" in program.source, program.source
        assert torch.equal(load(tmp_path, spec, program).run_poisoned([x])[0], aten_counts(x, 64, -4.0, 4.0))
    assert "div_rn" in FAMILY.generate(spec_of(aten.histc.default, (x, 64, -3.0, 3.0)), config).source


def test_seeds_bin_32_elements_per_thread():
    spec = spec_of(aten.histc.default, (torch.empty(1 << 24), 256, -3.0, 3.0))
    assert any(c["VARIANT"] == "local" and c["BLOCK"] // (32 * c["num_warps"]) == 32 for c in FAMILY.seed_configs(spec))


@pytest.mark.parametrize("dtype", [F32, F16], ids=str)  # fp32: the histogram kernel writes the NaNs; fp16: the last one
@pytest.mark.parametrize("variant", ["shared", "local", "dot"])
def test_data_range_with_nan_gives_nan(variant, dtype, tmp_path):
    """ATen raises for a NaN/inf data range; a kernel cannot raise, so every bin is NaN (never silently wrong)."""
    x = torch.randn(100).to(dtype)
    spec = spec_of(aten.histc.default, (x, 8))
    config = next(c for c in FAMILY.seed_configs(spec) if c["VARIANT"] == variant)
    runner = load(tmp_path, spec, FAMILY.generate(spec, config))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[17] = bad
        with pytest.raises(RuntimeError):
            torch.histc(y, 8)
        assert runner.run_poisoned([y])[0].isnan().all()


@pytest.mark.parametrize("what", ["bins", "last_bin", "range", "dot_split", "dot_skip"])
def test_broken_programs_fail_validation(what, tmp_path):
    x = inputs(F32)
    spec = spec_of(aten.histc.default, (x, 100 if what.startswith("dot") else 16, -2.0, 2.0) if what != "range" else (x, 16))
    program = FAMILY.generate(spec, DOT if what.startswith("dot") else FAMILY.seed_configs(spec)[0])
    old, new = {"bins": ("* 16.0", "* 15.0"),
                "last_bin": ("tl.minimum(tl.maximum(pos, 0), 15)", "tl.minimum(tl.maximum(pos, 0), 14)"),
                "range": ("mn.to(tl.float64) - 1.0", "mn.to(tl.float64) - 2.0"),
                "dot_split": ("pos & 15", "pos & 7"),
                "dot_skip": ("tl.where(keep, pos >> 4, -1)", "tl.where(keep, pos >> 4, 0)")}[what]
    if what == "range":  # only matters for all-equal data: the "zeros" edge trial catches it
        old, new = "hi64 = tl.where(mn == mx, mx.to(tl.float64) + 1.0", "hi64 = tl.where(mn == mx, mx.to(tl.float64) + 3.0"
    assert_mutant_fails(FAMILY, spec, program, old, new, tmp_path, seeds=(0, 1, 2))


def test_refusals():
    x = torch.randn(10)
    s = spec_of(aten.histc.default, (x, 4, -1, 1))
    assert "min > max" in FAMILY.supports(dataclasses.replace(s, args=[{"tensor": 0}, 4, 1.0, -1.0]))
    assert "non-finite" in FAMILY.supports(dataclasses.replace(s, args=[{"tensor": 0}, 4, -1.0, {"float": "inf"}]))
    assert "collapses" in FAMILY.supports(spec_of(aten.histc.default, (x.half(), 4, 1.0, 1.0001)))
    assert "float64" in FAMILY.supports(spec_of(aten.histc.default, (x.double(), 4, -1, 1)))
    assert "empty" in FAMILY.supports(spec_of(aten.histc.default, (torch.empty(0), 4, -1, 1)))
    assert family_for(s) is FAMILY


@pytest.mark.parametrize("dtype,args", [(F32, (256, -3.0, 3.0)), (F16, (100,)), (BF16, (200, -1, 1)), (F32, (4000, -1, 1))],
                         ids=["f32_256", "f16_100_data", "bf16_200", "f32_4000"])
def test_sm90_compile(dtype, args, tmp_path):
    """Every seed (the "dot" ones included: 4000 bins is a [64, 64] tile) compiles for sm_90."""
    spec = spec_of(aten.histc.default, (torch.randn(4096 * 64).to(dtype), *args))
    configs = FAMILY.seed_configs(spec)
    assert "dot" in {c["VARIANT"] for c in configs}
    for config in configs:
        compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)


DOT_CASES = {"fixed_256": (256, -2.0, 2.0), "fixed_100": (100, -0.3, 1.7), "data_256": (256, 0, 0), "data_100": (100, 0, 0)}


@pytest.mark.parametrize("case,dtype,onehot", [  # each one-hot dtype meets every case and every input dtype
    (case, dtype, ("int8", "float16")[(i + j) % 2]) for i, case in enumerate(DOT_CASES) for j, dtype in enumerate((F32, F16, BF16))],
    ids=str)
def test_dot_variant_matches_torch_exactly(case, dtype, onehot, tmp_path):
    """The tensor-core count: the same bins as ATen, 100 bins (a partly used [16, 16] tile) included."""
    bins, lo, hi = DOT_CASES[case]
    layout = "sliced" if bins == 100 else "contiguous"
    x = inputs(dtype, layout)
    spec = spec_of(aten.histc.default, (x, bins, lo, hi))
    program = assert_valid(FAMILY, spec, tmp_path, DOT.replace(ONEHOT=onehot), seeds=(0, 1), eager=False)
    assert "tl.dot(" in program.source and "tl.histogram" not in program.source
    runner = load(tmp_path, spec, program)
    for seed in range(2):  # unrestricted data, edges included
        xs = torch.empty_strided(x.shape, x.stride(), dtype=dtype).copy_(inputs(dtype, layout, seed=seed + 5) * (1 + seed))
        assert torch.equal(runner.run_poisoned([xs])[0], aten_counts(xs, bins, lo, hi))


def test_dot_counts_one_crowded_bin(tmp_path):
    """Every element in one bin: per-program counts well past int8/fp16 range still add up exactly."""
    x = torch.full((3000,), 0.7)
    x[::7] = 1.0   # the max: the last bin
    spec = spec_of(aten.histc.default, (x, 256, -1.0, 1.0))
    for onehot in ("int8", "float16"):
        program = FAMILY.generate(spec, Config.of(BLOCK=1024, ITERS=2, num_warps=4, VARIANT="dot", ONEHOT=onehot))
        assert torch.equal(load(tmp_path, spec, program).run_poisoned([x])[0], torch.histc(x, 256, -1.0, 1.0))


def test_dot_tile_and_limits():
    assert [_dot_tile(b) for b in (1, 100, 256, 257, 1024, 4096)] == [(16, 16), (16, 16), (16, 16), (16, 32), (32, 32), (64, 64)]
    assert max(_dot_tile(4097)) > 64
    spec = spec_of(aten.histc.default, (torch.empty(1 << 24), 256, -3.0, 3.0))
    dots = [c for c in FAMILY.seed_configs(spec) if c["VARIANT"] == "dot"]
    assert len(dots) == 3 and all(256 <= (1 << 24) // (c["BLOCK"] * c["ITERS"]) <= 1024 for c in dots)
    plan = FAMILY.plan(spec)
    assert not FAMILY._valid(plan, DOT.replace(ONEHOT=None))            # a dot config names its one-hot dtype
    assert not FAMILY._valid(plan, DOT.replace(VARIANT="local"))       # and only a dot config does
    assert not FAMILY._valid(plan, DOT.replace(BLOCK=8192))            # one-hots over 128 KiB of shared memory
    assert not FAMILY._valid(plan, DOT.replace(num_warps=16))


def test_data_range_needs_no_fills():
    """The range pass stores per-program partial ranges and zeroes the counts: nothing to initialise
    per call. Two launches with fp32 (fp16: a third converts the counts), or ONE_LAUNCH: one
    grid-synchronized launch (2 phases; fp16 3), whose only state is the barrier's semaphore."""
    for dtype, launches, phases in ((F32, 2, 2), (F16, 3, 3)):
        spec = spec_of(aten.histc.default, (torch.randn(1 << 20).to(dtype), 256))
        one = 0
        for config in FAMILY.seed_configs(spec):
            program = FAMILY.generate(spec, config)
            assert not program.output_init and all(t.init is None for t in program.temps), config
            parts = program.launches[0].grid[0]
            assert parts <= 1024 and program.temps[0].shape == (3 * parts,)
            if config.get("ONE_LAUNCH"):
                one += 1
                (launch,) = program.launches
                assert launch.phases == phases and parts == config["ONE_LAUNCH"], config
                assert program.state == (Buffer((1,), "int32", 0),)
            else:
                assert len(program.launches) == launches and not program.state, config
        assert one == 2


ONE_LAUNCH = {
    "local_p3": dict(BLOCK=128, ITERS=1, num_warps=4, VARIANT="local", ONE_LAUNCH=3),
    "shared_p8": dict(BLOCK=128, ITERS=1, num_warps=4, VARIANT="shared", COPIES=8, ONE_LAUNCH=8),
    "atomic_p2": dict(BLOCK=256, ITERS=1, num_warps=2, VARIANT="atomic", ONE_LAUNCH=2),
    "dot_p5": dict(BLOCK=128, ITERS=1, num_warps=4, VARIANT="dot", ONEHOT="int8", ONE_LAUNCH=5),
}


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("config", ONE_LAUNCH.values(), ids=ONE_LAUNCH.keys())
def test_one_launch_data_range_matches_torch_exactly(config, dtype, tmp_path):
    """Programs walk blocks pid, pid + P, ... (the last ones partial, some programs a block fewer),
    reduce every program's partial range behind the barrier (in the interpreter: a launch per
    phase), and count; the runner's semaphore carries over from call to call."""
    x = inputs(dtype, n=(23, 41))  # 943 elements: 8 blocks of 128, 4 of 256
    spec = spec_of(aten.histc.default, (x, 10))
    program = assert_valid(FAMILY, spec, tmp_path, Config.of(**config), eager=False)
    assert f"for blk in range(pid, {-(-943 // config['BLOCK'])}, {config['ONE_LAUNCH']})" in program.source
    runner = load(tmp_path, spec, program)
    for seed in range(3):
        xs = inputs(dtype, n=(23, 41), seed=seed) * (1 + seed)
        assert torch.equal(runner.run_poisoned([xs])[0], aten_counts(xs, 10)), seed
    nan = x.clone()
    nan[5, 7] = float("nan")
    assert runner.run_poisoned([nan])[0].isnan().all()


def test_one_launch_refusals():
    x = torch.randn(1000)
    data, fixed = (FAMILY.plan(spec_of(aten.histc.default, (x, 16, *r))) for r in ((), (-1.0, 1.0)))
    ok = Config.of(BLOCK=128, ITERS=1, num_warps=4, VARIANT="local", ONE_LAUNCH=8)
    assert FAMILY._valid(data, ok)
    assert not FAMILY._valid(fixed, ok)                                 # no range pass to wait for
    assert not FAMILY._valid(data, ok.replace(ONE_LAUNCH=9))            # more programs than blocks
    assert not FAMILY._valid(data, ok.replace(ITERS=2))                 # programs walk their blocks
    assert not FAMILY._valid(data, ok.replace(REVERSE=True))            # always last-first already


def test_data_range_reduces_many_partials(tmp_path, monkeypatch):
    """More blocks than MAX_PARTIALS: the range kernel's programs take more blocks each."""
    import torch_kernelize.lowering.kernels.histc as histc
    monkeypatch.setattr(histc, "MAX_PARTIALS", 8)
    x = torch.randn(40, 130) * 2
    spec = spec_of(aten.histc.default, (x, 16))
    program = FAMILY.generate(spec, Config.of(BLOCK=128, ITERS=1, num_warps=4, VARIANT="shared", COPIES=8))
    assert program.launches[0].grid == (6,) and program.launches[1].grid == (41,)
    assert torch.equal(load(tmp_path, spec, program).run_poisoned([x])[0], aten_counts(x, 16))


@pytest.mark.parametrize("copies", [1, 32])
def test_shared_variant_counts_in_shared_memory_on_sm90(copies, tmp_path):
    """The PTX helpers compile (the interpreter runs their twins): one warp-aggregated shared atomic
    per element, no tl.histogram (ballots), no local memory; the read-back stays inside the array
    (100 bins read 128: an out-of-bounds read of 32 copies was an illegal address on the H200)."""
    from torch_kernelize.building.triton_compile import sass
    from torch_kernelize.building.programs import write_program
    from torch_kernelize.lowering.kernels.histc import _shared_words
    spec = spec_of(aten.histc.default, (torch.randn(1 << 16), 100))
    config = Config.of(BLOCK=2048, ITERS=4, num_warps=8, VARIANT="shared", COPIES=copies)
    program = FAMILY.generate(spec, config)
    assert f"tk_shist[{_shared_words(100, copies)}]" in program.source and _shared_words(100, copies) >= 128 * copies
    write_program(tmp_path, spec, program, "cuda", ("cuda", 90, 32))
    code = sass(tmp_path / "launch1.cubin")  # launch 0: the range kernel
    per_thread = 2048 // (32 * 8)
    assert code.count("ATOMS.POPC.INC.32") == per_thread
    assert "VOTE" not in code and "LDL" not in code and "STL" not in code


@pytest.mark.parametrize("stream", ["", "evict_first"])
def test_reverse_order_and_stream_hint(stream, tmp_path):
    """REVERSE (a range from the data only): the histogram programs take the blocks last-first and
    still count every element once; STREAM="evict_first" puts the hint on the x loads (sm_90:
    LDG.E.EF) and nowhere else."""
    from torch_kernelize.building.triton_compile import sass
    from torch_kernelize.building.programs import write_program
    x = torch.randn(40, 130) * 2
    spec = spec_of(aten.histc.default, (x, 16))
    config = Config.of(BLOCK=128, ITERS=4, num_warps=4, VARIANT="shared", COPIES=8, REVERSE=True,
                       **({"STREAM": stream} if stream else {}))
    program = assert_valid(FAMILY, spec, tmp_path / "interp", config, eager=False)
    assert "blk = 10 - pid" in program.source  # 41 blocks of 128 in 11 programs of 4
    assert torch.equal(load(tmp_path / "interp", spec, program).run_poisoned([x])[0], aten_counts(x, 16))
    write_program(tmp_path / "sm90", spec, program, "cuda", ("cuda", 90, 32))
    assert ("LDG.E.EF" in sass(tmp_path / "sm90" / "launch1.cubin")) == bool(stream)
    assert "LDG.E.EF" not in sass(tmp_path / "sm90" / "launch0.cubin")  # the range pass keeps its lines
    fixed = spec_of(aten.histc.default, (x, 16, -2.0, 2.0))
    assert not FAMILY._valid(FAMILY.plan(fixed), config)  # nothing to reuse without a range pass


def test_neighbours_toggle_the_read_order_hint_and_one_launch():
    spec = spec_of(aten.histc.default, (torch.randn(1 << 16), 256))
    seeds = FAMILY.seed_configs(spec)
    one = next(c for c in seeds if c.get("ONE_LAUNCH"))
    two = next(c for c in seeds if not c.get("ONE_LAUNCH"))
    for seed in (one, two):
        near = FAMILY.neighbours(spec, seed)
        assert any(c.get("STREAM", "") != seed.get("STREAM", "") for c in near)
        assert all(c.get(k, None) not in ("", False, 0) for c in near for k in ("STREAM", "REVERSE", "ONE_LAUNCH"))  # defaults left out
        assert {bool(c.get("ONE_LAUNCH")) for c in near} == {True, False}
    assert any(c.get("REVERSE", False) != two.get("REVERSE", False) for c in FAMILY.neighbours(spec, two))
    programs = {c["ONE_LAUNCH"] for c in FAMILY.neighbours(spec, one) if c.get("ONE_LAUNCH")}
    assert {one["ONE_LAUNCH"] // 2, one["ONE_LAUNCH"] * 2} & programs


def test_programs_without_their_interpreter_twins_are_refused(tmp_path):
    spec = spec_of(aten.histc.default, (torch.randn(1000), 16, -1.0, 1.0))
    program = FAMILY.generate(spec, Config.of(BLOCK=256, ITERS=1, num_warps=4, VARIANT="shared", COPIES=1))
    broken = dataclasses.replace(program, source=program.source.replace('"_shist_add_twin"', '"_shist_add_missing"'))
    with pytest.raises(ValueError, match="interpreter twin '_shist_add_missing' of '_shist_add' is not defined"):
        load(tmp_path, spec, broken)


def test_no_inline_ptx_seeds_on_rocm(monkeypatch):
    spec = spec_of(aten.histc.default, (torch.randn(1000), 16, -1.0, 1.0))
    assert "shared" in {c["VARIANT"] for c in FAMILY.seed_configs(spec)}
    monkeypatch.setattr(torch.version, "hip", "6.2")
    configs = FAMILY.seed_configs(spec)
    assert "shared" not in {c["VARIANT"] for c in configs}
    assert all(n["VARIANT"] != "shared" for c in configs for n in FAMILY.neighbours(spec, c))


@pytest.mark.parametrize("args", [(10, -1.0, 1.0), (7,)], ids=["fixed", "data_range"])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1, 1), "broadcast"], ids=str)
def test_zero_dim_one_element_and_broadcast_inputs(shape, args, tmp_path):
    """The input's offset has no term (0-d, one element, or one element expanded): x is still
    loaded as a block (``idx * 0``), under the block mask, one element per lane; every seed
    config against the float64 reference and torch.histc."""
    x = torch.randn(1).expand(300) if shape == "broadcast" else torch.randn(shape)
    spec = spec_of(aten.histc.default, (x,) + args)
    assert family_for(spec) is FAMILY
    for config in FAMILY.seed_configs(spec):
        program = assert_valid(FAMILY, spec, tmp_path, config, seeds=(0, 1), eager=False)
        assert "in0_ptr + idx * 0" in program.source
        got = load(tmp_path, spec, program).run_poisoned([x])[0]
        assert torch.equal(got, torch.histc(x, *args)), config
