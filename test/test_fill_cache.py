"""fill_cache end to end on the interpreter target: misses -> fill -> hits in a new process,
SIGKILL + resume, concurrent runs, corrupted entries, and no compilation on the serving path."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import last_json, run_python

pytestmark = pytest.mark.slow

MODELS = "torch_kernelize.model_zoo"  # the model zoo: --model references are f"{MODELS}:make_..."

COMPILE_SNIPPET = """
import json, sys, torch
from torch_kernelize import model_zoo
model, inputs = model_zoo.{fn}()
compiled = torch.compile(model, backend="kernelize", options={{"target": {target!r}, "cache_dir": {cache!r},
                         "repro_dir": {repros!r}, "report": {report!r}}})
with torch.no_grad():
    outs, refs = compiled(*inputs), model(*inputs)
outs = outs if isinstance(outs, tuple) else (outs,)
refs = refs if isinstance(refs, tuple) else (refs,)
err = max((o - r).abs().max().item() for o, r in zip(outs, refs))
doc = json.load(open({report!r}))
tiers = {{n["op"]: n["tier"] for g in doc["graphs"] for n in g["nodes"]}}
misses = sorted({{n["op"] for g in doc["graphs"] for n in g["nodes"] if n.get("miss")}})
print(json.dumps({{"err": err, "tiers": tiers, "misses": misses}}))
"""


def compile_in_fresh_process(tmp_path, cache, fn="make_small", name="report.json", env=None, target="interpreter"):
    proc = run_python(COMPILE_SNIPPET.format(fn=fn, cache=str(cache), target=target,
                                             repros=str(tmp_path / "repros"), report=str(tmp_path / name)), env=env)
    return last_json(proc), proc


def fill_cache(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", *args],
                          capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"fill_cache failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


OPS = ("aten.sigmoid.default", "aten.mul.Tensor", "aten._softmax.default", "aten.histc.default")


def test_misses_then_fill_cache_then_triton_tier_in_a_new_process(tmp_path):
    cache = tmp_path / "cache"
    before, _ = compile_in_fresh_process(tmp_path, cache, name="before.json")
    assert before["err"] < 1e-5
    assert set(before["misses"]) >= set(OPS)
    assert all(before["tiers"][op] == "vendor" for op in OPS)
    assert len(list((tmp_path / "repros").glob("*/spec.json"))) >= 4

    proc = fill_cache("--model", f"{MODELS}:make_small", "--target", "interpreter", "--cache-dir", str(cache))
    assert "stored" in proc.stdout and "without a correct candidate" in proc.stdout
    runs = list(cache.glob("*/runs/*.json"))
    summary = json.loads(runs[0].read_text())
    # nodes inside a region that got a fused kernel are not searched alone
    assert {r["status"] for r in summary["specs"]} <= {"stored", "in a fused region"}

    after, _ = compile_in_fresh_process(tmp_path, cache, name="after.json")
    assert after["err"] < 1e-5
    assert all(after["tiers"][op] == "triton" for op in OPS), after["tiers"]
    assert after["misses"] == []


def _journal_lines(cache: Path) -> list[dict]:
    out = []
    for j in cache.glob("*/journals/*.jsonl"):
        for line in j.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def test_sigkill_then_resume_loses_nothing_and_repeats_nothing(tmp_path):
    cache = tmp_path / "cache"
    args = ["--model", f"{MODELS}:make_wide", "--target", "interpreter", "--cache-dir", str(cache), "--budget", "5"]
    proc = subprocess.Popen([sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and len(_journal_lines(cache)) < 2 and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = _journal_lines(cache)
    assert 2 <= len(done_before) < 5, "the run was not killed in the middle of its search"
    assert not list(cache.glob("*/entries/*/entry.json")), "nothing may be stored before the search ends"

    resumed = fill_cache(*args, "--resume")
    assert "stored" in resumed.stdout
    lines = _journal_lines(cache)
    configs = [json.dumps(r["config"], sort_keys=True) for r in lines]
    assert len(lines) == 5, "the resumed search must stop at the budget"
    assert len(set(configs)) == len(configs), "a configuration was evaluated twice"
    assert configs[:len(done_before)] == [json.dumps(r["config"], sort_keys=True) for r in done_before]
    summary = json.loads(sorted(cache.glob("*/runs/*.json"))[-1].read_text())
    assert summary["specs"][0]["resumed"] == len(done_before)


def test_two_concurrent_runs_leave_a_valid_cache(tmp_path):
    cache = tmp_path / "cache"
    args = ["--model", f"{MODELS}:make_small", "--target", "interpreter", "--cache-dir", str(cache)]
    procs = [subprocess.Popen([sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.core.targets import get_target
    kc = KernelCache.for_target(cache, get_target("interpreter"))
    assert kc.check_integrity() == []
    assert len(kc.keys()) >= 2  # the fused region (sigmoid, mul, softmax) and histc, + nodes searched before it
    # each spec was searched once: the other process found it stored
    statuses = [r["status"] for f in cache.glob("*/runs/*.json") for r in json.loads(f.read_text())["specs"]]
    assert statuses.count("stored") == len(kc.keys())
    assert {kc.get(k).language for k in kc.keys()} == {"triton"}  # kernel.py programs
    after, _ = compile_in_fresh_process(tmp_path, cache)
    assert after["err"] < 1e-5 and all(after["tiers"][op] == "triton" for op in OPS)


def test_corrupted_entry_is_skipped_with_a_warning_and_the_model_still_runs(tmp_path):
    cache = tmp_path / "cache"
    fill_cache("--model", f"{MODELS}:make_small", "--target", "interpreter", "--cache-dir", str(cache))
    kernels = sorted(cache.glob("*/entries/*/program/kernel.py"))
    victim = next(k for k in kernels if "histc" in json.loads((k.parent.parent / "entry.json").read_text())["spec"]["op"])
    key = victim.parent.parent.name
    victim.write_text(victim.read_text().replace("tl.atomic_add", "tl.atomic_max", 1) + "\n# tampered\n")
    after, proc = compile_in_fresh_process(tmp_path, cache)
    assert after["err"] < 1e-5
    assert after["tiers"]["aten.histc.default"] == "vendor"
    assert after["tiers"]["aten._softmax.default"] == "triton"
    assert key in proc.stderr and "skip" in proc.stderr.lower()


def test_serving_from_a_warm_cache_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    fill_cache("--model", f"{MODELS}:make_small", "--target", "interpreter", "--cache-dir", str(cache))
    proc = run_python(f"""
        import json, torch, triton
        import triton.compiler.compiler as cc
        from triton.runtime.jit import JITFunction
        counts = {{"compile": 0, "jit_run": 0}}
        orig_compile, orig_run = cc.compile, JITFunction.run
        def counting_compile(*a, **k):
            counts["compile"] += 1
            return orig_compile(*a, **k)
        def counting_run(self, *a, **k):
            counts["jit_run"] += 1
            return orig_run(self, *a, **k)
        cc.compile = triton.compile = counting_compile
        JITFunction.run = counting_run
        from torch_kernelize import model_zoo
        model, inputs = model_zoo.make_small()
        compiled = torch.compile(model, backend="kernelize", options={{"target": "interpreter",
                                 "cache_dir": {str(cache)!r}, "repro_dir": "off"}})
        with torch.no_grad():
            for _ in range(3):
                compiled(*inputs)
        lowered = [g for g in __import__("gc").get_objects() if type(g).__name__ == "LoweredGraph"]
        on_triton = sum(d.tier == "triton" for g in lowered for d in g.report.decisions)
        families = sorted({{str(d.family) for g in lowered for d in g.report.decisions if d.tier == "triton"}})
        # every node hit (alone or in a fused region): no generator family was asked about any
        asked = "torch_kernelize.lowering.kernels.registry" in __import__("sys").modules
        print(json.dumps(dict(counts, on_triton=on_triton, families=families, asked=asked)))
    """)
    res = last_json(proc)
    assert res["on_triton"] >= 4
    assert res["compile"] == 0 and res["jit_run"] == 0, res
    assert not res["asked"], res
    assert "None" not in res["families"], res  # covered nodes name the region's family


@pytest.mark.parametrize("case", ["cache dir is a file", "model file does not import", "model function raises",
                                  "bad budget", "nothing to fill"])
def test_bad_input_exits_2_with_one_clear_line(case, tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "broken.py").write_text("import a_module_that_does_not_exist_anywhere\n")
    (tmp_path / "raises.py").write_text("def make():\n    raise ValueError('no weights here')\n")
    model = ["--model", f"{MODELS}:make_small"]
    args = {"cache dir is a file": [*model, "--cache-dir", str(tmp_path / "afile")],
            "model file does not import": ["--model", f"{tmp_path / 'broken.py'}:make"],
            "model function raises": ["--model", f"{tmp_path / 'raises.py'}:make"],
            "bad budget": [*model, "--budget", "0"],
            "nothing to fill": []}[case]
    proc = fill_cache("--target", "interpreter", *args, check=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fill_cache: error: ") and "Traceback" not in proc.stderr, lines
    expected = {"cache dir is a file": "--cache-dir", "model file does not import": "does not import",
                "model function raises": "no weights here", "bad budget": "--budget", "nothing to fill": "--model"}
    assert expected[case] in lines[0]


FORWARD_RAISES = """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        raise ValueError("shapes do not match\\nmore context")
def make():
    return M(), (torch.randn(4, 4),)
"""


def main_code(args: list[str]) -> int:
    """fill_cache's exit code, in this process (argparse's errors exit through SystemExit)."""
    from torch_kernelize.fill_cache import cli
    try:
        return cli.main(["--quiet", "--target", "interpreter", *args])
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("case", ["model forward raises", "candidate not .py", "target is a folder",
                                  "summary is a folder"])
def test_more_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    (tmp_path / "forward.py").write_text(FORWARD_RAISES)
    model = ["--model", f"{MODELS}:make_small", "--cache-dir", str(tmp_path / "c")]
    args, expected = {
        "model forward raises": (["--model", f"{tmp_path / 'forward.py'}:make", "--cache-dir", str(tmp_path / "c")],
                                 "forward.py:make': running it on cpu raised ValueError: shapes do not match"),
        "candidate not .py": ([*model, "--candidate", str(tmp_path / "afile")], "a Python file named *.py"),
        "target is a folder": ([*model, "--target", str(tmp_path)], "cannot be read as a .toml file"),
        "summary is a folder": ([*model, "--summary", str(tmp_path)], "is a folder")}[case]
    assert main_code(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fill_cache: error: ") and expected in lines[0], lines


def test_a_model_that_raises_shows_its_traceback_with_verbose(tmp_path, capsys):
    from torch_kernelize.fill_cache import cli
    (tmp_path / "forward.py").write_text(FORWARD_RAISES)
    args = ["--quiet", "--model", f"{tmp_path / 'forward.py'}:make", "--target", "interpreter",
            "--cache-dir", str(tmp_path / "c")]
    assert cli.main([*args, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and 'forward.py", line 5, in forward' in err
    assert err.strip().splitlines()[-1].startswith("fill_cache: error: --model")


def test_a_full_disk_exits_4_in_one_line_leaves_nothing_half_written_and_resume_finishes(tmp_path, monkeypatch,
                                                                                         capsys):
    import errno

    from torch_kernelize.fill_cache import cli
    from torch_kernelize.kernel_cache import KernelCache, clear_memo, store
    from torch_kernelize.core.targets import get_target

    real, calls = store.write_durable, []

    def full_disk(path, data):  # the second file of the first entry: half of it is on disk
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)
    monkeypatch.setattr(store, "write_durable", full_disk)
    cache = tmp_path / "cache"
    args = ["--quiet", "--model", f"{MODELS}:make_small", "--target", "interpreter", "--cache-dir", str(cache),
            "--budget", "1"]
    assert cli.main(args) == 4
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and "free disk space" in lines[0], lines
    assert "--resume" in lines[0]
    clear_memo()
    kc = KernelCache.for_target(cache, get_target("interpreter"))
    assert kc.keys() == [] and not [p for p in kc.entries_dir.iterdir() if p.name != "journals"]
    journaled = len(_journal_lines(cache))
    monkeypatch.setattr(store, "write_durable", real)
    assert cli.main([*args, "--resume"]) == 0
    clear_memo()
    assert len(kc.keys()) == 2 and kc.check_integrity() == []
    configs = [(r["spec"], json.dumps(r["config"], sort_keys=True)) for r in _journal_lines(cache)]
    assert len(configs) == len(set(configs)) and journaled >= 1  # nothing evaluated twice


def test_journal_lines_of_the_wrong_shape_are_skipped_on_resume(tmp_path):
    from torch_kernelize.fill_cache.journal import Journal
    cache = tmp_path / "cache"
    args = ["--model", f"{MODELS}:make_small", "--cache-dir", str(cache), "--budget", "1"]
    assert main_code(args) == 0
    journals = sorted(cache.glob("*/journals/*.jsonl"))
    good = {j: Journal(j).records() for j in journals}
    assert journals and all(len(r) == 1 for r in good.values())
    for j in journals:
        with open(j, "a") as f:
            f.write('{}\n[1, 2]\n{"config": 5}\n"text"\n{"config": {}, "correct": "yes", "fitness": 1}\n')
        assert Journal(j).records() == good[j]
    assert main_code([*args, "--resume", "--force"]) == 0  # the malformed lines are redone, not a crash
    assert {j: Journal(j).records() for j in journals} == good  # the budget was spent: nothing new ran


def test_an_interrupted_fill_writes_the_summary_of_the_specs_it_searched(tmp_path):
    import argparse
    import time
    import types
    from torch_kernelize.fill_cache.cli import _interrupted_summary
    rows = [{"spec": "aten.relu(f32[8])", "key": "k", "status": "stored", "time": {"build": 1.0}}]
    run = types.SimpleNamespace(rows=rows, cache=types.SimpleNamespace(dir=tmp_path), search_id="s1", budget=1,
                                target=types.SimpleNamespace(describe=lambda: "interpreter"), log=None,
                                trace_seconds=3.0, in_flight=None)
    _interrupted_summary(argparse.Namespace(summary=None), run, 2.5)
    summary = json.loads((tmp_path / "runs" / "s1.json").read_text())
    assert summary["interrupted"] is True and summary["specs"] == rows and summary["seconds"] == 2.5
    assert "stopped_in" not in summary
    # stopped inside its first spec: the summary still says where the time went
    first = types.SimpleNamespace(**{**vars(run), "rows": [], "in_flight": ("region(f16[8x512])", time.perf_counter() - 40)})
    _interrupted_summary(argparse.Namespace(summary=tmp_path / "first.json"), first, 50.0)
    summary = json.loads((tmp_path / "first.json").read_text())
    assert summary["specs"] == [] and summary["trace_seconds"] == 3.0
    assert summary["stopped_in"]["spec"] == "region(f16[8x512])" and 40 <= summary["stopped_in"]["seconds"] < 60


def test_sigint_exits_130_in_one_line_and_resume_continues(tmp_path):
    cache = tmp_path / "cache"
    args = ["--model", f"{MODELS}:make_wide", "--target", "interpreter", "--cache-dir", str(cache), "--budget", "4"]
    proc = subprocess.Popen([sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not _journal_lines(cache) and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("fill_cache: interrupted") and "--resume" in err
    done_before = _journal_lines(cache)
    assert 1 <= len(done_before) < 4
    resumed = fill_cache(*args, "--resume")
    assert resumed.returncode == 0 and "stored" in resumed.stdout
    configs = [json.dumps(r["config"], sort_keys=True) for r in _journal_lines(cache)]
    assert len(configs) == 4 and len(set(configs)) == 4
