"""The grouped_mm family serving a shape bucket (interpreter target): one kernel with S, the routed
tokens, taken at run time, generated at the bucket's upper edge, matches the float64 reference
(offs drawn by the op's input domain at each size) and the op's own loop at the lower edge, inside
and the upper edge; what cannot vary is refused with a reason; the exact-shape kernel keeps its
literals; real sm_90 code."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_testing import assert_bucket_valid, compile_sm90, load
from test_kernels_grouped_mm import _spec
from torch_kernelize.compiling.bucket_lookup import bucket_runner
from torch_kernelize.core.buckets import instantiate, spec_at
from torch_kernelize.core.spec import TensorMeta
from torch_kernelize.core.validate import compare, validate
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.grouped_mm import FAMILY

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN edge trials

S_DIMS = (("in", 0, 0, 0), ("out", 0, 0, 0))


def config(**changes) -> Config:
    """Tiles small enough for several row tiles, slot groups and column tiles."""
    base = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2, DOT_UPCAST=False)
    return Config.of(**{**base, **changes})


# name: (_spec's arguments at the upper edge, ranges of S, config)
CASES = {
    "f32": (dict(S=40), ((17, 40),), config()),
    "f16_transposed_weight": (dict(S=40, dtype=torch.float16, transposed=True), ((17, 40),), config(GROUP_M=4)),
    "f16_transposed_weight_tma": (dict(S=40, dtype=torch.float16, transposed=True), ((17, 40),),
                                  config(GROUP_M=4, TMA=True, PROGRAMS=3)),
    "one_token_up_int32_offs": (dict(S=16, offs_dtype=torch.int32, offs=[3, 3, 9, 12, 16]), ((1, 16),), config()),
    "bf16_upcast_one_expert": (dict(S=48, E=1, offs=[48], dtype=torch.bfloat16), ((33, 48),),
                               config(DOT_UPCAST=True, BLOCK_N=32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bucketed_grouped_mm_is_right_at_both_edges_and_inside(case, tmp_path):
    kwargs, ranges, cfg = CASES[case]
    spec, _ = _spec(**kwargs)
    program = assert_bucket_valid(FAMILY, spec, S_DIMS, ranges, tmp_path, cfg)
    (launch,) = program.launches
    E, n_tiles = spec.inputs[1].shape[0], -(-spec.outputs[0].shape[1] // cfg["BLOCK_N"])
    lo = ranges[0][0]
    (small,) = instantiate(program, (lo,)).launches
    assert small.args[-1] == ("i32", lo)
    if cfg.get("TMA"):  # persistent: the same grid at every S
        assert launch.runtime_sizes == {"args": {"4": "v0"}} and small.grid == (cfg["PROGRAMS"],)
        assert "shape=[S, " in program.source
        return
    assert launch.runtime_sizes == {"grid": [["mul", ["add", ["cdiv", "v0", cfg["BLOCK_M"]], E], n_tiles]],
                                    "args": {"4": "v0"}}
    assert "slots = (S + BLOCK_M - 1) // BLOCK_M" in program.source
    assert small.grid == ((-(-lo // cfg["BLOCK_M"]) + E) * n_tiles,)


@pytest.mark.parametrize("S", [17, 29, 40])
def test_a_bucketed_grouped_mm_matches_the_ops_own_loop(S, tmp_path):
    """Given offsets with an empty expert and rows of no expert, at each size of the bucket."""
    spec, _ = _spec(S=40)
    base = load(tmp_path, spec, FAMILY.generate_bucketed(spec, config(), S_DIMS))
    at = spec_at(spec, S_DIMS, (S,))
    g = torch.Generator().manual_seed(S)
    x, w = torch.randn(S, 24, generator=g), torch.randn(5, 24, 36, generator=g)
    offs = torch.tensor([2, 2, S // 2, S - 3, S - 1])   # expert 1 empty; row S - 1 no expert's
    (got,) = bucket_runner(at, S_DIMS, base).run_poisoned([x, w, offs])
    (want,) = at.run_vendor([x, w, offs])
    assert tuple(got.shape) == (S, 36) and bool((got[-1] == 0).all())
    c = compare(got, want.double(), at.op, got.dtype)
    assert c.ok, c.reason


def test_the_exact_shape_kernel_keeps_its_literals():
    """One generator: without a bucket S and the slot count stay literals, the grid a number."""
    spec, _ = _spec(S=40)
    static, bucketed = FAMILY.generate(spec, config()), FAMILY.generate_bucketed(spec, config(), S_DIMS)
    assert "out0_ptr, BLOCK_M" in static.source and "tl.minimum(8 - first, GROUP_M)" in static.source
    assert "[last end, 40)" in static.source and "(tail < 40)" in static.source and "slots =" not in static.source
    assert static.launches[0].runtime_sizes == {} and static.launches[0].grid == (8 * 3,)
    assert "out0_ptr, S, BLOCK_M" in bucketed.source and "tl.minimum(slots - first, GROUP_M)" in bucketed.source
    assert "40" not in bucketed.source.split("@triton.jit")[1]   # S is nowhere a literal
    assert bucketed.launches[0].grid == static.launches[0].grid


def test_a_kernel_with_the_upper_edges_slot_count_fails_inside_the_bucket(tmp_path):
    """The check can fail: slots counted at the upper edge (4 for 40 rows of one expert) instead of
    from S group a smaller S's programs wrongly (its last group is smaller than GROUP_M there), so
    some tiles are never computed and stay poisoned."""
    spec, _ = _spec(S=40, E=1, offs=[40])
    program = FAMILY.generate_bucketed(spec, config(GROUP_M=4), S_DIMS)
    line = "slots = (S + BLOCK_M - 1) // BLOCK_M + 1"
    assert line in program.source
    bad = dataclasses.replace(program, source=program.source.replace(line, "slots = 4"))
    base = load(tmp_path, spec, bad)
    for S in (1, 20, 40):
        at = spec_at(spec, S_DIMS, (S,))
        rec = validate(bucket_runner(at, S_DIMS, base).run_poisoned, at, FAMILY.sample_inputs, (), seeds=(0,))
        assert rec.ok == (S == 40), (S, rec.reason)


def test_what_cannot_vary_is_refused_with_a_reason():
    spec, _ = _spec(S=40, K=24, N=36)
    k = S_DIMS + (("in", 0, 1, 1), ("in", 1, 1, 1))
    assert "K varies" in FAMILY.bucket_support(spec, k)
    assert "N varies" in FAMILY.bucket_support(spec, S_DIMS + (("in", 1, 2, 1), ("out", 0, 1, 1)))
    assert "experts" in FAMILY.bucket_support(spec, S_DIMS + (("in", 1, 0, 1), ("in", 2, 0, 1)))
    assert "one variable" in FAMILY.bucket_support(spec, S_DIMS[:1])   # the output's S stays 40
    assert "one variable" in FAMILY.bucket_support(spec, (("in", 0, 0, 0), ("out", 0, 0, 1)))
    with pytest.raises(ValueError, match="K varies"):
        FAMILY.generate_bucketed(spec, config(), k)
    a, w, offs = spec.inputs
    column_major = dataclasses.replace(spec, inputs=(dataclasses.replace(a, stride=(1, 40)), w, offs))
    assert FAMILY.supports(column_major) is None
    assert "not contiguous" in FAMILY.bucket_support(column_major, S_DIMS)
    assert FAMILY.bucket_support(spec, S_DIMS) is None
    assert FAMILY.bucket_support(_spec(transposed=True)[0], S_DIMS) is None   # the weight's layout is its own


def test_a_bucketed_grouped_mm_compiles_for_sm90_and_s_is_i64_only_where_the_upper_edge_needs_it(tmp_path):
    """Mixtral's gate_up in the suite (metas only): real GPU code with S an i32 argument."""
    small, _ = _spec(E=4, offs=[8, 8, 21, 40], dtype=torch.float16)
    S, K, N, E = 8192, 2048, 11264, 8
    meta = lambda shape, stride, dtype="float16": TensorMeta(shape, stride, dtype, "cpu")  # noqa: E731
    spec = dataclasses.replace(small, inputs=(meta((S, K), (K, 1)), meta((E, K, N), (K * N, 1, K)),
                                              meta((E,), (1,), "int64")), outputs=(meta((S, N), (N, 1)),))
    tma, pointers = FAMILY.seed_configs(spec)[:2]
    assert tma["TMA"] and not pointers["TMA"]
    for cfg in (tma, pointers):
        program = FAMILY.generate_bucketed(spec, cfg, S_DIMS)
        assert program.launches[0].args[-1] == ("i32", S)
        compile_sm90(spec, program, tmp_path)
    huge = spec_at(spec, S_DIMS, (2**31 - 8,))
    program = FAMILY.generate_bucketed(huge, pointers, S_DIMS)
    assert program.launches[0].args[-1] == ("i64", 2**31 - 8)
    compile_sm90(huge, program, tmp_path)
    # TMA's coordinates are 32-bit: that far, only the pointer kernel
    assert not any(c["TMA"] for c in FAMILY.seed_configs(huge))
    with pytest.raises(ValueError, match="invalid config"):
        FAMILY.generate_bucketed(huge, tma, S_DIMS)
