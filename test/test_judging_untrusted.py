"""Untrusted kernels are judged so that they cannot cheat, and a replaced entry is never served
stale (issue 43): outputs are judged on fills a kernel cannot predict (core/fills.py), and a
process's loaded runners follow the entry's identity."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import REPO
from torch_kernelize import flush_repros
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


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A reproducer folder of a sigmoid miss, recorded by the backend."""
    root = tmp_path_factory.mktemp("recorded")
    torch._dynamo.reset()
    compiled = torch.compile(torch.sigmoid, backend="kernelize", options={
        "target": "interpreter", "cache_dir": str(root / "cache"), "repro_dir": str(root / "repros"),
        "graph_cache": "off"})
    compiled(torch.randn(SHAPE))
    flush_repros()
    torch._dynamo.reset()
    folder, = (p.parent for p in (root / "repros").glob("*/spec.json"))
    return folder


@pytest.fixture
def repro(recorded, tmp_path) -> Path:
    """A copy of the recorded folder whose repro.py, if anything ran it, would leave a marker."""
    folder = tmp_path / "repros" / recorded.name
    shutil.copytree(recorded, folder)
    marker = tmp_path / "MARKER"
    script = folder / "repro.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + script.read_text())
    return folder


def test_reproducers_are_read_as_data_never_run(repro, tmp_path, capsys):
    from torch_kernelize.fill_cache.collect import repro_work
    from torch_kernelize.fill_cache.external import check_main
    from torch_kernelize.repro.listing import replay_one
    from torch_kernelize.repro.task import write_task

    work = repro_work(repro)
    assert work is not None and len(work.captured) == 1 and work.captured[0].shape == SHAPE
    write_task(repro)
    assert check_main(repro, [str(CANDIDATES / "sigmoid_ok.py"), "--target", "interpreter"]) == 0
    assert "ACCEPTED" in capsys.readouterr().out
    _, code, detail = replay_one(repro, "interpreter", str(tmp_path / "empty"), 300)
    assert code == 1 and "still a miss" in detail, detail  # replayed: an empty cache has no kernel for it
    assert not (tmp_path / "MARKER").exists()  # (fill_cache --repros: the tests below)


def test_a_batch_replay_stops_at_a_folder_that_cannot_run_and_the_rest_run_alone(repro, tmp_path):
    """``repros replay`` replays a share of folders per process; after one that could not run (it
    may have left the process unusable) the others are replayed each in a fresh process."""
    from torch_kernelize.repro import listing
    broken, last = (shutil.copytree(repro, tmp_path / "repros" / name) for name in ("broken", "last"))
    (broken / "spec.json").unlink()
    with mock.patch.object(listing, "replay_one", wraps=listing.replay_one) as alone:
        results = listing.replay_batch([repro, broken, last], "interpreter", str(tmp_path / "empty"), 300)
    assert [(f, code) for f, code, _ in results] == [(repro, 1), (broken, 2), (last, 1)], results
    assert "still a miss" in results[2][2]
    assert [c.args[0] for c in alone.call_args_list] == [last]  # the batch answered the first two


@pytest.mark.parametrize("damage, why", [
    (lambda f: (f / "spec.json").unlink(), "spec.json unreadable"),
    (lambda f: next((f / "inputs" / "storages").iterdir()).write_bytes(b"x"), "inputs/storages/"),
    (lambda f: (f / "repro.py").write_text((f / "repro.py").read_text().replace(str(SHAPE), "(2, 32)")),
     "captured input 0 is torch.float32[2, 32]"),
    (lambda f: (f / "repro.py").write_text((f / "repro.py").read_text().replace(
        "def load_args(reader):\n", "def load_args(reader):\n    import os\n")), "does more than read"),
])
def test_a_folder_that_fails_its_checks_is_skipped_with_one_warning(repro, damage, why, caplog):
    from torch_kernelize.fill_cache.collect import specs_from_repros
    damage(repro)
    with caplog.at_level(logging.WARNING, logger="torch_kernelize.fill_cache"):
        assert specs_from_repros(repro.parent) == []
    skipped = [r.getMessage() for r in caplog.records if "skipping reproducer" in r.getMessage()]
    assert len(skipped) == 1 and why in skipped[0], skipped


def test_check_candidate_and_fill_cache_reject_a_candidate_that_guesses_the_poison(repro, tmp_path, capsys):
    from torch_kernelize.fill_cache.cli import main
    from torch_kernelize.fill_cache.external import check_main
    guesser = CANDIDATES / "sigmoid_guesses_poison.py"
    assert check_main(repro, [str(guesser), "--target", "interpreter"]) == 1
    assert "REJECTED: trial 1 (random, seed 0): output 0 depends on what its buffer held" in capsys.readouterr().out
    cache = tmp_path / "cache"
    assert main(["--quiet", "--repros", str(repro.parent), "--target", "interpreter", "--cache-dir", str(cache),
                 "--budget", "1", "--candidate", str(guesser)]) == 0
    record = json.loads(next(cache.glob("*/entries/*/entry.json")).read_text())
    assert record["provenance"]["generator"] != "external", record["provenance"]
    assert not (tmp_path / "MARKER").exists()  # fill_cache --repros read the reproducer as data


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
    """Its runner, and its health (a kernel disabled here), are the old entry's no more."""
    from torch_kernelize.compiling.lower import Session
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
        Session._states[(str(cache.dir), spec.key)].disable("failed in this process")  # as a raise would
        doubled = tmp_path / "doubled.py"  # another program: a deliberately wrong one
        doubled.write_text((CANDIDATES / "sigmoid_ok.py").read_text().replace("1.0 / (1.0 +", "2.0 / (1.0 +"))
        plant(cache, spec, doubled, tmp_path / "work")
        torch.testing.assert_close(served(), 2 * torch.sigmoid(x))
        plant(cache, spec, CANDIDATES / "sigmoid_ok.py", tmp_path / "work")
        torch.testing.assert_close(served(), torch.sigmoid(x))
    finally:
        torch._dynamo.reset()
        clear_memo()


PATCHER = '''
import torch, triton, triton.language as tl
import torch_kernelize.core.validate as validate

validate.compare_all = lambda *args, **kwargs: validate.Comparison(True)  # "always equal"
validate.compare_elementwise = lambda *args, **kwargs: validate.Comparison(True)
open({marker!r}, "a").write("imported\\n")
OP = "aten.sigmoid.default"


@triton.jit
def zeros_kernel(out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, 0.0, mask=offs < n)


def launch(x):
    out = torch.empty_like(x)
    zeros_kernel[(triton.cdiv(x.numel(), 256),)](out, x.numel(), BLOCK=256)
    return out
'''


def test_a_candidate_that_patches_the_harness_cannot_change_a_verdict(repro, tmp_path):
    """Its import-time code runs only in the process that records it: the judging process keeps
    its own validation, rejects the zeros, and stores nothing of that code."""
    import torch_kernelize.core.validate as validate
    from torch_kernelize.fill_cache.cli import main
    harness = (validate.compare_all, validate.compare_elementwise)
    marker = tmp_path / "imported"
    patcher = tmp_path / "patcher.py"
    patcher.write_text(PATCHER.format(marker=str(marker)))
    cache = tmp_path / "cache"
    assert main(["--quiet", "--repros", str(repro.parent), "--target", "interpreter", "--cache-dir", str(cache),
                 "--budget", "1", "--candidate", str(patcher)]) == 0
    assert (validate.compare_all, validate.compare_elementwise) == harness
    assert marker.read_text() == "imported\n"  # once, in the recording process
    record = json.loads(next(cache.glob("*/entries/*/entry.json")).read_text())
    assert record["provenance"]["generator"] != "external", record["provenance"]
    assert not (tmp_path / "MARKER").exists()  # fill_cache --repros read the reproducer as data
    c = Candidate(patcher)
    program = CandidateGenerator([c], None).generate(sigmoid_spec(), c.config)
    assert "def zeros_kernel" in program.source
    assert not any(s in program.source for s in ("torch_kernelize", "compare_all", "open(", "def launch"))


def test_verify_and_serving_never_import_a_candidate_file(tmp_path):
    from torch_kernelize.fill_cache.verify import verify_entries
    spec, target = sigmoid_spec(), get_target("interpreter")
    marker = tmp_path / "imported"
    marked = tmp_path / "marked.py"
    marked.write_text(f"open({str(marker)!r}, 'a').write('imported\\n')\n" + (CANDIDATES / "sigmoid_ok.py").read_text())
    cache = KernelCache.for_target(tmp_path / "cache", target)
    plant(cache, spec, marked, tmp_path / "work")
    marker.unlink()  # imported once, to record it
    assert "open(" not in (cache.get(spec.key).program_dir / "kernel.py").read_text()
    verdict, = verify_entries(cache, target, [spec.key])
    assert verdict.ok, verdict.detail
    x = torch.randn(SHAPE)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(torch.sigmoid, backend="kernelize", options={
            "target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": "off", "graph_cache": "off"})
        torch.testing.assert_close(compiled(x), torch.sigmoid(x))
    finally:
        torch._dynamo.reset()
        clear_memo()
    assert not marker.exists()
