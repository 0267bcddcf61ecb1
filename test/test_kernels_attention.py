"""The flash-attention family on the Triton interpreter: SDPA's CPU flash op (out, logsumexp) and its
backward, scaled_dot_product_attention itself; causal, scale, float and bool masks, GQA, dtypes,
strided layouts; validated against the float64 reference, compared with eager ATen (values and the
traced output strides), refusals, and an sm_90 compile of every kernel."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernel_testing import assert_valid, compile_sm90, run_validation, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.attention import FAMILY
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.core.spec import KernelSpec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SDPA = aten.scaled_dot_product_attention.default


def qkv(L=24, S=20, E=8, Ev=None, H=2, Hkv=None, B=1, dtype=F32):
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    return r(B, H, L, E), r(B, Hkv or H, S, E), r(B, Hkv or H, S, Ev or E)


def fwd_spec(q, k, v, causal=False, mask=None, scale=None) -> KernelSpec:
    kw = {k_: v_ for k_, v_ in (("attn_mask", mask), ("scale", scale)) if v_ is not None}
    return spec_of(FWD, (q, k, v, 0.0, causal), kw)


def bwd_spec(q, k, v, causal=False, mask=None, scale=None) -> KernelSpec:
    kw = {k_: v_ for k_, v_ in (("attn_mask", mask), ("scale", scale)) if v_ is not None}
    out, lse = FWD(q, k, v, 0.0, causal, **kw)
    return spec_of(BWD, (torch.randn_like(out), q, k, v, out, lse, 0.0, causal), kw)


def small(bm=16, bn=16, upcast=False) -> Config:
    """Blocks smaller than the sequences, so the loops, edges and causal bounds all run."""
    return Config.of(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=2, DOT_UPCAST=upcast)


def upcast_for(dtype) -> bool:
    return dtype == BF16  # the interpreter's bf16 tl.dot is wrong (notes); fp16 runs as on the GPU


VARIANTS = {
    "plain": lambda spec, **kw: spec(*qkv(**kw)),
    "causal": lambda spec, **kw: spec(*qkv(**kw), causal=True),
    "causal_L_lt_S": lambda spec, **kw: spec(*qkv(**dict(kw, L=12, S=40)), causal=True),
    "scale": lambda spec, **kw: spec(*qkv(**kw), scale=0.3),
    "float_mask": lambda spec, **kw: spec(*qkv(**kw), mask=torch.randn(24, 20).to(kw.get("dtype", F32))),
    "batch_head_mask": lambda spec, **kw: spec(*qkv(**dict(kw, B=2)), mask=torch.randn(2, 1, 24, 20).to(kw.get("dtype", F32))),
    "expanded_mask": lambda spec, **kw: spec(*qkv(**dict(kw, B=2)),
                                             mask=torch.randn(1, 1, 24, 20).to(kw.get("dtype", F32)).expand(2, 2, 24, 20)),
    "gqa": lambda spec, **kw: spec(*qkv(**dict(kw, H=4, Hkv=2))),
    "gqa_causal": lambda spec, **kw: spec(*qkv(**dict(kw, H=4, Hkv=1)), causal=True),
    "head_dim_5": lambda spec, **kw: spec(*qkv(**dict(kw, E=5))),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_variants(variant, tmp_path):
    spec = VARIANTS[variant](fwd_spec)
    assert [o.dtype for o in spec.outputs] == ["float32", "float32"]
    assert_valid(FAMILY, spec, tmp_path, small(), seeds=(0,))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_backward_variants(variant, tmp_path):
    spec = VARIANTS[variant](bwd_spec)
    assert len(spec.outputs) == 3
    assert_valid(FAMILY, spec, tmp_path, small(16, 32), seeds=(0,))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("variant", ["causal", "float_mask", "gqa"])
def test_half_dtypes(dtype, variant, tmp_path):
    """fp16/bf16 operands, fp32 accumulation; logsumexp stays fp32 (as ATen gives it)."""
    spec = VARIANTS[variant](fwd_spec, dtype=dtype)
    assert [o.dtype for o in spec.outputs] == [str(dtype)[6:], "float32"]
    assert_valid(FAMILY, spec, tmp_path, small(upcast=upcast_for(dtype)), seeds=(0,))
    spec = VARIANTS[variant](bwd_spec, dtype=dtype)
    assert_valid(FAMILY, spec, tmp_path, small(16, 32, upcast=upcast_for(dtype)), seeds=(0,))


def test_transposed_inputs_keep_the_traced_output_strides(tmp_path):
    """[B, L, H, E] projections seen as [B, H, L, E]: ATen's CPU kernel then gives out (and the
    gradients) in [B, L, H, E] order and logsumexp in [B, L, H] order; the kernel writes exactly those."""
    # [2, 3, 16, 8] with strides (384, 8, 24, 1)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(H=3, L=16, S=16, B=2))
    spec = fwd_spec(q, k, v, causal=True)
    assert spec.outputs[0].stride == (384, 8, 24, 1) and spec.outputs[1].stride == (48, 1, 3)
    assert_valid(FAMILY, spec, tmp_path, small(), seeds=(0,))   # compare_eager checks the strides
    spec = bwd_spec(q, k, v, causal=True)
    assert all(g.stride == (384, 8, 24, 1) for g in spec.outputs)
    assert_valid(FAMILY, spec, tmp_path, small(), seeds=(0,))
    # and contiguous inputs: out contiguous, logsumexp [B, L, H]-ordered, gradients [B, L, H, E]
    spec = bwd_spec(*qkv(H=3, L=16, S=16, B=2))
    assert spec.inputs[5].stride == (48, 1, 3) and spec.outputs[0].stride == (384, 8, 24, 1)
    assert_valid(FAMILY, spec, tmp_path, small(), seeds=(0,))


def sdpa_spec(q, k, v, **kw) -> KernelSpec:
    return spec_of(SDPA, (q, k, v), kw)


@pytest.mark.parametrize("case", ["bool_mask", "float_mask", "enable_gqa", "rank3_causal", "value_dim"])
def test_scaled_dot_product_attention(case, tmp_path):
    q, k, v = qkv()
    if case == "bool_mask":
        spec = sdpa_spec(q, k, v, attn_mask=torch.rand(24, 20) < 0.6)
    elif case == "float_mask":
        spec = sdpa_spec(q, k, v, attn_mask=torch.randn(1, 2, 24, 20), scale=0.5)
    elif case == "enable_gqa":
        spec = sdpa_spec(*qkv(H=4, Hkv=2), enable_gqa=True)
    elif case == "rank3_causal":
        spec = sdpa_spec(*(t[0] for t in qkv()), is_causal=True)
    else:   # the math kernel admits a value head dim of its own (the CPU flash op does not)
        spec = sdpa_spec(*qkv(E=16, Ev=5))
    assert len(spec.outputs) == 1
    assert_valid(FAMILY, spec, tmp_path, small(), seeds=(0,))


def test_fully_masked_rows_give_zero_like_aten(tmp_path):
    """Rows whose every key is masked: out 0, logsumexp 0 (ATen's CPU kernel); the gradients 0."""
    q, k, v = qkv(L=16, S=16)
    mask = torch.zeros(16, 16)
    mask[3] = float("-inf")
    spec = fwd_spec(q, k, v, mask=mask)
    assert_valid(FAMILY, spec, tmp_path, small(), seeds=(0,), kinds=("special",))
    assert_valid(FAMILY, bwd_spec(q, k, v, mask=mask), tmp_path, small(), seeds=(0,), kinds=("special",))


@pytest.mark.parametrize("name", ["forward", "backward"])
def test_every_seed_config_validates(name, tmp_path):
    spec = (fwd_spec if name == "forward" else bwd_spec)(*qkv(L=40, S=40, H=1), causal=True)
    configs = FAMILY.seed_configs(spec)
    assert 1 <= len(configs) <= 5
    for config in configs:
        assert_valid(FAMILY, spec, tmp_path, config, seeds=(0,), eager=config is configs[0], kinds=())
    for n in FAMILY.neighbours(spec, configs[0]):
        FAMILY.generate(spec, n)


def _broken(program, old: str, new: str):
    assert old in program.source, program.source
    return dataclasses.replace(program, source=program.source.replace(old, new, 1))


@pytest.mark.parametrize("what", ["causal_bound", "rescale", "lse", "delta", "gqa_head"])
def test_broken_programs_fail_validation(what, tmp_path):
    if what in ("causal_bound", "rescale", "lse"):
        spec = fwd_spec(*qkv(L=32, S=32), causal=True)
    elif what == "delta":
        spec = bwd_spec(*qkv(L=32, S=32))
    else:
        spec = fwd_spec(*qkv(H=4, Hkv=2))
    program = FAMILY.generate(spec, small())
    bad = {
        "causal_bound": lambda: _broken(program, "(rn[None, :] <= rm[:, None])", "(rn[None, :] <= rm[:, None] + 1)"),
        "rescale": lambda: _broken(program, "acc = acc * alpha[:, None] +", "acc = acc +"),
        "lse": lambda: _broken(program, "* 0.6931471805599453", "* 0.69"),
        "delta": lambda: _broken(program, "dst = pt * (dpt - delta[None, :])", "dst = pt * dpt"),
        "gqa_head": lambda: _broken(program, "hk = h // 2", "hk = h % 2"),
    }[what]()
    rec = run_validation(FAMILY, spec, bad, tmp_path, seeds=(0,), kinds=())
    assert not rec.ok and rec.reason


def test_refusals():
    q, k, v = qkv()
    ok = fwd_spec(q, k, v)
    assert FAMILY.supports(ok) is None
    with_dropout = dataclasses.replace(ok, args=ok.args[:3] + [0.1] + ok.args[4:])
    assert "dropout" in FAMILY.supports(with_dropout)
    f64 = fwd_spec(*(t.double() for t in (q, k, v)))
    assert "fp32/fp16/bf16" in FAMILY.supports(f64)
    assert "head dims" in FAMILY.supports(fwd_spec(*qkv(E=300, L=4, S=4)))
    gqa = sdpa_spec(*qkv(H=4, Hkv=2), enable_gqa=True)
    assert FAMILY.supports(gqa) is None
    assert "enable_gqa is off" in FAMILY.supports(dataclasses.replace(gqa, kwargs={}))
    five_d = spec_of(SDPA, tuple(t.unsqueeze(0) for t in (q, k, v)), {})
    assert "ranks" in FAMILY.supports(five_d)
    masked = fwd_spec(q, k, v, mask=torch.randn(24, 20))
    assert FAMILY.supports(masked) is None
    with_meta = lambda spec, i, **kw: dataclasses.replace(
        spec, inputs=spec.inputs[:i] + (dataclasses.replace(spec.inputs[i], **kw),) + spec.inputs[i + 1:])
    assert "attn_mask dtype" in FAMILY.supports(with_meta(masked, 3, dtype="int32"))
    assert "only scaled_dot_product_attention" in FAMILY.supports(with_meta(masked, 3, dtype="bool"))
    assert "does not broadcast" in FAMILY.supports(with_meta(masked, 3, shape=(24, 3), stride=(3, 1)))
    causal_masked = dataclasses.replace(masked, args=masked.args[:4] + [True])
    assert "is_causal with an attn_mask" in FAMILY.supports(causal_masked)
    # the math op returns the attention weights too, and the CUDA ops rng state: not this family's
    assert FAMILY.supports(spec_of(aten._scaled_dot_product_attention_math.default, (q, k, v)))
    assert FAMILY.supports(spec_of(aten.mm.default, (torch.randn(4, 4), torch.randn(4, 4))))


def test_registry():
    assert family_for(fwd_spec(*qkv())) is FAMILY
    assert family_for(bwd_spec(*qkv())) is FAMILY
    assert family_for(sdpa_spec(*qkv())) is FAMILY


def test_compiles_for_sm90(tmp_path):
    """Llama-sized heads on the H200: bf16 causal with GQA (forward and backward), fp16 with a
    float mask, fp32; every seed config of the first compiles to a cubin."""
    with FakeTensorMode():
        q, k = torch.empty(2, 32, 1024, 128, dtype=BF16), torch.empty(2, 8, 1024, 128, dtype=BF16)
        h = torch.empty(2, 16, 512, 64, dtype=F16)
        mask = torch.empty(2, 1, 512, 512, dtype=F16)
        f = torch.empty(1, 8, 256, 64)
        fwd = fwd_spec(q, k, k, causal=True)
        bwd = bwd_spec(q, k, k, causal=True)
        masked = fwd_spec(h, h, h, mask=mask)
        fp32 = bwd_spec(f, f, f)
    for config in FAMILY.seed_configs(fwd):
        compile_sm90(fwd, FAMILY.generate(fwd, config), tmp_path)
    for spec in (bwd, masked, fp32):
        compile_sm90(spec, FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]), tmp_path)


def test_offsets_past_int32_use_int64_indices(tmp_path):
    """2^31 query elements: batch/head and row indices are int64 (an int32 offset would wrap)."""
    with FakeTensorMode():
        q = torch.empty(1, 16, 1 << 20, 128, dtype=BF16)
        long = fwd_spec(q, q, q, causal=True)
        short = fwd_spec(*(torch.empty(1, 16, 1024, 128, dtype=BF16) for _ in range(3)), causal=True)
    program = FAMILY.generate(long, FAMILY.seed_configs(long)[0])
    assert "bh = tl.program_id(1).to(tl.int64)" in program.source
    assert "tl.arange(0, BLOCK_M).to(tl.int64)" in program.source
    assert "int64" not in FAMILY.generate(short, FAMILY.seed_configs(short)[0]).source
    compile_sm90(long, program, tmp_path)


def test_attention_without_dropout_is_not_random():
    """The ops are tagged seeded (for dropout); with dropout_p == 0 they draw nothing, so the
    planner may serve them from the cache."""
    from torch_kernelize.compiling.op_classes import is_random
    assert not is_random(FWD, ("q", "k", "v")) and not is_random(FWD, ("q", "k", "v", 0.0, True))
    assert not is_random(SDPA, ("q", "k", "v"), {"dropout_p": 0.0})
    assert is_random(FWD, ("q", "k", "v", 0.1)) and is_random(SDPA, ("q", "k", "v"), {"dropout_p": 0.5})
    assert is_random(aten.native_dropout.default, ("x", 0.0, True))   # no dropout_p: random as tagged
    assert not is_random(BWD, ())
