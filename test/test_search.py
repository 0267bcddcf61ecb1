"""The search policy: budget, journal checkpoints, and candidates that take their process down."""
from __future__ import annotations

import json

import pytest
import torch

from kernel_testing import spec_of
from torch_kernelize.fill_cache.journal import Journal
from torch_kernelize.fill_cache.search import DeviceFault, run_search
from torch_kernelize.lowering.kernels.elementwise import FAMILY

SPEC = spec_of(torch.ops.aten.add.Tensor, (torch.randn(64, 48), torch.randn(64, 48)))


def _evaluate(config):
    return {"config": config.to_json(), "correct": True, "fitness": 1.0 + config["BLOCK"] / 1e4,
            "candidate_ms": 1.0, "vendor_ms": 1.0, "error": "", "validation": None, "measured": True}


def test_a_device_fault_is_journaled_then_ends_the_run_and_is_never_rerun(tmp_path):
    journal = Journal(tmp_path / "j.jsonl")
    seeds = FAMILY.seed_configs(SPEC)

    def faulting(config):
        r = _evaluate(config)
        if config.key == seeds[1].key:
            r.update(correct=False, fitness=0.0, fault=True,
                     error="trial 1 raised RuntimeError: CUDA error: an illegal memory access was encountered")
        return r
    with pytest.raises(DeviceFault, match="faulted the device"):
        run_search(SPEC, FAMILY, faulting, 4, [], journal.append)
    assert [r.get("fault", False) for r in journal.records()] == [False, True]
    seen = []

    def tracking(config):
        seen.append(config.key)
        return _evaluate(config)
    result = run_search(SPEC, FAMILY, tracking, 4, journal.records(), journal.append)
    assert seeds[0].key not in seen and seeds[1].key not in seen and len(result.evaluated) == 4


@pytest.mark.slow
def test_a_fresh_search_keeps_the_candidates_that_faulted(tmp_path):
    from test_fill_cache import MODELS, _journal_lines, fill_cache
    args = ["--model", f"{MODELS}:make_wide", "--target", "interpreter", "--cache-dir", str(tmp_path), "--budget", "2"]
    fill_cache(*args)
    [path] = list(tmp_path.glob("*/journals/*.jsonl"))
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    first.update(correct=False, fitness=0.0, fault=True, error="an illegal memory access was encountered")
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    fill_cache(*args, "--force")  # a fresh search (no --resume) of the same spec
    lines = _journal_lines(tmp_path)
    assert lines[0]["fault"] and lines[0]["config"] == first["config"]
    assert [r["config"] for r in lines].count(first["config"]) == 1, "the faulted candidate ran again"
    assert len(lines) == 2


def test_paired_timing_alternates_vendor_and_candidate(monkeypatch):
    import torch_kernelize.fill_cache.benchmark as bench
    calls = []
    monkeypatch.setattr(bench, "median_ms", lambda fn: calls.append(fn()) or {"v": 2.0, "c": 1.0}[calls[-1]] + len(calls) / 100)
    vendor, cand = bench.paired_ms(lambda: "v", lambda: "c", rounds=3)
    assert calls == ["v", "c"] * 3
    assert (vendor, cand) == (2.03, 1.04)  # medians of 2.01/2.03/2.05 and 1.02/1.04/1.06


@pytest.mark.parametrize("search,paired,status", [
    (1.05, (1.0, 1.02), "vendor wins"),   # a near tie, reversed when timed alternately
    (1.05, (1.0, 0.9), "stored"),         # confirmed
    (2.0, None, "stored"),                # far from a tie: not timed again
])
def test_near_ties_are_timed_again_before_the_decision(search, paired, status, tmp_path, monkeypatch):
    """fill_cache stores a Triton winner only if it still beats the vendor kernel when both are
    timed alternately (the search times the vendor once, at its start)."""
    import torch_kernelize.fill_cache.measure as measure
    from torch_kernelize.fill_cache.cli import FillRun
    from torch_kernelize.fill_cache.collect import Work
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.core.targets import get_target

    target = get_target("interpreter")
    confirmed = []
    monkeypatch.setattr(measure, "timing_available", lambda t: True)  # time on the interpreter: faked
    monkeypatch.setattr(measure, "median_ms", lambda fn: 1.0 / search)
    monkeypatch.setattr(measure.Measurer, "vendor_ms", lambda self: 1.0)
    monkeypatch.setattr(measure, "paired_ms", lambda v, c, rounds: confirmed.append(rounds) or paired)
    cache = KernelCache.for_target(tmp_path / "cache", target)
    spec = spec_of(torch.ops.aten.sigmoid.default, (torch.randn(300),))
    run = FillRun(target, cache, budget=1, resume=False, force=False, min_speedup=1.03, isolate=False)  # timing faked here
    row = run.process(Work(spec, "test"))
    run._store_pending(wait=True)
    assert row["status"] == status, row
    assert bool(confirmed) == (paired is not None)
    kind, entry, _ = cache.lookup(spec.key)
    assert kind == ("vendor" if status == "vendor wins" else "hit")
    if paired is not None:
        assert row["speedup"] == pytest.approx(paired[0] / paired[1])


def test_a_graphed_races_vendor_side_copies_what_it_made_into_the_next_stretchs_inputs():
    """The vendor op of a GRAPHED spec syncs, so serving splits the captured graph there and copies
    each tensor it made into the next stretch's static inputs (serving/cudagraphs.py): its side of
    the race is timed with those copies (Measurer.baseline)."""
    from torch_kernelize.core.targets import get_target
    from torch_kernelize.fill_cache.benchmark import with_split_copies
    from torch_kernelize.fill_cache.measure import Measurer
    run = with_split_copies(lambda ins: (ins[0] * 2, [ins[0] + 1], 3))
    out = run([torch.arange(4.0)])
    assert [b.tolist() for b in run.buffers] == [out[0].tolist(), out[1][0].tolist()]
    first = run.buffers[0]
    run([torch.ones(4)])
    assert run.buffers[0] is first and first.tolist() == [2.0] * 4  # the same buffers, call after call
    from torch_kernelize.lowering.kernels import KernelFamily
    spec = spec_of(torch.ops.aten.sigmoid.default, (torch.randn(8),))
    graphed = Measurer(spec.graphed(), KernelFamily(), get_target("interpreter"))
    plain = Measurer(spec, KernelFamily(), get_target("interpreter"))
    try:
        assert hasattr(graphed.baseline(), "buffers") and not hasattr(plain.baseline(), "buffers")
    finally:
        graphed.builder.close()
        plain.builder.close()


def test_a_graphed_spec_is_timed_as_a_captured_model_serves_it(tmp_path, monkeypatch):
    """A GRAPHED spec's race (core/spec.py): the vendor op and each candidate timed behind queued
    work (benchmark.queued_ms), the candidate captured; its plain twin's, each alone."""
    import torch_kernelize.fill_cache.measure as measure
    from torch_kernelize.fill_cache.cli import FillRun
    from torch_kernelize.fill_cache.collect import Work
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.core.targets import get_target

    target = get_target("interpreter")
    queued, alone = [], []
    monkeypatch.setattr(measure, "timing_available", lambda t: True)  # time on the interpreter: faked
    monkeypatch.setattr(measure, "queued_ms", lambda fn, graphed=False: queued.append(graphed) or (0.5 if graphed else 1.0))
    monkeypatch.setattr(measure, "median_ms", lambda fn: alone.append(fn) or 1.0)
    cache = KernelCache.for_target(tmp_path / "cache", target)
    spec = spec_of(torch.ops.aten.sigmoid.default, (torch.randn(300),)).graphed()
    run = FillRun(target, cache, budget=1, resume=False, force=False, min_speedup=1.03, isolate=False)
    row = run.process(Work(spec, "test"))
    run._store_pending(wait=True)
    assert row["status"] == "stored" and row["speedup"] == pytest.approx(2.0), row
    assert not alone and sorted(queued[:2]) == [False, True]  # the vendor op as it is, the candidate captured
    plain = spec_of(torch.ops.aten.sigmoid.default, (torch.randn(300),))
    assert cache.lookup(spec.key)[0] == "hit" and cache.lookup(plain.key)[0] == "miss"
