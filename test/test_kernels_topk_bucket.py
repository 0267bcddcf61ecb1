"""The topk family serving a shape bucket (interpreter target): one kernel with the number of rows
taken at run time, generated at the bucket's upper edge, matches the float64 reference at the
lower edge, inside and the upper edge; what cannot vary is refused with a reason; int64 indexing
follows the upper edge; real sm_90 code."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_testing import assert_bucket_valid, compile_sm90, load, spec_of
from torch_kernelize.compiling.bucket_lookup import bucket_runner
from torch_kernelize.core.buckets import instantiate, spec_at
from torch_kernelize.core.validate import validate
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.topk import FAMILY

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/inf edge values

aten = torch.ops.aten
ROWS = (("in", 0, 0, 0), ("out", 0, 0, 0), ("out", 1, 0, 0))
BATCH_SEQ = tuple((side, i, d, d) for side, i in (("in", 0), ("out", 0), ("out", 1)) for d in (0, 1))
PASSES = Config.of(BLOCK_M=4, VARIANT="passes", num_warps=1)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


# name: (topk's arguments at the upper edge, dims, ranges, config)
CASES = {
    # an MoE router's probs.topk(2): tokens vary; several blocks, the last one partly masked inside
    "moe_router": (lambda: (_x(16, 8).softmax(-1), 2, -1), ROWS, ((5, 16),), PASSES),
    "smallest_f16_k_not_pow2": (lambda: (_x(14, 37, dtype=torch.float16), 5, 1, False), ROWS, ((1, 14),), PASSES),
    "batch_and_seq_bf16": (lambda: (_x(3, 8, 20, dtype=torch.bfloat16), 3), BATCH_SEQ, ((2, 3), (5, 8)), PASSES),
    "bitonic": (lambda: (_x(12, 24), 4), ROWS, ((7, 12),), Config.of(BLOCK_M=8, VARIANT="bitonic", num_warps=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bucketed_topk_is_right_at_both_edges_and_inside(case, tmp_path):
    args, dims, ranges, config = CASES[case]
    spec = spec_of(aten.topk.default, args())
    program = assert_bucket_valid(FAMILY, spec, dims, ranges, tmp_path, config)
    (launch,) = program.launches
    assert "n_rows" in program.source and launch.runtime_sizes["args"] == {"3": launch.runtime_sizes["grid"][0][1]}
    lo = tuple(lo for lo, _ in ranges)
    rows = spec_at(spec, dims, lo).outputs[0].numel // spec.outputs[0].shape[-1]
    (small,) = instantiate(program, lo).launches
    assert small.args[-1] == ("i32", rows) and small.grid == (-(-rows // config["BLOCK_M"]),)


def test_the_exact_shape_kernel_takes_no_sizes_at_run_time():
    """Sharing one generator leaves ``generate`` as it was: literal rows, a literal grid."""
    spec = spec_of(aten.topk.default, (_x(13, 24), 4))
    static = FAMILY.generate(spec, PASSES)
    assert "n_rows" not in static.source and "row_mask = rows < 13" in static.source
    assert static.launches[0].runtime_sizes == {} and len(static.launches[0].args) == 3
    bucketed = FAMILY.generate_bucketed(spec, PASSES, ROWS)
    assert "row_mask = rows < n_rows" in bucketed.source
    body = lambda p: p.source[p.source.index("    cols = "):]  # noqa: E731 - past the rows: the same code
    assert body(bucketed) == body(static)


def test_a_kernel_with_the_rows_baked_in_fails_inside_the_bucket(tmp_path):
    """The check can fail: a kernel that masks its rows at a literal count (the lower edge's)
    instead of ``n_rows`` is right there, but leaves the rows past it poisoned above it."""
    args, dims, ranges, config = CASES["moe_router"]
    spec = spec_of(aten.topk.default, args())
    program = FAMILY.generate_bucketed(spec, config, dims)
    assert "row_mask = rows < n_rows" in program.source
    bad = dataclasses.replace(program, source=program.source.replace("rows < n_rows", "rows < 5"))
    base = load(tmp_path, spec, bad)
    for values in ((5,), (11,), (16,)):
        at = spec_at(spec, dims, values)
        rec = validate(bucket_runner(at, dims, base).run_poisoned, at, FAMILY.sample_inputs, (), seeds=(0,),
                       resolve_ties=FAMILY.resolve_ties)
        assert rec.ok == (values == (5,)), (values, rec.reason)


def test_what_cannot_vary_is_refused_with_a_reason():
    along_0 = spec_of(aten.topk.default, (_x(8, 40), 3, 0))
    assert "not the last" in FAMILY.bucket_support(along_0, (("in", 0, 1, 0), ("out", 0, 1, 0), ("out", 1, 1, 0)))
    last = spec_of(aten.topk.default, (_x(8, 40), 3))
    assert "topk dim 1 varies" in FAMILY.bucket_support(last, (("in", 0, 1, 0),))
    assert "other dims" in FAMILY.bucket_support(last, (("in", 0, 0, 0), ("out", 0, 0, 0)))   # indices stay 8 rows
    assert "other dims" in FAMILY.bucket_support(last, ROWS[:1])
    assert "no dim varies" in FAMILY.bucket_support(last, ())
    transposed = spec_of(aten.topk.default, (_x(40, 8).t(), 3))
    assert "not contiguous" in FAMILY.bucket_support(transposed, ROWS)
    with pytest.raises(ValueError, match="not the last"):
        FAMILY.generate_bucketed(along_0, PASSES, (("in", 0, 1, 0), ("out", 0, 1, 0), ("out", 1, 1, 0)))
    assert FAMILY.bucket_support(last, ROWS) is None


def test_int64_indexing_follows_the_upper_edge():
    small = spec_of(aten.topk.default, (_x(8, 4096), 4))
    huge = spec_at(small, ROWS, (1 << 20,))   # 2^32 elements at the upper edge (never allocated)
    config = FAMILY.seed_configs(small)[0]
    wide = "rows = tl.program_id(0).to(tl.int64) * BLOCK_M"
    assert wide not in FAMILY.generate_bucketed(small, config, ROWS).source
    program = FAMILY.generate_bucketed(huge, config, ROWS)
    assert wide in program.source   # decided at the representative: every size of the bucket fits
    (launch,) = instantiate(program, (3,)).launches
    assert launch.args[-1] == ("i32", 3) and launch.grid == (-(-3 // config["BLOCK_M"]),)


def test_a_bucketed_topk_compiles_for_sm90(tmp_path):
    """Real GPU code: the run-time row count is an i32 argument of the compiled binary."""
    spec = spec_of(aten.topk.default, (torch.empty(4096, 64, dtype=torch.bfloat16), 8))
    for config in FAMILY.seed_configs(spec)[:2]:   # both variants
        compile_sm90(spec, FAMILY.generate_bucketed(spec, config, ROWS), tmp_path)
