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


def test_for_a_whole_graph_its_own_assembly_must_beat_inductors_program_clearly():
    """Inductor's program is what torch.compile runs: a near tie keeps it (the ViT of a noisy H100 run
    served its own assembly at 0.97x torch.compile after the fill timed the program 1.02x of it);
    the assembly wins only when the program runs clearly slower."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.regions import region_spec
    from torch_kernelize.compiling.whole_graph import whole_graph_region
    graph = make_fx(lambda x: (x * 2).relu(), tracing_mode="fake")(torch.randn(8))
    whole = region_spec(whole_graph_region(graph)[0], {})
    inductor = {"generator": "inductor", "mode": "default"}
    assert verdict({**best(0.99), "config": inductor}, GPU, whole, MIN_SPEEDUP) == ("triton", "")
    winner, note = verdict({**best(0.95), "config": inductor}, GPU, whole, MIN_SPEEDUP)
    assert winner == "vendor" and note.startswith("own assembly wins: best whole-graph candidate ran at 0.950x")
    # any other whole-graph candidate (a mix of stretches) must beat the assembly clearly, as a kernel must
    assert verdict({**best(1.02), "config": {"mix": "abc"}}, GPU, whole, MIN_SPEEDUP)[0] == "vendor"
