"""Misses and missing ops: repro folders, standalone repro.py, strict mode, check mode + minifier,
kernels failing at run time, lowering failures, python -m torch_kernelize.repros, fill_cache --repros."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, console_scripts, last_json, run_python, write_target
sys.path.insert(0, str(REPO / "test"))
from torch_kernelize import flush_repros
from torch_kernelize.core.errors import MissingOpsError

pytestmark = pytest.mark.slow
MODELS = "torch_kernelize.model_zoo"


def repro_exit(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(folder / "repro.py"), *args], capture_output=True, text=True,
                          cwd=folder, timeout=600)


def fill(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", *args],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _small(tmp_path, chip, cache, repros, strict=False, check=False):
    from torch_kernelize.model_zoo import make_small
    model, inputs = make_small()
    compiled = torch.compile(model, backend="kernelize", options={
        "target": str(chip), "cache_dir": str(cache), "repro_dir": str(repros), "strict": strict, "check": check})
    return model, inputs, compiled


def test_missing_op_repro_reproduces_until_fill_cache_adds_a_kernel(tmp_path):
    chip = write_target(tmp_path / "chip.toml", unsupported=["aten.histc"])
    cache, repros = tmp_path / "cache", tmp_path / "repros"
    model, inputs, compiled = _small(tmp_path, chip, cache, repros)
    with torch.no_grad():
        for o, r in zip(compiled(*inputs), model(*inputs)):
            torch.testing.assert_close(o, r)
    flush_repros()  # misses are recorded in the background
    folders = {json.loads((f / "spec.json").read_text())["op"]: f for f in (p.parent for p in repros.glob("*/spec.json"))}
    missing = folders["aten.histc.default"]
    meta = json.loads((missing / "spec.json").read_text())
    assert meta["kind"] == "missing" and meta["target"] == str(chip.resolve())
    assert {"graph.py", "repro.py", "reference.pt", "inputs"} <= {p.name for p in missing.iterdir()}
    assert "histc" in (missing / "graph.py").read_text()
    # misses of ops with a generator are recorded too
    assert json.loads((folders["aten._softmax.default"] / "spec.json").read_text())["kind"] == "miss"

    before = repro_exit(missing)
    assert before.returncode == 1, before.stdout + before.stderr
    assert "REPRODUCES" in before.stdout and "fallback" in before.stdout

    out = fill("--repros", str(repros), "--target", str(chip), "--cache-dir", str(cache))
    assert "stored" in out.stdout
    after = repro_exit(missing)  # the folder's own script, as a person runs it
    assert after.returncode == 0, after.stdout + after.stderr
    assert "FIXED" in after.stdout and "tier triton" in after.stdout

    listing = subprocess.run([sys.executable, "-m", "torch_kernelize.repros", "replay", str(repros)],
                             capture_output=True, text=True, timeout=900)  # every folder, one process
    assert listing.returncode == 0, listing.stdout + listing.stderr
    every = [p.parent.name for p in repros.glob("*/spec.json")]
    n = len(every)
    assert f"{n} reproducer(s): 0 reproduce, {n} fixed, 0 error" in listing.stdout
    rows = [line for line in listing.stdout.splitlines() if line.split(" ")[0] in every]
    assert len(rows) == n and all("tier triton" in row for row in rows), listing.stdout


def test_strict_mode_names_every_missing_op_and_its_repro_folder(tmp_path):
    chip = write_target(tmp_path / "chip.toml", unsupported=["aten.histc", "aten.sigmoid"], triton="none")
    _, inputs, compiled = _small(tmp_path, chip, tmp_path / "cache", tmp_path / "repros", strict=True)
    with pytest.raises(MissingOpsError) as info:
        compiled(*inputs)
    err = info.value
    assert set(err.missing) == {"aten.histc.default", "aten.sigmoid.default"}
    for op, folder in err.missing.items():
        assert folder and (Path(folder) / "repro.py").exists(), op
        assert folder in str(err)
    assert "strict mode" in str(err) and "fill_cache" in str(err)
    with pytest.raises(MissingOpsError):  # and again on the next call
        compiled(*inputs)


def _plant(cache_root: Path, op: str, edit) -> str:
    """Replace the stored program of the entry for ``op`` by an edited one, with valid hashes."""
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.core.targets import get_target
    import shutil
    kc = KernelCache.for_target(cache_root, get_target("interpreter"))
    entry = next(e for e in kc.entries() if e.spec.op == op)
    work = cache_root.parent / f"planted-{entry.key}"
    shutil.copytree(entry.program_dir, work)
    edit(work)
    kc.put(dict(entry.record), work, replace=True)
    return entry.key


def test_check_mode_catches_a_planted_wrong_kernel_and_minifies_it_to_one_node(tmp_path):
    cache, repros = tmp_path / "cache", tmp_path / "repros"
    fill("--model", f"{MODELS}:make_wide", "--target", "interpreter", "--cache-dir", str(cache))

    def wrong(d: Path):  # tanh -> something else, still a valid kernel
        src = (d / "kernel.py").read_text()
        assert "(1.0 - e)" in src
        (d / "kernel.py").write_text(src.replace("(1.0 - e)", "(1.5 - e)"))
    key = _plant(cache, "aten.tanh.default", wrong)

    from torch_kernelize.model_zoo import make_wide
    model, inputs = make_wide()
    compiled = torch.compile(lambda x: model(x) * 2 + 1, backend="kernelize", options={
        "target": "interpreter", "cache_dir": str(cache), "repro_dir": str(repros), "check": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs) * 2 + 1)  # the vendor's answer was used
        compiled(*inputs)  # the kernel stays disabled: no second report
    found = [p.parent for p in repros.glob("mismatch-*/spec.json")]
    assert len(found) == 1
    meta = json.loads((found[0] / "spec.json").read_text())
    assert meta["spec"]["key"] == key and meta["kind"] == "mismatch" and "mismatch" in meta["cause"]
    assert meta["minified_from"]["to"] < meta["minified_from"]["nodes"]
    graph = (found[0] / "graph.py").read_text()
    assert graph.count("torch.ops.aten.") == 1 and "tanh" in graph, graph
    assert repro_exit(found[0]).returncode == 1
    # fill_cache --repros replaces the wrong entry; the repro is then fixed
    fill("--repros", str(repros), "--target", "interpreter", "--cache-dir", str(cache))
    assert repro_exit(found[0]).returncode == 0


def test_a_kernel_that_raises_at_run_time_is_disabled_and_the_answer_stays_right(tmp_path, caplog):
    cache, repros = tmp_path / "cache", tmp_path / "repros"
    fill("--model", f"{MODELS}:make_small", "--target", "interpreter", "--cache-dir", str(cache))

    def broken(d: Path):  # a launch that reads an input the spec does not have
        prog = json.loads((d / "program.json").read_text())
        prog["launches"][0]["args"][0] = ["in", 7]
        (d / "program.json").write_text(json.dumps(prog))
    _plant(cache, "aten.histc.default", broken)
    from torch_kernelize.model_zoo import make_small
    model, inputs = make_small()
    compiled = torch.compile(model, backend="kernelize", options={
        "target": "interpreter", "cache_dir": str(cache), "repro_dir": str(repros)})
    with torch.no_grad():
        for _ in range(2):
            for o, r in zip(compiled(*inputs), model(*inputs)):
                torch.testing.assert_close(o, r)
    assert sum("is disabled for this process" in r.message for r in caplog.records) == 1
    assert list(repros.glob("failure-histc*/repro.py"))


def test_a_graph_that_fails_to_lower_is_minified_and_the_error_names_the_repro(tmp_path):
    proc = run_python(f"""
        import json, torch
        import torch_kernelize.compiling.planner as planner
        real = planner.build_spec
        def buggy(node, bindings):
            if node.target is torch.ops.aten.sigmoid.default:
                raise RuntimeError("planted planner bug")
            return real(node, bindings)
        planner.build_spec = buggy
        def f(x):
            return (x.relu() * 2).sigmoid().sum(-1) + 1
        c = torch.compile(f, backend="kernelize", options={{"target": "interpreter",
                          "repro_dir": {str(tmp_path / 'repros')!r}}})
        try:
            c(torch.randn(4, 8))
        except Exception as e:
            print(json.dumps({{"error": str(e)}}))
    """)
    error = last_json(proc)["error"]
    assert "could not lower" in error and "planted planner bug" in error and "minified repro:" in error
    folder = Path(error.split("minified repro: ")[1].strip().splitlines()[0])
    graph = (folder / "graph.py").read_text()
    assert "sigmoid" in graph and graph.count("torch.ops.aten.") == 1, graph
    assert json.loads((folder / "spec.json").read_text())["kind"] == "lowering"


def test_repros_list_tool(tmp_path):
    chip = write_target(tmp_path / "chip.toml", unsupported=["aten.histc"], triton="none")
    _, inputs, compiled = _small(tmp_path, chip, tmp_path / "cache", tmp_path / "repros")
    compiled(*inputs)
    flush_repros()
    out = subprocess.run([sys.executable, "-m", "torch_kernelize.repros", "list", str(tmp_path / "repros")],
                         capture_output=True, text=True, check=True).stdout
    assert "missing" in out and "aten.histc.default" in out and "1 reproducer(s)" in out


def test_the_checkout_script_and_the_console_script_run_the_same_command(tmp_path, monkeypatch, capsys):
    """tools/repros.py run as a script, and pyproject's kernelize-repros, call the package's main."""
    import importlib
    import runpy

    import torch_kernelize.repros
    (tmp_path / "repros").mkdir()
    monkeypatch.setattr(sys, "argv", ["tools/repros.py", "list", str(tmp_path / "repros")])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(REPO / "tools" / "repros.py"), run_name="__main__")
    assert exited.value.code == 0 and "0 reproducer(s)" in capsys.readouterr().out
    module, _, name = console_scripts()["kernelize-repros"].partition(":")
    assert getattr(importlib.import_module(module), name) is torch_kernelize.repros.main


def test_every_region_miss_gets_a_repro_also_when_view_folding_removed_its_inputs(tmp_path, monkeypatch):
    """In an inference graph, view folding replaces a chain of views by one re-striding call: a
    region whose inputs are such views still gets its repro, its views replayed on the copy of
    their root (compiling/folded_capture.py) rather than the planned graph run a second time."""
    from torch_kernelize.model_zoo import make_transformer
    from torch_kernelize.serving import runtime

    def interpreted(*args, **kwargs):
        raise AssertionError("the first call ran FX's interpreter")
    monkeypatch.setattr(runtime.CapturingInterpreter, "run", interpreted)
    model, inputs = make_transformer()
    repros, report = tmp_path / "repros", tmp_path / "report.json"
    compiled = torch.compile(model, backend="kernelize", options={
        "target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": str(repros),
        "report": str(report)})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    flush_repros()
    regions = [r for g in json.loads(report.read_text())["graphs"] for r in g["regions"] if r.get("miss")]
    assert len(regions) >= 3
    for r in regions:
        assert (Path(r["repro"]) / "spec.json").exists(), f"no repro for {r['shapes']}"
    folder = Path(regions[0]["repro"])
    replay = repro_exit(folder)
    assert replay.returncode == 1 and "REPRODUCES" in replay.stdout, replay.stdout + replay.stderr
