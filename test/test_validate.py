"""Validation rules: tolerances, NaN/inf handling, poisoned outputs, edge trials the vendor misses."""
from __future__ import annotations

import math

import torch

from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.validate import compare, validate

aten = torch.ops.aten


def _spec(op, *args):
    return KernelSpec.from_call(op, list(args), {}, op(*args))


def test_nan_only_where_the_reference_has_nan():
    ref = torch.tensor([1.0, float("nan"), 3.0], dtype=torch.float64)
    assert compare(torch.tensor([1.0, float("nan"), 3.0]), ref).ok
    assert not compare(torch.tensor([1.0, 2.0, 3.0]), ref).ok
    bad = compare(torch.tensor([float("nan"), float("nan"), 3.0]), ref)
    assert not bad.ok and "unexpected NaN" in bad.reason


def test_infinities_must_match_with_their_sign():
    ref = torch.tensor([math.inf, -1.0], dtype=torch.float64)
    assert compare(torch.tensor([math.inf, -1.0]), ref).ok
    assert not compare(torch.tensor([-math.inf, -1.0]), ref).ok


def test_tolerance_by_dtype_and_scale():
    ref = torch.tensor([1000.0, 1.0], dtype=torch.float64)
    assert compare(torch.tensor([1000.0, 1.05], dtype=torch.float16), ref).ok  # atol scales with max|ref|
    assert compare(torch.tensor([1000.0, 1.05], dtype=torch.float32), ref).ok  # 0.05 < 1e-4 * 1000
    assert not compare(torch.tensor([1000.0, 1.5], dtype=torch.float32), ref).ok


def test_an_unwritten_output_fails_through_the_poison():
    x = torch.randn(8)
    spec = _spec(aten.relu.default, x)

    def lazy(inputs):  # writes only half of its (poisoned) output
        out = torch.full((8,), float("nan"))
        out[:4] = inputs[0][:4].relu()
        return (out,)

    rec = validate(lazy, spec, lambda s, seed, kind, dev: [torch.randn(8, generator=torch.Generator().manual_seed(seed))])
    assert not rec.ok and "unexpected NaN" in rec.reason


def test_edge_trials_the_vendor_also_misses_are_judged_against_the_vendor():
    import dataclasses

    x = torch.randn(64, dtype=torch.float16)
    base = _spec(aten.tanh.default, x)

    @dataclasses.dataclass(frozen=True)
    class Spec(KernelSpec):
        def reference(self, tensors, device="cpu"):
            # a float64 reference that, on the edge trial only, no fp16 computation reaches
            ref = super().reference(tensors, device)
            return tuple(r + 1.0 for r in ref) if tensors[0].abs().max() > 100 else ref

    spec = Spec(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})

    def sample(s, seed, kind, dev):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(64, generator=g) * (1e3 if kind == "large" else 1.0)).half()]

    def like_vendor(inputs):
        return (torch.tanh(inputs[0]),)

    rec = validate(like_vendor, spec, sample, edge_kinds=("large",))
    assert rec.ok and rec.vendor_judged == ["large"], rec
    # the elementwise bar against the vendor output is waived there: the vendor output is the bar
    rec = validate(like_vendor, spec, sample, edge_kinds=("large",), elementwise_bar=True)
    assert rec.ok and rec.vendor_judged == ["large"] and rec.elementwise_waived == ["large"], rec
    assert rec.elementwise == {"float16": [1e-2, 1e-2]}

    def off_on_large(inputs):  # right on normal trials, but not what the vendor does on the edge trial
        out = like_vendor(inputs)[0]
        return (out * 0.5 if inputs[0].abs().max() > 100 else out,)

    rec = validate(off_on_large, spec, sample, edge_kinds=("large",))
    assert not rec.ok and "large" in rec.reason

    def off_on_random(inputs):  # random trials are always judged against the reference
        return (like_vendor(inputs)[0] + 0.1,)

    assert not validate(off_on_random, spec, sample, edge_kinds=("large",)).ok


def test_either_rounding_at_the_overflow_threshold_is_right():
    # 65530 rounds to inf in fp16 while an fp32 sum in another order may give 65500 -> 65504.
    ref = torch.tensor([65530.0, -65530.0, 65500.0, 1e6], dtype=torch.float64)
    h = torch.float16
    assert compare(torch.tensor([65504.0, -65504.0, 65504.0, math.inf], dtype=h), ref).ok
    assert compare(torch.tensor([math.inf, -math.inf, math.inf, math.inf], dtype=h), ref).ok
    assert not compare(torch.tensor([-math.inf, -65504.0, 65504.0, math.inf], dtype=h), ref).ok  # sign
    assert not compare(torch.tensor([65504.0, -65504.0, 65504.0, 65504.0], dtype=h), ref).ok  # far over
    assert not compare(torch.tensor([60000.0, -65504.0, 65504.0, math.inf], dtype=h), ref).ok  # too far


def test_factor_widens_both_tolerances():
    ref = torch.tensor([1.0], dtype=torch.float64)
    out = torch.tensor([1.0 + 1.5e-4])  # fp32: atol 1e-4 + rtol 1e-4 -> 2e-4 at 1.0
    assert compare(out, ref).ok
    out = torch.tensor([1.0 + 3e-4])
    assert not compare(out, ref).ok and compare(out, ref, factor=2.0).ok


def test_a_region_is_judged_by_the_values_it_rounds():
    # mm in fp16 read back as fp32: the fp32 output carries the fp16 matmul's rounding.
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_kernelize.compiling.regions import find_regions, region_spec
    from torch_kernelize.core.targets import get_target
    from torch_kernelize.core.validate import compare_all

    a, b = torch.randn(64, 128, dtype=torch.half), torch.randn(128, 16, dtype=torch.half)
    gm = make_fx(lambda a, b: aten._to_copy.default(aten.mm.default(a, b), dtype=torch.float32))(a, b)
    regions = [r for r in find_regions(gm, get_target("interpreter")) if any(n.target == aten.mm.default for n in r.nodes)]
    assert regions, "mm -> float should form one region"
    spec = region_spec(regions[0], {})
    ref = spec.reference([a, b])
    eager = gm(a, b)  # what a correct kernel computes: the fp16 product, widened
    assert compare_all([eager], ref, spec).ok
    assert not compare(eager, ref[0], "region", torch.float32).ok  # judged as plain fp32, it would fail


def test_a_kernel_close_to_float64_only_at_the_scale_of_its_largest_value_fails_the_elementwise_bar():
    # An output whose largest value is 1000: the float64 bar allows 1e-4 * 1000 on every element,
    # so small elements 2e-4 off pass it; torch.allclose(out, eager, atol=1e-4, rtol=1e-4) fails.
    from torch_kernelize.core.validate import BY_ELEMENTWISE, BY_REFERENCE

    x = torch.randn(256)
    spec = _spec(aten.mul.Tensor, x, x)

    def sample(s, seed, kind, dev):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(256, generator=g)
        a[0] = 40.0  # 40 * 40 = 1600: a large output element
        return [a, a.clone()]

    def slightly_wrong(inputs):
        out = inputs[0] * inputs[1]
        return (torch.where(out.abs() < 1, out + 2e-4, out),)

    rec = validate(slightly_wrong, spec, sample)
    assert rec.ok and rec.decided_by == BY_REFERENCE and not rec.elementwise  # the bar is opt-in
    rec = validate(slightly_wrong, spec, sample, elementwise_bar=True)
    assert not rec.ok and rec.decided_by == BY_ELEMENTWISE, rec
    assert "vendor" in rec.reason and rec.elementwise == {"float32": [1e-4, 1e-4]}
    rec = validate(lambda inputs: (inputs[0] * inputs[1],), spec, sample, elementwise_bar=True)
    assert rec.ok and BY_ELEMENTWISE in rec.decided_by and rec.trials == 3


def test_streamed_comparison_judges_as_the_whole_tensor_does(monkeypatch):
    import torch_kernelize.core.validate as v

    ref = torch.randn(64, 33, dtype=torch.float64)
    ref[50, 3] = 900.0  # the scale (max |ref|) lies in a late block
    out = ref.float() + 0.05  # passes: 0.05 < 1e-4 * 900
    out[7, 7] = float("nan")
    whole = [compare(out, ref), compare(out[:, :20], ref[:, :20]), compare(out.t(), ref.t())]
    wrong = out.clone()
    wrong[7, 7] = ref[7, 7]
    wrong[60, 1] += 1.0  # out of tolerance, late
    whole.append(compare(wrong, ref))
    monkeypatch.setattr(v, "CHUNK_ELEMENTS", 100)
    monkeypatch.setattr(v, "MIN_CHUNK_ELEMENTS", 100)
    streamed = [compare(out, ref), compare(out[:, :20], ref[:, :20]), compare(out.t(), ref.t()), compare(wrong, ref)]
    assert [(c.ok, c.reason) for c in streamed] == [(c.ok, c.reason) for c in whole]
    assert "NaN mismatch: 1 unexpected" in streamed[0].reason
    assert not streamed[3].ok and "1 element(s)" in streamed[3].reason and "x900" in streamed[3].reason
    assert len(list(v._blocks(ref, 100))) > 20


def test_nothing_of_one_trial_is_held_into_the_next():
    import gc

    from kernel_testing import trial_holding_check
    x = torch.randn(32, 32)
    spec = _spec(aten.sigmoid.default, x)
    run, calls = trial_holding_check(lambda inputs: (torch.sigmoid(inputs[0]),))
    gc.disable()  # reference counting alone must free them
    try:
        rec = validate(run, spec, lambda s, seed, kind, dev: [torch.randn(32, 32)], edge_kinds=("zeros",),
                       elementwise_bar=True)
    finally:
        gc.enable()
    assert rec.ok and rec.trials == 4 and len(calls) == 8, rec


def test_an_element_nearer_the_exact_answer_than_eager_is_judged_against_the_exact_answer():
    # a*b - c*d in bf16: eager rounds both products before the subtraction, a fused kernel keeps
    # them in fp32 and rounds once. Where they cancel, eager is off the exact answer by more than
    # the bar (1e-2), so the right kernel is that far from eager: it passes, judged there against
    # float64 by the same bar; a kernel far from both still fails.
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_kernelize.compiling.regions import find_regions, region_spec
    from torch_kernelize.core.targets import get_target
    from torch_kernelize.core.validate import BY_ELEMENTWISE, BY_EXACT_NEARER, compare_elementwise

    bf = torch.bfloat16
    xs = [torch.randn(512, dtype=bf) for _ in range(4)]
    gm = make_fx(lambda a, b, c, d: aten.sub.Tensor(aten.mul.Tensor(a, b), aten.mul.Tensor(c, d)))(*xs)
    (region,) = find_regions(gm, get_target("interpreter"))
    spec = region_spec(region, {})

    def sample(s, seed, kind, dev):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(512, generator=g) * 4).to(bf) for _ in range(4)]

    def fused(inputs):
        a, b, c, d = (t.float() for t in inputs)
        return ((a * b - c * d).to(bf),)

    inputs = sample(spec, 0, "random", "cpu")
    assert not compare_elementwise(fused(inputs), spec.run_vendor(inputs), spec).ok  # eager's roundings
    rec = validate(fused, spec, sample, elementwise_bar=True)
    assert rec.ok and rec.decided_by.endswith(BY_ELEMENTWISE + BY_EXACT_NEARER), rec
    assert rec.elementwise_exact == ["random"] * 3

    def off(inputs):
        out = fused(inputs)[0].float()
        return ((out + 0.05 * out.sign()).to(bf),)

    rec = validate(off, spec, sample, elementwise_bar=True)
    assert not rec.ok and rec.decided_by == BY_ELEMENTWISE and "within it of the float64 reference" in rec.reason, rec


def test_an_edge_trial_at_the_bar_for_the_vendor_too_allows_twice_the_bar():
    # Mixtral's fp16 down projection on "large" inputs: cuBLAS inside the float64 bar by luck, a
    # right Triton kernel 2% past it. A vendor using more than half the bar on an edge trial makes
    # it judged against the reference at twice the bar; a vendor well inside it does not.
    import dataclasses

    from torch_kernelize.core.tolerances import tolerance

    base = _spec(aten.neg.default, torch.randn(64))
    atol, rtol = tolerance(torch.float32, "aten.neg.default")

    def off_by(x, share):  # -x with its element 3 moved by ``share`` of the float64 bar
        out = -x.double()
        scale = max(1.0, float(out.abs().max()))
        out[3] += share * (atol * scale + rtol * abs(float(out[3])))
        return out.float()

    def spec_with_vendor_at(share):
        @dataclasses.dataclass(frozen=True)
        class Spec(KernelSpec):
            def run_vendor(self, inputs):
                return (off_by(inputs[0], share if inputs[0].abs().max() > 100 else 0.0),)

            def reference(self, inputs, device="cpu"):
                return (-inputs[0].double(),)

        return Spec(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})

    def sample(s, seed, kind, dev):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(64, generator=g, dtype=torch.float64).float() * (1e3 if kind == "large" else 1.0)]

    def candidate(share):
        return lambda inputs: (off_by(inputs[0], share if inputs[0].abs().max() > 100 else 0.0),)

    rec = validate(candidate(1.05), spec_with_vendor_at(0.9), sample, edge_kinds=("large",))
    assert rec.ok and rec.at_the_bar == ["large"] and rec.vendor_judged == [], rec
    assert "twice the bar" in rec.decided_by
    assert not validate(candidate(2.5), spec_with_vendor_at(0.9), sample, edge_kinds=("large",)).ok
    rec = validate(candidate(1.05), spec_with_vendor_at(0.1), sample, edge_kinds=("large",))
    assert not rec.ok and "large" in rec.reason, rec
    # random trials keep the bar itself, wherever the vendor stands
    rec = validate(lambda inputs: (off_by(inputs[0], 1.05),), spec_with_vendor_at(0.9), sample,
                   edge_kinds=("large",))
    assert not rec.ok and "random" in rec.reason, rec


def test_an_edge_trials_cancelling_gemm_elements_are_judged_by_the_size_of_their_terms():
    # fp16 GEMM on "large" inputs (x1e3): its few finite outputs cancel terms ~1e3 times their size.
    # A vendor whose accumulation errs by 2e-5 of the terms (tensor cores) and a candidate erring by
    # 5e-5 (another order) both miss the float64 bar there; per unit of terms the candidate is
    # within TERMS_FACTOR of the vendor, so it passes; 1e-3 of the terms, a NaN, or no magnitudes
    # (a family whose outputs are not sums of products) fail.
    import dataclasses

    from torch_kernelize.core.validate import BY_TERMS
    from torch_kernelize.lowering.kernels.matmul import FAMILY

    base = _spec(aten.mm.default, torch.randn(64, 64).half(), torch.randn(64, 64).half())

    def off(inputs, share):  # the exact product, each finite element moved by ``share`` of its terms' size
        a, b = (t.double() for t in inputs)
        exact, terms = a @ b, a.abs() @ b.abs()
        moved = (exact + share * terms * torch.where(exact > 0, 1.0, -1.0)).clamp(-65504, 65504)
        return torch.where(exact.abs() < 65504, moved, exact).half()

    large = lambda inputs: bool(inputs[0].abs().max() > 100)  # noqa: E731

    @dataclasses.dataclass(frozen=True)
    class Spec(KernelSpec):
        def run_vendor(self, inputs):
            return (off(inputs, 2e-5 if large(inputs) else 0.0),)

        def reference(self, inputs, device="cpu"):  # (the base class's runs run_vendor in float64)
            return (inputs[0].double() @ inputs[1].double(),)

    spec = Spec(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})

    def sample(s, seed, kind, dev):
        g = torch.Generator().manual_seed(seed)
        scale = 1e3 if kind == "large" else 1.0
        return [(torch.randn(64, 64, generator=g, dtype=torch.float64) * scale).half(),
                (torch.randn(64, 64, generator=g, dtype=torch.float64) * scale).half()]

    def candidate(share, nan=False):
        def run(inputs):
            out = off(inputs, share if large(inputs) else 0.0)
            if nan and large(inputs):
                out[out.isfinite().nonzero()[0].tolist()[0], :1] = float("nan")
            return (out,)
        return run

    def judged(run, magnitudes=FAMILY.term_magnitudes):
        return validate(run, spec, sample, edge_kinds=("large",), magnitudes=magnitudes)

    assert not judged(candidate(5e-5), magnitudes=None).ok  # the bar alone: past it
    rec = judged(candidate(5e-5))
    assert rec.ok and rec.by_terms == ["large"] and BY_TERMS in rec.decided_by, rec
    wrong = judged(candidate(2e-4))  # 10x the vendor per unit of terms
    assert not wrong.ok and "out of tolerance" in wrong.reason, wrong
    assert not judged(candidate(5e-5, nan=True)).ok
    assert FAMILY.sums_products


def test_by_terms_takes_the_vendors_error_at_least_as_fp32s_roundoff():
    """A vendor that lands on the reference (unit 0) leaves the allowance at fp32's roundoff of the
    terms: an element cancelling terms 1e7 times its size is snapped within 4 * 2**-24 of them,
    not past; an element whose terms are its own size gets no more than that of itself."""
    from torch_kernelize.core.validate import ACCUMULATOR_ROUNDOFF, TERMS_FACTOR, _by_terms
    ref = torch.tensor([7208.0, 7208.0, 100.0], dtype=torch.float64)
    terms = torch.tensor([1.6e11, 1.6e11, 100.0], dtype=torch.float64)
    allowed = TERMS_FACTOR * ACCUMULATOR_ROUNDOFF * terms
    out = (ref + torch.stack([allowed[0] * 0.5, allowed[1] * 2, torch.tensor(0.01, dtype=torch.float64)])).float()
    (snapped,) = _by_terms([out], [ref], [ref.clone()], [terms])
    assert snapped[0] == 7208.0 and snapped[1] == out[1] and snapped[2] == out[2]
    assert allowed[2] < 1e-4  # (the last: 0.01 off its own terms' size is past the floor)
