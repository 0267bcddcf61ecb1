"""Untrusted kernels are judged so that they cannot cheat, and a replaced entry is never served
stale (issue 43): outputs are judged on fills a kernel cannot predict (core/fills.py), and a
process's loaded runners follow the entry's identity."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from conftest import REPO
from torch_kernelize.building.programs import write_program
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache.external import Candidate, CandidateGenerator
from torch_kernelize.kernel_cache import KernelCache, clear_memo

CANDIDATES = REPO / "test" / "candidates"
SHAPE = (8, 32)


def sigmoid_spec() -> KernelSpec:
    x = torch.randn(SHAPE)
    return KernelSpec.from_call(torch.ops.aten.sigmoid.default, [x], {}, torch.sigmoid(x))


def plant(cache: KernelCache, spec: KernelSpec, candidate: Path, work: Path) -> None:
    """Store ``candidate``'s recorded program as the entry of ``spec``, unjudged (as a hand-made or
    tampered entry would be), replacing any entry there."""
    c = Candidate(candidate)
    program = CandidateGenerator([c], None).generate(spec, c.config)
    shutil.rmtree(work, ignore_errors=True)
    write_program(work, spec, program, "interpreter")
    cache.put({"spec": spec.to_json(), "winner": "triton", "family": "external", "config": c.config.to_json(),
               "validation": {"ok": True}, "timings": {"speedup": 2.0, "measured": True}}, work, replace=True)


def test_verify_fails_an_entry_that_guesses_the_poison(tmp_path):
    """tools/cache.py verify judges an entry as fill_cache does: on both fills."""
    from torch_kernelize.fill_cache.verify import verify_entries
    spec, target = sigmoid_spec(), get_target("interpreter")
    cache = KernelCache.for_target(tmp_path / "cache", target)
    plant(cache, spec, CANDIDATES / "sigmoid_guesses_poison.py", tmp_path / "work")
    verdict, = verify_entries(cache, target, [spec.key])
    assert not verdict.ok and "depends on what its buffer held before the run" in verdict.detail, verdict.detail
    plant(cache, spec, CANDIDATES / "sigmoid_ok.py", tmp_path / "work")
    verdict, = verify_entries(cache, target, [spec.key])
    assert verdict.ok, verdict.detail


def test_a_replaced_entry_runs_at_the_next_compile_in_the_same_process(tmp_path):
    spec, target = sigmoid_spec(), get_target("interpreter")
    cache = KernelCache.for_target(tmp_path / "cache", target)
    x = torch.randn(SHAPE)

    def served() -> torch.Tensor:
        torch._dynamo.reset()
        compiled = torch.compile(torch.sigmoid, backend="kernelize", options={
            "target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": "off",
            "graph_cache": "off"})
        return compiled(x)

    try:
        plant(cache, spec, CANDIDATES / "sigmoid_ok.py", tmp_path / "work")
        torch.testing.assert_close(served(), torch.sigmoid(x))
        doubled = tmp_path / "doubled.py"  # another program: a deliberately wrong one
        doubled.write_text((CANDIDATES / "sigmoid_ok.py").read_text().replace("1.0 / (1.0 +", "2.0 / (1.0 +"))
        plant(cache, spec, doubled, tmp_path / "work")
        torch.testing.assert_close(served(), 2 * torch.sigmoid(x))
        plant(cache, spec, CANDIDATES / "sigmoid_ok.py", tmp_path / "work")
        torch.testing.assert_close(served(), torch.sigmoid(x))
    finally:
        torch._dynamo.reset()
        clear_memo()
