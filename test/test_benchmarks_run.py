"""benchmarks/run.py's helpers that run on any machine."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def _run_module():
    spec = importlib.util.spec_from_file_location("bench_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_child_processs_exception_keeps_its_whole_message():
    """A first-call row records why a child failed: the exception's every line, not the last."""
    code = "def f():\n    raise ValueError('an artifact must be one graph:\\n a graph break\\n. Use torch.compile')\nf()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    text = _run_module()._exception_text(proc.stderr)
    assert text == "ValueError: an artifact must be one graph: a graph break . Use torch.compile"
    assert _run_module()._exception_text("") == "no output"
