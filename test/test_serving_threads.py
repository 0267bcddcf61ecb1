"""One compiled model called from several threads at once: right answers, kernels kept on every
target (Triton's interpreter is not reentrant, so its launches take turns), and a new shape
signature or a first call that several threads meet together is lowered and run once."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conftest import write_target
from torch_kernelize.core.errors import MissingOpsError
from torch_kernelize import model_zoo
from torch_kernelize.model_zoo import make_mlp
from torch_kernelize.serving.launch import ProgramRunner
from torch_kernelize.compiling.lower import LoweredGraph, Session, lower
from torch_kernelize.compiling.planner import GraphPlan


THREADS = 4


def _in_threads(work, n: int = THREADS) -> list:
    """Run ``work(i)`` in ``n`` threads started together; the results, or the exceptions raised."""
    start = threading.Barrier(n)
    results: list = [None] * n

    def run(i: int) -> None:
        start.wait()
        try:
            with torch.no_grad():  # (grad mode is per thread)
                results[i] = work(i)
        except BaseException as e:  # handed to the test, which asserts on it
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return results


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    """An interpreter-target kernel cache holding model_zoo.make_small's kernels (a fused region, histc)."""
    cache = tmp_path_factory.mktemp("filled")
    proc = subprocess.run([sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", "--model",
                           "torch_kernelize.model_zoo:make_small", "--target", "interpreter",
                           "--cache-dir", str(cache), "--budget", "1"],
                          capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cache


@pytest.mark.parametrize("check", [False, True])  # check mode: each call also compared with the vendor op
def test_interpreter_kernels_stay_enabled_and_right_under_threads(check, filled, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    shutil.copytree(filled, cache)
    launches = []
    launch = ProgramRunner.launch
    monkeypatch.setattr(ProgramRunner, "launch", lambda self, *a: launches.append(self.spec.key) or launch(self, *a))
    model, (x,) = model_zoo.make_small()
    compiled = torch.compile(model, backend="kernelize",
                             options={"target": "interpreter", "cache_dir": str(cache), "repro_dir": "off",
                                      "check": check})
    with torch.no_grad():
        want = model(x)
        compiled(x)
        kernels = set(launches)
        assert len(kernels) == 2, "the filled cache should serve the fused region and histc"
        launches.clear()
        results = _in_threads(lambda i: [compiled(x) for _ in range(3)])
    for calls in results:
        assert not isinstance(calls, BaseException), calls
        for got in calls:
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
    states = {k: s.disabled for (d, k), s in Session._states.items() if d.startswith(str(cache))}
    assert states and all(why is None for why in states.values()), states
    assert sorted(launches) == sorted(list(kernels) * THREADS * 3), "every call should run the kernels"


def test_a_new_shape_met_by_several_threads_is_lowered_once(monkeypatch):
    model, _ = make_mlp()
    compiled = torch.compile(model, backend="kernelize", dynamic=True, options={"target": "cpu"})
    decided = []
    decide = GraphPlan.decide

    def slow_decide(self, bindings, *a, **k):
        decided.append(tuple(sorted(bindings.values())))
        time.sleep(0.2)  # the other threads arrive while this one lowers
        return decide(self, bindings, *a, **k)
    with torch.no_grad():
        compiled(torch.randn(3, 32))  # compiled (and the dynamic graph's first size lowered)
        monkeypatch.setattr(GraphPlan, "decide", slow_decide)
        x = torch.randn(11, 32)
        results = _in_threads(lambda i: compiled(x))
        want = model(x)
    for got in results:
        assert not isinstance(got, BaseException), got
        torch.testing.assert_close(got, want)
    assert len(decided) == 1, f"the batch of 11 was lowered {len(decided)} times"


def test_cpu_target_threads_with_their_own_shapes_get_their_own_answers():
    model, _ = make_mlp()
    compiled = torch.compile(model, backend="kernelize", dynamic=True, options={"target": "cpu"})
    inputs = [torch.randn(2 + i, 32) for i in range(THREADS)]
    with torch.no_grad():
        compiled(torch.randn(9, 32))
        results = _in_threads(lambda i: [compiled(inputs[i]) for _ in range(20)])
        for i, calls in enumerate(results):
            assert not isinstance(calls, BaseException), calls
            want = model(inputs[i])
            for got in calls:
                torch.testing.assert_close(got, want)


def test_threads_meeting_a_strict_first_call_all_see_its_error(tmp_path, monkeypatch):
    """The first call of a strict graph with a missing op raises; a thread that arrives meanwhile
    waits for it and raises too, instead of running the graph with the host fallback."""
    chip = write_target(tmp_path / "chip.toml", unsupported=["aten.histc"], triton="none")
    gm = make_fx(lambda x: torch.histc(x, bins=4) + 1)(torch.randn(8))
    lowered = lower(gm, [torch.randn(8)], {"target": str(chip), "strict": True, "repro_dir": str(tmp_path / "r")})
    first = LoweredGraph._first_call

    def slow_first_call(self, *a, **k):
        time.sleep(0.3)
        return first(self, *a, **k)
    monkeypatch.setattr(LoweredGraph, "_first_call", slow_first_call)
    results = _in_threads(lambda i: lowered([torch.randn(8)]), n=2)
    assert all(isinstance(r, MissingOpsError) for r in results), results
