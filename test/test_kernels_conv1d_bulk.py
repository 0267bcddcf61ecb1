"""conv1d's CUDA C++ configurations (conv1d_bulk.py / conv1d_bulk.cu): which convolutions they
take and why not the others, tilings that cover every shape within shared memory and registers,
CUDA C++ programs through the build/load path (language, source file, parameter names), an sm_90
build of every seed with nvcc (no spills), and on an sm_90 GPU every seed against the float64
reference, through the same stored-cubin path that serving uses.

The Triton interpreter cannot run CUDA C++, so numerical checks of this kernel need the GPU; on
CPU the conv1d family offers no CUDA configurations (the test below checks that), and
fill_cache validates each candidate against float64 before it stores one.
"""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from kernel_testing import spec_of
from test_kernels_conv1d import bench_spec
from torch_kernelize.building import nvcc
from torch_kernelize.building.programs import write_program
from torch_kernelize.serving.launch import load_program, read_program
from torch_kernelize.lowering.kernels import conv1d_bulk
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.conv1d import FAMILY
from torch_kernelize.core.program import KernelProgram, Launch
from torch_kernelize.core.validate import validate

aten = torch.ops.aten
F16, BF16 = torch.float16, torch.bfloat16


def conv(N=3, Cin=32, L=40, Cout=48, K=3, stride=1, pad=1, dil=1, groups=1, bias=True, dtype=F16, x=None):
    x = torch.randn(N, Cin, L).to(dtype) if x is None else x
    w = torch.randn(Cout, Cin // groups, K).to(dtype)
    b = torch.randn(Cout).to(dtype) if bias else None
    return spec_of(aten.convolution.default, (x, w, b, [stride], [pad], [dil], False, [0], groups))


SHAPES = {
    "k3_pad1": dict(),
    "k5_pad2_no_bias": dict(Cin=64, Cout=128, L=96, K=5, pad=2, bias=False),
    "dilation2_bf16": dict(K=3, pad=2, dil=2, dtype=BF16),
    "no_padding": dict(Cin=96, Cout=96, L=200, pad=0, N=5),
    "big_padding_k1": dict(K=1, pad=3, Cin=16, Cout=16, L=8),
    "long_rows": dict(Cin=16, Cout=32, L=1000, K=7, pad=3, N=2),
}


def _gpu_spec(spec):
    on = lambda m: dataclasses.replace(m, device="cuda")
    return dataclasses.replace(spec, inputs=tuple(map(on, spec.inputs)), outputs=tuple(map(on, spec.outputs)))


def plan_of(spec):
    plan = FAMILY.plan(spec)
    assert not isinstance(plan, str), plan
    return plan


@pytest.mark.parametrize("case,why", [
    (dict(dtype=torch.float32), "fp16/bf16"),
    (dict(stride=2), "stride 2"),
    (dict(groups=2, Cin=32, Cout=32), "groups 2"),
    (dict(Cin=24), "multiples of 16"),
    (dict(L=41), "16-byte units"),
    (dict(x=torch.randn(3, 40, 32).to(F16).transpose(1, 2)), "contiguous"),
    (dict(K=33, pad=16), "33 taps"),
    (dict(Cin=1024, Cout=1024, L=512), "shared memory"),
])
def test_refusals_say_why(case, why):
    assert why in conv1d_bulk.reason(plan_of(conv(**case)))


@pytest.mark.parametrize("name", SHAPES)
def test_seeds_cover_the_convolution_within_the_limits(name):
    plan = plan_of(conv(**SHAPES[name]))
    assert conv1d_bulk.reason(plan) is None
    seeds = conv1d_bulk.seeds(plan)
    assert seeds
    for c in seeds + [n for s in seeds for n in conv1d_bulk.neighbours(plan, s)]:
        assert conv1d_bulk.valid(plan, c), c
        mt, nt = conv1d_bulk.tiles(plan, c)
        assert c["WARPS_M"] * mt * 16 == plan.Cout
        assert c["WARPS_N"] * nt * 8 >= plan.Lout > (c["WARPS_N"] - 1) * nt * 8  # no idle warp
        assert conv1d_bulk.shared_bytes(plan, c) <= conv1d_bulk.SHARED_LIMIT
        assert 4 * mt * nt <= conv1d_bulk.MAX_ACC


def test_benchmark_shape_seeds_the_measured_best():
    plan = plan_of(bench_spec())
    first = conv1d_bulk.seeds(plan)[0]
    assert (first["WARPS_M"], first["WARPS_N"], first["IN_BUFS"], first["GRID"]) == (3, 4, 2, 132)
    assert conv1d_bulk.tiles(plan, first) == (2, 7)


def test_invalid_configs_are_refused():
    plan = plan_of(bench_spec())
    good = conv1d_bulk.seeds(plan)[0]
    for bad in (good.replace(WARPS_M=4),            # 96 channels = 6 m16 tiles: 4 warps do not divide them
                good.replace(WARPS_N=40),           # 3840 threads
                good.replace(IN_BUFS=3), good.replace(GRID=0), good.replace(WARPS_M=True),
                good.replace(WARPS_M=1, WARPS_N=1),  # 6 x 25 tiles: far too many accumulators
                Config.of(**{**good.to_json(), "BLOCK_L": 64})):
        assert not conv1d_bulk.valid(plan, bad), bad
    with pytest.raises(ValueError, match="invalid config"):
        FAMILY.generate(bench_spec(), good.replace(IN_BUFS=3))


def test_family_offers_cuda_configs_only_where_they_build_and_run(monkeypatch):
    spec = _gpu_spec(bench_spec())
    monkeypatch.setattr(nvcc, "available", lambda: False)
    assert not [c for c in FAMILY.seed_configs(spec) if c.get("IMPL")]
    monkeypatch.setattr(nvcc, "available", lambda: True)
    seeds = FAMILY.seed_configs(spec)
    assert seeds[0].get("IMPL") == "cuda" and [c for c in seeds if not c.get("IMPL")]  # Triton ones follow
    assert all(n.get("IMPL") == "cuda" for n in FAMILY.neighbours(spec, seeds[0]))
    # convolutions the kernel does not take get Triton seeds only
    assert not [c for c in FAMILY.seed_configs(_gpu_spec(conv(stride=2))) if c.get("IMPL")]
    # nor do CPU specs (the interpreter target): the interpreter cannot run CUDA C++
    assert not [c for c in FAMILY.seed_configs(bench_spec()) if c.get("IMPL")]


def test_cuda_program_round_trips_through_its_files(tmp_path):
    spec = bench_spec()
    program = FAMILY.generate(spec, conv1d_bulk.seeds(plan_of(spec))[0])
    assert program.language == "cuda" and program.source_file == "kernel.cu"
    launch = program.launches[0]
    assert program.kernel_arg_names(launch.kernel) == ["x", "w", "bias", "y", "N"]
    assert launch.args == (("in", 0), ("in", 1), ("in", 2), ("out", 0), ("i32", 2048))
    assert launch.shared == conv1d_bulk.shared_bytes(plan_of(spec), conv1d_bulk.seeds(plan_of(spec))[0])
    write_program(tmp_path, spec, program, "interpreter")  # sources only: nothing to compile
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernel.cu", "program.json"]
    assert read_program(tmp_path) == program
    with pytest.raises(ValueError, match="runs on the cuda target only"):
        load_program(tmp_path, spec, "interpreter")


def test_program_language_is_checked():
    with pytest.raises(ValueError, match="unknown kernel language"):
        KernelProgram("", (), language="fortran")
    with pytest.raises(ValueError, match="negative shared memory"):
        Launch("k", (1,), (), shared=-1)
    p = KernelProgram('extern "C" __global__ void __launch_bounds__(128, 1)\nk(const float* __restrict__ a, int n) {}',
                      (Launch("k", (1,), (("in", 0), ("i32", 3)), shared=1024),), language="cuda")
    assert p.kernel_arg_names("k") == ["a", "n"]
    assert KernelProgram.from_json(json.loads(json.dumps(p.to_json())), p.source) == p
    with pytest.raises(ValueError, match="not defined"):
        p.kernel_arg_names("other")
    with pytest.raises(ValueError, match="no Triton signature"):
        p.signature(p.launches[0], None)


def test_nvcc_command_names_the_arch_and_the_constants(tmp_path):
    launch = Launch("k", (1,), (), {"A": 3, "B": True}, num_warps=4)
    cmd = nvcc.nvcc_command(tmp_path / "k.cu", tmp_path / "k.cubin", launch, 90)
    assert "-gencode=arch=compute_90,code=sm_90" in cmd and "-DA=3" in cmd and "-DB=1" in cmd
    with pytest.raises(ValueError, match="int or bool"):
        nvcc.nvcc_command(tmp_path / "k.cu", tmp_path / "k.cubin", dataclasses.replace(launch, constexprs={"A": 1.5}), 90)


def test_missing_nvcc_is_a_clear_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv(nvcc.NVCC_ENV, str(tmp_path / "no-nvcc"))
    assert nvcc.nvcc() is None
    spec = bench_spec()
    program = FAMILY.generate(spec, conv1d_bulk.seeds(plan_of(spec))[0])
    with pytest.raises(RuntimeError, match="needs nvcc"):
        write_program(tmp_path / "p", spec, program, "cuda", ("cuda", 90, 32))


NVCC = nvcc.nvcc()


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_nvcc_errors_reach_the_build_error(tmp_path):
    broken = KernelProgram('extern "C" __global__ void k(float* y, int n) { y[0] = UNDEFINED_NAME; }',
                           (Launch("k", (1,), (("out", 0), ("i32", 1)), {"A": 2}),), language="cuda")
    with pytest.raises(RuntimeError, match=r"(?s)nvcc failed on k \(-DA=2\).*UNDEFINED_NAME"):
        write_program(tmp_path, conv(), broken, "cuda", ("cuda", 90, 32))


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("name", ["k3_pad1", "k5_pad2_no_bias", "dilation2_bf16", "long_rows"])
def test_seeds_build_for_sm90_without_spills(name, tmp_path):
    spec = conv(**SHAPES[name])
    for i, c in enumerate(conv1d_bulk.seeds(plan_of(spec))):
        files = write_program(tmp_path / f"s{i}", spec, FAMILY.generate(spec, c), "cuda", ("cuda", 90, 32))
        assert files == ["kernel.cu", "program.json", "launch0.cubin", "launch0.json"]
        meta = json.loads((tmp_path / f"s{i}" / "launch0.json").read_text())
        assert meta["shared"] == conv1d_bulk.shared_bytes(plan_of(spec), c)
        assert re.search(r"\b0 bytes spill stores", meta["ptxas"]), (c, meta["ptxas"])


def test_benchmark_shape_builds_for_sm90_without_spills(tmp_path):
    if NVCC is None:
        pytest.skip("needs nvcc (the CUDA toolkit)")
    spec = bench_spec()
    c = conv1d_bulk.seeds(plan_of(spec))[0]
    write_program(tmp_path, spec, FAMILY.generate(spec, c), "cuda", ("cuda", 90, 32))
    assert "0 bytes spill stores" in json.loads((tmp_path / "launch0.json").read_text())["ptxas"]


GPU = torch.cuda.is_available() and nvcc.available()



@pytest.mark.skipif(not GPU, reason="needs an sm_90 GPU and nvcc")
@pytest.mark.parametrize("name", list(SHAPES) + ["benchmark"])
def test_gpu_seeds_validate_through_the_stored_cubins(name, tmp_path):
    spec = _gpu_spec(bench_spec() if name == "benchmark" else conv(**SHAPES[name]))
    for i, c in enumerate(conv1d_bulk.seeds(plan_of(spec))):
        write_program(tmp_path / f"s{i}", spec, FAMILY.generate(spec, c), "cuda")
        runner = load_program(tmp_path / f"s{i}", spec, "cuda")
        rec = validate(runner.run_poisoned, spec, FAMILY.sample_inputs, FAMILY.edge_kinds, device="cuda")
        assert rec.ok, f"{name} [{c}]: {rec.reason}"


@pytest.mark.skipif(not GPU, reason="needs an sm_90 GPU and nvcc")
def test_gpu_unaligned_input_goes_to_the_vendor_op(tmp_path):
    from torch_kernelize.serving.launch import MisalignedInput
    spec = _gpu_spec(conv())
    write_program(tmp_path, spec, FAMILY.generate(spec, conv1d_bulk.seeds(plan_of(spec))[0]), "cuda")
    runner = load_program(tmp_path, spec, "cuda")
    x, w, b = FAMILY.sample_inputs(spec, 0, "random", "cuda")
    torch.testing.assert_close(runner(x, w, b), spec.run_vendor([x, w, b])[0], rtol=2e-3, atol=2e-3)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x)
    shifted.copy_(x)
    with pytest.raises(MisalignedInput):
        runner(shifted, w, b)


@pytest.mark.skipif(not GPU, reason="needs an sm_90 GPU and nvcc")
def test_gpu_fill_then_serve_runs_the_cuda_kernel(tmp_path):
    """fill_cache stores a CUDA C++ winner (kernel.cu and its cubin); a fresh process serves the
    convolution from it, with the eager result."""
    from test_fill_cache import MODELS, compile_in_fresh_process, fill_cache
    cache = tmp_path / "cache"
    # a winner however its time compares with cuDNN's: this checks the path, not the speed
    fill_cache("--model", f"{MODELS}:make_conv1d_layer", "--target", "cuda", "--cache-dir", str(cache), "--budget", "2",
               "--min-speedup", "0")
    sources = list(cache.glob("**/kernel.cu"))
    assert len(sources) == 1 and (sources[0].parent / "launch0.cubin").exists()
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.core.targets import get_target
    kc = KernelCache.for_target(cache, get_target("cuda"))
    (key,) = kc.keys()
    status, entry, why = kc.lookup(key)
    assert status == "hit" and entry.language == "cuda" and why.startswith("CUDA C++ kernel conv1d"), why
    res, _ = compile_in_fresh_process(tmp_path, cache, fn="make_conv1d_layer", target="cuda")
    assert res["tiers"]["aten.convolution.default"] == "triton" and res["misses"] == []
    assert res["err"] < 2e-2

