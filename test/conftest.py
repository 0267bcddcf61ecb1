"""Shared fixtures: isolated cache/repro dirs, and running a snippet in a fresh Python process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A suite started in the background (`make test &`, nohup) inherits SIGINT ignored, and so would
# every child: Python then installs no KeyboardInterrupt, and the tests that stop a child with
# SIGINT (fill_cache's Ctrl-C) would see it run on. A handler of our own is reset to the default
# in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path, monkeypatch):
    """No test reads or writes the user's cache or keys, or leaves repros in the working directory."""
    monkeypatch.setenv("KERNELIZE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KERNELIZE_REPRO_DIR", str(tmp_path / "repros"))
    monkeypatch.setenv("KERNELIZE_CONFIG_DIR", str(tmp_path / "config"))  # signing and trusted keys
    for var in ("KERNELIZE_TARGET", "KERNELIZE_REPORT", "KERNELIZE_STRICT", "KERNELIZE_CHECK",
                "KERNELIZE_GRAPH_CACHE", "KERNELIZE_EXECUTABLE_CACHE", "KERNELIZE_PREWARM"):
        monkeypatch.delenv(var, raising=False)
    yield


@pytest.fixture(autouse=True)
def _reset_dynamo():
    import torch
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fresh_repro_budget():
    """Each test has the miss-recording caps of a process of its own, and its queued
    reproducers are written before the next test starts."""
    yield
    recorder = sys.modules.get("torch_kernelize.serving.repro_recorder")
    if recorder is not None:
        recorder.flush(120)
        recorder.budget = recorder.MissBudget()
        recorder.repro_counts.clear()


def run_python(code: str, env: dict | None = None, cwd: Path | None = None, timeout: int = 600,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (nothing imported beforehand)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
    return proc


# The head of a warm-process snippet: counts Triton compiles, JIT runs and Inductor compiles in
# ``counts`` (a snippet run_python runs as ``COUNT_COMPILES + rest``).
COUNT_COMPILES = textwrap.dedent("""
    import json, torch, triton
    import torch._inductor.compile_fx as compile_fx
    import triton.compiler.compiler as cc
    from triton.runtime.jit import JITFunction
    counts = {"triton_compile": 0, "jit_run": 0, "inductor_compile": 0}
    def counting(name, orig):
        def f(*a, **k):
            counts[name] += 1
            return orig(*a, **k)
        return f
    cc.compile = triton.compile = counting("triton_compile", cc.compile)
    JITFunction.run = counting("jit_run", JITFunction.run)
    compile_fx.compile_fx = counting("inductor_compile", compile_fx.compile_fx)
    compile_fx.compile_fx_inner = counting("inductor_compile", compile_fx.compile_fx_inner)
""")


def last_json(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object a snippet printed on its last stdout line."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def console_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: command name -> "module:function"."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.fixture
def fresh_python():
    return run_python


def write_target(path: Path, name: str = "chip", device: str = "cpu", triton: str = "interpreter",
                 unsupported: list[str] | None = None, supported: list[str] | None = None) -> Path:
    lines = [f'name = "{name}"', f'device = "{device}"', f'triton = "{triton}"', "[ops]"]
    if unsupported is not None:
        lines.append("unsupported = [" + ", ".join(f'"{o}"' for o in unsupported) + "]")
    if supported is not None:
        lines.append("supported = [" + ", ".join(f'"{o}"' for o in supported) + "]")
    path.write_text("\n".join(lines) + "\n")
    return path
