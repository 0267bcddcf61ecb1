"""fill_cache on what real models and earlier runs leave: a resumed winner whose build folder is
gone, a spec whose search raises, exit codes that say whether the run finished (docs/filling.md: exit
codes), and the generators' own logging kept off the terminal (run_log.py). In-process, on the
interpreter target."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings

import pytest

from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache import cli, fill_run, measure, measure_worker
from torch_kernelize.fill_cache.collect import specs_from_model
from torch_kernelize.fill_cache.measure import Evaluation
from torch_kernelize.lowering.kernels import KernelFamily
from torch_kernelize.lowering.kernels.elementwise import FAMILY as ELEMENTWISE

MODEL = "torch_kernelize.model_zoo:make_wide"   # one spec
SMALL = "torch_kernelize.model_zoo:make_small"  # a fused region, its nodes, and histc


class InProcessWorker:
    """The measure worker's protocol (measure_worker.MeasureWorker) run in this process, so that
    a test can give the worker's Measurer a timer on the CPU."""

    def __init__(self) -> None:
        self.holds: set[str] = set()
        self.restarts = 0
        measure_worker._HELD.clear()

    @classmethod
    def for_target(cls, target, time_limit_s: float, inductor: bool = False) -> "InProcessWorker":
        return cls()

    def start(self) -> None:
        pass

    def call(self, fn, *args):
        return fn(*args)

    def restart(self) -> None:
        measure_worker._HELD.clear()

    def close(self) -> None:
        measure_worker._HELD.clear()

    stop = close


def _timed_on_cpu(monkeypatch) -> None:
    """Every candidate ties the vendor op in the search (1 ms each), so the winner is timed again
    (store_policy.needs_confirmation), where it is 1.2x faster."""
    monkeypatch.setattr(measure, "timing_available", lambda target: True)
    monkeypatch.setattr(measure, "median_ms", lambda fn, *a, **k: (fn(), 1.0)[1])
    monkeypatch.setattr(measure, "paired_ms", lambda vendor, cand, rounds=3: (vendor(), cand(), 1.2, 1.0)[2:])
    monkeypatch.setattr(fill_run, "MeasureWorker", InProcessWorker)


def _fill(cache_dir, resume: bool):
    from torch_kernelize.kernel_cache import KernelCache
    target = get_target("interpreter")
    cache = KernelCache.for_target(cache_dir, target)
    run = cli.FillRun(target, cache, 1, resume, False, cli.MIN_SPEEDUP, isolate=True)
    return run, cache, run.run(specs_from_model(MODEL, target, cache_dir), quiet=True)


def test_resume_rebuilds_a_journaled_winner_whose_build_folder_is_gone(tmp_path, monkeypatch):
    _timed_on_cpu(monkeypatch)

    def interrupted(self, config, rounds=3):
        raise KeyboardInterrupt  # after the search journaled its candidate, before the winner is stored
    with monkeypatch.context() as m:
        m.setattr(measure_worker.IsolatedMeasurer, "confirm", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _fill(tmp_path / "cache", resume=False)
    journals = list((tmp_path / "cache").glob("*/journals/*.jsonl"))
    assert len(journals) == 1 and json.loads(journals[0].read_text())["measured"]
    # that process's build folder went with it; this run resumes from the journal: nothing new is
    # searched (budget 1), and the winner is built and validated again, confirmed and stored
    run, cache, rows = _fill(tmp_path / "cache", resume=True)
    assert [(r["status"], r["resumed"]) for r in rows] == [("stored", 1)], rows
    assert len(journals[0].read_text().splitlines()) == 1   # validated again, but not searched again
    assert cache.lookup(rows[0]["key"])[0] == "hit"
    entry = cache.lookup(rows[0]["key"])[1]
    assert entry.speedup == pytest.approx(1.2)


def test_a_spec_whose_search_raises_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    evaluate = measure_worker.IsolatedMeasurer.evaluate  # (fill_cache measures in its worker)

    def histc_breaks(self, config):
        if self.spec.op == "aten.histc.default":
            raise ValueError("a bug in one family")
        return evaluate(self, config)
    monkeypatch.setattr(measure_worker.IsolatedMeasurer, "evaluate", histc_breaks)
    args = ["--quiet", "--model", SMALL, "--target", "interpreter", "--cache-dir", str(tmp_path / "cache"),
            "--budget", "1", "--summary", str(tmp_path / "summary.json")]
    assert cli.main(args) == 0   # finished: the cache serves the model, histc on the vendor op
    rows = json.loads((tmp_path / "summary.json").read_text())["specs"]
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(failed) == 1 and "ValueError: a bug in one family" in failed[0]["winner"]
    assert any(r["status"] == "stored" for r in rows)
    out = capsys.readouterr().out
    assert "left on the vendor op (1" in out and "aten.histc.default" in out
    assert cli.main([*args, "--strict", "--force"]) == 1


def test_no_correct_candidate_exits_0_and_1_under_strict(tmp_path, monkeypatch):
    monkeypatch.setattr(measure_worker.IsolatedMeasurer, "evaluate", lambda self, config: Evaluation(
        config.to_json(), False, 0.0, error="trial 1 (random, seed 0): 3 element(s) out of tolerance"))
    args = ["--quiet", "--model", MODEL, "--target", "interpreter", "--cache-dir", str(tmp_path / "cache"),
            "--budget", "1"]
    assert cli.main(args) == 0
    assert cli.main([*args, "--strict"]) == 1


def test_generators_logging_goes_to_the_run_log_and_journal_not_the_terminal(tmp_path, monkeypatch, capsys, caplog):
    from torch_kernelize.fill_cache import builder
    build = builder._build

    def noisy_build(*args):   # as Inductor's autotuning and Triton do while a candidate is generated
        logging.getLogger("torch._inductor.select_algorithm").warning(
            "No valid triton configs. OutOfMemoryError: out of resource: triton_mm Required: 262144")
        logging.getLogger("triton.runtime.autotuner").warning("a triton line")
        warnings.warn("a generator's warning")
        return build(*args)
    monkeypatch.setattr(builder, "_build", noisy_build)
    before = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate) for n in ("torch", "triton")}
    code = cli.main(["--model", MODEL, "--target", "interpreter", "--cache-dir", str(tmp_path / "cache"),
                     "--budget", "1", "--summary", str(tmp_path / "summary.json")])
    assert code == 0
    terminal = capsys.readouterr()
    shown = terminal.out + terminal.err + "\n".join(r.getMessage() for r in caplog.records)
    assert "No valid triton configs" not in shown and "a triton line" not in shown
    assert "a generator's warning" not in shown
    log_path = json.loads((tmp_path / "summary.json").read_text())["log"]
    text = open(log_path).read()
    assert "No valid triton configs" in text and "a triton line" in text and "a generator's warning" in text
    line = next(x for x in text.splitlines() if "No valid triton configs" in x)
    assert "[-]" not in line and "torch._inductor.select_algorithm [" in line   # tagged with the spec searched
    assert f"log: {log_path}" in terminal.out
    journals = (tmp_path / "cache").glob("*/journals/*.jsonl")
    journal = [json.loads(line) for j in journals for line in j.read_text().splitlines()]
    assert len(journal) == 1 and any("No valid triton configs" in x for x in journal[0]["log"]), journal
    after = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate) for n in ("torch", "triton")}
    assert after == before   # put back as they were after the run


def test_a_device_assert_while_a_generator_ran_in_this_process_ends_the_run_and_one_in_a_build_worker_does_not():
    """A device-side assert while Inductor ran a graph to capture it (its generator runs in the
    fill's process) leaves that process's CUDA context unusable: journaled as a fault and not
    contained (search.DeviceFault ends the run; --resume skips it). In a build worker, the
    pool is started afresh and the search goes on."""
    import types
    from torch_kernelize.core.spec import KernelSpec, TensorMeta
    from torch_kernelize.fill_cache.builder import Builder
    from torch_kernelize.fill_cache.measure_worker import IsolatedMeasurer
    from torch_kernelize.lowering.kernels import Config
    m = TensorMeta((8,), (1,), "float32", "cpu")
    spec, config = KernelSpec("aten.relu.default", [{"tensor": 0}], {}, (m,), (m,)), Config.of(mode="default")
    builder = Builder(get_target("interpreter"))
    restarts = []
    builder._pool, builder._restart = object(), lambda: restarts.append(1)  # as if building in workers
    fake = types.SimpleNamespace(target=types.SimpleNamespace(device="cuda"), spec=spec, builder=builder)
    error = "build failed: RuntimeError: AcceleratorError: CUDA error: device-side assert triggered"
    ev = IsolatedMeasurer._build_failed(fake, config, error)
    assert ev.fault and ev.contained and restarts == [1]
    builder.failed_here.add((spec.key, config.key))  # the generator ran in this process
    ev = IsolatedMeasurer._build_failed(fake, config, error)
    assert ev.fault and not ev.contained and restarts == [1]
    ev = IsolatedMeasurer._build_failed(fake, config, "build failed: SyntaxError: bad kernel")
    assert not ev.fault and ev.error.endswith("bad kernel")
    builder._pool = None
    builder.close()


def _slow_echo(value, seconds):
    import time
    time.sleep(seconds)
    return value


def test_a_call_interrupted_by_the_callers_alarm_leaves_no_stale_answer_for_the_next():
    """An exception raised into the parent while the worker computes (a caller's SIGALRM, as a
    sweep's deadline raises; Ctrl-C) ends the worker: its answer would otherwise be read as the
    next call's, and every later call of the process would get the one before's."""
    import signal

    class Deadline(Exception):
        pass

    def fire(signum, frame):
        raise Deadline()
    worker = measure_worker.MeasureWorker(time_limit_s=60)
    previous = signal.signal(signal.SIGALRM, fire)
    try:
        assert worker.call(_slow_echo, "warm", 0) == "warm"
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(Deadline):
            worker.call(_slow_echo, "late", 2)
        assert worker.call(_slow_echo, "next", 0) == "next"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        worker.stop()


class DeviceGenerator(KernelFamily):
    """A generator that runs code on the device while it generates (as Inductor runs the graph it
    captures), found by name from this module: its ``act`` config faults the device or kills
    its process instead of generating."""

    name = "device-generator"
    generates_in_parent = True

    def supports(self, spec):
        return None

    def generate(self, spec, config):
        if config["act"] == "assert":
            raise RuntimeError("CUDA error: device-side assert triggered")
        if config["act"] == "die":
            os._exit(3)
        program = ELEMENTWISE.generate(spec, ELEMENTWISE.seed_configs(spec)[0])
        return dataclasses.replace(program, source=program.source + f"\n# generated in process {os.getpid()}\n")


DEVICE_GENERATOR = DeviceGenerator()


def test_a_generator_that_runs_on_the_device_generates_in_the_measure_worker_where_a_fault_ends_only_it():
    """Issue 36: Inductor's capture ran Mixtral's routing graph on the fill's own GPU context; a
    device-side assert there ended the run. Given the measure worker (as FillRun gives it), such a
    generator generates there: a fault or a death is ContainedFault, journaled as a contained
    fault, the worker is replaced, and the next candidate is generated by a fresh one."""
    import types
    import torch
    from kernel_testing import spec_of
    from torch_kernelize.fill_cache.builder import Builder
    from torch_kernelize.lowering.kernels import Config
    spec = spec_of(torch.ops.aten.relu.default, [torch.randn(8)])
    builder = Builder(get_target("interpreter"))
    worker = measure_worker.MeasureWorker(time_limit_s=120)
    builder.generate_elsewhere = measure_worker.generate_in(worker)
    fake = types.SimpleNamespace(target=types.SimpleNamespace(device="cuda"), spec=spec, builder=builder)
    try:
        directory = builder.build(spec, DEVICE_GENERATOR, Config.of(act="ok"))
        first = worker._proc.pid
        assert first != os.getpid()
        assert any(f"generated in process {first}" in f.read_text(errors="replace")
                   for f in directory.rglob("*.py")), "the program was not generated in the worker"
        for act, why in (("assert", "faulted the device"), ("die", "ended the measure worker")):
            with pytest.raises(RuntimeError, match=why) as e:
                builder.build(spec, DEVICE_GENERATOR, Config.of(act=act))
            assert (spec.key, Config.of(act=act).key) in builder.contained
            ev = measure_worker.IsolatedMeasurer._build_failed(fake, Config.of(act=act), f"build failed: {e.value}")
            assert ev.fault and ev.contained and not builder.failed_here
        builder.discard(spec)
        directory = builder.build(spec, DEVICE_GENERATOR, Config.of(act="ok"))   # a fresh worker generates it
        assert worker._proc.pid not in (first, os.getpid())
        assert any(f"generated in process {worker._proc.pid}" in f.read_text(errors="replace")
                   for f in directory.rglob("*.py"))
    finally:
        worker.close()
        builder.close()


def test_the_lookahead_leaves_generators_that_run_here_to_the_search():
    """The fill builds the next specs' seeds ahead in the pool; a generator that generates before
    its job goes there (Inductor, in the measure worker) would make it wait, for specs a whole
    graph's program may cover (Llama's fill spent its minute so, Mixtral's faulted on a stretch
    searched only at budget 2): ahead, only pool-generated candidates are submitted."""
    import torch
    from kernel_testing import spec_of
    from torch_kernelize.fill_cache.builder import Builder
    from torch_kernelize.lowering.kernels import Config
    spec = spec_of(torch.ops.aten.relu.default, [torch.randn(8)])
    builder = Builder(get_target("interpreter"))
    submitted = []
    builder._pool, builder._submit = object(), submitted.append   # as if building in workers
    builder.submit(spec, DEVICE_GENERATOR, [Config.of(act="die")], ahead=True)
    builder.submit(spec, ELEMENTWISE, ELEMENTWISE.seed_configs(spec)[:1], ahead=True)
    assert submitted == [(spec.key, ELEMENTWISE.seed_configs(spec)[0].key)]
    builder.submit(spec, DEVICE_GENERATOR, [Config.of(act="ok")])   # the search asks: generated now (here)
    assert submitted[-1] == (spec.key, Config.of(act="ok").key)
    builder._pool = None
    builder.close()


def test_the_fill_says_where_its_time_went():
    """Issue 36: the summary line accounts for the whole run: the trace before it, each phase,
    and the rest (storing, waiting for the last compiles)."""
    summary = {"time": {"build": 2.0, "reference": 1.0, "validation": 1.5, "timing": 0.5}, "trace_seconds": 9.04}
    assert cli.time_line(10.0, summary) == ("trace 9.0s before; build 2.0s, reference 1.0s, validation 1.5s, "
                                            "timing 0.5s, other 5.0s")
    summary["closing_seconds"] = 3.0  # the last stores and the workers' end, apart from the rest
    assert cli.time_line(10.0, summary).endswith("timing 0.5s, closing 3.0s, other 2.0s")


def test_on_cuda_the_measure_worker_starts_before_the_models_are_traced_and_a_failed_trace_ends_it(
        tmp_path, monkeypatch):
    """Its imports, CUDA context and Inductor's import overlap the trace (FillRun.start_worker);
    a trace that fails kills it instead of waiting for its start."""
    events = []
    monkeypatch.setattr(fill_run.FillRun, "start_worker", lambda self: events.append("worker started"))
    monkeypatch.setattr(fill_run.FillRun, "close", lambda self, kill=False: events.append(f"closed kill={kill}"))

    def collect(args, target, generators):
        events.append("traced")
        raise cli.UsageError("the model raised")
    monkeypatch.setattr(cli, "collect_work", collect)
    args = cli.parse_args(["--model", MODEL, "--target", "interpreter", "--cache-dir", str(tmp_path)])
    with pytest.raises(cli.UsageError):
        cli._start_run(args, None)
    assert events == ["worker started", "traced", "closed kill=True"]


def test_a_worker_that_will_generate_with_inductor_is_warmed_on_cuda_only():
    cuda = dataclasses.replace(get_target("interpreter"), name="a-gpu", device="cuda", triton="cuda")
    assert measure_worker.MeasureWorker.for_target(cuda, 60, inductor=True).inductor
    assert not measure_worker.MeasureWorker.for_target(get_target("interpreter"), 60, inductor=True).inductor
    assert not measure_worker.MeasureWorker.for_target(cuda, 60).inductor
    # a spare worker started without Inductor does not serve one that wants it warm
    assert measure_worker.MeasureWorker(inductor=True)._kind() != measure_worker.MeasureWorker()._kind()
    measure_worker._warm_inductor()  # (in this process: Inductor's import)


def test_nothing_is_compiled_ahead_while_a_whole_graph_is_searched(tmp_path, monkeypatch):
    """A whole graph's candidates are timed host-bound: the lookahead's compiles wait until the
    search has moved past it (fill_run.LOOKAHEAD), then go on for the specs after it."""
    import torch
    from kernel_testing import spec_of
    from torch_kernelize.fill_cache.collect import Work
    from torch_kernelize.kernel_cache import KernelCache
    target = get_target("interpreter")
    whole, *nodes = [spec_of(op, [torch.randn(8 + i)]) for i, op in
                     enumerate([torch.ops.aten.relu.default, torch.ops.aten.neg.default, torch.ops.aten.exp.default])]
    monkeypatch.setattr(fill_run, "is_whole_graph", lambda spec: spec.key == whole.key)
    run = fill_run.FillRun(target, KernelCache.for_target(tmp_path, target), 1, False, False, cli.MIN_SPEEDUP,
                           isolate=False)
    events = []
    monkeypatch.setattr(run.builder, "submit", lambda spec, family, configs, ahead=False: events.append(("ahead", spec.key)))
    monkeypatch.setattr(run, "_timed", lambda w, bar: events.append(("searched", w.spec.key)) or {"key": w.spec.key, "status": "vendor wins"})
    run.run([Work(whole, "test"), *(Work(n, "test") for n in nodes)], quiet=True)
    assert events[0] == ("searched", whole.key)  # nothing compiled beside its timing
    assert ("ahead", nodes[0].key) in events and ("ahead", nodes[1].key) in events
    assert events.index(("ahead", nodes[0].key)) < events.index(("searched", nodes[0].key))
