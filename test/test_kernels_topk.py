"""The topk family on the Triton interpreter: both variants, largest/smallest, k up to 64, dims
and layouts, fp32/fp16/bf16, NaN/inf ordering like ATen; tie-free validation inputs, and on ties
the values equal ATen's and the indices point at them; refusals; broken programs fail; sm_90."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_testing import assert_mutant_fails, assert_valid, compare_eager, compile_sm90, load, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.topk import FAMILY

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/inf edge values

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

CASES = {
    "moe_router": lambda dt: (torch.randn(64, 16).softmax(-1).to(dt), 4, -1),      # probs.topk(4, -1)
    "smallest": lambda dt: (torch.randn(9, 37).to(dt), 5, 1, False),
    "dim0": lambda dt: (torch.randn(40, 6).to(dt), 3, 0),
    "k_not_pow2_long_row": lambda dt: (torch.randn(3, 300).to(dt), 20),
    "transposed_3d": lambda dt: (torch.randn(2, 3, 10).to(dt).transpose(1, 2), 1, 1),
    "k_equals_n": lambda dt: (torch.randn(6, 7).to(dt), 7, -1, False),
}


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_seed_config(case, dtype, tmp_path):
    spec = spec_of(aten.topk.default, CASES[case](dtype))
    assert family_for(spec) is FAMILY
    configs = FAMILY.seed_configs(spec)
    assert {c["VARIANT"] for c in configs} == {"bitonic", "passes"}
    for config in configs:
        # tl.topk's bitonic network is slow on the interpreter (~1 s a run): one random and one
        # special trial there; every trial kind for the passes variant
        kinds = ("special",) if config["VARIANT"] == "bitonic" else None
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), kinds=kinds, eager=config["VARIANT"] != "bitonic")
        for n in FAMILY.neighbours(spec, config):
            FAMILY.generate(spec, n)


def test_large_k(tmp_path):
    spec = spec_of(aten.topk.default, (torch.randn(2, 130), 64))
    for config in FAMILY.seed_configs(spec):
        program = FAMILY.generate(spec, config)
        compare_eager(FAMILY, spec, program, tmp_path, exact=True)


@pytest.mark.parametrize("largest", [True, False])
def test_nan_inf_order_like_aten(largest, tmp_path):
    x = torch.tensor([[1.0, float("nan"), -float("inf"), 3.0, float("inf"), -2.0, 0.5],
                      [float("nan"), 2.0, -1.0, -float("inf"), 7.0, float("inf"), -0.25]])
    spec = spec_of(aten.topk.default, (x, 6, -1, largest))
    for config in FAMILY.seed_configs(spec):
        compare_eager(FAMILY, spec, FAMILY.generate(spec, config), tmp_path, exact=True, inputs=[x])


def test_ties_give_atens_values_and_indices_of_them(tmp_path):
    """With ties, ATen's index choice is unspecified: the values must match exactly and every
    index must point at its value (distinct indices per row)."""
    x = torch.randint(0, 4, (32, 16)).to(F16)
    spec = spec_of(aten.topk.default, (x, 5))
    for config in FAMILY.seed_configs(spec):
        vals, idx = load(tmp_path, spec, FAMILY.generate(spec, config)).run_poisoned([x])
        want_vals, _ = torch.topk(x, 5)
        assert torch.equal(vals, want_vals)
        assert torch.equal(x.gather(1, idx), vals)
        assert all(len(set(r.tolist())) == 5 for r in idx)
    # validation inputs have no ties, in every kind this family lists
    for kind in ("random",) + FAMILY.edge_kinds:
        t = FAMILY.sample_inputs(spec_of(aten.topk.default, (torch.randn(64, 300).bfloat16(), 4)), 3, kind)[0]
        assert all(r.unique().numel() + int(r.isnan().sum()) - int(r.isnan().any()) == 300 for r in t)


MUTANTS = {"index": ("BLOCK_N - 1 - (top", "BLOCK_N - 2 - (top"),
           "order": ("key = bits ^ ((bits >> 31) & 0x7FFFFFFF)", "key = bits"),
           "sign": ("values = bits.to(tl.float32, bitcast=True)", "values = -bits.to(tl.float32, bitcast=True)")}


@pytest.mark.parametrize("what", MUTANTS)
def test_broken_programs_fail_validation(what, tmp_path):
    spec = spec_of(aten.topk.default, (torch.randn(16, 24), 4))
    assert_mutant_fails(FAMILY, spec, FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]), *MUTANTS[what], tmp_path)


def test_refusals():
    x = torch.randn(4, 100)
    assert "sorted=False" in FAMILY.supports(spec_of(aten.topk.default, (x, 3, -1, True, False)))
    assert "k=65" in FAMILY.supports(spec_of(aten.topk.default, (x, 65)))
    assert "int64" in FAMILY.supports(spec_of(aten.topk.default, (x.long(), 3)))
    assert "stride-0" in FAMILY.supports(spec_of(aten.topk.default, (x[:1].expand(4, 100), 3)))
    assert "registers" in FAMILY.supports(spec_of(aten.topk.default, (torch.randn(1, 20000), 3)))


def test_sm90_compile(tmp_path):
    """Every seed config of the MoE router shape; a long row and k = 64 (both variants) too."""
    for args, which in [((torch.empty(4096, 16), 4, -1), None), ((torch.empty(64, 1000).bfloat16(), 8, 1, False), None),
                        ((torch.empty(512, 4096).half(), 64), 1)]:
        spec = spec_of(aten.topk.default, args)
        configs = FAMILY.seed_configs(spec)
        for config in configs if which is None else [c for c in configs if c["BLOCK_M"] == which][:2]:
            compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)


def _tied_rows():
    x = torch.tensor([[3.0, 1.0, 3.0, 0.0, 3.0], [2.0, 2.0, -1.0, 5.0, 2.0]])
    return x, spec_of(aten.topk.default, (x, 2))


def test_ties_accept_any_index_naming_an_equal_element():
    from torch_kernelize.core.validate import compare_all
    x, spec = _tied_rows()
    ref_v, ref_i = aten.topk.default(x.double(), 2)
    other = torch.tensor([[4, 2], [3, 4]])  # equal values, other columns than the reference's
    assert not torch.equal(other, ref_i)
    settled = FAMILY.resolve_ties(spec, [x], (ref_v.float(), other), (ref_v, ref_i))
    assert compare_all(settled, (ref_v, ref_i), spec).ok
    assert not compare_all((ref_v.float(), other), (ref_v, ref_i), spec).ok  # without the rule
    twice = torch.tensor([[0, 0], [3, 0]])      # names one element twice: no tie, rejected
    assert not compare_all(FAMILY.resolve_ties(spec, [x], (ref_v.float(), twice), (ref_v, ref_i)),
                           (ref_v, ref_i), spec).ok
    wrong = torch.tensor([[0, 1], [3, 0]])      # column 1 holds 1.0, not the tied 3.0
    assert not compare_all(FAMILY.resolve_ties(spec, [x], (ref_v.float(), wrong), (ref_v, ref_i)),
                           (ref_v, ref_i), spec).ok


def test_validation_on_captured_ties_takes_the_rule():
    from torch_kernelize.core.validate import validate
    x, spec = _tied_rows()

    def run(inputs):  # a correct top-k that breaks ties towards the last column
        v, i = aten.topk.default(inputs[0].flip(-1), 2)
        return v, inputs[0].shape[-1] - 1 - i

    sample = lambda spec, seed, kind, device: [x.clone()]
    unsettled = lambda spec, inputs, outs, refs: outs  # noqa: E731
    assert not validate(run, spec, sample, (), seeds=(0,), resolve_ties=unsettled).ok
    rec = validate(run, spec, sample, (), seeds=(0,), resolve_ties=FAMILY.resolve_ties)
    assert rec.ok, rec.reason
    assert validate(run, spec, sample, (), seeds=(0,)).ok   # the default settles topk's ties too


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("args", [(1,), (1, 0, False), (1, -1)], ids=["largest", "smallest", "dim_minus_1"])
def test_zero_dim_input_is_one_row_of_one(args, dtype, tmp_path):
    """topk(k=1) of a 0-d input: one row of one element (ATen: the value, index 0); before,
    refused. Every seed config against the float64 reference and eager."""
    x = torch.randn(()).to(dtype)
    spec = spec_of(aten.topk.default, (x,) + args)
    assert family_for(spec) is FAMILY, FAMILY.supports(spec)
    assert tuple(FAMILY.sample_inputs(spec, 0)[0].shape) == ()
    for config in FAMILY.seed_configs(spec):
        program = assert_valid(FAMILY, spec, tmp_path, config, seeds=(0, 1))
    compile_sm90(spec, program, tmp_path)
    assert "k=2 > 1" in FAMILY.supports(dataclasses.replace(spec, args=[{"tensor": 0}, 2] + list(spec.args[2:])))
