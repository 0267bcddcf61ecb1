"""benchmarks/report.py: the README table of a results.json, targets judged per workload (met,
met only with CUDA graphs, missed), host time beside GPU time in the profile table."""
from __future__ import annotations

from pathlib import Path

from torch_kernelize.serving.launch import import_source

REPORT = Path(__file__).resolve().parent.parent / "benchmarks" / "report.py"


def _report():
    return import_source(REPORT, "bench_report")


RESULTS = {
    "env": {"date": "2026-11-30", "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
            "host_us_per_eager_add": 7.08, "measure_isolated": True},
    "measure": {
        "rmsnorm_4096x8192_fp16": {"eager_ms": 0.448, "inductor_ms": 0.037, "kernelize_ms": 0.037,
                                   "kernelize_cudagraphs_ms": 0.076, "kernelize_err": 3e-4, "host_add_us": 11.04,
                                   "speedup_vs_eager": 12.1, "speedup_vs_inductor": 1.0},
        "llama4L_d1024_b8_s512_fp16": {"eager_ms": 2.5, "inductor_ms": 1.396, "kernelize_ms": 1.631,
                                       "kernelize_cudagraphs_ms": 1.348, "kernelize_cudagraphs_err": 6e-4,
                                       "inductor_reduce_overhead_ms": 1.201, "kernelize_err": 6e-4, "speedup_vs_eager": 1.5, "speedup_vs_inductor": 0.86},
        "conv1d_B2048_C96_L200_k3_fp16": {"eager_ms": 0.34, "inductor_ms": 0.258, "kernelize_ms": 0.137,
                                          "kernelize_err": 6e-4, "speedup_vs_eager": 2.5, "speedup_vs_inductor": 1.9},
        "moe_T4096_d1024_E16_top4_fp16": {"error": "RuntimeError: boom"},
    },
    "firstcall": {"llama4L_d1024_b8_s512_fp16": {
        "eager_first_call_s": 0.305, "inductor_first_call_s": 1.665, "kernelize_first_call_s": 0.8,
        "kernelize_triton_compiles": 0, "kernelize_graph_cache_hits": 0, "kernelize_executable_cache_hits": 1,
        "inductor_dynamo_s": 0.9, "kernelize_dynamo_s": 0.85, "inductor_backend_s": 0.4, "kernelize_backend_s": 0.1,
        "inductor_aot_first_call_s": 0.35, "kernelize_aot_first_call_s": 0.25,
        "inductor_gc_s": 0.0123, "inductor_gc_full": 0, "kernelize_gc_s": 0.21, "kernelize_gc_full": 1},
        "moe_T4096_d1024_E16_top4_fp16": {
            "inductor_aot_error": "RuntimeError: Graph breaks are not supported with aot compile",
            "kernelize_aot_error": "RuntimeError: KernelizeError: an artifact must be one graph, and Dynamo broke it"}},
    "profile": {"llama4L_d1024_b8_s512_fp16": {
        "eager": {"gpu_ms": 2.139, "launches": 179.0, "host_ms": 3.82, "syncs_per_call": 1.0},
        "kernelize": {"gpu_ms": 1.217, "launches": 72.0, "host_ms": 1.91,
                      "kernels": [{"name": "nvjet_sm90", "calls": 8, "ms": 0.263}]}}},
}


def test_table_judges_targets_and_shows_host_time():
    report = _report()
    text = report.table(RESULTS)
    speed, profile = text.split("GPU time per call")
    speed, first = speed.split("First call in a fresh process")
    assert "| llama4L_d1024_b8_s512_fp16 | 0.305 | 1.665 | 0.800 | 0.48 | yes | 0 | 0 / 1 | 0.900 / 0.850 | 0.400 / 0.100 " \
           "| 0.012 (0 full) / 0.210 (1 full) | 0.350 / 0.250 |" in first
    assert "| — / — | graph break / graph break |" in first  # moe: no figures recorded
    assert "| — | — / — | — / — |" in first
    assert first.splitlines()[-2].endswith("| graph break / graph break |")  # moe: no artifact
    rows = {line.split(" | ")[0].lstrip("| "): line for line in speed.splitlines() if line.startswith("| ")}
    assert "one process per workload" in text and "7.08 us" in text
    assert "| within 10% of inductor | yes |" in rows["rmsnorm_4096x8192_fp16"]
    assert rows["rmsnorm_4096x8192_fp16"].endswith("| 3.0e-04 | 11.0 |")  # the host's speed while measured
    assert rows["conv1d_B2048_C96_L200_k3_fp16"].endswith("| — |")
    assert "| with CUDA graphs |" in rows["llama4L_d1024_b8_s512_fp16"]
    assert "| 1.348 | 1.201 | 1.50x |" in rows["llama4L_d1024_b8_s512_fp16"]  # beside its fair pair
    assert "| 0.076 | — | 12.10x |" in rows["rmsnorm_4096x8192_fp16"]  # not measured in that run
    assert "| no |" in rows["conv1d_B2048_C96_L200_k3_fp16"]
    assert "error: RuntimeError: boom" in rows["moe_T4096_d1024_E16_top4_fp16"]
    llama = [line for line in profile.splitlines() if line.startswith("| llama4L")]
    assert llama == ["| llama4L_d1024_b8_s512_fp16 | 2.139 (179.0) 3.820 (21.3 µs/launch), 1 syncs | — | "
                     "1.217 (72.0) 1.910 (26.5 µs/launch) | "
                     "nvjet_sm90 x8: 0.263 |"]


def test_target_met_needs_a_correct_graph_run():
    report = _report()
    row = dict(RESULTS["measure"]["llama4L_d1024_b8_s512_fp16"], kernelize_cudagraphs_err=0.5)
    assert report.target_met("llama4L_d1024_b8_s512_fp16", row) == "no"  # fast but wrong: not met
    assert report.target_met("unknown", row) is None
