"""benchmarks/run.py's helpers that run on any machine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torch_kernelize.serving.launch import import_source

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


def test_first_call_script_reports_the_collections_inside_the_call(tmp_path):
    """The first-call child (here eager, on the CPU) starts from a collected heap and reports the
    time its call spent in garbage collections beside the call's time."""
    import json
    import os
    run = _run_module()
    code = run.FIRST_CALL.format(backend="eager", name="histc_16M_256bins_fixed",
                                 cache=str(tmp_path), artifact=str(tmp_path / "a"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, KERNELIZE_BENCH_DEVICE="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["first_call_s"] > 0 and 0 <= r["gc_s"] < r["first_call_s"] and r["gc_full"] >= 0


def test_first_call_backends_take_turns_and_a_failing_one_drops_out_alone():
    """After every backend's warm-up process, each round runs one process per backend (a drifting
    host moves all alike); a backend whose process fails keeps the reason and is not run again."""
    run = _run_module()
    order: list[str] = []

    def child(code, env):
        order.append(code)
        if code == "b" and len(order) > 4:
            raise RuntimeError("a graph break")
        return {"first_call_s": len(order)}

    children = {"a": ("a", {}, True), "b": ("b", {}, True), "c": ("c", {}, False)}
    samples = run.first_call_samples(children, 3, run_child=child)
    assert order == ["a", "b", "a", "b", "c", "a", "b", "c", "a", "c"]
    assert [s["first_call_s"] for s in samples["a"]] == [3, 6, 9]
    assert samples["b"] == "RuntimeError: a graph break"
    assert [s["first_call_s"] for s in samples["c"]] == [5, 8, 10]


def test_first_run_table_times_each_node_of_a_bound_graph(tmp_path):
    """host_profile --first-run: every call_function node of each run is timed, and the table
    compares the first run with the second per callable."""
    import torch
    from torch_kernelize.compiling.lower import lower
    from torch_kernelize.serving.runtime import Specialization

    hp = import_source(RUN.parent / "host_profile.py", "bench_host_profile")
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.relu.default(torch.ops.aten.mul.Tensor(x, 2.0)))
    lowered = lower(gm, [torch.randn(8)], {"target": "cpu", "cache_dir": str(tmp_path), "repro_dir": "off"})
    runs: list = []
    original = hp.time_runs_by_node(runs, lambda: None)
    try:
        x = torch.randn(8)
        assert torch.equal(lowered([x]), torch.relu(x * 2.0))
        lowered([x])
    finally:
        Specialization.__call__ = original
    assert [[name for _, _, name in run] for run in runs] == [["mul.Tensor", "relu.default"]] * 2
    table = hp.first_run_table(runs[:1], runs[1:], top=10)
    assert "relu.default" in table and "mul.Tensor" in table and "slowest nodes of the first run" in table


def test_the_work_floor_counts_grouped_query_attention_at_the_querys_heads():
    """torch's own sdpa formula asserts on 4 KV heads for 32 query heads (Llama): the floor's formula
    counts the two matmuls at the query's heads, for ordinary attention as for grouped."""
    import torch
    timing = import_source(RUN.parent / "timing.py", "bench_timing")
    q, kv = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
    model = Attention()
    two_matmuls = 2 * (2 * 8) * 16 * 16 * (32 + 32) / 1e9
    assert timing.work_floor(model, (q, kv, kv), model(q, kv, kv))["gflop"] == float(f"{two_matmuls:.4g}")
    assert timing.work_floor(model, (q, q, q), model(q, q, q))["gflop"] == float(f"{two_matmuls:.4g}")


def test_the_work_floor_counts_an_moe_models_grouped_expert_gemms():
    """transformers' fp16 experts run an opaque custom op around a loop of mm (the counter sees none of
    them): the floor counts each token's GEMM with its expert's weight, as the same mms would count."""
    import torch
    pytest.importorskip("transformers.integrations.moe")
    timing = import_source(RUN.parent / "timing.py", "bench_timing")
    x, w = torch.randn(10, 16), torch.randn(3, 16, 24)
    offs = torch.tensor([4, 4, 10])  # the second expert gets no token

    class Experts(torch.nn.Module):
        def forward(self, x, w, offs):
            return torch.ops.transformers.grouped_mm_fallback(x, w, offs)

    class Loop(torch.nn.Module):
        def forward(self, x, w, offs):
            return torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    model, loop = Experts(), Loop()
    assert torch.equal(model(x, w, offs), loop(x, w, offs))
    counted = timing.work_floor(model, (x, w, offs), model(x, w, offs))["gflop"]
    assert counted == timing.work_floor(loop, (x, w, offs), loop(x, w, offs))["gflop"] == float(f"{2 * 10 * 16 * 24 / 1e9:.4g}")


def test_a_kernels_launch_shape_is_read_off_the_profilers_trace():
    """Two backends' kernels of one name and different times: the trace says whether they ran
    another configuration (issue 35's kernel-by-kernel account of a loss)."""
    timing = import_source(RUN.parent / "timing.py", "bench_timing")
    trace = {"traceEvents": [
        {"cat": "cpu_op", "name": "aten::mm", "args": {}},
        {"cat": "kernel", "name": "triton_poi_fused_gelu_view_4",
         "args": {"grid": [18912, 1, 1], "block": [128, 1, 1], "registers per thread": 24, "shared memory": 0}},
        {"cat": "kernel", "name": "triton_poi_fused_gelu_view_4", "args": {"grid": [1, 1, 1], "block": [32, 1, 1]}},
        {"cat": "kernel", "name": "nvjet", "args": {"grid": [132, 1, 1]}}]}
    assert timing.launch_shapes(trace) == {
        "triton_poi_fused_gelu_view_4": {"grid": [18912, 1, 1], "block": [128, 1, 1], "registers": 24, "shared": 0},
        "nvjet": {"grid": [132, 1, 1]}}


def test_glu_tiles_builds_each_seed_and_the_parts_and_checks_them_against_the_eager_region(tmp_path, monkeypatch):
    """benchmarks/glu_tiles.py --smoke: tiny sizes on the interpreter, nothing timed; every row's
    kernel built as the fill stores it and run against the eager region."""
    import json
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    glu = import_source(RUN.parent / "glu_tiles.py", "bench_glu_tiles")
    assert glu.main([str(tmp_path / "glu.json"), "--smoke"]) == 0
    rows = json.loads((tmp_path / "glu.json").read_text())["rows"]
    seeds = [k for k in rows if k.startswith("glu seed")]
    assert len(seeds) >= 3 and any("tma" in k for k in seeds), list(rows)
    assert all(isinstance(r, dict) and r["max_abs_err"] <= 1e-2 for r in rows.values()), rows
