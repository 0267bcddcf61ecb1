"""benchmarks/run.py's helpers that run on any machine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torch_kernelize.launch import import_source

RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def _run_module():
    return import_source(RUN, "bench_run")


def test_a_child_processs_exception_keeps_its_whole_message():
    """A first-call row records why a child failed: the exception's every line, not the last."""
    code = "def f():\n    raise ValueError('an artifact must be one graph:\\n a graph break\\n. Use torch.compile')\nf()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    text = _run_module()._exception_text(proc.stderr)
    assert text == "ValueError: an artifact must be one graph: a graph break . Use torch.compile"
    assert _run_module()._exception_text("") == "no output"
