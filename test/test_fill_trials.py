"""fill_cache's trials at real sizes: inputs drawn where they are used, what is kept where, the
trial count of a huge spec, the memory plan, and a reference let go before the vendor output."""
from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

import torch_kernelize.fill_cache.trials as trials
from kernel_testing import spec_of, trial_holding_check
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.lowering.kernels.base import sample_generator, sample_tensor
from torch_kernelize.lowering.kernels.elementwise import FAMILY
from torch_kernelize.core.targets import get_target
from torch_kernelize.core.spec import TensorMeta
from torch_kernelize.core.validate import DEFAULT_SEEDS, Trials, compare, validate

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
aten = torch.ops.aten


def _meta(shape, dtype=torch.float16, stride=None) -> TensorMeta:
    return TensorMeta.of(torch.empty_strided(shape, stride or torch.empty(shape).stride(), dtype=dtype))


@pytest.mark.parametrize("kind", ["random", "zeros", "large", "negative", "special"])
def test_device_draws_in_the_dtypes_precision_are_deterministic_per_seed(kind):
    """The draw a CUDA device makes (float32 working precision) on the CPU's generator: the same
    values for the same seed, others for another, each kind what it says, strides kept."""
    meta = _meta((64, 48), stride=(1, 64))  # a transposed layout
    draw = lambda seed: sample_tensor(meta, sample_generator(seed, "cpu"), kind, working=torch.float32)
    a, b, c = draw(3), draw(3), draw(4)
    assert a.dtype == torch.float16 and a.stride() == (1, 64)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    if kind == "zeros":
        assert not a.any()
        return
    assert not torch.equal(a.nan_to_num(), c.nan_to_num())
    if kind == "negative":
        assert bool((a < 0).all())
    if kind == "large":
        assert float(a.abs().max()) > 100
    if kind == "special":
        assert bool(a.isnan().any()) and bool(a.isinf().any())


def test_a_cpu_draw_keeps_the_values_validation_has_always_used():
    meta = _meta((16, 16), torch.float32)
    g = torch.Generator().manual_seed(5)
    old = torch.randn(256, generator=g, dtype=torch.float64).to(torch.float32).reshape(16, 16)
    assert torch.equal(sample_tensor(meta, sample_generator(5, "cpu")), old)


def test_inputs_drawn_again_meet_the_reference_computed_on_the_first_draw(monkeypatch):
    """Inputs not kept (drawn again for each candidate): the kept reference is still theirs."""
    spec = spec_of(aten.mul.Tensor, (torch.randn(40, 30), torch.randn(40, 30)))
    store = trials.TrialStore(spec, FAMILY.sample_inputs, "cpu", trials=2)
    place = store.place
    monkeypatch.setattr(store, "place", lambda size, on_device, seconds, inputs=False:
                        None if inputs else place(size, on_device, seconds))
    first = store.inputs(0, "random")
    ref = store.reference(0, "random", first)
    again = store.inputs(0, "random")
    assert again[0] is not first[0] and store.computed["inputs"] == 2
    assert store.reference(0, "random", again)[0] is ref[0] and store.computed["reference"] == 1
    assert torch.equal(spec.reference(again)[0], ref[0])
    assert store.computed["vendor"] == 1  # its verdict, computed with the reference


def test_what_is_cheaper_to_compute_again_than_to_move_is_not_kept(monkeypatch):
    spec = spec_of(aten.sigmoid.default, (torch.randn(1024, 1024),))  # 4 MiB in, 4 MiB out
    monkeypatch.setattr(trials, "available_host_memory", lambda: 1 << 40)
    store = trials.TrialStore(spec, FAMILY.sample_inputs, "cuda", trials=1)
    assert store._device_budget == 2 << 20  # a quarter of the spec's 8 MiB
    assert store.place(1 << 20, True, 0.0) == "device"
    assert store.place(16 << 20, True, 1e-4) is None     # 2 ms to bring back, 0.1 ms to compute
    assert store.place(16 << 20, True, 1.0) == "host"    # a float64 convolution, say
    assert store.place(16 << 20, False, 0.0) == "host"   # computed on the CPU: nothing to move


def test_a_huge_spec_gets_one_random_trial_and_the_record_says_why(monkeypatch):
    spec = spec_of(aten.add.Tensor, (torch.randn(64, 64), torch.randn(64, 64)))
    assert trials.trial_seeds(spec) == (DEFAULT_SEEDS, "")
    monkeypatch.setattr(trials, "REDUCED_TRIALS_BYTES", trials.spec_bytes(spec) - 1)
    seeds, why = trials.trial_seeds(spec)
    assert seeds == DEFAULT_SEEDS[:1] and "1 random trial of 3" in why and "every edge kind kept" in why
    measurer = Measurer(spec, FAMILY, get_target("interpreter"))
    ev = measurer.evaluate(FAMILY.seed_configs(spec)[0])
    assert ev.correct, ev.error
    assert ev.validation["trials_note"] == why
    assert ev.validation["kinds"] == ["random", *FAMILY.edge_kinds]  # the edge trials stay


def test_the_memory_plan_of_a_large_fp32_matmul_stays_within_three_times_its_size():
    """bmm f32[16x4096x1024] x f32[16x1024x4096] (issue 25's sweep: 4.1x before): inputs, the copy
    that shows they are unchanged, outputs, the vendor's, comparison blocks and what is kept."""
    a = torch.empty(16, 4096, 1024, device="meta")
    b = torch.empty(16, 1024, 4096, device="meta")
    spec = spec_of(aten.bmm.default, (a, b))
    size = trials.spec_bytes(spec)
    assert size == (2 * 64 + 256) * 2**20 * 4
    assert trials.validation_bytes(spec, False) <= 3 * size
    assert trials.device_keep_bytes(spec) <= size // 4


def test_the_reference_moves_to_the_cpu_when_the_device_cannot_hold_it(monkeypatch):
    spec = spec_of(aten.tanh.default, (torch.randn(256, 256),))
    store = trials.TrialStore(spec, FAMILY.sample_inputs, "meta")
    store.reference_device = "cuda"  # as on a GPU with float64; no device is touched
    free = (trials.validation_bytes(spec, False) + trials.validation_bytes(spec, True)) // 2
    monkeypatch.setattr(trials, "free_device_memory", lambda device: free)
    store.check_fits()
    assert store.reference_device == "cpu"
    monkeypatch.setattr(trials, "free_device_memory", lambda device: trials.validation_bytes(spec, False) - 1)
    with pytest.raises(trials.SpecTooLarge, match="GiB of device memory"):
        store.check_fits()


def test_the_reference_is_let_go_before_the_vendor_output_is_made():
    """Trials that know the vendor's verdict: validation drops the float64 reference once the
    candidate met it, so that it and the vendor output are never held at once."""
    x = torch.randn(32, 32)
    spec = spec_of(aten.sigmoid.default, (x,))
    alive: list = []

    class Known(Trials):
        def reference(self, seed, kind, inputs):
            ref = super().reference(seed, kind, inputs)
            alive.append(weakref.ref(ref[0]))
            return ref

        def vendor(self, seed, kind, inputs, ref):
            assert ref is None and alive[-1]() is None, "the reference is still held"
            return self.spec.run_vendor(inputs), False

        def vendor_needs_reference(self, seed, kind):
            return True if kind == "zeros" else False

    gc.disable()  # reference counting alone must free it
    try:
        rec = validate(lambda inputs: (torch.sigmoid(inputs[0]),), spec, FAMILY.sample_inputs,
                       trials=Known(spec, FAMILY.sample_inputs), elementwise_bar=True)
    finally:
        gc.enable()
    assert rec.ok and rec.trials == 3 and "elementwise vs vendor" in rec.decided_by


@pytest.mark.parametrize("case", range(6))
def test_the_one_pass_comparison_decides_as_the_element_by_element_one(monkeypatch, case):
    import torch_kernelize.core.validate as v

    g = torch.Generator().manual_seed(case)
    ref = torch.randn(300, 70, generator=g, dtype=torch.float64) * 10 ** (case - 2)
    out = ref.float() + torch.randn(300, 70, generator=g) * 10 ** (-case - 1)
    if case == 4:
        out[3, 3], ref[3, 3] = math.inf, math.inf
    if case == 5:
        ref[1, 1] = math.nan
    results = []
    for one_pass in (True, False):
        if not one_pass:
            monkeypatch.setattr(v, "_clear_pass", lambda *a: None)
        results.append([(c.ok, c.reason, c.max_abs, c.max_rel, c.max_err)
                        for c in (compare(out, ref), compare(out, ref, scaled=False, tol=(1e-4, 1e-4)))])
    assert results[0] == results[1]


def test_a_store_that_keeps_nothing_judges_as_one_that_keeps_everything(monkeypatch):
    """All recomputed for each candidate (as on a device, where that is cheaper than moving them):
    the same verdicts and errors, the vendor's verdict on each trial computed once."""
    spec = spec_of(aten.mul.Tensor, (torch.randn(33, 17), torch.randn(33, 17)))
    configs = FAMILY.seed_configs(spec)[:2]
    kept = Measurer(spec, FAMILY, get_target("interpreter"))
    records = [kept.evaluate(c).validation for c in configs]
    bare = Measurer(spec, FAMILY, get_target("interpreter"))
    monkeypatch.setattr(bare.trials, "place", lambda *a, **k: None)
    again = [bare.evaluate(c).validation for c in configs]
    assert again == records and all(r["ok"] for r in again)
    n = records[0]["trials"]
    # the vendor's output: once for its verdict, with the reference, then for each candidate
    assert bare.trials.computed == {"inputs": 2 * n, "reference": 2 * n, "vendor": 3 * n}
    assert len(bare.trials._far) == n and not bare.trials._refs and not bare.trials._vendor


def test_the_nearer_of_reference_and_vendor_is_chosen_block_by_block(monkeypatch):
    """An edge trial the vendor leaves float64 on: per element the candidate's nearer expectation,
    the same in blocks as whole, for a strided output too."""
    import torch_kernelize.core.validate as v

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(40, 30, generator=g, dtype=torch.float64)
    vendor = ref.float()
    vendor[::7] = math.nan           # where ATen gives NaN, the exact answer a number
    out = vendor.clone()
    out[::14] = ref[::14].float()    # the candidate right there instead
    out_t = out.t().contiguous().t()  # a column-major output
    whole = v.nearest_expected([out_t], [ref], [vendor])[0]
    monkeypatch.setattr(v, "CHUNK_ELEMENTS", 90)
    monkeypatch.setattr(v, "MIN_CHUNK_ELEMENTS", 90)
    assert len(list(v._blocks(out_t, 90))) > 10
    blocked = v.nearest_expected([out_t], [ref], [vendor])[0]
    assert torch.equal(blocked.isnan(), whole.isnan()) and torch.equal(blocked.nan_to_num(), whole.nan_to_num())
    assert bool(blocked[14].isfinite().all()) and bool(blocked[7].isnan().all())
    assert compare(out_t, blocked, dtype=torch.float32).ok


def test_nothing_of_a_trial_outlives_it_when_the_store_keeps_nothing():
    """As on a device (inputs drawn again, references computed again): with the cycle collector
    off, every tensor of a trial is gone when the next one starts; a fused region's too."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.core import targets as tg
    from torch_kernelize.lowering.kernels.fused import FAMILY as FUSED
    from torch_kernelize.compiling.regions import find_regions, region_spec

    def chain(c, x):
        y = torch.relu(c) * 0.5 + x
        return y * torch.sigmoid(y)
    a = torch.randn(4, 8, 16)
    gm = make_fx(chain, tracing_mode="fake", decomposition_table=torch._decomp.core_aten_decompositions())(a, a)
    spec = region_spec(find_regions(gm, tg.get_target("interpreter"))[0], {})
    store = trials.TrialStore(spec, FUSED.sample_inputs, "cpu", trials=7)
    store.place = lambda *a, **k: None
    run, _ = trial_holding_check(spec.run_vendor)
    gc.disable()
    try:
        for _ in range(2):  # two candidates
            rec = validate(run, spec, FUSED.sample_inputs, FUSED.edge_kinds, trials=store, elementwise_bar=True)
            assert rec.ok, rec.reason
    finally:
        gc.enable()
