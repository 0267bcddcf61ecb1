"""fill_cache's store policy (fill_cache/store_policy.py): what a searched spec's entry says."""
from __future__ import annotations

import torch

from torch_kernelize.core.spec import KernelSpec, TensorMeta
from torch_kernelize.core.targets import Target
from torch_kernelize.fill_cache.store_policy import (CONFIRM_BELOW, INTERPRETER_NOTE, MIN_SPEEDUP, needs_confirmation,
                                                     verdict)

SPEC = KernelSpec("aten.relu.default", [], {}, (TensorMeta.of(torch.empty(8)),), (TensorMeta.of(torch.empty(8)),))
GPU = Target("gpu", device="cpu", triton="interpreter")
CHIP = Target("chip", device="cpu", triton="interpreter", supported=frozenset(["aten.mul"]))  # no relu


def best(fitness: float, measured: bool = True) -> dict:
    return {"fitness": fitness, "measured": measured}


def test_a_winner_must_beat_the_vendor_clearly():
    assert verdict(best(1.5), GPU, SPEC, MIN_SPEEDUP) == ("triton", "")
    winner, note = verdict(best(1.01), GPU, SPEC, MIN_SPEEDUP)
    assert winner == "vendor" and note.startswith("vendor wins: best Triton candidate ran at 1.010x")


def test_a_chip_without_the_op_keeps_the_fastest_correct_candidate():
    winner, note = verdict(best(0.5), CHIP, SPEC, MIN_SPEEDUP)
    assert winner == "triton" and "does not run aten.relu.default" in note


def test_unmeasured_winners_are_stored_with_the_interpreter_note():
    assert verdict(best(0.0, measured=False), GPU, SPEC, MIN_SPEEDUP) == ("triton", INTERPRETER_NOTE)


def test_near_ties_are_timed_again():
    assert needs_confirmation(best(CONFIRM_BELOW - 0.01))
    assert not needs_confirmation(best(CONFIRM_BELOW))
    assert not needs_confirmation(best(1.0, measured=False))
