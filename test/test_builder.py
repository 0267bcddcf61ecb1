"""The builder's worker pool: a worker that dies fails only the candidate it was building; the
pool is started again and every other build, of this spec and the next, goes on."""
from __future__ import annotations

import pytest
import torch

from fault_family import BUILD as FAMILY
from kernel_testing import spec_of
from torch_kernelize.fill_cache.builder import WORKER_DIED, Builder
from torch_kernelize.fill_cache.journal import Journal
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.fill_cache.search import run_search
from torch_kernelize.core.targets import get_target

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_a_worker_that_segfaults_fails_only_its_candidate_and_the_run_goes_on(tmp_path):
    target = get_target("interpreter")
    specs = [spec_of(torch.ops.aten.tanh.default, (torch.randn(40, 24),)),
             spec_of(torch.ops.aten.sigmoid.default, (torch.randn(33, 17),))]
    builder = Builder(target, workers=2, isolate=True)
    try:
        for spec in specs:  # both specs' seeds in flight at once, as fill_cache's look-ahead does
            builder.submit(spec, FAMILY, FAMILY.seed_configs(spec)[:3])
        journals = []
        for spec in specs:
            journal = Journal(tmp_path / f"{spec.key}.jsonl")
            measurer = Measurer(spec, FAMILY, target, builder=builder)
            result = run_search(spec, FAMILY, lambda c: measurer.evaluate(c).to_json(), 3, [], journal.append,
                                prepare=measurer.prepare)
            journals.append(journal.records())
            assert len(result.evaluated) == 3 and result.best is not None
        crashed = [r for rs in journals for r in rs if r["error"]]
        assert len(crashed) == 2, crashed  # one candidate of each spec, and only those
        for spec, records in zip(specs, journals):
            for r in records:
                from torch_kernelize.lowering.kernels import Config
                if FAMILY.crashes(spec, Config.from_json(r["config"])):
                    assert not r["correct"] and WORKER_DIED in r["error"], r
                else:
                    assert r["correct"], r
        assert builder.restarts >= 2
    finally:
        builder.close()


def test_a_candidate_that_kills_the_measure_worker_fails_alone_and_the_run_goes_on(tmp_path, monkeypatch):
    from fault_family import MEASURE

    import torch_kernelize.fill_cache.fill_run as fill_run
    from torch_kernelize.fill_cache.collect import Work
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.lowering.kernels import Config

    monkeypatch.setattr(fill_run, "family_for", lambda spec: MEASURE)
    target = get_target("interpreter")
    specs = [spec_of(torch.ops.aten.tanh.default, (torch.randn(40, 24),)),
             spec_of(torch.ops.aten.sigmoid.default, (torch.randn(33, 17),))]
    cache = KernelCache.for_target(tmp_path / "cache", target)
    run = fill_run.FillRun(target, cache, budget=3, resume=False, force=False, min_speedup=1.03, isolate=True)
    rows = run.run([Work(s, "test") for s in specs], quiet=True)
    assert [r["status"] for r in rows] == ["stored", "stored"], rows
    for spec in specs:
        records = Journal(cache.journal_path(spec.key)).records()
        assert len(records) == 3
        for r in records:
            if MEASURE.crashes(spec, Config.from_json(r["config"])):
                assert not r["correct"] and r["fault"] and r["contained"], r
                assert "measure worker died" in r["error"] and "SIGSEGV" in r["error"], r
            else:
                assert r["correct"], r
    assert run._worker.restarts == 2  # one fresh worker after each crash


@pytest.mark.parametrize("fault", ["out of bounds", "hang"])
def test_a_faulting_candidate_is_contained_journaled_and_skipped_on_resume(tmp_path, monkeypatch, fault):
    """On the interpreter a kernel's body runs as Python in the process that launches it: a store
    far out of bounds kills that process, a loop without end holds it. By default fill_cache runs
    candidates in its measure worker on every target, within a time limit, so the fill goes on,
    and the fault is journaled before the next candidate runs, so --resume never runs it again."""
    from fault_family import HANG, OUT_OF_BOUNDS

    import torch_kernelize.fill_cache.fill_run as fill_run
    from torch_kernelize.fill_cache.collect import Work
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.lowering.kernels import Config

    # (a limit of a few seconds: wall time, which the good candidate needs too on a loaded machine)
    FAMILY, reason, limit = {"out of bounds": (OUT_OF_BOUNDS, "SIGSEGV", None),
                             "hang": (HANG, "timed out after 6 s", 6)}[fault]
    monkeypatch.setattr(fill_run, "family_for", lambda spec: FAMILY)
    target = get_target("interpreter")
    spec = spec_of(torch.ops.aten.tanh.default, (torch.randn(40, 24),))
    cache = KernelCache.for_target(tmp_path / "cache", target)
    run = fill_run.FillRun(target, cache, budget=2, resume=False, force=False, min_speedup=1.03, time_limit=limit)
    row, = run.run([Work(spec, "test")], quiet=True)
    assert row["status"] == "stored", row
    journal = Journal(cache.journal_path(spec.key))
    first, fault = journal.records()
    assert first["correct"] and FAMILY.crashes(spec, Config.from_json(fault["config"]))
    assert fault["fault"] and fault["contained"] and reason in fault["error"], fault
    again = fill_run.FillRun(target, cache, budget=3, resume=True, force=True, min_speedup=1.03)
    row, = again.run([Work(spec, "test")], quiet=True)
    assert row["status"] == "stored" and row["resumed"] == 2 and row["evaluated"] == 3, row
    assert again._worker.restarts == 0  # the faulting candidate did not run again
    assert [r["config"] for r in journal.records()][:2] == [first["config"], fault["config"]]
    assert sum(r["fault"] for r in journal.records()) == 1


def test_a_device_side_assert_is_a_device_fault():
    """It leaves the CUDA context unusable, like an illegal address: the worker is replaced."""
    from torch_kernelize.fill_cache.measure import device_fault

    assert device_fault("trial 2 (random, seed 1) raised RuntimeError: CUDA error: device-side assert triggered")
    assert not device_fault("trial 2 (random, seed 1) raised IndexError: index 9 is out of bounds")


class ManyKernels:
    """A generator that runs before its job (as Inductor's capture does) and gives a program of five
    kernels and six launches: relu's elementwise kernel under five names, the first launched twice."""

    name = "many-kernels"
    generates_in_parent = True

    def generate(self, spec, config):
        import dataclasses
        from torch_kernelize.lowering.kernels.elementwise import FAMILY as ELEMENTWISE
        program = ELEMENTWISE.generate(spec, ELEMENTWISE.seed_configs(spec)[0])
        launch = program.launches[0]
        kernel = program.source[program.source.index("@triton.jit"):]
        copies = "".join("\n\n" + kernel.replace(f"def {launch.kernel}(", f"def {launch.kernel}_{j}(") for j in range(1, 5))
        launches = (launch, *(dataclasses.replace(launch, kernel=f"{launch.kernel}_{j}") for j in range(1, 5)), launch)
        return dataclasses.replace(program, source=program.source + copies, launches=launches)


def test_a_generated_program_of_many_kernels_compiles_one_kernel_per_pool_job(tmp_path):
    """One job compiled Inductor's whole program for Llama on one core (9.8 s for its unaligned
    binaries alone): a program of SPLIT_AT kernels or more is written here and compiled a kernel per job, each launch's binary
    as one job would have made it (here for sm_90, which Triton compiles without a GPU)."""
    from torch_kernelize.core.program import launch_files
    from torch_kernelize.fill_cache import builder as builder_module
    from torch_kernelize.lowering.kernels import Config
    spec = spec_of(torch.ops.aten.relu.default, (torch.randn(8),))
    family, config = ManyKernels(), Config.of(seed=0)
    builder = Builder(get_target("interpreter"), workers=2, isolate=True)
    builder.backend, builder._gpu_target = "cuda", ("cuda", 90, 32)   # (a build for the GPU, on this CPU)
    jobs = []
    submit = builder._pool.submit
    builder._pool.submit = lambda fn, *args: jobs.append(fn.__name__) or submit(fn, *args)
    try:
        directory = builder.build(spec, family, config)
        assert jobs == ["_compile_part"] * 5  # one per kernel; the repeated launch shares its kernel's job
        assert all((directory / f).exists() for i in range(6) for f in launch_files(i))
        program = family.generate(spec, config)
        assert builder_module.kernel_groups(program.to_json()) == [[0, 5], [1], [2], [3], [4]]
        # a part that fails fails the program with its error
        broken = builder_module._all_of([builder_module._done(None), builder_module._done("RuntimeError: ptxas")])
        assert broken.result() == "RuntimeError: ptxas"
    finally:
        builder.close()


def test_a_broken_pool_under_one_part_fails_the_whole_program_so_it_is_built_again_alone():
    import concurrent.futures
    from concurrent.futures.process import BrokenProcessPool
    from torch_kernelize.fill_cache.builder import _all_of, _done
    dead: concurrent.futures.Future = concurrent.futures.Future()
    whole = _all_of([_done(None), dead])
    assert not whole.done()
    dead.set_exception(BrokenProcessPool("a worker died"))
    with pytest.raises(BrokenProcessPool):
        whole.result()


def test_a_builder_never_closed_removes_its_folder_when_collected():
    """close() removes the build folder; a Builder dropped without it (a test's Measurer) removes
    it when collected, or at exit, instead of leaving it in the temporary folder."""
    import gc
    builder = Builder(get_target("interpreter"))
    root = builder.root
    assert root.is_dir()
    del builder
    gc.collect()
    assert not root.exists()
    closed = Builder(get_target("interpreter"))
    closed.close()
    assert not closed.root.exists()
    closed.close()  # (twice is harmless)
