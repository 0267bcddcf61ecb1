"""The reduction family on the Triton interpreter: sum/mean/prod/amax/amin/var/std/var_mean over any
dims and layouts, keepdim, dtype=, split-R configs, and softmax/log_softmax single-pass and online;
float64 and integer/bool inputs (exact) besides fp32/fp16/bf16."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_testing import assert_valid, compile_sm90, run_validation, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.reductions import FAMILY

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN edge trials

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def x3(dtype=F32, layout="contiguous"):
    x = torch.randn(6, 40, 10)
    x = {"contiguous": x, "permuted": x.permute(2, 0, 1).contiguous().permute(1, 2, 0), "sliced": torch.randn(6, 80, 12)[:, ::2, 1:11],
         "transposed_last": torch.randn(6, 10, 40).transpose(1, 2)}[layout]
    return x.to(dtype)


REDUCE = {
    "sum": lambda x, d, k: (aten.sum.dim_IntList, (x, d, k), {}),
    "mean": lambda x, d, k: (aten.mean.dim, (x, d, k), {}),
    "amax": lambda x, d, k: (aten.amax.default, (x, d, k), {}),
    "amin": lambda x, d, k: (aten.amin.default, (x, d, k), {}),
    "var": lambda x, d, k: (aten.var.correction, (x, d), {"correction": 1, "keepdim": k}),
    "std": lambda x, d, k: (aten.std.correction, (x, d), {"correction": 0, "keepdim": k}),
    "var_mean": lambda x, d, k: (aten.var_mean.correction, (x, d), {"keepdim": k}),
}
DIMS = [[-1], [1], [0], [0, 2], [0, 1, 2]]


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("kind", list(REDUCE))
def test_reductions_dims_keepdim(kind, dims, keepdim, tmp_path):
    op, args, kwargs = REDUCE[kind](x3(), dims, keepdim)
    assert_valid(FAMILY, spec_of(op, args, kwargs), tmp_path)


@pytest.mark.parametrize("layout", ["permuted", "sliced", "transposed_last"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("kind", list(REDUCE))
def test_reductions_dtypes_layouts(kind, dtype, layout, tmp_path):
    op, args, kwargs = REDUCE[kind](x3(dtype, layout), [1], False)
    assert_valid(FAMILY, spec_of(op, args, kwargs), tmp_path)


@pytest.mark.parametrize("op,src,dst", [(aten.sum.dim_IntList, F16, F32), (aten.sum.dim_IntList, F32, F16),
                                        (aten.mean.dim, BF16, F32), (aten.mean.dim, F32, BF16), (aten.sum.dim_IntList, F16, BF16)],
                         ids=str)
def test_dtype_argument(op, src, dst, tmp_path):
    spec = spec_of(op, (x3(src), [2]), {"dtype": dst})
    assert spec.outputs[0].dtype == str(dst).removeprefix("torch.")
    assert_valid(FAMILY, spec, tmp_path)


F64, I64, I32 = torch.float64, torch.int64, torch.int32
CFG = dict(num_warps=1, num_stages=2)
WIDE = [  # (name, spec, config params or None for the first seed): float64 in float64, ints in int64
    ("f64_sum_loop", lambda: spec_of(aten.sum.dim_IntList, (torch.randn(5, 20, dtype=F64), [1])), dict(BLOCK_M=4, BLOCK_R=8, SPLIT=1)),
    ("f64_var_mean_split", lambda: spec_of(aten.var_mean.correction, (torch.randn(3, 50, dtype=F64), [1])),
     dict(BLOCK_M=1, BLOCK_R=16, SPLIT=4)),
    ("f64_amax", lambda: spec_of(aten.amax.default, (x3(F64, "permuted"), [0, 2], True)), None),
    ("f64_log_softmax_online", lambda: spec_of(aten._log_softmax.default, (torch.randn(5, 20, dtype=F64), 1, False)),
     dict(BLOCK_M=8, BLOCK_R=8, SPLIT=1)),
    ("bool_sum", lambda: spec_of(aten.sum.dim_IntList, (torch.rand(6, 40) < 0.5, [1])), None),
    ("i32_sum_dtype_split", lambda: spec_of(aten.sum.dim_IntList, (torch.arange(150, dtype=I32).view(3, 50), [1]),
                                            {"dtype": I32}), dict(BLOCK_M=2, BLOCK_R=8, SPLIT=4)),
    ("i64_amin_split", lambda: spec_of(aten.amin.default, (torch.arange(240).view(6, 40), [1])),
     dict(BLOCK_M=2, BLOCK_R=8, SPLIT=2)),
    ("i8_amax", lambda: spec_of(aten.amax.default, (x3().to(torch.int8), [1])), None),
    ("f16_prod_keepdim", lambda: spec_of(aten.prod.dim_int, (torch.randn(6, 12).half(), 1, True)), None),
    ("f32_prod_loop", lambda: spec_of(aten.prod.dim_int, (torch.randn(20, 6).t(), 1)), dict(BLOCK_M=4, BLOCK_R=8, SPLIT=1)),
    ("i64_prod_split", lambda: spec_of(aten.prod.default, (torch.arange(60).view(6, 10),)), dict(BLOCK_M=1, BLOCK_R=8, SPLIT=4)),
]


@pytest.mark.parametrize("name,make,params", WIDE, ids=[w[0] for w in WIDE])
def test_float64_and_integer_reductions(name, make, params, tmp_path):
    """Integer results are exact (the fill compares them exactly) on the whole dtype range ("large"
    edge trials: sums and products wrap around as ATen's) and on negatives only."""
    spec = make()
    program = assert_valid(FAMILY, spec, tmp_path, Config.of(**CFG, **params) if params else None)
    if params and params["SPLIT"] > 1:
        assert program.temps[0].dtype == FAMILY.plan(spec).acc


@pytest.mark.parametrize("case", ["sum_default", "mean_default", "amax_all", "var_none", "zero_dim", "size1_dim",
                                  "empty_var_mean", "empty_prod"])
def test_full_and_degenerate(case, tmp_path):
    x = x3(F16)
    op, args, kwargs = {
        "sum_default": (aten.sum.default, (x,), {}),
        "mean_default": (aten.mean.default, (x,), {"dtype": F32}),
        "amax_all": (aten.amax.default, (x,), {}),
        "var_none": (aten.var.correction, (x, None), {}),
        "zero_dim": (aten.sum.dim_IntList, (torch.tensor(2.5), []), {}),
        "size1_dim": (aten.amin.default, (torch.randn(5, 1, 3), [1]), {}),
        # rows of no elements: NaN (mean, var), 1 (prod), without reading the input
        "empty_var_mean": (aten.var_mean.correction, (torch.empty(4, 0), [1]), {}),
        "empty_prod": (aten.prod.default, (torch.empty(0, 3, dtype=torch.int32),), {}),
    }[case]
    assert_valid(FAMILY, spec_of(op, args, kwargs), tmp_path)


SPLITS = [
    ("sum", lambda: spec_of(aten.sum.default, (torch.randn(50, 90),)), dict(BLOCK_M=1, BLOCK_R=256, SPLIT=8)),
    ("var_mean", lambda: spec_of(aten.var_mean.correction, (torch.randn(50, 90), None)), dict(BLOCK_M=1, BLOCK_R=256, SPLIT=8)),
    ("amax_outer", lambda: spec_of(aten.amax.default, (torch.randn(300, 24).half(), [0])), dict(BLOCK_M=32, BLOCK_R=32, SPLIT=4)),
    ("std_rows", lambda: spec_of(aten.std.correction, (torch.randn(3, 700), [1]), {"keepdim": True}), dict(BLOCK_M=4, BLOCK_R=64, SPLIT=4)),
    ("mean_uneven", lambda: spec_of(aten.mean.dim, (torch.randn(5, 999).bfloat16(), [1])), dict(BLOCK_M=8, BLOCK_R=128, SPLIT=2)),
]


@pytest.mark.parametrize("name,make,params", SPLITS, ids=[s[0] for s in SPLITS])
def test_split_reductions(name, make, params, tmp_path):
    spec = make()
    config = Config.of(num_warps=4, num_stages=2, **params)
    program = assert_valid(FAMILY, spec, tmp_path, config)
    assert len(program.launches) == 2 and program.temps  # partial + combine through an fp32 temp


@pytest.mark.parametrize("dim", [-1, 1, 0])
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("op", [aten._softmax.default, aten._log_softmax.default], ids=lambda o: o._opname)
def test_softmax(op, dtype, dim, tmp_path):
    spec = spec_of(op, (x3(dtype, "permuted" if dim == 0 else "contiguous"), dim, False))
    configs = FAMILY.seed_configs(spec)
    assert_valid(FAMILY, spec, tmp_path, configs[0])
    # the online (looped) variant too: a BLOCK_R shorter than the row
    assert_valid(FAMILY, spec, tmp_path, Config.of(BLOCK_M=64, BLOCK_R=4, SPLIT=1, num_warps=2, num_stages=2),
                 seeds=(0,), eager=False)


def test_softmax_rows_with_infinities(tmp_path):
    """Rows all -inf, with +inf, with NaN, with some -inf: the same NaN/0 pattern as ATen, both variants."""
    x = torch.randn(6, 37)
    x[0] = -float("inf")
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    x[3, ::2] = -float("inf")
    for op in (aten._softmax.default, aten._log_softmax.default):
        spec = spec_of(op, (x, 1, False))
        for config in (FAMILY.seed_configs(spec)[0], Config.of(BLOCK_M=2, BLOCK_R=8, SPLIT=1, num_warps=1, num_stages=2)):
            from kernel_testing import compare_eager
            compare_eager(FAMILY, spec, FAMILY.generate(spec, config), tmp_path, inputs=[x])


@pytest.mark.parametrize("make", [
    lambda: spec_of(aten.sum.dim_IntList, (torch.randn(64, 300).half(), [1])),
    lambda: spec_of(aten.mean.dim, (torch.randn(3000, 16), [0], True)),
    lambda: spec_of(aten.var_mean.correction, (torch.randn(100, 90), None)),
    lambda: spec_of(aten._softmax.default, (torch.randn(16, 500).bfloat16(), -1, False)),
])
def test_every_seed_config_validates(make, tmp_path):
    spec = make()
    configs = FAMILY.seed_configs(spec)
    assert 1 <= len(configs) <= 5
    for config in configs:
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=False)
        for n in FAMILY.neighbours(spec, config):
            assert FAMILY._valid(FAMILY.plan(spec), n)
    if spec.op in ("aten.var_mean.correction", "aten.mean.dim"):  # few rows, long R: a split seed
        assert any(c["SPLIT"] > 1 for c in configs)


@pytest.mark.parametrize("what", ["divisor", "mask", "nan", "int_padding", "int_accumulator"])
def test_broken_programs_fail_validation(what, tmp_path):
    if what == "divisor":
        spec = spec_of(aten.mean.dim, (torch.randn(8, 40), [1]))
        program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
        bad = dataclasses.replace(program, source=program.source.replace("total, 40.0)", "total, 41.0)"))
    elif what == "mask":  # padding counted: other=1.0 instead of 0.0
        spec = spec_of(aten.sum.dim_IntList, (torch.randn(8, 40), [1]))
        program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
        bad = dataclasses.replace(program, source=program.source.replace("other=0.0", "other=1.0"))
    elif what == "int_padding":  # an integer amax padded with 0: fails on rows of negatives
        spec = spec_of(aten.amax.default, (torch.arange(40).view(4, 10), [1]))
        program = FAMILY.generate(spec, Config.of(BLOCK_M=4, BLOCK_R=16, SPLIT=1, num_warps=1, num_stages=1))
        bad = dataclasses.replace(program, source=program.source.replace("other=-9223372036854775808", "other=0"))
    elif what == "int_accumulator":  # an int32 sum of int32 accumulated in int32: wraps on "large"
        spec = spec_of(aten.sum.dim_IntList, (torch.arange(40, dtype=torch.int32).view(4, 10), [1]))
        program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
        bad = dataclasses.replace(program, source=program.source.replace(".to(tl.int64)", ""))
    else:                 # amax without the NaN term: fails only the "special" trial
        spec = spec_of(aten.amax.default, (torch.randn(8, 40), [1]))
        program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
        bad = dataclasses.replace(program, source=program.source.replace(
            "best += tl.sum(tl.where(acc != acc, acc, 0.0), 1)", "pass"))
    assert bad.source != program.source
    rec = run_validation(FAMILY, spec, bad, tmp_path)
    assert not rec.ok and rec.reason
    if what in ("nan", "int_padding", "int_accumulator"):
        assert {"nan": "special", "int_padding": "negative", "int_accumulator": "large"}[what] in rec.reason


def test_refusals():
    x = torch.randn(4, 8)
    assert "half_to_float" in FAMILY.supports(dataclasses.replace(
        spec_of(aten._softmax.default, (x.half(), 1, False)), args=[{"tensor": 0}, 1, True]))
    var = spec_of(aten.var.correction, (x, [1]))   # ATen refuses var (and mean) of integers
    assert "floating inputs only" in FAMILY.supports(
        dataclasses.replace(var, inputs=[dataclasses.replace(var.inputs[0], dtype="int64")]))
    # a float -> int conversion is undefined for NaN/inf
    assert "dtype=int64" in FAMILY.supports(spec_of(aten.sum.dim_IntList, (x, [1]), {"dtype": torch.int64}))
    assert "empty" in FAMILY.supports(spec_of(aten.amax.default, (torch.empty(0, 3), [1])))  # ATen raises
    assert "empty" in FAMILY.supports(spec_of(aten.sum.dim_IntList, (torch.empty(0, 3), [1])))  # no output
    assert FAMILY.supports(spec_of(aten.exp.default, (x,)))
    assert family_for(spec_of(aten.amax.default, (x, [1]))) is FAMILY


def test_sm90_compile(tmp_path):
    specs = [spec_of(aten._softmax.default, (torch.randn(16, 5000).half(), -1, False)),
             spec_of(aten.var_mean.correction, (torch.randn(100, 9000), None)),
             spec_of(aten.amax.default, (torch.randn(64, 300, 7), [1], True)),
             # float64 exp/log/sqrt/division, int64 extremes as literals, tl.reduce with a multiply
             spec_of(aten._log_softmax.default, (torch.randn(16, 5000, dtype=torch.float64), -1, False)),
             spec_of(aten.amax.default, (torch.zeros(64, 300, dtype=torch.int64), [1])),
             spec_of(aten.prod.default, (torch.randn(100, 900),))]
    for spec in specs:
        for config in FAMILY.seed_configs(spec)[:2]:
            compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)
