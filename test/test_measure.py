"""The runner side of fill_cache: candidates of one spec are judged on the same trials."""
from __future__ import annotations

import re
import sys
import time

import pytest
import torch

from kernel_testing import spec_of
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.fill_cache.trials import spec_bytes
from torch_kernelize.lowering.kernels.elementwise import FAMILY
from torch_kernelize.core.targets import get_target
from torch_kernelize.core.spec import KernelSpec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_references_are_computed_once_per_trial_for_all_candidates(monkeypatch):
    spec = spec_of(torch.ops.aten.add.Tensor, (torch.randn(33, 17), torch.randn(33, 17)))
    calls = []
    reference = KernelSpec.reference

    def counting(self, tensors, device="cpu"):
        calls.append(device)
        return reference(self, tensors, device)
    monkeypatch.setattr(KernelSpec, "reference", counting)
    measurer = Measurer(spec, FAMILY, get_target("interpreter"))
    configs = FAMILY.seed_configs(spec)[:2]
    assert len(configs) == 2
    first = measurer.evaluate(configs[0])
    assert first.correct, first.error
    per_candidate = len(calls)
    assert per_candidate == first.validation["trials"]
    second = measurer.evaluate(configs[1])
    assert second.correct, second.error
    assert len(calls) == per_candidate, "the second candidate recomputed the references"
    assert set(calls) == {measurer.reference_device} == {"cpu"}


def test_trials_are_kept_once_for_all_candidates_and_their_cost_is_reported():
    spec = spec_of(torch.ops.aten.mul.Tensor, (torch.randn(33, 17), torch.randn(33, 17)))
    measurer = Measurer(spec, FAMILY, get_target("interpreter"))
    configs = FAMILY.seed_configs(spec)[:2]
    for c in configs:
        ev = measurer.evaluate(c)
        assert ev.correct, ev.error
        assert "elementwise vs vendor" in ev.validation["decided_by"]
    trials = ev.validation["trials"]
    assert measurer.trials.computed == {"inputs": trials, "reference": trials, "vendor": trials}
    assert measurer.seconds["reference"] > 0 and measurer.seconds["validation"] > 0
    assert measurer.seconds["build"] > 0 and measurer.seconds["timing"] == 0  # nothing is timed here
    measurer.close()
    assert not measurer.trials._refs


def test_a_spec_too_large_for_free_device_memory_is_left_to_vendor_and_the_run_goes_on(tmp_path, monkeypatch):
    import torch_kernelize.fill_cache.trials as trials
    from torch_kernelize.fill_cache.cli import FillRun
    from torch_kernelize.fill_cache.collect import Work
    from torch_kernelize.kernel_cache import KernelCache

    target = get_target("interpreter")
    big = spec_of(torch.ops.aten.tanh.default, (torch.randn(64, 256),))
    small = spec_of(torch.ops.aten.sigmoid.default, (torch.randn(8, 8),))
    free = 100_000  # bytes "free on the device" (the host's): the small spec's validation fits, the big one's not
    assert trials.validation_bytes(small, True) < free < trials.validation_bytes(big, False)
    monkeypatch.setattr(trials, "free_device_memory", lambda device: free)
    cache = KernelCache.for_target(tmp_path / "cache", target)
    run = FillRun(target, cache, budget=1, resume=False, force=False, min_speedup=1.03, isolate=False)
    rows = run.run([Work(big, "test"), Work(small, "test")], quiet=True)
    assert [r["status"] for r in rows] == ["too large", "stored"], rows
    assert "GiB of host memory" in rows[0]["winner"]
    assert cache.lookup(big.key)[0] == "miss"  # nothing stored: with more memory it can be filled
    assert set(rows[1]["time"]) == {"generate", "build", "reference", "validation", "timing"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker's memory limit is RLIMIT_AS")
def test_a_spec_larger_than_the_workers_memory_is_too_large_without_allocating_it(tmp_path, monkeypatch):
    """A 3 GiB spec (metadata only) on a CPU target, its measure worker limited to 2 GiB: "too large",
    nothing of it allocated, and the next spec is stored."""
    from torch_kernelize.fill_cache.cli import FillRun
    from torch_kernelize.fill_cache.collect import Work
    from torch_kernelize.fill_cache.measure_worker import MEMORY_LIMIT_ENV
    from torch_kernelize.kernel_cache import KernelCache

    target = get_target("interpreter")
    big = spec_of(torch.ops.aten.tanh.default, (torch.empty(3 << 27, device="meta"),))
    assert spec_bytes(big) == 3 << 30
    small = spec_of(torch.ops.aten.sigmoid.default, (torch.randn(8, 8),))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "2")
    cache = KernelCache.for_target(tmp_path / "cache", target)
    run = FillRun(target, cache, budget=1, resume=False, force=False, min_speedup=1.03)
    started = time.monotonic()
    rows = run.run([Work(big, "test"), Work(small, "test")], quiet=True)
    assert [r["status"] for r in rows] == ["too large", "stored"], rows
    assert re.fullmatch(r"validation needs ~\d+\.\d GiB of host memory, (1\.\d|2\.0) GiB are available", rows[0]["winner"])
    assert rows[0]["time"]["reference"] == 0 and time.monotonic() - started < 120
    assert cache.lookup(big.key)[0] == "miss"


def test_a_slightly_wrong_kernel_is_not_stored_the_elementwise_bar_decides(monkeypatch):
    """Off by 2e-4 on its small elements only: within the float64 bar (atol scaled by the largest
    output, 1600 here) but not within torch.allclose(atol=1e-4, rtol=1e-4) of the vendor op."""
    import torch_kernelize.fill_cache.measure as measure

    load = measure.load_program

    class SlightlyWrong:
        def __init__(self, runner):
            self.runner = runner

        def run_poisoned(self, inputs):
            return tuple(torch.where(o.abs() < 1, o + 2e-4, o) for o in self.runner.run_poisoned(inputs))

    monkeypatch.setattr(measure, "load_program", lambda *a, **k: SlightlyWrong(load(*a, **k)))
    spec = spec_of(torch.ops.aten.mul.Tensor, (torch.randn(33, 17), torch.randn(33, 17)))

    def sample(spec, seed, kind, device):
        inputs = FAMILY.sample_inputs(spec, seed, kind, device)
        inputs[0].view(-1)[0] = inputs[1].view(-1)[0] = 40.0
        return inputs

    measurer = Measurer(spec, FAMILY, get_target("interpreter"))
    monkeypatch.setattr(measurer, "_sample", sample)
    measurer.trials.sample_inputs = sample
    ev = measurer.evaluate(FAMILY.seed_configs(spec)[0])
    assert not ev.correct and ev.validation["decided_by"] == "elementwise vs vendor", ev
    assert "out of tolerance (atol 0.0001, rtol 0.0001)" in ev.error


def test_inputs_are_kept_before_references_when_host_memory_is_short(monkeypatch):
    import torch_kernelize.fill_cache.trials as trials

    spec = spec_of(torch.ops.aten.sigmoid.default, (torch.randn(64, 64),))  # 16 KiB in, 16 KiB out
    monkeypatch.setattr(trials, "DEVICE_KEEP_BYTES", 0)  # nothing "small": everything counts as host memory
    monkeypatch.setattr(trials, "available_host_memory", lambda: 4 * 5 * 16384)  # a quarter: 5 tensors
    store = trials.TrialStore(spec, FAMILY.sample_inputs, "cpu", trials=3)
    for seed in range(3):
        inputs = store.inputs(seed, "random")
        ref = store.reference(seed, "random", inputs)
        store.vendor(seed, "random", inputs, ref)
    # room is kept for all three inputs (48 KiB); the rest holds the first float64 reference (32 KiB)
    assert len(store._inputs) == 3 and len(store._refs) == 1 and not store._vendor
    for seed in range(3):
        store.inputs(seed, "random")
    assert store.computed["inputs"] == 3
