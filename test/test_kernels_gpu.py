"""The pointwise, reduction and histc families on a real GPU (skipped without CUDA).

Same checks as the interpreter tests, on larger shapes: every seed config of each spec validates
against the float64 CPU reference with the inputs on the GPU; histc counts equal ATen's (CPU)
exactly; and one program per family goes through the project's ahead-of-time CUDA path
(write_program(..., "cuda") + load_program). ``python -m kernel_testing``-style timings live in
``kernel_testing.gpu_benchmarks``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_testing import aten_counts, jit_runner
from torch_kernelize.building.programs import write_program
from torch_kernelize.serving.launch import load_program
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.validate import validate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

aten = torch.ops.aten


def cuda_specs() -> list[tuple[str, KernelSpec]]:
    def s(op, *args, **kwargs):
        if op is aten.histc.default and args[0].dtype != torch.float32:
            # ATen CUDA has no fp16/bf16 histc: take the spec from a CPU call, then move it
            cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
            spec = KernelSpec.from_call(op, cpu, kwargs, op(*cpu, **kwargs))
            on = lambda m: dataclasses.replace(m, device="cuda")
            return dataclasses.replace(spec, inputs=tuple(map(on, spec.inputs)), outputs=tuple(map(on, spec.outputs)))
        return KernelSpec.from_call(op, args, kwargs, op(*args, **kwargs))
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape, dtype=torch.float32: torch.randn(*shape, device="cuda", generator=g).to(dtype)
    return [
        ("add_bcast_f16", s(aten.add.Tensor, r(512, 1000, dtype=torch.float16), r(1000, dtype=torch.float16), alpha=2)),
        ("gelu_tanh_bf16_t", s(aten.gelu.default, r(700, 900, dtype=torch.bfloat16).t(), approximate="tanh")),
        ("silu_f32", s(aten.silu.default, r(1 << 20))),
        ("where_mixed", s(aten.where.self, r(300, 800) > 0, r(300, 800, dtype=torch.float16), r(800))),
        ("to_bf16_permuted", s(aten._to_copy.default, r(64, 128, 96).permute(2, 0, 1), dtype=torch.bfloat16)),
        ("pow_2_5", s(aten.pow.Tensor_Scalar, r(300, 1001), 2.5)),
        ("lt_scalar", s(aten.lt.Scalar, r(1000, 333, dtype=torch.float16), 0.25)),
        ("sum_last_f16", s(aten.sum.dim_IntList, r(1024, 3000, dtype=torch.float16), [-1])),
        ("mean_outer", s(aten.mean.dim, r(5000, 384), [0], True)),
        ("amax_all_bf16", s(aten.amax.default, r(1 << 20, dtype=torch.bfloat16))),
        ("var_mean_rows", s(aten.var_mean.correction, r(512, 4096), [1], correction=1)),
        ("sum_full_split", s(aten.sum.default, r(3 << 20))),
        ("softmax_f16", s(aten._softmax.default, r(1024, 1000, dtype=torch.float16), -1, False)),
        ("log_softmax_vocab", s(aten._log_softmax.default, r(64, 50257), -1, False)),
        ("softmax_dim0_bf16", s(aten._softmax.default, r(300, 512, dtype=torch.bfloat16), 0, False)),
        ("histc_fixed_f32", s(aten.histc.default, r(1 << 20), 256, -3.0, 3.0)),
        ("histc_data_f16", s(aten.histc.default, r(1 << 20, dtype=torch.float16), 100)),
        ("histc_fixed_bf16", s(aten.histc.default, r(4096, 256, dtype=torch.bfloat16).t(), 64, -2.0, 2.0)),
    ]


SPECS = cuda_specs() if torch.cuda.is_available() else []


@pytest.mark.parametrize("name,spec", SPECS, ids=[n for n, _ in SPECS])
def test_gpu_seed_configs_validate(name, spec, tmp_path):
    family = family_for(spec)
    assert family is not None, spec.describe()
    for config in family.seed_configs(spec):
        program = family.generate(spec, config)
        runner = jit_runner(tmp_path, spec, program)
        rec = validate(runner.run_poisoned, spec, family.sample_inputs, family.edge_kinds, device="cuda")
        assert rec.ok, f"{name} [{config}]: {rec.reason}\n{program.source}"
        if spec.op == "aten.histc.default":  # exact counts, as ATen (CPU) bins them
            args = spec.build_args([torch.empty(0)])[0]
            x = family.sample_inputs(spec, 7, "random", "cuda")[0]
            got = runner(x).cpu()
            assert torch.equal(got, aten_counts(x.cpu(), *args[1:])), name


@pytest.mark.parametrize("name", ["add_bcast_f16", "var_mean_rows", "histc_data_f16", "softmax_f16"])
def test_gpu_aot_cuda_path(name, tmp_path):
    spec = dict(SPECS)[name]
    family = family_for(spec)
    program = family.generate(spec, family.seed_configs(spec)[0])
    write_program(tmp_path / "p", spec, program, "cuda")
    runner = load_program(tmp_path / "p", spec, "cuda")
    rec = validate(runner.run_poisoned, spec, family.sample_inputs, family.edge_kinds, device="cuda")
    assert rec.ok, rec.reason


def test_gpu_one_launch_histc_waits_at_its_grid_barrier(tmp_path):
    """A data-range histc in one cooperative launch (ONE_LAUNCH): the programs wait at a grid
    barrier whose semaphore the runner keeps per stream. Repeated calls (the semaphore is never
    reset), a second stream, and a grid too large to be resident (refused, not hung)."""
    from torch_kernelize.lowering.kernels.base import Config
    from torch_kernelize.lowering.kernels.histc import FAMILY

    x = torch.randn(1 << 22, device="cuda")
    spec = KernelSpec.from_call(aten.histc.default, [x, 256], {}, torch.histc(x, 256))
    config = Config.of(BLOCK=1024, ITERS=1, num_warps=8, VARIANT="shared", COPIES=1, ONE_LAUNCH=528)
    write_program(tmp_path / "p", spec, FAMILY.generate(spec, config), "cuda")
    runner = load_program(tmp_path / "p", spec, "cuda")
    assert not runner._kernels[0].static  # torch's static launcher has no cooperative launch
    side = torch.cuda.Stream()
    for i in range(20):
        xi = torch.randn(1 << 22, device="cuda") * (1 + i % 3) + i
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            got = runner(xi)
            want = torch.histc(xi, 256)
        torch.cuda.synchronize()
        assert torch.equal(got, want), i
    # captured in a CUDA graph on a stream the runner has not seen: its semaphore is allocated
    # (and zeroed) inside the capture, so every replay starts from zero
    xg = torch.randn(1 << 22, device="cuda")
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture):
        got = runner(xg)
    for i in range(5):
        xg.copy_(torch.randn(1 << 22, device="cuda") * (i + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, torch.histc(xg, 256)), i
    too_many = Config.of(BLOCK=1024, ITERS=1, num_warps=16, VARIANT="shared", COPIES=1, ONE_LAUNCH=1024)
    write_program(tmp_path / "q", spec, FAMILY.generate(spec, too_many), "cuda")
    with pytest.raises(RuntimeError, match="cooperative"):
        load_program(tmp_path / "q", spec, "cuda")(x)


class _Norm(torch.nn.Module):  # at module level: a saved artifact refers to the class by its name
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(512, device="cuda", dtype=torch.float16) + 0.5)

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).half() * self.w


def test_gpu_saved_artifact_runs_the_cached_kernels(tmp_path):
    """torch_kernelize.aot on the GPU: save, load (no Dynamo), same result as eager; the loaded
    function runs kernelize's graph with the CUDA target."""
    from torch_kernelize import aot

    model = _Norm().eval()
    x = torch.randn(64, 512, device="cuda", dtype=torch.float16)
    options = {"target": "cuda", "cache_dir": str(tmp_path / "kc"), "repro_dir": "off"}
    with torch.no_grad():
        aot.save(model.forward, (x,), tmp_path / "norm.kz", options=options)
        run = aot.load(tmp_path / "norm.kz", model)
        torch.testing.assert_close(run(x), model(x), rtol=2e-3, atol=2e-3)


def test_gpu_a_loaded_programs_kernels_are_on_the_device_before_their_first_launch(tmp_path):
    """Lowering binds programs ahead of their calls: their kernels' code is loaded then (cuFuncLoad),
    not by CUDA's lazy loading at a served call's first launch of each (issue 41)."""
    import ctypes

    from torch_kernelize.serving.cubin_launch import _Driver
    lib = _Driver.lib()
    if getattr(lib, "cuFuncIsLoaded", None) is None:
        pytest.skip("the driver predates cuFuncIsLoaded (CUDA 12.4)")
    spec = dict(SPECS)["softmax_f16"]
    family = family_for(spec)
    write_program(tmp_path / "p", spec, family.generate(spec, family.seed_configs(spec)[0]), "cuda")
    runner = load_program(tmp_path / "p", spec, "cuda")
    functions = [(k.name, k._static.function) for k in runner._kernels if k.static]
    assert functions, "no kernel took torch's static launcher: nothing here says where its code is"
    for name, function in functions:
        state = ctypes.c_int(-1)
        assert lib.cuFuncIsLoaded(ctypes.byref(state), ctypes.c_void_p(function)) == 0
        assert state.value == 1, f"{name} is not loaded (CU_FUNCTION_LOADING_STATE {state.value})"
