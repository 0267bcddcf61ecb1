"""The row families serve shape buckets: softmax/log_softmax, sum/mean/amax/var_mean over trailing
dims and native_layer_norm take their number of rows at run time, so one kernel, validated at a
bucket's edges and inside, serves every batch or sequence length in it (interpreter target)."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_testing import assert_bucket_valid, compile_sm90, spec_of  # noqa: E402

from torch_kernelize.backend import compile_with_session
from torch_kernelize.compiling.lower import Session
from torch_kernelize.core.buckets import instantiate, spec_at
from torch_kernelize.core.options import Options
from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache.buckets import BucketFamily
from torch_kernelize.fill_cache.cli import main as fill_main
from torch_kernelize.kernel_cache import KernelCache
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.elementwise import FAMILY as ELEMENTWISE
from torch_kernelize.lowering.kernels.layernorm import FAMILY as LAYER_NORM
from torch_kernelize.lowering.kernels.reductions import FAMILY as REDUCTIONS

aten = torch.ops.aten
f16, bf16 = torch.float16, torch.bfloat16
ROWS = (("in", 0, 0, 0), ("out", 0, 0, 0))                      # dim 0 of the input and the output varies
BATCH_SEQ = (("in", 0, 0, 0), ("in", 0, 1, 1), ("out", 0, 0, 0), ("out", 0, 1, 1))
LN_ROWS = (("in", 0, 0, 0), ("out", 0, 0, 0), ("out", 1, 0, 0), ("out", 2, 0, 0))


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


REDUCTION_CASES = {
    "softmax": (aten._softmax.default, lambda: [_x(8, 3, 40), -1, False], {}, ROWS, ((5, 8),), None),
    # BLOCK_R < R: the looped (online) variant
    "log_softmax-looped-f16": (aten._log_softmax.default, lambda: [_x(6, 100, dtype=f16), -1, False], {}, ROWS,
                               ((3, 6),), Config.of(BLOCK_M=2, BLOCK_R=32, SPLIT=1, num_warps=1, num_stages=2)),
    "sum-trailing-keepdim": (aten.sum.dim_IntList, lambda: [_x(8, 4, 6), [1, 2], True], {}, ROWS, ((5, 8),), None),
    "mean": (aten.mean.dim, lambda: [_x(16, 24), [-1]], {}, ROWS, ((9, 16),), None),
    "amax-bf16-batch-and-seq": (aten.amax.default, lambda: [_x(4, 8, 64, dtype=bf16), [-1]], {}, BATCH_SEQ,
                                ((3, 4), (5, 8)), None),
    "var_mean": (aten.var_mean.correction, lambda: [_x(8, 48), [-1]], {"correction": 1, "keepdim": True},
                 ROWS + (("out", 1, 0, 0),), ((5, 8),), None),
}


@pytest.mark.parametrize("case", list(REDUCTION_CASES))
def test_a_bucketed_reduction_is_right_at_both_edges_and_inside(case, tmp_path):
    op, args, kwargs, dims, ranges, config = REDUCTION_CASES[case]
    spec = spec_of(op, args(), kwargs)
    program = assert_bucket_valid(REDUCTIONS, spec, dims, ranges, tmp_path, config)
    assert "n_rows" in program.source and all(l.runtime_sizes for l in program.launches)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_a_bucketed_layer_norm_is_right_at_both_edges_and_inside(affine, tmp_path):
    x = _x(4, 8, 32)
    w, b = (_x(32) + 1, _x(32)) if affine else (None, None)
    spec = spec_of(aten.native_layer_norm.default, [x, [32], w, b, 1e-5])
    dims = (("in", 0, 0, 0), ("in", 0, 1, 1)) + tuple(("out", k, d, d) for k in range(3) for d in (0, 1))
    assert_bucket_valid(LAYER_NORM, spec, dims, ((3, 4), (5, 8)), tmp_path)
    # rows longer than a block: the looped passes, the rows still at run time
    looped = Config.of(BLOCK_M=2, BLOCK_N=16, num_warps=1, num_stages=2, ALIGN=True, EVICT=False)
    assert_bucket_valid(LAYER_NORM, spec, dims, ((3, 4), (5, 8)), tmp_path, looped)


def test_a_bucketed_pointwise_op_reads_one_value_per_row_of_a_norms_statistics(tmp_path):
    # RMSNorm's x * rsqrt(mean(x^2) + eps): [B, S, H] times [B, S, 1], batch and sequence varying
    x, r = _x(4, 8, 32), _x(4, 8, 1)
    spec = spec_of(aten.mul.Tensor, [x, r])
    dims = tuple((side, i, d, d) for side, i in (("in", 0), ("in", 1), ("out", 0)) for d in (0, 1))
    program = assert_bucket_valid(ELEMENTWISE, spec, dims, ((3, 4), (5, 8)), tmp_path)
    assert "idx // 32" in program.source
    # a bias [H] beside the varying rows still reads idx % H
    bias = spec_of(aten.add.Tensor, [x, _x(32)])
    assert "idx % 32" in assert_bucket_valid(ELEMENTWISE, bias, ROWS + (("in", 0, 1, 1), ("out", 0, 1, 1)),
                                             ((3, 4), (5, 8)), tmp_path).source


def test_what_does_not_fit_a_bucket_over_the_rows_is_refused_with_a_reason():
    per_row = spec_of(aten.mul.Tensor, [_x(8, 32), _x(8, 1)])
    assert "broadcasts otherwise" in ELEMENTWISE.bucket_support(per_row, (("in", 0, 1, 0), ("out", 0, 1, 0)))
    assert "other dims" in ELEMENTWISE.bucket_support(per_row, (("in", 0, 0, 0), ("out", 0, 0, 0)))
    bias = spec_of(aten.add.Tensor, [_x(8, 32), _x(32)])
    assert "broadcasts otherwise" in ELEMENTWISE.bucket_support(bias, (("in", 0, 1, 0), ("in", 1, 0, 0), ("out", 0, 1, 0)))
    soft = spec_of(aten._softmax.default, [_x(8, 40), -1, False])
    assert "reduced" in REDUCTIONS.bucket_support(soft, (("in", 0, 1, 0), ("out", 0, 1, 0)))
    assert "other dims" in REDUCTIONS.bucket_support(soft, (("in", 0, 0, 0),))
    outer = spec_of(aten.sum.dim_IntList, [_x(8, 40), [0]])
    assert "not trailing" in REDUCTIONS.bucket_support(outer, (("in", 0, 1, 0), ("out", 0, 0, 0)))
    transposed = spec_of(aten._softmax.default, [_x(40, 8).t(), -1, False])
    assert "not contiguous" in REDUCTIONS.bucket_support(transposed, ROWS)
    ln = spec_of(aten.native_layer_norm.default, [_x(8, 32), [32], _x(32), None, 1e-5])
    assert "normalized" in LAYER_NORM.bucket_support(ln, (("in", 0, 1, 0),) + tuple(("out", k, 1, 0) for k in range(3)))
    assert "weight or bias" in LAYER_NORM.bucket_support(ln, LN_ROWS + (("in", 1, 0, 0),))
    assert "other dims" in LAYER_NORM.bucket_support(ln, LN_ROWS[:2])


def test_split_configs_stay_out_of_a_bucket_search_and_int64_indexing_follows_the_upper_edge():
    few_long = spec_of(aten.sum.dim_IntList, [_x(4, 16384), [-1]])
    assert any(c["SPLIT"] > 1 for c in REDUCTIONS.seed_configs(few_long))
    bucketed = BucketFamily(REDUCTIONS, ROWS)
    seeds = bucketed.seed_configs(few_long)
    assert seeds and all(c["SPLIT"] == 1 for c in seeds)
    assert all(c["SPLIT"] == 1 for c in bucketed.neighbours(few_long, seeds[0]))
    split = next(c for c in REDUCTIONS.seed_configs(few_long) if c["SPLIT"] > 1)
    with pytest.raises(ValueError, match="SPLIT"):
        REDUCTIONS.generate_bucketed(few_long, split, ROWS)

    small = spec_of(aten._softmax.default, [_x(8, 4096), -1, False])
    huge = spec_at(small, ROWS, (1 << 20,))  # 2^32 elements at the upper edge (never allocated)
    config = REDUCTIONS.seed_configs(small)[0]
    assert ".to(tl.int64)" not in REDUCTIONS.generate_bucketed(small, config, ROWS).source
    program = REDUCTIONS.generate_bucketed(huge, config, ROWS)
    assert ".to(tl.int64)" in program.source  # decided at the representative: every size of the bucket fits
    (launch,) = instantiate(program, (3,)).launches
    assert launch.args[-1] == ("i32", 3) and launch.grid == (-(-3 // config["BLOCK_M"]),)


def test_bucketed_row_kernels_compile_for_sm90(tmp_path):
    """Real GPU code: the run-time row count is an i32 argument of the compiled binary."""
    soft = spec_of(aten._softmax.default, [_x(64, 1024, dtype=f16), -1, False])
    ln = spec_of(aten.native_layer_norm.default, [_x(64, 4096, dtype=bf16), [4096], _x(4096, dtype=bf16), None, 1e-5])
    for family, spec, dims in ((REDUCTIONS, soft, ROWS), (LAYER_NORM, ln, LN_ROWS)):
        compile_sm90(spec, family.generate_bucketed(spec, family.seed_configs(spec)[0], dims), tmp_path)


MODELS = {  # the model's body, and the ops that must run on a bucket's kernel
    "softmax": ("torch.softmax(x, -1)", ["aten._softmax.default"]),
    "layer_norm": ("torch.nn.functional.layer_norm(x, (16,), self.w, self.b)", ["aten.native_layer_norm.default"]),
    # decomposed RMSNorm: its nodes' buckets, and its fused (rowwise) region's, which serves them
    "rms_norm": ("x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w",
                 ["aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor", "aten.rsqrt.default",
                  "aten.mul.Tensor", "aten.mul.Tensor", "region"]),
}
MODEL = '''
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))
        self.b = torch.nn.Parameter(torch.randn(16))
    def forward(self, x):
        return {body}
def make():
    torch.manual_seed(0)
    return M(), (torch.randn(6, 16),)
'''


@pytest.mark.parametrize("name", list(MODELS))
def test_fill_cache_fills_the_bucket_of_a_row_op_and_a_dynamic_compile_serves_it_on_triton(name, tmp_path):
    body, ops = MODELS[name]
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(body=body))
    cache_dir = tmp_path / "cache"
    assert fill_main(["--target", "interpreter", "--cache-dir", str(cache_dir), "--quiet", "--budget", "1",
                      "--model", f"{path}:make", "--dynamic", "0:0:5-8"]) == 0
    cache = KernelCache.for_target(cache_dir, get_target("interpreter"))
    buckets = {e.key: e for e in cache.entries() if e.bucket is not None}
    assert sorted(e.spec.op for e in buckets.values()) == sorted(ops)
    assert all(e.bucket.ranges == ((5, 8),) and e.winner == "triton" for e in buckets.values())

    model = runpy.run_path(str(path))["make"]()[0]
    opts = Options.resolve({"target": "interpreter", "cache_dir": str(cache_dir), "repro_dir": str(tmp_path / "repros"),
                            "graph_cache": "off"})
    session, graphs = Session(opts), []
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=True,
                             backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    with torch.no_grad():
        for rows in (5, 7, 8):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), model(x))
    (g,) = graphs
    for rows in (5, 7, 8):
        ((decisions, regions),) = {id(s): (s.decisions, s.regions) for k, s in g.specializations().items()
                                   if rows in k}.values()
        served = [d for d in decisions + regions if d.op in ops and d.tier == "triton"]
        assert sorted(d.op for d in served) == sorted(ops)
        for d in served:
            if d.reason.startswith("in fused region"):  # (the region's bucket serves it)
                assert any(r.entry.key in buckets for r in regions if r.tier == "triton"), (rows, d)
            else:
                assert d.entry.key in buckets and "bucket" in d.reason, (rows, d)
