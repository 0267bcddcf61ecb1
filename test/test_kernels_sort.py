"""The sort family on the Triton interpreter, both variants (rank, bitonic): ascending/descending,
dims and layouts, float, integer and bool rows, rows longer than a block; NaN/inf/-0.0 ordered like ATen; on ties (ATen's sort is not
stable) the values equal ATen's and the indices name equal elements, and the kernel's own order is
the stable one; refusals; broken programs fail; sm_90 compiles."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import assert_mutant_fails, assert_valid, compare_eager, compile_sm90, load, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.sort import FAMILY
from torch_kernelize.core.validate import compare_all

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/inf edge values

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

CASES = {
    "moe_expert_ids": lambda dt: (torch.randint(0, 8, (64,)).to(dt),),       # sort(top_k_index.reshape(-1))
    "rows_descending": lambda dt: (torch.randn(5, 37).to(dt), -1, True),
    "dim0": lambda dt: (torch.randn(40, 6).to(dt), 0),
    "transposed_3d": lambda dt: (torch.randn(2, 3, 10).to(dt).transpose(1, 2), 1, True),
    "sliced_long_row": lambda dt: (torch.randn(3, 300).to(dt)[:, ::2],),
}
DTYPES = [F32, F16, BF16, torch.int64, torch.int32, torch.uint8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_seed_config(case, dtype, tmp_path):
    args = CASES[case](dtype if dtype.is_floating_point else F32)
    x = args[0] if dtype.is_floating_point else (args[0] * 10).to(dtype)
    spec = spec_of(aten.sort.default, (x,) + args[1:])
    assert family_for(spec) is FAMILY
    for config in FAMILY.seed_configs(spec):
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,))
        for n in FAMILY.neighbours(spec, config):
            FAMILY.generate(spec, n)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_special_values_in_aten_order(descending, dtype, tmp_path):
    """NaN last ascending (first descending), infinities at the ends, -0.0 and +0.0 equal (so kept
    in their order): values bit for bit as ATen's, indices exactly the stable sort's."""
    x = torch.tensor([1.5, float("nan"), -0.0, float("inf"), 0.0, -float("inf"), -2.0, float("nan"), 0.0, -0.0,
                      3.0, -float("inf")]).to(dtype)
    spec = spec_of(aten.sort.default, (x, 0, descending))
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    values, indices = load(tmp_path, spec, program).run_poisoned([x])
    want = torch.sort(x, stable=True, descending=descending)
    assert torch.equal(indices, want.indices), (indices, want.indices)
    assert torch.equal(values.view(torch.int16), want.values.view(torch.int16)) if dtype != F32 else \
        torch.equal(values.view(torch.int32), want.values.view(torch.int32))


def test_ties_take_the_stable_order_and_validate_against_an_unstable_reference(tmp_path):
    """MoE expert ids: many ties. The kernel's indices are the stable sort's; ATen's (not stable)
    differ, and the tie rule accepts both while a row naming one element twice still fails."""
    x = torch.randint(0, 4, (3, 200))
    spec = spec_of(aten.sort.default, (x, 1))
    program = assert_valid(FAMILY, spec, tmp_path, seeds=(0, 1))
    values, indices = load(tmp_path, spec, program).run_poisoned([x])
    stable = torch.sort(x, dim=1, stable=True)
    assert torch.equal(values, stable.values) and torch.equal(indices, stable.indices)
    ref = torch.sort(x, 1)
    assert not torch.equal(ref.indices, stable.indices)
    assert compare_all(FAMILY.resolve_ties(spec, [x], (values, indices), ref), ref, spec).ok
    twice = indices.clone()
    twice[:, 1] = twice[:, 0]
    assert not compare_all(FAMILY.resolve_ties(spec, [x], (values, twice), ref), ref, spec).ok
    stable_op = spec_of(aten.sort.stable, (x,), {"stable": True, "dim": 1, "descending": True})
    program = assert_valid(FAMILY, stable_op, tmp_path, seeds=(0,))
    got = load(tmp_path, stable_op, program).run_poisoned([x])[1]
    assert torch.equal(got, torch.sort(x, dim=1, descending=True, stable=True).indices)


def test_bool_and_small_tiles(tmp_path):
    x = torch.rand(4, 50) < 0.3
    spec = spec_of(aten.sort.default, (x, 1, True))
    program = assert_valid(FAMILY, spec, tmp_path, Config.of(BLOCK_I=8, BLOCK_J=16, num_warps=1), seeds=(0,))
    compare_eager(FAMILY, spec, program, tmp_path, exact=True, inputs=[x])


MUTANTS = {"tie_break": ("rank", "(j[None, :] < i[:, None])", "(j[None, :] <= i[:, None])"),
           "nan_order": ("rank", "(a == a) & (b != b)", "(a != a) & (b == b)"),
           "reversed_store": ("rank", "out0_ptr + row * 20 + rank", "out0_ptr + row * 20 + 19 - rank"),
           "bitonic_negative_order": ("bitonic", "b ^ 0x7FFFFFFF, b)", "b, b)"),
           "bitonic_no_index": ("bitonic", "| cols[None, :].to(tl.int64)", "| 0"),
           "bitonic_last_merge": ("bitonic", "swap = lo > hi\n", "swap = lo < hi\n")}


@pytest.mark.parametrize("what", MUTANTS)
def test_broken_programs_fail_validation(what, tmp_path):
    variant, old, new = MUTANTS[what]
    # bitonic: rows of 16, no padding (a reversed merge would gather the padding's index)
    spec = spec_of(aten.sort.default, ((torch.randn(6, 20) if variant == "rank" else torch.randn(5, 16)).t(), 0))
    config = next(c for c in FAMILY.seed_configs(spec) if c.get("VARIANT", "rank") == variant)
    assert_mutant_fails(FAMILY, spec, FAMILY.generate(spec, config), old, new, tmp_path)


def test_refusals():
    x = torch.randn(4, 10)
    assert "float64" in FAMILY.supports(spec_of(aten.sort.default, (x.double(),)))
    assert "empty" in FAMILY.supports(spec_of(aten.sort.default, (torch.empty(3, 0),)))
    assert "N^2" in FAMILY.supports(spec_of(aten.sort.default, (torch.empty(1 << 17 + 1),)))
    assert FAMILY.supports(spec_of(aten.topk.default, (x, 2))) is not None


def test_sm90_compile(tmp_path):
    """Every seed config of MoE shapes (4096 tokens x top-8 expert ids), and a row batch of fp16."""
    for args in [(torch.empty(32768, dtype=torch.int64),), (torch.empty(512, 1000).half(), 1, True)]:
        spec = spec_of(aten.sort.default, args)
        for config in FAMILY.seed_configs(spec):
            compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)


@pytest.mark.parametrize("shape", [(3, 1), (1,), (5,), (2, 7)], ids=str)
def test_short_rows_sort_in_one_whole_row_tile(shape, tmp_path):
    """Rows shorter than a warp's 32 compares (one element: a median or quantile of a 0-d tensor)
    take one tile of the whole row with one warp; before, no configuration fit them and the sort
    stayed on the host."""
    x = torch.randn(shape)
    spec = spec_of(torch.ops.aten.sort.default, (x,))
    assert family_for(spec) is FAMILY
    config = next(c for c in FAMILY.seed_configs(spec) if c.get("VARIANT") is None)   # the rank variant's
    if shape[-1] < 5:
        assert config["num_warps"] == 1 and config["BLOCK_I"] * config["BLOCK_J"] < 32
    program = assert_valid(FAMILY, spec, tmp_path, seeds=(0,))
    compare_eager(FAMILY, spec, program, tmp_path, exact=True, inputs=[x])
    compile_sm90(spec, program, tmp_path)


@pytest.mark.parametrize("x,args", [(torch.tensor(1.5), ()), (torch.tensor(-2.0).half(), (-1, True)),
                                    (torch.tensor(7), (0,)), (torch.tensor(float("nan")), ())],
                         ids=["f32", "f16_descending", "i64", "nan"])
def test_zero_dim_input_is_one_row_of_one(x, args, tmp_path):
    """A 0-d input sorts as one row of one element (ATen: the value, index 0); before, refused.
    Every seed config against the float64 reference and eager, exactly."""
    spec = spec_of(aten.sort.default, (x,) + args)
    assert family_for(spec) is FAMILY, FAMILY.supports(spec)
    for config in FAMILY.seed_configs(spec):
        program = assert_valid(FAMILY, spec, tmp_path, config, seeds=(0, 1))
        compare_eager(FAMILY, spec, program, tmp_path, exact=True, inputs=[x])
    compile_sm90(spec, program, tmp_path)
