"""benchmarks/fill_sweep.py as a tiny dry run on the interpreter: it fills, and records per spec
what the H200 sweep records (fill time and its split, memory against the spec's size)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_the_sweep_runs_tiny_on_the_interpreter(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fill_sweep.py"), "--out", str(tmp_path),
                           "--target", "interpreter", "--tiny", "--budget", "2",
                           "--only", "mm_fp16_4096,gemm_groupnorm_fp32"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "fill_sweep.json").read_text())
    assert [w["name"] for w in doc["workloads"]] == ["mm_fp16_4096", "gemm_groupnorm_fp32"]
    assert doc["summary"]["lost_runs"] == 0 and doc["summary"]["ooms"] == 0
    specs = [s for w in doc["workloads"] for s in w["specs"]]
    assert any(s["spec"].startswith("region(") for s in specs)  # the GroupNorm region, fused
    searched = [s for s in specs if s["status"] in ("stored", "vendor wins", "no correct candidate")]
    assert searched and doc["summary"]["specs"] >= len(searched)
    for s in searched:
        assert s["seconds"] > 0 and s["bytes"] > 0
        assert set(s["time"]) == {"generate", "build", "reference", "validation", "timing"}
        assert s["peak_extra_bytes"] is None  # measured on CUDA only
    table = (tmp_path / "fill_sweep.md").read_text()
    assert "| gemm_groupnorm_fp32 |" in table and "lost" not in table.split("\n", 3)[3]
    assert not list(tmp_path.glob("cache-*")), "the sweep's cache is removed"
