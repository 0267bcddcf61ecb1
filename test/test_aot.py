"""Ahead-of-time artifacts (aot.py): saved in one process, loaded in a fresh one, where neither
Dynamo nor aot_autograd runs (the graph cache supplies the ATen graph); clear errors for what the
format cannot do."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_kernelize import aot
from torch_kernelize.core.errors import KernelizeError

pytestmark = pytest.mark.skipif(aot.CompiledGraph is None, reason="this torch has no aot_compile")

REPO = Path(__file__).resolve().parent.parent

# The model and the two processes; each prints one JSON line.
PROGRAM = '''
import json, sys
import torch
import torch._dynamo.utils as du
from torch_kernelize import aot


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32) * 0.1 + 1)
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return x + torch.nn.functional.silu(self.fc(h))


torch.manual_seed(0)
model = Block().eval()
x = torch.randn(4, 32)
what, artifact, cache = sys.argv[1:4]
with torch.no_grad():
    if what == "save":
        aot.save(model.forward, (x,), artifact, options={"cache_dir": cache})
        out = None
    else:
        out = aot.load(artifact, model)(x)
        want = model(x)
counters = {k: dict(v) for k, v in du.counters.items() if v}
print(json.dumps({"counters": counters, "err": None if out is None else (out - want).abs().max().item()}))
'''


def _run(tmp_path: Path, *args: str) -> dict:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_process_loads_without_dynamo_or_aot_autograd(tmp_path):
    artifact, cache = str(tmp_path / "block.kz"), str(tmp_path / "kc")
    saved = _run(tmp_path, "save", artifact, cache)
    assert saved["counters"]["stats"]["unique_graphs"] == 1 and saved["counters"]["aot_autograd"]["total"] == 1
    loaded = _run(tmp_path, "load", artifact, cache)
    assert loaded["err"] < 1e-5
    assert not loaded["counters"]  # no Dynamo ("stats", "frames") and no aot_autograd
    # without the graph cache the ATen graph is traced again (aot_autograd), still without Dynamo
    shutil.rmtree(Path(cache) / "graphs")
    again = _run(tmp_path, "load", artifact, cache)
    assert again["err"] < 1e-5 and "stats" not in again["counters"] and "frames" not in again["counters"]
    assert again["counters"]["aot_autograd"]["total"] >= 1


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _block():
    torch.manual_seed(0)
    return _Block().eval()


def test_other_inputs_are_refused_with_what_to_do(tmp_path):
    model = _block()
    with torch.no_grad():
        path = aot.save(model.forward, (torch.randn(2, 8),), tmp_path / "m.kz", options={"cache_dir": str(tmp_path)})
        run = aot.load(path, model)
        x = torch.randn(2, 8)
        assert torch.allclose(run(x), model(x), atol=1e-6)
        with pytest.raises(KernelizeError, match="saved for other inputs.*size mismatch.*save it again"):
            run(torch.randn(3, 8))
    assert not list(tmp_path.glob("*.partial"))


def test_what_an_artifact_cannot_hold(tmp_path):
    model = _block()
    with pytest.raises(KernelizeError, match=r"model\.forward"):
        aot.save(model, (torch.randn(2, 8),), tmp_path / "m.kz")

    def breaks(x):
        y = x * 2
        print("a graph break")
        return y + 1
    with pytest.raises(KernelizeError, match="one graph"):
        aot.save(breaks, (torch.randn(4),), tmp_path / "b.kz", options={"cache_dir": str(tmp_path)})
    assert not (tmp_path / "b.kz").exists()
    sequential = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()  # Dynamo's code refers to the module
    with pytest.raises(KernelizeError, match="cannot hold.*Sequential"):
        aot.save(sequential.forward, (torch.randn(2, 8),), tmp_path / "s.kz", options={"cache_dir": str(tmp_path)})
    assert not list(tmp_path.glob("s.kz*"))
    with pytest.raises(KernelizeError, match="no kernelize artifact"):
        aot.load(tmp_path / "missing.kz")
