"""The indexing family on the Triton interpreter: x[idx], index_select, embedding, gather,
index_add, scatter_add and index_put over dtypes, dims, index dtypes and strided layouts; validated against
the float64 reference, compared with eager; the MoE routing ops taken from a real (functionalized)
MoE graph; refusals; broken programs fail; sm_90 compiles."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kernel_testing import assert_valid, compare_eager, compile_sm90, load, run_validation, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.base import Config
from torch_kernelize.lowering.kernels.indexing import FAMILY
from torch_kernelize.core.spec import KernelSpec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/inf edge values

aten = torch.ops.aten
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def rnd(*shape, dtype=F32):
    return torch.randn(shape).to(dtype)


def ix(high, *shape, dtype=torch.int64):
    return torch.randint(0, high, shape, dtype=dtype)


CASES = {
    # name: (op, args, kwargs)
    "index_rows": lambda dt: (aten.index.Tensor, (rnd(10, 24, dtype=dt), [ix(10, 13)]), {}),
    "index_rows_i32_2d": lambda dt: (aten.index.Tensor, (rnd(10, 24, dtype=dt), [ix(10, 3, 4, dtype=torch.int32)]), {}),
    "index_dim1": lambda dt: (aten.index.Tensor, (rnd(6, 9, 5, dtype=dt), [None, ix(9, 7)]), {}),
    "index_transposed": lambda dt: (aten.index.Tensor, (rnd(24, 10, dtype=dt).t(), [ix(10, 6)]), {}),
    "index_select_0": lambda dt: (aten.index_select.default, (rnd(12, 20, dtype=dt), 0, ix(12, 9)), {}),
    "index_select_last": lambda dt: (aten.index_select.default, (rnd(7, 20, dtype=dt), -1, ix(20, 11, dtype=torch.int32)), {}),
    "embedding": lambda dt: (aten.embedding.default, (rnd(30, 16, dtype=dt), ix(30, 3, 5)), {}),
    "gather_last": lambda dt: (aten.gather.default, (rnd(9, 16, dtype=dt), 1, ix(16, 9, 4)), {}),
    "gather_dim0_sliced": lambda dt: (aten.gather.default, (rnd(9, 16, dtype=dt)[:, ::2], 0, ix(9, 5, 8)), {}),
    "index_add_rows": lambda dt: (aten.index_add.default, (rnd(8, 24, dtype=dt), 0, ix(8, 12), rnd(12, 24, dtype=dt)), {}),
    "index_add_alpha_dim1": lambda dt: (aten.index_add.default,
                                        (rnd(6, 10, dtype=dt), 1, ix(10, 7, dtype=torch.int32), rnd(6, 7, dtype=dt)),
                                        {"alpha": 0.5}),
    "scatter_add": lambda dt: (aten.scatter_add.default, (rnd(8, 12, dtype=dt), 0, ix(8, 6, 12), rnd(7, 12, dtype=dt)), {}),
    "scatter_add_last_strided": lambda dt: (aten.scatter_add.default,
                                            (rnd(12, 8, dtype=dt).t(), 1, ix(12, 8, 5), rnd(8, 9, dtype=dt)), {}),
    "index_put_rows": lambda dt: (aten.index_put.default, (rnd(12, 24, dtype=dt), [torch.randperm(12)[:9]],
                                                           rnd(9, 24, dtype=dt)), {}),
    "index_put_dim1_2d_broadcast": lambda dt: (aten.index_put.default,
                                               (rnd(5, 9, 6, dtype=dt), [None, ix(9, 2, 3, dtype=torch.int32)],
                                                rnd(6, dtype=dt)), {}),
    "index_put_accumulate": lambda dt: (aten.index_put.default, (rnd(8, 24, dtype=dt).t(), [None, ix(8, 12)],
                                                                 rnd(24, 12, dtype=dt), True), {}),
}


def _interpretable(spec, config) -> bool:
    """The interpreter has no bf16 atomics: the "direct" bf16 scatter-adds only compile (sm_90)."""
    return not (config.get("VARIANT") == "direct" and spec.outputs[0].dtype == "bfloat16"
                and spec.op in ("aten.index_add.default", "aten.scatter_add.default", "aten.index_put.default"))


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_seed_config(case, dtype, tmp_path):
    op, args, kwargs = CASES[case](dtype)
    spec = spec_of(op, args, kwargs)
    assert family_for(spec) is FAMILY
    configs = FAMILY.seed_configs(spec)
    for config in configs:
        if _interpretable(spec, config):
            assert_valid(FAMILY, spec, tmp_path, config, seeds=(0, 1))
        else:
            compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)
        for n in FAMILY.neighbours(spec, config):
            FAMILY.generate(spec, n)
    if FAMILY.plan(spec).accumulate and not FAMILY.plan(spec).overwrite and dtype != F32:
        assert {c["VARIANT"] for c in configs} == {"direct", "fp32"}


@pytest.mark.parametrize("op", [aten.index_add.default, aten.scatter_add.default], ids=str)
def test_accumulation_into_a_donated_buffer_skips_the_copy(op, tmp_path):
    # reinplace.py hands a dead ``self`` to the kernel: the same sums, in that buffer, one launch
    out = rnd(12, 6)
    args = (out, 0, ix(12, 5), rnd(5, 6)) if op == aten.index_add.default else (out, 0, ix(12, 5, 6), rnd(5, 6))
    spec = spec_of(op, args)
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    assert [(d.out, d.input, d.skip) for d in program.donations] == [(0, 0, (0,))]
    assert program.launches[0].kernel == "clone_kernel"
    runner = load(tmp_path, spec, program)
    donating = runner.donating()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    want = runner(*tensors)
    buf = tensors[0].clone()
    got = donating(buf, *tensors[1:])
    assert got is buf and donating._keep == [1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(runner(*tensors), want, rtol=0, atol=0)  # the original still copies


def test_no_donation_when_self_has_another_layout_or_an_fp32_accumulator():
    out = rnd(6, 12).t()  # a transposed ``self``: the output is allocated contiguous
    spec = spec_of(aten.index_add.default, (out, 0, ix(12, 5), rnd(5, 6)))
    assert spec.inputs[0] != spec.outputs[0]
    assert not FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]).donations
    spec = spec_of(aten.index_add.default, (rnd(12, 6, dtype=F16), 0, ix(12, 5), rnd(5, 6, dtype=F16)))
    fp32 = next(c for c in FAMILY.seed_configs(spec) if c["VARIANT"] == "fp32")
    assert not FAMILY.generate(spec, fp32).donations


def test_integer_values_and_small_tiles(tmp_path):
    x = torch.randint(-100, 100, (9, 12))
    spec = spec_of(aten.index_select.default, (x, 0, ix(9, 5)))
    assert_valid(FAMILY, spec, tmp_path, Config.of(BLOCK_R=2, BLOCK_D=4, num_warps=1))   # several tiles each way
    spec = spec_of(aten.gather.default, (x.int(), 1, ix(12, 9, 7)))
    assert_valid(FAMILY, spec, tmp_path, Config.of(BLOCK=32, num_warps=1))


def test_negative_indices_wrap_for_index_tensor(tmp_path):
    x = rnd(10, 6)
    idx = torch.tensor([-1, 0, -10, 9, -3, 2])
    spec = spec_of(aten.index.Tensor, (x, [idx]))
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    compare_eager(FAMILY, spec, program, tmp_path, exact=True, inputs=[x, idx])
    # sample_inputs draws negative ones too, for this op only
    drawn = FAMILY.sample_inputs(spec, 0)[1]
    assert drawn.min() >= -10 and drawn.max() < 10
    sel = spec_of(aten.index_select.default, (x, 0, idx.abs().clamp(max=9)))
    assert FAMILY.sample_inputs(sel, 0)[1].min() >= 0


def test_out_of_range_index_never_reads_out_of_bounds(tmp_path):
    """ATen raises; the kernel cannot: the row reads NaN (never memory outside the tensor) and a
    flag is set, which the call turns into eager's IndexError."""
    from torch_kernelize.core.errors import IndexOutOfRange
    x = rnd(5, 8)
    idx = torch.tensor([0, 7, 4, -9])
    spec = spec_of(aten.index.Tensor, (x, [torch.tensor([0, 1, 4, 2])]))
    runner = load(tmp_path, spec, FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]))
    outs, temps = runner.allocate(torch.device("cpu"), poison=True)
    runner.launch([x, idx], outs, temps)
    out = outs[0]
    assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[4])
    assert out[1].isnan().all() and out[3].isnan().all()
    assert temps[-1].item() == 1
    with pytest.raises(IndexError):
        x[idx]
    with pytest.raises(IndexOutOfRange, match="out of bounds"):
        runner(x, idx)
    runner(x, torch.tensor([0, 4, -5, 2]))  # valid again: the flag is the call's own


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_index_put_inverts_a_permutation(dtype, tmp_path):
    """MoE's ``inv_perm[perm] = arange(S)`` on integers: exact, every element written once; negative
    indices wrap; sample_inputs draws distinct indices (of both signs)."""
    perm = torch.randperm(64)
    spec = spec_of(aten.index_put.default, (torch.empty(64, dtype=dtype), [perm], torch.arange(64, dtype=dtype)))
    assert family_for(spec) is FAMILY
    program = assert_valid(FAMILY, spec, tmp_path, seeds=(0, 1))
    assert "tl.atomic_add" not in program.source
    inputs = [torch.full((64,), -5, dtype=dtype), perm - 64 * (torch.arange(64) % 2), torch.arange(64, dtype=dtype)]
    out = load(tmp_path, spec, program).run_poisoned(inputs)[0]
    assert torch.equal(out, torch.argsort(perm).to(dtype))
    drawn = FAMILY.sample_inputs(spec, 3)[1]
    assert (drawn % 64).unique().numel() == 64 and drawn.min() < 0


def test_index_put_rows_with_small_tiles_and_an_invalid_index(tmp_path):
    """Several tiles each way; an index out of range writes nothing (ATen raises, and so does the
    call, from the kernel's flag), the rest land."""
    from torch_kernelize.core.errors import IndexOutOfRange
    x, v = rnd(10, 12), rnd(4, 12)
    spec = spec_of(aten.index_put.default, (x, [torch.tensor([3, 0, 7, 9])], v))
    program = FAMILY.generate(spec, Config.of(BLOCK_R=2, BLOCK_D=4, num_warps=1))
    compare_eager(FAMILY, spec, program, tmp_path, exact=True, inputs=[x, torch.tensor([3, -10, 7, 9]), v])
    runner = load(tmp_path, spec, program)
    with pytest.raises(IndexOutOfRange):
        runner.run_poisoned([x, torch.tensor([3, 10, -11, 9]), v])
    outs, temps = runner.allocate(torch.device("cpu"), poison=True)
    runner.launch([x, torch.tensor([3, 10, -11, 9]), v], outs, temps)
    out = outs[0]
    assert torch.equal(out[3], v[0]) and torch.equal(out[9], v[3])
    assert torch.equal(out[[0, 1, 2, 4, 5, 6, 7, 8]], x[[0, 1, 2, 4, 5, 6, 7, 8]])


def test_repeated_indices_accumulate(tmp_path):
    """Every row added at the same index: the atomics must sum them all (exact for small ints)."""
    self_ = torch.zeros(4, 16)
    src = torch.arange(10 * 16, dtype=F32).reshape(10, 16) % 7
    idx = torch.full((10,), 2)
    spec = spec_of(aten.index_add.default, (self_, 0, idx, src))
    for config in FAMILY.seed_configs(spec):
        compare_eager(FAMILY, spec, FAMILY.generate(spec, config), tmp_path, exact=True, inputs=[self_, idx, src])


def _moe_graph_specs(tokens=32, experts=4, k=2, d=16):
    """KernelSpecs of the routing ops of a functionalized MoE forward (torch_kernelize.model_zoo.MoE)."""
    def routing(x, logits, h):
        probs = logits.float().softmax(-1)
        topw, topi = probs.topk(k, -1)
        counts = torch.histc(topi.float(), bins=experts, min=0, max=experts - 1)
        offsets = counts.cumsum(0)
        order = topi.flatten().argsort()
        tok = order // k
        xs = x[tok]
        out = torch.zeros_like(x)
        out.index_add_(0, tok, h * topw.flatten()[order].unsqueeze(-1))
        return xs, out, offsets

    from torch.func import functionalize
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(tokens, d, generator=g), torch.randn(tokens, experts, generator=g),
            torch.randn(tokens * k, d, generator=g))
    gm = make_fx(functionalize(routing))(*args)
    wanted = {"aten.topk.default", "aten.histc.default", "aten.cumsum.default", "aten.index.Tensor",
              "aten.index_add.default"}
    specs = {}

    class Capture(torch.fx.Interpreter):
        def call_function(self, target, a, kw):
            out = super().call_function(target, a, kw)
            if isinstance(target, torch._ops.OpOverload):
                spec = KernelSpec.from_call(target, a, kw, out)
                if spec.op in wanted:
                    specs.setdefault(spec.op, []).append(spec)
            return out

    Capture(gm).run(*args)
    return specs


def test_moe_graph_specs(tmp_path):
    specs = _moe_graph_specs()
    assert set(specs) == {"aten.topk.default", "aten.histc.default", "aten.cumsum.default", "aten.index.Tensor",
                          "aten.index_add.default"}, set(specs)
    assert any(s.inputs[0].shape == (32, 16) for s in specs["aten.index.Tensor"])   # xs = x[tok]
    for name, group in specs.items():
        for spec in group:
            family = family_for(spec)
            assert family is not None, spec.describe()
            for config in family.seed_configs(spec)[:2]:
                assert_valid(family, spec, tmp_path, config, seeds=(0,))


def test_moe_sizes_compile_for_sm90(tmp_path):
    """The H200 MoE shapes (T4096 d1024 E16 top4, fp16): every seed config compiles."""
    x = torch.empty(4096, 1024, dtype=F16)
    tok = torch.empty(16384, dtype=torch.int64)
    h = torch.empty(2000, 1024, dtype=F16)
    specs = [KernelSpec.from_call(aten.index.Tensor, (x, [tok]), {}, torch.empty(16384, 1024, dtype=F16)),
             KernelSpec.from_call(aten.index_add.default, (x, 0, tok[:2000], h), {}, x),
             KernelSpec.from_call(aten.index_add.default, (x.bfloat16(), 0, tok[:2000], h.bfloat16()), {},
                                  x.bfloat16()),
             KernelSpec.from_call(aten.gather.default, (torch.empty(4096, 16), 1, tok[:16384].view(4096, 4)), {},
                                  torch.empty(4096, 4))]
    for spec in specs:
        assert FAMILY.supports(spec) is None, spec.describe()
        for config in FAMILY.seed_configs(spec):
            compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)


@pytest.mark.parametrize("what", ["atomic_to_store", "alpha", "gather_offset", "index_stride", "put_no_wrap"])
def test_broken_programs_fail_validation(what, tmp_path):
    if what == "atomic_to_store":   # a plain store loses the adds of repeated indices
        spec = spec_of(aten.index_add.default, (rnd(4, 16), 0, ix(4, 12), rnd(12, 16)))
    elif what == "alpha":
        spec = spec_of(aten.index_add.default, (rnd(6, 10), 1, ix(10, 7), rnd(6, 7)), {"alpha": 0.5})
    elif what == "gather_offset":
        spec = spec_of(aten.gather.default, (rnd(9, 16), 1, ix(16, 9, 4)))
    elif what == "put_no_wrap":   # negative indices would write nothing
        spec = spec_of(aten.index_put.default, (rnd(12, 8), [torch.randperm(12)], rnd(12, 8)))
    else:
        spec = spec_of(aten.embedding.default, (rnd(30, 16), ix(30, 3, 5)))
    program = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0])
    old, new = {"atomic_to_store": ("tl.atomic_add(dst_ptr + ", "tl.store(dst_ptr + "),
                "alpha": ("v * 0.5", "v * 0.25"),
                "gather_offset": ("src_off = k0 * 16", "src_off = k0 * 15"),
                "index_stride": ("i * 16", "i * 8"),
                "put_no_wrap": ("i = tl.where(i < 0, i + 12, i)", "i = i")}[what]
    assert old in program.source, program.source
    source = program.source.replace(old, new)
    if what == "atomic_to_store":
        source = source.replace(', sem="relaxed")', ")")
    bad = dataclasses.replace(program, source=source)
    rec = run_validation(FAMILY, spec, bad, tmp_path, seeds=(0,))
    assert not rec.ok and rec.reason


def test_refusals():
    x = rnd(6, 4)
    assert "bool" in FAMILY.supports(spec_of(aten.index.Tensor, (x, [torch.tensor([True, False] * 3)])))
    assert "one index tensor" in FAMILY.supports(spec_of(aten.index.Tensor, (x, [ix(6, 2), ix(4, 2)])))
    assert "float64" in FAMILY.supports(spec_of(aten.index_select.default, (x.double(), 0, ix(6, 2))))
    assert "empty" in FAMILY.supports(spec_of(aten.index_select.default, (x, 0, ix(6, 0))))
    assert "int64" in FAMILY.supports(spec_of(aten.index_add.default, (x.long(), 0, ix(6, 2), torch.ones(2, 4).long())))
    assert FAMILY.supports(spec_of(aten.add.Tensor, (x, x))) is not None
    assert "written twice" in FAMILY.supports(spec_of(aten.index_put.default, (x, [ix(6, 7)], rnd(7, 4))))
    assert FAMILY.supports(spec_of(aten.index_put.default, (x, [ix(6, 7)], rnd(7, 4), True))) is None
    assert "one index tensor" in FAMILY.supports(spec_of(aten.index_put.default, (x, [ix(6, 2), ix(4, 2)], rnd(2))))
    assert "int64" in FAMILY.supports(spec_of(aten.index_put.default, (x.long(), [ix(6, 2)], torch.ones(2, 4).long(), True)))


def _one(*shape, dtype=torch.int64):
    return torch.zeros(shape, dtype=dtype)  # the only valid index into a dim of size 1


TINY = {
    # gather/scatter_add of one index element, of 0-d tensors, and 0-d mixed with one-element 1-d
    # ones (nanmedian, quantile, multi_margin_loss and index_reduce decompose to these): every
    # offset of the index walk folds to "0", so the pointers must be made blocks like the values
    "gather_1": lambda dt: (aten.gather.default, (rnd(1, dtype=dt), 0, _one(1))),
    "gather_1x1_of_3x1": lambda dt: (aten.gather.default, (rnd(3, 1, dtype=dt), 0, ix(3, 1, 1))),
    "gather_one_of_4x5": lambda dt: (aten.gather.default, (rnd(4, 5, dtype=dt), 1, ix(5, 1, 1, dtype=torch.int32))),
    "gather_0d": lambda dt: (aten.gather.default, (rnd(dtype=dt), 0, _one())),
    "gather_0d_dim_minus_1": lambda dt: (aten.gather.default, (rnd(dtype=dt), -1, _one(dtype=torch.int32))),
    "gather_0d_self_1d_index": lambda dt: (aten.gather.default, (rnd(dtype=dt), 0, _one(1))),
    "gather_1d_self_0d_index": lambda dt: (aten.gather.default, (rnd(1, dtype=dt), 0, _one())),
    "scatter_add_1": lambda dt: (aten.scatter_add.default, (rnd(1, dtype=dt), 0, _one(1), rnd(1, dtype=dt))),
    "scatter_add_one_into_5": lambda dt: (aten.scatter_add.default, (rnd(5, dtype=dt), 0, ix(5, 1), rnd(1, dtype=dt))),
    "scatter_add_1x1": lambda dt: (aten.scatter_add.default, (rnd(1, 1, dtype=dt), 1, _one(1, 1), rnd(1, 1, dtype=dt))),
    "scatter_add_0d": lambda dt: (aten.scatter_add.default, (rnd(dtype=dt), 0, _one(), rnd(dtype=dt))),
    "scatter_add_0d_self_1d_index": lambda dt: (aten.scatter_add.default, (rnd(dtype=dt), 0, _one(1), rnd(1, dtype=dt))),
}


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("case", list(TINY))
def test_zero_dim_and_one_element(case, dtype, tmp_path):
    """Every seed config against the float64 reference (and eager) on the interpreter, which
    refuses a block value or mask at a scalar pointer ('... cannot be block type if pointer
    argument is not a block')."""
    op, args = TINY[case](dtype)
    spec = spec_of(op, args)
    assert family_for(spec) is FAMILY, FAMILY.supports(spec)
    for config in FAMILY.seed_configs(spec):
        if _interpretable(spec, config):
            program = assert_valid(FAMILY, spec, tmp_path, config, seeds=(0, 1))
            assert "* 0," in program.source or "* 0)" in program.source  # the block of one address
        else:
            compile_sm90(spec, FAMILY.generate(spec, config), tmp_path)


def test_offsets_of_larger_walks_are_unchanged():
    """Only an offset with no term becomes a block of one address (``e * 0``): a gather whose
    index walk has dims keeps its offsets as they were; one of one index element stores there."""
    spec = spec_of(aten.gather.default, (rnd(9, 16), 1, ix(16, 9, 4)))
    src = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]).source
    assert "v = tl.load(src_ptr + src_off + i, mask=ok" in src and "tl.store(dst_ptr + e, v, mask=mask)" in src
    spec = spec_of(aten.gather.default, (rnd(1), 0, _one(1)))
    src = FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]).source
    assert "v = tl.load(src_ptr + i, mask=ok" in src and "tl.store(dst_ptr + e * 0, v, mask=mask)" in src


def test_zero_dim_values_of_the_rows_ops_stay_refused():
    assert "0-d values" in FAMILY.supports(spec_of(aten.index_select.default, (rnd(), 0, _one(1))))
