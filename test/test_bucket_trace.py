"""benchmarks/bucket_trace.py, issue 28's serving trace: its smoke mode end to end on the CPU, and
how it picks lengths and judges the targets."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torch_kernelize.serving.launch import import_source

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bucket_trace.py"


def _trace():
    return import_source(SCRIPT, "bench_bucket_trace")


def test_lengths_are_distinct_seeded_and_in_range():
    t = _trace()
    lengths = t.lengths_of(33, 512, 50)
    assert len(set(lengths)) == 50 and all(33 <= n <= 512 for n in lengths) and lengths == t.lengths_of(33, 512, 50)
    with pytest.raises(ValueError, match="fewer than"):
        t.lengths_of(3, 5, 4)
    assert t.percentile([1.0, 2.0, 3.0, 100.0], 50) in (2.0, 3.0) and t.percentile([1.0, 2.0, 100.0], 99) == 100.0


def test_the_warm_up_takes_a_filled_length_the_trace_does_not_visit():
    t = _trace()
    assert t.warmup_length(33, 40, [33, 35, 34]) == 36
    assert t.warmup_length(3, 6, [3, 4, 5, 6]) == 2 and t.warmup_length(1, 2, [1, 2]) == 3


def test_a_profiled_gemm_is_matched_against_the_layouts_the_bucket_warm_logged_at_its_size(tmp_path):
    """What a served call ran (the profiler's input dims and strides) against what the warm ran
    (serving/bucket_warm.py's debug record), each operand by its shape and strides."""
    import logging

    import torch
    from torch.profiler import ProfilerActivity, profile

    from torch_kernelize.serving.vendor_replay import Call
    t = import_source(SCRIPT.with_name("first_call_profile.py"), "bench_first_call_profile")
    warmed = t.WarmedLayouts().install()
    try:
        a, b = torch.randn(6, 4), torch.randn(4, 5)
        rec = lambda x, y: Call(torch.ops.aten.mm.default, [  # noqa: E731
            {"tensor": [list(v.shape), list(v.stride()), 0, "float32", "cpu"]} for v in (x, y)], {}, 0).to_record()
        logging.getLogger("torch_kernelize.serving.bucket_warm").debug(
            "bucket %s: size %d: warming %s", "g", 6, [rec(a, b), rec(a, b.t().contiguous().t())])
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            torch.mm(a, b)
            torch.mm(a, torch.randn(5, 4).t(), out=torch.empty(6, 5))  # (served programs pass out=)
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
    finally:
        logging.getLogger("torch_kernelize.serving.bucket_warm").removeHandler(warmed)
    durations = {}
    served = t.served_gemms(json.loads((tmp_path / "trace.json").read_text()), durations)
    assert len(served) == 2 and len(warmed.by_size[6]) == 2
    assert set(durations) == set(served) and all(len(v) == 1 and v[0] >= 0 for v in durations.values())
    assert set(served) == warmed.by_size[6]
    assert ("mm", (((6, 4), (4, 1)), ((4, 5), (1, 4)))) in set(served)  # a transposed operand is another layout


def test_profiled_lengths_are_new_and_spread_over_the_range():
    t = _trace()
    assert t.profile_lengths(33, 40, [33, 35, 34], 2) == [36, 40]
    assert t.profile_lengths(3, 4, [3, 4], 2) == [] and t.profile_lengths(3, 9, [], 0) == []
    # beside each, the nearest length nothing visits (profiled after the warm's calls are replayed)
    assert t.rewarm_lengths(33, 40, [33, 35, 34], [36, 40]) == [37, 39]
    assert t.rewarm_lengths(3, 5, [3, 4], [5]) == []
    # beside each of the dearest first calls, the nearest length nothing visited (ties: the shorter)
    extra = {34: 0.1, 38: 1.2, 45: 0.9, 50: 0.2}
    assert t.dearest_neighbours(extra, [37, 39], 33, 50, 2) == {36: (38, 1.2), 44: (45, 0.9)}
    assert t.dearest_neighbours({3: 2.0, 4: 1.0}, [], 3, 4, 1) == {}


def test_targets_are_judged_with_their_distance():
    t = _trace()
    k = {"first_minus_repeat": {"p99_ms": 0.4, "max_ms": 1.5}, "repeat": {"p50_ms": 2.0, "p99_ms": 2.0},
         "recompiles": 1, "repro_folders": 5, "buckets": 4, "warmup_len": 32, "repros": {"warmup_folders": 7}}
    i = {"first_minus_repeat": {"p99_ms": 9.0, "max_ms": 9.0}, "repeat": {"p50_ms": 1.0, "p99_ms": 4.0},
         "recompiles": 3}
    first, recompiles, folders, p50, p99 = t.targets({"kernelize": k, "inductor": i})
    assert "(p99): met (0.400 ms; worst 1.500)" in first
    assert recompiles == "recompiles after the warm-up: missed (1; torch.compile(dynamic=True): 3)"
    assert folders == ("at most one reproducer folder per miss and bucket: not judged (5 folder(s) for 4 bucket(s); "
                       "that run did not count the misses recorded per length)")
    assert "at p50: 0.50x (missed" in p50 and "at p99: 2.00x (met" in p99
    # misses taken for recording per length: one taken again at a later length of a visited bucket
    lengths, claims = [33, 40, 70, 35, 90], {33: 3, 40: 1, 70: 2, 90: 1}
    assert t.claimed_again(lengths, 32, claims) == 2  # 40 (bucket of 33) and 90 (of 70); 33's bucket is new
    counted = dict(k, recompiles=0, repros={"warmup_folders": 7, "claimed_again_in_a_bucket": 2,
                                            "claimed_per_length": {"33": 3, "40": 1, "70": 2, "90": 1}})
    assert t.targets({"kernelize": counted})[2] == (
        "at most one reproducer folder per miss and bucket: missed (2 miss(es) recorded again at a later length of "
        "a bucket; 7 taken for recording at 4 of the trace's lengths, 4 bucket(s); 5 folder(s) written, 7 more at the warm-up "
        "length 32)")
    counted["repros"].update(claimed_again_in_a_bucket=0, suppressed_by_reason={"bytes_cap": 3822})
    assert t.targets({"kernelize": counted})[2].startswith("at most one reproducer folder per miss and bucket: met (0 ")
    assert t.targets({"kernelize": counted})[2].endswith("; 3822 left unwritten by the caps)")


def test_the_fill_asks_the_generators_named(tmp_path, monkeypatch):
    """--generators goes to fill_cache (the interpreter fills whole graphs only when asked)."""
    t = _trace()
    import real_models
    ran = []
    monkeypatch.setattr(real_models, "run_bounded", lambda cmd, limit, log: ran.append(cmd) or (0, 1.0, False))
    for extra, expected in (([], None), (["--generators", "inductor"], "inductor")):
        args = t.parse_args(["--out", str(tmp_path), "--smoke", "--model", "mixtral", "--fill"] + extra)
        assert t._fill(args, tmp_path / "fill.log") == {"exit": 0, "seconds": 1.0, "stopped_at_limit": False}
        cmd = ran[-1]
        assert (cmd[cmd.index("--generators") + 1] if "--generators" in cmd else None) == expected
        assert cmd[cmd.index("--dynamic") + 1] == "0:1:3-12" and "make_hf_mixtral" in cmd[cmd.index("--model") + 1]


@pytest.mark.slow
def test_python_hot_spots_names_the_packages_functions_by_cumulative_time():
    import first_call_profile as fcp  # (on the path: bucket_trace.py puts benchmarks/ there)
    from torch_kernelize.core import buckets
    _trace()

    def call(n: int) -> list:
        return [buckets.pow2_bucket(v) for v in range(1, n)]
    found = fcp.python_hot_spots(call, 2000, within="buckets.py")
    (row, *_) = found["own"]
    assert found["call_ms"] > 0 and row["function"].startswith("buckets.py:") and "pow2_bucket" in row["function"]
    assert row["calls"] == 1999 and row["cumulative_ms"] >= row["own_ms"] > 0
    assert found["functions"] == []  # (pow2_bucket is the whole of its package's time: nothing below it)
    assert fcp.python_hot_spots(call, 3, within="no_such_package")["functions"] == []


def test_the_gc_clock_times_collections_while_installed_and_only_then():
    import gc
    t = _trace()
    junk = [[i] for i in range(200_000)]  # (something for the collector to walk)
    with t.GcClock() as clock:
        gc.collect()
    assert clock.collections >= 1 and clock.ms > 0 and clock not in gc.callbacks
    counted = clock.collections
    gc.collect()
    assert clock.collections == counted and len(junk) == 200_000
    doc = {"model": "llama", "lengths": [5], "device": "cpu", "date": "d", "torch": "t", "target": "x",
           "backends": [{"backend": "kernelize", "first": {"p50_ms": 1, "p99_ms": 1}, "repeat": {"p50_ms": 1, "p99_ms": 1},
                         "first_minus_repeat": {"p50_ms": 0, "max_ms": 0}, "trace": {"p50_ms": 1, "p99_ms": 1},
                         "first_calls_gc": {"collections": 2, "ms": 250.0, "per_length_ms": {"5": 249.0}}}]}
    assert "the garbage collector ran 2 time(s) in the first calls, 250.0 ms in all, at most 249.0 ms (length 5)" \
        in t.markdown(doc)
    doc["backends"][0]["first_call_profile"] = {"6": [{"call_ms": 2.0, "beside_dear": [5, 1.25]},
                                                      {"op": "aten::mm", "self_host_ms": 1.5, "calls": 3}]}
    assert ("- kernelize, first call at length 6 (beside length 5, whose first call cost 1.250 ms over its "
            "repeat): 2.0 ms; most host time of its own: aten::mm 1.5 ms (3x)") in t.markdown(doc)
    doc["backends"][0]["first_call_python"] = {"length": 7, "call_ms": 3.5, "functions": [
        {"function": "lower.py:340(_specialize)", "calls": 1, "cumulative_ms": 3.25, "own_ms": 0.1}],
        "own": [{"function": "spec.py:10(key)", "calls": 90, "cumulative_ms": 1.5, "own_ms": 1.25}]}
    assert ("- kernelize, first call at length 7 under cProfile: 3.5 ms; most time in its own Python (cumulative, "
            "below the dispatch): lower.py:340(_specialize) 3.2 ms (1x); own time: spec.py:10(key) 1.2 ms") \
        in t.markdown(doc)
    doc["backends"][0]["repeat_call_profile"] = {"5": [{"call_ms": 10.5, "device_ms": 4.25}, {
        "by_device": [{"op": "grouped_mm_kernel", "calls": 8, "self_host_ms": 0.0, "self_device_ms": 2.5}],
        "by_host": [{"op": "cudaMemcpyAsync", "calls": 9, "self_host_ms": 3.0, "self_device_ms": 0.0}],
        "python": {"call_ms": 10.0, "functions": [
            {"function": "launch.py:90(launch)", "calls": 40, "cumulative_ms": 6.5, "own_ms": 1.0}], "own": []}}]}
    assert ("- kernelize, a repeat call at length 5: 10.50 ms, its kernels 4.25 ms of device time; most device "
            "time: grouped_mm_kernel 2.50 ms (8x); most host time of its own: cudaMemcpyAsync 3.00 ms (9x)\n"
            "  - its Python under cProfile (cumulative): launch.py:90(launch) 6.50 ms (40x)") in t.markdown(doc)
    doc["backends"][0]["first_calls_planning"] = {"planned": 3, "shared": 1, "unshared": {"s1 takes 5..8 (mm)": 2},
                                                  "pinned": {"s0": "mm at mm: entry k does not give back s0"}}
    assert ("- kernelize: the first calls planned 3 signature(s) anew and found 1 in a planned shape class; planned "
            "ones served themselves alone because 2x s1 takes 5..8 (mm); sizes whose every value is a class of its "
            "own: s0 by mm at mm: entry k does not give back s0") in t.markdown(doc)


def test_smoke_serves_a_tiny_llama_at_several_lengths_beside_the_baseline(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--smoke", "--lengths", "2",
                           "--lo", "5", "--hi", "8", "--baseline", "eager", "--profile-first", "1",
                           "--profile-repeat", "1"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*-cpu-bucket-trace.json")
    doc = json.loads(path.read_text())
    lengths = {str(n) for n in doc["lengths"]}
    assert len(lengths) == 2 and [b["backend"] for b in doc["backends"]] == ["kernelize", "eager"]
    (free,) = {"5", "6", "7", "8"} - lengths - {str(doc["warmup_len"])}  # the one length left to profile
    for b in doc["backends"]:
        assert "error" not in b, b
        (call, *ops) = b["first_call_profile"][free]  # a first call at a new length, its ops by host time
        assert call["call_ms"] > 0 and ops and ops[0]["self_host_ms"] >= ops[-1]["self_host_ms"]
        ((n, (call, ops)),) = b["repeat_call_profile"].items()  # a repeat call at a length of the trace
        assert n in lengths and call["call_ms"] > 0 and ops["by_host"] and ops["by_device"] == []  # (no GPU)
        assert ops["python"]["call_ms"] > 0  # and its Python by function (none of ours for eager)
        assert set(b["per_length_ms"]) == lengths and b["trace"]["p99_ms"] >= b["trace"]["p50_ms"] > 0
        assert isinstance(b["recompiles"], int) and b["buckets"] == 1
        assert b["first_calls_gc"]["collections"] >= 0 and set(b["first_calls_gc"]["per_length_ms"]) <= lengths
    assert isinstance(doc["backends"][0]["repro_folders"], int) and doc["backends"][1]["recompiles"] == 0
    planning = doc["backends"][0]["first_calls_planning"]  # each new length: planned, or its class's
    assert planning["planned"] + planning["shared"] == 2 and "first_calls_planning" not in doc["backends"][1]
    assert (tmp_path / path.name.replace(".json", ".md")).read_text().startswith("# Bucket trace: llama")


def test_the_first_call_of_each_bucket_entered_is_profiled_on_request(tmp_path):
    """--profile-bucket-firsts: the trace's first call in a bucket it enters (not the warm-up's)
    runs under torch.profiler, the others as ever; the first-call target is then not judged."""
    t = _trace()
    ref = t.MODELS["llama"][1]
    r = t.measure("eager", ref, [5, 3, 4, 7], 6, tmp_path / "cache", "interpreter", tmp_path, bucket_firsts=True)
    (call, *ops), = r["bucket_first_profile"].values()  # 3 enters 3-4; 5 and 7 are the warm-up's 5-8, 4 entered
    assert list(r["bucket_first_profile"]) == ["3"] and ops and r["per_length_ms"]["3"][0] == call["call_ms"]
    doc = {"model": "llama", "lengths": [5, 3, 4, 7], "device": "cpu", "date": "d", "torch": "t", "target": "cpu",
           "backends": [{**r, "backend": "kernelize"}]}
    doc["targets"] = t.targets({"kernelize": doc["backends"][0]})
    assert doc["targets"][0].startswith("first call of a new length <= 1.0 ms over a repeat (p99): not judged "
                                        "(--profile-bucket-firsts: 1 of the first calls ran under torch.profiler")
    assert "- kernelize, the trace's first call in bucket 3-4, at length 3, under torch.profiler: " in t.markdown(doc)
    assert "bucket_first_profile" not in t.measure("eager", ref, [3], 6, tmp_path / "cache", "interpreter", tmp_path)
