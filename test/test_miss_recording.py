"""Miss recording at serving time: once per record key, capped per process in count and bytes,
written by a background thread (never the calling one), flushed at exit, never raising."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import run_python
from torch_kernelize import flush_repros
from torch_kernelize.core.errors import OptionsError
from torch_kernelize.core.options import Options
from torch_kernelize.serving import repro_writer as dump


def _model(x):
    return torch.sigmoid(x) * 2


def _compiled(tmp_path: Path, **options):
    opts = {"target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": str(tmp_path / "repros"),
            "report": str(tmp_path / "report.json"), "graph_cache": "off"}
    return torch.compile(_model, backend="kernelize", dynamic=True, options=dict(opts, **options))


def _folders(tmp_path: Path) -> list[Path]:
    return sorted(p.parent for p in (tmp_path / "repros").glob("*/spec.json"))


def _counts(tmp_path: Path) -> dict:
    from torch_kernelize.compiling.report import ReportWriter
    ReportWriter.for_path(tmp_path / "report.json").write()
    return json.loads((tmp_path / "report.json").read_text())["repros"]


def test_many_shapes_record_a_bounded_number_of_misses_and_the_report_counts_the_rest(tmp_path):
    compiled = _compiled(tmp_path, repro_max=3)
    with torch.no_grad():
        for batch in range(2, 14):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), _model(x))
    assert flush_repros(60)
    assert len(_folders(tmp_path)) == 3
    counts = _counts(tmp_path)
    assert counts["written"] == 3 and counts["failed"] == 0
    assert counts["suppressed_by_reason"]["count_cap"] >= 12 * 2 - 3  # two ops a shape (sigmoid, mul)
    assert counts["suppressed"] == sum(counts["suppressed_by_reason"].values())


def test_a_miss_is_recorded_once_per_process_and_not_again_where_its_folder_exists(tmp_path):
    x = torch.randn(4, 8)
    with torch.no_grad():
        _compiled(tmp_path)(x)
        torch._dynamo.reset()
        _compiled(tmp_path)(x)  # a second compile of the same graph: the same specs
    assert flush_repros(60)
    folders = _folders(tmp_path)
    assert folders and _counts(tmp_path)["suppressed_by_reason"]["duplicate"] >= len(folders)
    stamps = {f: (f / "spec.json").stat().st_mtime_ns for f in folders}

    # a new process (the same folder on disk): nothing is written again
    from torch_kernelize.serving import repro_recorder as recorder
    recorder.budget = recorder.MissBudget()
    torch._dynamo.reset()
    with torch.no_grad():
        _compiled(tmp_path)(x)
    assert flush_repros(60)
    assert {f: (f / "spec.json").stat().st_mtime_ns for f in _folders(tmp_path)} == stamps
    assert recorder.budget.count == 0


def test_the_cap_in_bytes_of_captured_inputs(tmp_path):
    # a (16, 8) float32 input holds 512 bytes: room for one miss, not for two
    compiled = _compiled(tmp_path, repro_max_bytes=700)
    with torch.no_grad():
        compiled(torch.randn(16, 8))
    assert flush_repros(60)
    assert len(_folders(tmp_path)) == 1
    counts = _counts(tmp_path)
    assert counts["written"] == 1 and counts["suppressed_by_reason"]["bytes_cap"] >= 1


def test_the_cap_warning_counts_what_was_written(tmp_path, caplog):
    # tanh's (64, 32) input (8 KiB) alone is over the cap when the graph is planned, before the
    # (22, 8) misses (704 bytes each) are taken on the first call and written
    def model(x, y):
        return torch.sigmoid(x) * 2, torch.tanh(y)
    opts = {"target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": str(tmp_path / "repros"),
            "graph_cache": "off", "repro_max_bytes": 3000}
    with caplog.at_level(logging.WARNING, logger="torch_kernelize"), torch.no_grad():
        torch.compile(model, backend="kernelize", options=opts)(torch.randn(22, 8), torch.randn(64, 32))
        assert flush_repros(60)
    said = [r.getMessage() for r in caplog.records if "met its cap" in r.getMessage()]
    written = _folders(tmp_path)
    assert len(said) == 1 and len(written) >= 2, (said, written)
    assert f"wrote {len(written)} miss reproducer(s) ({704 * len(written)} bytes of inputs)" in said[0]


def test_reproducers_are_written_off_the_calling_thread(tmp_path, monkeypatch):
    release, writers = threading.Event(), []
    original = dump.write_repro

    def slow_write(*args, **kwargs):
        writers.append(threading.current_thread())
        release.wait(60)  # the call below would never return if it waited for this write
        return original(*args, **kwargs)

    monkeypatch.setattr(dump, "write_repro", slow_write)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(tmp_path)(x), _model(x))
    assert not release.is_set() and _folders(tmp_path) == []  # the call returned with its repros queued
    release.set()
    assert flush_repros(60)
    assert _folders(tmp_path) and writers
    assert all(t is not threading.main_thread() and t.name == "kernelize-repro-writer" for t in writers)


def test_writing_a_reproducer_runs_no_compiled_hash_under_a_reseeded_rng(tmp_path, monkeypatch):
    """The content store's default hash is a torch.compile'd kernel run under a reseeded global RNG:
    from the writer thread it would race the model's compiles and hand seed-0 numbers to whichever
    thread draws meanwhile. The writer hashes with sha1 instead."""
    import torch.utils._content_store as store

    def compiled_hash(*args, **kwargs):
        raise AssertionError("the repro writer ran the compiled storage hash")

    monkeypatch.setattr(store, "hash_storage_kernel", compiled_hash)
    from torch_kernelize.core import targets
    gm = torch.fx.symbolic_trace(_model)
    x = torch.randn(4, 8)
    assert dump.write_repro(tmp_path / "r", None, [x], targets.get_target("interpreter"), "lowering", None, gm=gm)
    assert {"spec.json", "repro.py", "inputs"} <= {p.name for p in (tmp_path / "r").iterdir()}


def test_queued_reproducers_are_written_at_interpreter_exit(tmp_path):
    run_python(f"""
        import time, torch
        from torch_kernelize.serving import repro_writer as dump
        original = dump.write_repro
        def slow_write(*args, **kwargs):
            time.sleep(0.5)
            return original(*args, **kwargs)
        dump.write_repro = slow_write
        f = torch.compile(lambda x: torch.sigmoid(x) * 2, backend="kernelize", options={{
            "target": "interpreter", "cache_dir": {str(tmp_path / 'cache')!r},
            "repro_dir": {str(tmp_path / 'repros')!r}, "graph_cache": "off"}})
        with torch.no_grad():
            f(torch.randn(4, 8))
        # no flush: the interpreter exits with the writes queued
    """)
    folders = _folders(tmp_path)
    assert len(folders) >= 2  # sigmoid and mul
    for f in folders:
        assert {"spec.json", "repro.py", "graph.py", "reference.pt", "inputs"} <= {p.name for p in f.iterdir()}
    assert not [p for p in (tmp_path / "repros").iterdir() if ".tmp-" in p.name]  # nothing half-written


def test_an_unwritable_repro_dir_is_logged_once_and_never_raised(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="torch_kernelize"), torch.no_grad():
        torch.testing.assert_close(_compiled(tmp_path, repro_dir=str(blocker / "repros"))(x), _model(x))
        assert flush_repros(60)
    warnings = [r for r in caplog.records if "could not write a reproducer" in r.getMessage()]
    assert len(warnings) == 1 and "repro_dir" in warnings[0].getMessage()
    assert _counts(tmp_path)["failed"] >= 2


def test_cap_options_from_the_environment_and_their_errors():
    opts = Options.resolve(env={"KERNELIZE_REPRO_MAX": "5", "KERNELIZE_REPRO_MAX_BYTES": "1024"})
    assert (opts.repro_max, opts.repro_max_bytes) == (5, 1024)
    assert (Options.resolve(env={}).repro_max, Options.resolve(env={}).repro_max_bytes) == (512, 2**30)
    with pytest.raises(OptionsError, match="repro_max.*whole number"):
        Options.resolve({"repro_max": -1})
    with pytest.raises(OptionsError, match="KERNELIZE_REPRO_MAX_BYTES"):
        Options.resolve(env={"KERNELIZE_REPRO_MAX_BYTES": "256MB"})


EXIT_SNIPPET = """
import concurrent.futures, pathlib, time
from torch_kernelize.serving import repro_recorder as r
out = pathlib.Path({out!r})

def slow_write():  # a repro's write uses concurrent.futures (Dynamo's repro string does)
    time.sleep(1.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        (out / "first").write_text(pool.submit(lambda: "written").result())

r.EXIT_WAIT_S = 0.2    # the exit's wait, shortened
r.writer.submit(slow_write)
r.writer.submit(lambda: (out / "second").write_text("written"))
"""


def test_an_exit_while_reproducers_are_queued_finishes_the_running_one_and_drops_the_rest(tmp_path):
    """The exit neither aborts the interpreter (a write still running inside torch at finalization
    did, on a loaded machine) nor waits for the whole queue: the running write completes, the rest
    are dropped with a warning."""
    proc = run_python(EXIT_SNIPPET.format(out=str(tmp_path)), check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "first").read_text() == "written"
    assert not (tmp_path / "second").exists()
    assert "1 reproducer(s) not written" in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_miss_is_captured_on_the_device_and_copied_to_the_host_behind_the_model():
    """The calling thread takes device copies (no device-to-host wait in a served call); the
    writer's copies to the host wait for the work that made them, on a stream of their own, and
    hold the values of capture time though the model overwrites its tensors right after."""
    from torch_kernelize.serving.runtime import CapturingInterpreter

    gm = torch.fx.symbolic_trace(lambda x: torch.sigmoid(x * 2) + 1)
    node = next(n.name for n in gm.graph.nodes if n.op == "call_function")  # x * 2: its input is x
    x = torch.randn(1024, 1024, device="cuda")
    expected = x.cpu()
    torch.cuda._sleep(50_000_000)  # (the stream is busy: the capture is queued behind it)
    interp = CapturingInterpreter(gm, {node}, on_device=True)
    interp.run(x)
    copies = interp.captured[node]
    assert [t.device.type for t in copies] == ["cuda"]
    ready = dump.device_ready(copies)
    x.zero_()  # the model goes on with its buffers
    torch.cuda._sleep(50_000_000)
    on_host = dump.host_copies(copies, ready)
    assert on_host[0].device.type == "cpu"
    torch.testing.assert_close(on_host[0], expected)


def test_a_first_call_captures_its_misses_inputs_in_the_generated_code(tmp_path, monkeypatch):
    """The first call that records misses runs the graph's generated code with capture lines, not
    FX's interpreter (a node at a time: on Mixtral's first call of a new bucket, tens of ms), and
    the repro holds the input the miss met."""
    from torch_kernelize.serving import repro_inputs, runtime

    def interpreted(*args, **kwargs):
        raise AssertionError("the first call ran FX's interpreter")
    monkeypatch.setattr(runtime.CapturingInterpreter, "run", interpreted)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(_compiled(tmp_path)(x), _model(x))
    assert flush_repros(60)
    metas = {f: repro_inputs.read_meta(f) for f in _folders(tmp_path)}
    sigmoid = [f for f, m in metas.items() if "sigmoid" in json.dumps(m)]
    assert sigmoid, sorted(metas)
    torch.testing.assert_close(repro_inputs.read_inputs(sigmoid[0])[0], x)


def test_a_reproducer_is_written_once_the_model_is_quiet_or_when_someone_waits(tmp_path, monkeypatch):
    """Writes wait for a quiet spell of the model's calls (their Python would stretch its calls),
    at most MAX_DEFER_S; flush_repros does not wait for quiet."""
    from torch_kernelize.serving import repro_recorder, runtime
    monkeypatch.setattr(repro_recorder, "QUIET_S", 0.5)
    monkeypatch.setattr(repro_recorder, "MAX_DEFER_S", 30.0)
    started = []
    original = dump.write_repro
    monkeypatch.setattr(dump, "write_repro", lambda *a, **k: started.append(runtime.calls.quiet_s()) or
                        original(*a, **k))
    compiled, x = _compiled(tmp_path), torch.randn(4, 8)
    with torch.no_grad():
        compiled(x)
        for _ in range(20):  # a busy model: calls 20 ms apart
            time.sleep(0.02)
            compiled(x)
    assert started == []
    time.sleep(1.5)
    assert started and min(started) >= 0.5, started
    with torch.no_grad():
        compiled(torch.randn(6, 8))  # a new shape: more misses to write, the model just called
    assert flush_repros(60)
