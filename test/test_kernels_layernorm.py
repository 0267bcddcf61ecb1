"""The native_layer_norm family on the Triton interpreter: dtypes, optional weight/bias,
multi-dim normalized shapes, strided layouts, the looped (three-pass) variant; validated against
the float64 reference and compared with eager ATen."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernel_testing import assert_valid, compile_sm90, run_validation, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.layernorm import FAMILY
from torch_kernelize.core.spec import KernelSpec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
LN = aten.native_layer_norm.default


def ln_spec(x, norm, weight=True, bias=True, eps=1e-5) -> KernelSpec:
    shape = norm if isinstance(norm, list) else [norm]
    w = torch.randn(*shape, dtype=x.dtype) if weight is True else (weight if weight is not False else None)
    b = torch.randn(*shape, dtype=x.dtype) if bias is True else (bias if bias is not False else None)
    return spec_of(LN, (x, shape, w, b, eps))


def looped(block_n: int = 16, block_m: int = 2) -> Config:
    return Config.of(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=1, num_stages=2, ALIGN=True, EVICT=False)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_dtypes_and_affine(dtype, affine, tmp_path):
    spec = ln_spec(torch.randn(2, 3, 40, dtype=dtype), 40, weight=affine in ("both", "weight"),
                   bias=affine in ("both", "bias"))
    assert len(spec.inputs) == 1 + (affine in ("both", "weight")) + (affine in ("both", "bias"))
    assert_valid(FAMILY, spec, tmp_path, seeds=(0,))


SPECS = {
    "f16_rows_of_100": lambda: ln_spec(torch.randn(6, 100, dtype=F16), 100),
    "bf16_pow2": lambda: ln_spec(torch.randn(4, 64, dtype=BF16), 64),
    "f32_normalized_2d": lambda: ln_spec(torch.randn(3, 4, 10), [4, 10]),
    "f32_one_row": lambda: ln_spec(torch.randn(37), 37),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_every_seed_config_validates(name, tmp_path):
    spec = SPECS[name]()
    configs = FAMILY.seed_configs(spec)
    assert 1 <= len(configs) <= 5
    for config in configs:
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=config is configs[0])
    for n in FAMILY.neighbours(spec, configs[0]):
        FAMILY.generate(spec, n)


@pytest.mark.parametrize("name", ["f16_rows_of_100", "f32_normalized_2d"])
def test_looped_three_passes(name, tmp_path):
    spec = SPECS[name]()
    program = assert_valid(FAMILY, spec, tmp_path, looped(), seeds=(0, 1))
    assert "pass 3 of 3" in program.source


LAYOUTS = {
    "transposed_input": lambda: ln_spec(torch.randn(40, 6).t(), 40),           # rows of 40, stride 6
    "sliced_rows": lambda: ln_spec(torch.randn(6, 50)[:, :37], 37),
    "strided_weight": lambda: ln_spec(torch.randn(5, 24), 24, weight=torch.randn(48)[::2], bias=torch.randn(24)),
    "channels_last": lambda: ln_spec(torch.randn(2, 8, 3, 5).permute(0, 2, 3, 1), 8),  # over C of NHWC
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(layout, tmp_path):
    spec = LAYOUTS[layout]()
    assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    if spec.outputs[0].shape[-1] > 16:
        assert_valid(FAMILY, spec, tmp_path, looped(block_n=16, block_m=2), seeds=(0,), eager=False)


def test_cuda_style_fp32_statistics(tmp_path):
    """On CUDA, fp16/bf16 inputs give fp32 mean/rstd (CPU gives the input dtype): both are generated."""
    spec = SPECS["f16_rows_of_100"]()
    assert [o.dtype for o in spec.outputs] == ["float16"] * 3
    cuda = dataclasses.replace(spec, outputs=(spec.outputs[0],) + tuple(
        dataclasses.replace(o, dtype="float32") for o in spec.outputs[1:]))
    program = assert_valid(FAMILY, cuda, tmp_path, seeds=(0,), eager=False)
    assert "v0.to(tl.float16)" not in program.source  # mean stored as fp32


def _broken(program, old: str, new: str):
    assert old in program.source, program.source
    return dataclasses.replace(program, source=program.source.replace(old, new, 1))


@pytest.mark.parametrize("what", ["unbiased_variance", "eps", "row_mask"])
def test_broken_programs_fail_validation(what, tmp_path):
    spec = ln_spec(torch.randn(5, 48), 48)
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    if what == "unbiased_variance":   # N - 1 instead of N in the variance: 1% off
        bad = _broken(program, "tl.div_rn(tl.sum(tl.where(col_mask[None, :], v2, 0.0), 1)[:, None], 48.0)",
                      "tl.div_rn(tl.sum(tl.where(col_mask[None, :], v2, 0.0), 1)[:, None], 47.0)")
    elif what == "eps":
        bad = _broken(program, "+ 1e-05", "+ 0.01")
    else:                             # the last row is never written (outputs are poisoned)
        bad = _broken(program, "row_mask = rows < 5", "row_mask = rows < 4")
    rec = run_validation(FAMILY, spec, bad, tmp_path)
    assert not rec.ok and rec.reason


def test_refusals():
    x = torch.randn(4, 8)
    ok = ln_spec(x, 8)
    assert FAMILY.supports(ok) is None
    assert "normalized_shape" in FAMILY.supports(dataclasses.replace(ok, args=[ok.args[0], [4]] + ok.args[2:]))
    assert FAMILY.supports(dataclasses.replace(ok, inputs=(dataclasses.replace(ok.inputs[0], dtype="float64"),) + ok.inputs[1:]))
    # normalized dims that do not form one strided run (the [C, W] dims of an NCHW tensor seen as N, W, C)
    y = torch.randn(2, 3, 4, 5).permute(0, 2, 1, 3)  # [2, 4, 3, 5] with strides (60, 5, 20, 1)
    assert "strided run" in FAMILY.supports(ln_spec(y, [3, 5]))
    z = torch.randn(2, 8, 3, 5).permute(0, 2, 3, 1)  # [2, 3, 5, 8]: [5, 8] has strides (1, 15)
    assert "strided run" in FAMILY.supports(ln_spec(z, [5, 8]))
    assert "nothing to normalize" in FAMILY.supports(ln_spec(torch.randn(4, 1), 1))
    assert FAMILY.supports(spec_of(aten.mean.dim, (x, [-1], True)))


def test_registry():
    assert family_for(ln_spec(torch.randn(4, 8), 8)) is FAMILY


def test_compiles_for_sm90(tmp_path):
    with FakeTensorMode():
        x = torch.empty(4096, 4096, dtype=F16)
        w, b = torch.empty(4096, dtype=F16), torch.empty(4096, dtype=F16)
        long_rows = torch.empty(16, 65536, dtype=BF16)
        lw = torch.empty(65536, dtype=BF16)
    spec = spec_of(LN, (x, [4096], w, b, 1e-5))
    for config in FAMILY.seed_configs(spec):
        compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)
    spec = spec_of(LN, (long_rows, [65536], lw, None, 1e-6))
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    assert "pass 3 of 3" in program.source
    compile_sm90(spec, program, tmp_path)


@pytest.mark.parametrize("shape", [(1, 2), (3, 4), (1, 5), (1, 1, 3), (2,)], ids=str)
def test_regions_smaller_than_a_warp(shape, tmp_path):
    """Fewer than 32 elements: one tile of one warp holds them all (before, no config fitted);
    every seed config against the float64 reference and eager, and compiles for sm_90."""
    spec = ln_spec(torch.randn(shape), shape[-1])
    assert family_for(spec) is FAMILY, FAMILY.supports(spec)
    configs = FAMILY.seed_configs(spec)
    for config in configs:
        program = assert_valid(FAMILY, spec, tmp_path, config, seeds=(0, 1), eager=config is configs[0])
    compile_sm90(spec, program, tmp_path)


@pytest.mark.parametrize("shape", [(1,), (1, 1, 1), (3, 1)], ids=str)
def test_rows_of_one_element_are_left_to_the_graph(shape):
    """Rows of one element normalize to the bias alone: refused (the region is run node by node)."""
    assert "nothing to normalize" in FAMILY.supports(ln_spec(torch.randn(shape), 1))
