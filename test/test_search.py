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
