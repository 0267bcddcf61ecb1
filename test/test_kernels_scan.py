"""The cumsum family on the Triton interpreter: dims and layouts, float/int/bool inputs, dtype=,
rows longer than a block (carried prefix) and split rows (chunk sums first); validated against
the float64 reference and compared with eager; refusals; a broken program fails; sm_90 compiles."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import assert_mutant_fails, assert_valid, compare_eager, compile_sm90, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.scan import FAMILY

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/inf edge values

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

LAYOUTS = {
    "last": lambda t: (t, -1),
    "first": lambda t: (t, 0),
    "transposed_last": lambda t: (t.t(), 1),
    "sliced": lambda t: (t[:, ::3], 1),
    "3d_middle": lambda t: (t.reshape(5, 4, 15), 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_float_layouts_every_seed_config(dtype, layout, tmp_path):
    x, dim = LAYOUTS[layout](torch.randn(20, 15).to(dtype))
    spec = spec_of(aten.cumsum.default, (x, dim))
    assert family_for(spec) is FAMILY
    for config in FAMILY.seed_configs(spec):
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,))
        for n in FAMILY.neighbours(spec, config):
            FAMILY.generate(spec, n)


@pytest.mark.parametrize("args,kwargs", [
    ((torch.randint(-50, 50, (6, 33)), 1), {}),
    ((torch.randint(-50, 50, (33, 6), dtype=torch.int32), 0), {}),           # -> int64
    ((torch.rand(70) < 0.5, 0), {}),                                           # bool -> int64
    ((torch.randint(-5, 5, (4, 9)), 1), {"dtype": torch.float32}),
    ((torch.randn(4, 40), 1), {"dtype": torch.float16}),                       # converted first, like ATen
    ((torch.randn(4, 40).half(), -1), {"dtype": torch.float32}),
    ((torch.tensor(2.5), 0), {}),                                              # 0-d
    ((torch.tensor([3.0, 0.0, 5.0, 1.0]), 0), {"dtype": torch.int32}),        # MoE offsets of histc counts
    ((torch.randn(5, 70) * 100, 1), {"dtype": torch.int64}),                   # truncated toward zero first
    ((torch.randn(70, 3).half() * 100, 0), {"dtype": torch.int32}),
], ids=["i64", "i32", "bool", "int_to_f32", "f32_to_f16", "f16_to_f32", "scalar", "f32_to_i32", "f32_to_i64",
        "f16_to_i32"])
def test_types(args, kwargs, tmp_path):
    spec = spec_of(aten.cumsum.default, args, kwargs)
    program = assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    if not spec.outputs[0].torch_dtype.is_floating_point:
        compare_eager(FAMILY, spec, program, tmp_path, exact=True, inputs=[args[0]])


@pytest.mark.parametrize("config", [
    dict(BLOCK_M=2, BLOCK_N=64, SPLIT=1, num_warps=2),    # a loop over 16 blocks with a carried prefix
    dict(BLOCK_M=4, BLOCK_N=128, SPLIT=4, num_warps=2),   # 4 chunks of 2 blocks, chunk sums first
    dict(BLOCK_M=1, BLOCK_N=64, SPLIT=16, num_warps=1),   # 16 one-block chunks, the last one partial
], ids=["loop", "split", "split_16"])
@pytest.mark.parametrize("dtype", [F32, torch.int64], ids=str)
def test_long_rows(config, dtype, tmp_path):
    x = (torch.randn(3, 1000) * 10).to(dtype)
    spec = spec_of(aten.cumsum.default, (x, 1))
    program = assert_valid(FAMILY, spec, tmp_path, Config.of(**config), seeds=(0,), kinds=("large",))
    if dtype == torch.int64:
        compare_eager(FAMILY, spec, program, tmp_path, exact=True, inputs=[x])


def test_seeds_split_few_long_rows():
    spec = spec_of(aten.cumsum.default, (torch.empty(2, 1 << 20), 1))
    assert any(c["SPLIT"] > 1 for c in FAMILY.seed_configs(spec))
    spec = spec_of(aten.cumsum.default, (torch.empty(4096, 16), 1))
    assert all(c["SPLIT"] == 1 for c in FAMILY.seed_configs(spec))


@pytest.mark.parametrize("what", ["carry", "scan_offset"])
def test_broken_programs_fail_validation(what, tmp_path):
    spec = spec_of(aten.cumsum.default, (torch.randn(3, 300), 1))
    program = FAMILY.generate(spec, Config.of(BLOCK_M=4, BLOCK_N=64, SPLIT=1, num_warps=2))
    old, new = {"carry": ("+ carry[:, None]", "+ 0.5 * carry[:, None]"),
                "scan_offset": ("tl.cumsum(x, axis=1)", "(tl.cumsum(x, axis=1) - x)")}[what]
    assert_mutant_fails(FAMILY, spec, program, old, new, tmp_path)


def test_refusals():
    x = torch.randn(4, 5)
    assert "float64" in FAMILY.supports(spec_of(aten.cumsum.default, (x.double(), 1)))
    assert "empty" in FAMILY.supports(spec_of(aten.cumsum.default, (torch.empty(0, 3), 1)))


def test_sm90_compile(tmp_path):
    for args, kwargs in [((torch.empty(4096, 16), 0), {}), ((torch.empty(4096, 8192).half(), 1), {}),
                         ((torch.empty(2, 1 << 20), 1), {}), ((torch.empty(16, dtype=torch.int64), 0), {}),
                         ((torch.empty(64, 1000).bfloat16(), 0), {"dtype": torch.float32})]:
        spec = spec_of(aten.cumsum.default, args, kwargs)
        for config in FAMILY.seed_configs(spec):
            compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)


@pytest.mark.parametrize("args", [
    (torch.randn(20, 15), 1), (torch.randn(20, 15).t(), 0), (torch.randn(3, 300), 1),   # carried product
    (torch.tensor([2.0, 0.0, -3.0, float("inf"), 0.5]), 0),                               # zero then inf: NaN
    (torch.tensor([-1.5, float("nan"), 2.0]), 0), (torch.tensor(2.5), 0),
    (torch.randint(-3, 4, (5, 9)), 1), (torch.randn(4, 40).half(), -1),
], ids=["rows", "transposed", "carry", "zero_inf", "nan", "scalar", "i64", "f16"])
def test_cumprod(args, tmp_path):
    """cumprod: the scan with tl.cumprod and a carried product; zeros, negatives, inf and NaN as
    ATen's sequential product; no split configs."""
    spec = spec_of(aten.cumprod.default, args)
    assert family_for(spec) is FAMILY
    assert all(c["SPLIT"] == 1 for c in FAMILY.seed_configs(spec))
    program = assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    compare_eager(FAMILY, spec, program, tmp_path, exact=not args[0].is_floating_point(), inputs=[args[0]])
    assert not FAMILY._valid(FAMILY.plan(spec), FAMILY.seed_configs(spec)[0].replace(SPLIT=2))


def test_logcumsumexp_infinities_nan_and_a_carry(tmp_path):
    """logcumsumexp: ATen's log-add-exp in an associative scan; -inf is its identity, equal
    infinities stay themselves (not NaN), NaN propagates; a loop of blocks carries the prefix."""
    inf, nan = float("inf"), float("nan")
    x = torch.randn(3, 40) * 30
    x[0, :6] = torch.tensor([-inf, -inf, 1.0, inf, 2.0, inf])
    x[1, :4], x[1, 20] = -inf, nan
    x[2, 30:] = inf
    spec = spec_of(aten.logcumsumexp.default, (x, 1))
    assert family_for(spec) is FAMILY
    program = assert_valid(FAMILY, spec, tmp_path, Config.of(BLOCK_M=2, BLOCK_N=16, SPLIT=1, num_warps=1), seeds=(0,))
    compare_eager(FAMILY, spec, program, tmp_path, inputs=[x])
    big = spec_of(aten.logcumsumexp.default, (torch.empty(64, 1000).half(), 1))
    compile_sm90(big, FAMILY.generate(big, FAMILY.seed_configs(big)[0]), tmp_path)
