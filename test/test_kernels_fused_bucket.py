"""Fused regions serve shape buckets: a rowwise region (RMSNorm, LayerNorm, a masked softmax) takes
its number of rows at run time, a pointwise one its number of elements, so one kernel, validated
at a bucket's edges and inside, serves every batch or sequence length in it (interpreter target).
Regions are cut from graphs traced with symbolic shapes; their bucket dims, node values included,
come from compiling/bucket_lookup.region_bucket_sizes, as the planner reads them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).parent))
from kernel_testing import assert_bucket_valid, compile_sm90  # noqa: E402

from torch_kernelize.compiling.bucket_lookup import region_bucket_sizes
from torch_kernelize.compiling.regions import find_regions, region_spec
from torch_kernelize.core import targets
from torch_kernelize.core.buckets import instantiate, spec_at
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.fused import FAMILY

# the interpreter runs numpy, which warns on inf/NaN arithmetic the edge-value trials do on purpose
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F16, BF16 = torch.float16, torch.bfloat16
LOOPED = Config.of(BLOCK_M=2, BLOCK_N=16, num_warps=1, num_stages=2, ALIGN=True, EVICT=False)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def bucketed_region(fn, *inputs: torch.Tensor, vary: tuple[int, ...]) -> tuple[KernelSpec, tuple]:
    """The one region of ``fn`` traced with symbolic shapes, as a spec at the inputs' sizes, and
    its bucket dims (inputs, outputs and node values) in the sizes ``vary`` only (every size of
    the inputs is distinct, so a size names its symbol); the variables numbered as in ``vary``."""
    gm = make_fx(fn, tracing_mode="symbolic", decomposition_table=torch._decomp.core_aten_decompositions())(*inputs)
    regions = find_regions(gm, targets.get_target("interpreter"))
    assert len(regions) == 1, regions
    dims, symbols = region_bucket_sizes(regions[0])
    size_of = {v: inputs[i].shape[d] for side, i, d, v in dims if side == "in"}
    spec = region_spec(regions[0], {s: sympy.Integer(size_of[v]) for v, s in enumerate(symbols)})
    kept = tuple((side, i, d, vary.index(size_of[v])) for side, i, d, v in dims if size_of[v] in vary)
    assert any(side == "node" for side, *_ in kept)
    return spec, kept


# --- the functions regions are cut from ------------------------------------------------------------

def rmsnorm(x, w):  # torch_kernelize.model_zoo.RMSNorm
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def layernorm_manual(x, w, b):
    m = x.mean(-1, keepdim=True)
    d = x - m
    return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w + b


def masked_softmax(x, mask):
    return torch.softmax(x * 0.125 + mask, -1)


def swish_mul_add(x, y, z):
    return x * torch.sigmoid(x) * y + z


# --- rowwise: the rows at run time -----------------------------------------------------------------

ROWWISE = {
    # batch and sequence vary; the hidden size (the reduced row) stays
    "rmsnorm-f16": (rmsnorm, lambda: (_x(4, 8, 48, dtype=F16), _x(48, dtype=F16)), (4, 8), ((3, 4), (5, 8))),
    "layernorm-bf16-seq-only": (layernorm_manual, lambda: (_x(3, 8, 40, dtype=BF16), _x(40, dtype=BF16),
                                                           _x(40, dtype=BF16)), (8,), ((5, 8),)),
    # the rows are the one variable itself ("v0")
    "rmsnorm-2d": (rmsnorm, lambda: (_x(8, 40), _x(40)), (8,), ((5, 8),)),
    # the mask varies with the rows as the scores do
    "masked-softmax": (masked_softmax, lambda: (_x(4, 6, 24), _x(4, 6, 24)), (4, 6), ((3, 4), (4, 6))),
}


@pytest.mark.parametrize("case", list(ROWWISE))
@pytest.mark.parametrize("looped", [False, True], ids=["single", "looped"])
def test_a_bucketed_rowwise_region_is_right_at_both_edges_and_inside(case, looped, tmp_path):
    fn, inputs, vary, ranges = ROWWISE[case]
    spec, dims = bucketed_region(fn, *inputs(), vary=vary)
    program = assert_bucket_valid(FAMILY, spec, dims, ranges, tmp_path, LOOPED if looped else None)
    assert "n_rows" in program.source and all(launch.runtime_sizes for launch in program.launches)


def test_the_rows_of_a_bucketed_region_are_the_product_of_its_varying_and_static_leading_dims():
    spec, dims = bucketed_region(layernorm_manual, _x(3, 8, 40), _x(40), _x(40), vary=(8,))
    launch = FAMILY.generate_bucketed(spec, FAMILY.seed_configs(spec)[0], dims).launches[0]
    assert launch.runtime_sizes["args"][str(len(launch.args) - 1)] == ["mul", 3, "v0"]


# --- pointwise: the elements at run time ---------------------------------------------------------

POINTWISE = {
    # z a bias over the hidden size, y one value per row: read at idx % H and idx // H
    "bias-and-rows": (swish_mul_add, lambda: (_x(4, 8, 48, dtype=F16), _x(4, 8, 1, dtype=F16), _x(48, dtype=F16)),
                      (4, 8), ((3, 4), (5, 8))),
    # a flat run: the number of elements is the one variable itself ("v0")
    "one-dim": (swish_mul_add, lambda: (_x(300), _x(300), _x(1)), (300,), ((129, 300),)),
    # the batch varies, the sequence not: y is broadcast over the batch, a static run inside it
    "broadcast-over-the-batch": (swish_mul_add, lambda: (_x(4, 8, 40), _x(8, 40), _x(1)), (4,), ((3, 4),)),
}


@pytest.mark.parametrize("case", list(POINTWISE))
def test_a_bucketed_pointwise_region_is_right_at_both_edges_and_inside(case, tmp_path):
    fn, inputs, vary, ranges = POINTWISE[case]
    spec, dims = bucketed_region(fn, *inputs(), vary=vary)
    small = Config.of(BLOCK=128, num_warps=1, ALIGN=True)  # several blocks, the last one partial
    program = assert_bucket_valid(FAMILY, spec, dims, ranges, tmp_path, small)
    assert "n_elements" in program.source and all(launch.runtime_sizes for launch in program.launches)


# --- refusals --------------------------------------------------------------------------------------

def test_what_a_bucket_of_a_region_refuses_and_why():
    spec, dims = bucketed_region(rmsnorm, _x(4, 8, 48), _x(48), vary=(4, 8, 48))
    assert "row length" in FAMILY.bucket_support(spec, dims)
    spec, dims = bucketed_region(rmsnorm, _x(4, 8, 48), _x(48), vary=(4, 8))
    assert FAMILY.bucket_support(spec, dims) is None
    # a node's value spans the rows but does not vary with them: its size would stay the representative's
    unlisted = tuple(d for d in dims if d[:2] != ("node", 2))
    assert "region node 2's value dim 0 spans varying dim 0" in FAMILY.bucket_support(spec, unlisted)
    # the output's rows vary with another variable than the input's
    swapped = tuple(("out", 0, 0, 1) if d == ("out", 0, 0, 0) else d for d in dims)
    assert "two variables" in FAMILY.bucket_support(spec, swapped)
    with pytest.raises(ValueError, match="cannot be bucketed: dim 0 of the region"):
        FAMILY.generate_bucketed(spec, FAMILY.seed_configs(spec)[0], swapped)

    # a varying tensor that is not contiguous: its strides are no function of its sizes
    sliced = _x(4, 8, 64)[:, :, :48]
    gm = make_fx(rmsnorm, decomposition_table=torch._decomp.core_aten_decompositions())(sliced, _x(48))
    spec = region_spec(find_regions(gm, targets.get_target("interpreter"))[0], {})
    assert "not contiguous" in FAMILY.bucket_support(spec, (("in", 0, 0, 0), ("out", 0, 0, 0)))

    # rows that are no one strided run: a mask broadcast over the varying batch
    spec, dims = bucketed_region(masked_softmax, _x(4, 6, 24), _x(6, 24), vary=(4,))
    assert "one strided run" in FAMILY.bucket_support(spec, dims)

    # pointwise: an input broadcast across the varying dims splits the walk's outer run
    spec, dims = bucketed_region(swish_mul_add, _x(4, 8, 40), _x(4, 1, 40), _x(1), vary=(8,))
    assert "merge into one run" in FAMILY.bucket_support(spec, dims)
    # a varying dim named where an input broadcasts (y's size-1 last dim)
    spec, dims = bucketed_region(swish_mul_add, _x(4, 8, 48), _x(4, 8, 1), _x(48), vary=(4, 8))
    assert FAMILY.bucket_support(spec, dims) is None
    assert "input 1 dim 2 varies but broadcasts" in FAMILY.bucket_support(spec, dims + (("in", 1, 2, 1),))


def test_bucketed_region_kernels_compile_for_sm90(tmp_path):
    """Real GPU code: the run-time rows or elements are an i32 argument of the compiled binary."""
    rms, rms_dims = bucketed_region(rmsnorm, _x(64, 8, 4096, dtype=BF16), _x(4096, dtype=BF16), vary=(64, 8))
    pw, pw_dims = bucketed_region(swish_mul_add, _x(16, 24, 256, dtype=F16), _x(16, 24, 1, dtype=F16),
                                  _x(256, dtype=F16), vary=(16, 24))
    for spec, dims in ((rms, rms_dims), (pw, pw_dims)):
        program = FAMILY.generate_bucketed(spec, FAMILY.seed_configs(spec)[0], dims)
        assert program.launches[0].args[-1][0] == "i32"
        compile_sm90(spec, program, tmp_path)


def test_int64_indexing_is_decided_at_the_representative():
    """A bucket whose upper edge passes int32 offsets indexes in int64 at every size; one that does
    not, in int32. The size argument is i64 where the size itself can pass int32 (the elements,
    not the rows: 2^26 rows of 48)."""
    rms = bucketed_region(rmsnorm, _x(4, 8, 48), _x(48), vary=(4, 8))
    pw = bucketed_region(swish_mul_add, _x(4, 8, 48), _x(4, 8, 1), _x(48), vary=(4, 8))
    for (spec, dims), size_type in ((rms, "i32"), (pw, "i64")):
        config = FAMILY.seed_configs(spec)[0].replace(ALIGN=False)  # (the alignment test casts pointers)
        small = FAMILY.generate_bucketed(spec, config, dims)
        huge = FAMILY.generate_bucketed(spec_at(spec, dims, (1 << 16, 1 << 10)), config, dims)
        assert ".to(tl.int64)" not in small.source and small.launches[0].args[-1][0] == "i32"
        assert ".to(tl.int64)" in huge.source and huge.launches[0].args[-1][0] == size_type
        (launch,) = instantiate(huge, (3, 5)).launches
        assert launch.args[-1][1] == 15 * (1 if "n_rows" in huge.source else 48)
