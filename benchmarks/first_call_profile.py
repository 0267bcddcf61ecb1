"""What a first call at a new sequence length spends its host time on (bucket_trace.py's
``--profile-first``, issue 41): a call profiled under torch.profiler, its ops by host time of
their own, its GEMMs by shape and, in the kernelize process, matched against the layouts the
bucket warm ran at that size (serving/bucket_warm.py logs them at debug level), with each call's
host ms; beside each profiled length, one profiled right after the warm's calls at its size are
replayed outside the compile; beside each of the trace's dearest first calls, its nearest new length.
``repeat_call_profile`` does the same for a repeat call (``--profile-repeat``), its ops by device
time: is a slow repeat the GPU's work or the host's?"""
from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def sync() -> None:
    """Wait for the GPU, where there is one."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, *args: Any) -> float:
    """Host ms of one call of ``fn``, the GPU idle before and after."""
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    return (time.perf_counter() - t0) * 1e3


def profile_lengths(lo: int, hi: int, taken: list[int], count: int) -> list[int]:
    """``count`` lengths of [lo, hi] neither the trace nor its warm-up visits, spread over the range:
    each profiled call is a first call at that length, in a bucket the trace served."""
    return spread([n for n in range(lo, hi + 1) if n not in taken], count)


def rewarm_lengths(lo: int, hi: int, taken: list[int], profiled: list[int]) -> list[int]:
    """Beside each profiled length, the nearest other one nothing visits: profiled too, right after
    the bucket warm's calls at its size are replayed once more (does a warm done outside the
    compile, just before, leave the call cheap where the compile's did not?)."""
    used, out = set(taken) | set(profiled), []
    for n in profiled:
        near = sorted((m for m in range(lo, hi + 1) if m not in used), key=lambda m: abs(m - n))
        if near:
            out.append(near[0])
            used.add(near[0])
    return out


def dearest_neighbours(extra_ms: dict[int, float], used: list[int], lo: int, hi: int,
                       count: int) -> dict[int, tuple[int, float]]:
    """Beside each of the ``count`` first calls that cost most over their repeat (``extra_ms``, by
    length), the nearest length of [lo, hi] nothing visits, to profile as a first call: is a dear
    first call its length's neighbourhood's (the next one pays too) or one call's bad luck? The
    neighbour -> (the dear length, its extra ms)."""
    taken, out = set(used) | set(extra_ms), {}
    for n, ms in sorted(extra_ms.items(), key=lambda kv: -kv[1])[:count]:
        near = min((m for m in range(lo, hi + 1) if m not in taken), key=lambda m: abs(m - n), default=None)
        if near is not None:
            out[near] = (n, round(ms, 3))
            taken.add(near)
    return out


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


class WarmedLayouts(logging.Handler):
    """The layouts serving/bucket_warm.py warmed, per size (its debug records), installed in the
    kernelize child: a profiled first call's GEMMs are then matched against what was warmed at
    its size, so a cost left after the warm is told apart as a layout the warm missed or a
    choice cuBLAS forgot."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_size: dict[int, set] = {}
        self.records: dict[int, list[dict]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("bucket %s: size %d: warming") and len(record.args) == 3:
            _, size, records = record.args
            self.by_size.setdefault(size, set()).update(_gemm_layout(r["op"], r["args"]) for r in records)
            self.records.setdefault(size, []).extend(records)

    def rewarm(self, size: int) -> int:
        """Replay the warm's calls at ``size`` again, now (outside the compile); how many ran."""
        from torch_kernelize.serving import vendor_replay
        ran = sum(vendor_replay.replay(r) == "vendor" for r in self.records.get(size, ()))
        sync()
        return ran

    def install(self) -> "WarmedLayouts":
        logger = logging.getLogger("torch_kernelize.serving.bucket_warm")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self


OPERANDS = {"mm": 2, "bmm": 2, "addmm": 3, "baddbmm": 3}  # a GEMM's tensor operands, before ``out``


def _gemm_layout(op: str, args: list) -> tuple:
    """A GEMM's operands as (op packet, ((shape, stride) of each tensor operand, ``out`` left out))."""
    name = op.split(".")[1] if op.startswith("aten.") else op
    tensors = [a["tensor"] for a in args if isinstance(a, dict) and "tensor" in a]
    return name, tuple((tuple(t[0]), tuple(t[1])) for t in tensors[:OPERANDS.get(name, 3)])


def served_gemms(trace: dict, durations: dict | None = None) -> list[tuple]:
    """The GEMMs of a profiled call by the layouts of their tensor arguments (a chrome trace's
    "Input Dims" and "Input Strides", recorded with record_shapes), as ``_gemm_layout`` gives them,
    in call order; ``durations`` collects each layout's host ms per call, in that order."""
    out = []
    for e in trace.get("traceEvents", []):
        a = e.get("args") or {}
        if e.get("name") not in GEMM_OPS or "Input Dims" not in a:
            continue
        dims, strides = a["Input Dims"], a.get("Input Strides") or [[None]] * len(a["Input Dims"])
        name = e["name"].split("::")[1]
        tensors = [(tuple(d), tuple(s)) for d, s in zip(dims, strides) if d]
        out.append((name, tuple(tensors[:OPERANDS.get(name, 3)])))  # (an ``out=`` comes after them)
        if durations is not None:
            durations.setdefault(out[-1], []).append(round(e.get("dur", 0) / 1e3, 3))
    return out


def python_hot_spots(fn: Any, x: Any, top: int = 10, within: str = "torch_kernelize") -> dict[str, Any]:
    """One first call under cProfile: its ms, and the functions of the package ``within`` with the
    most cumulative time. Python time that torch.profiler leaves as the compiled region's own (a
    new length planned again: specs, lookups, binding, code) is named here by function."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    try:
        ms = timed(fn, x)
    finally:
        prof.disable()
    mine = [(f, st) for f, st in pstats.Stats(prof).stats.items() if within in f[0]]
    whole = max((st[3] for _, st in mine), default=0.0)

    def row(f: tuple, st: tuple) -> dict[str, Any]:
        return {"function": f"{Path(f[0]).name}:{f[1]}({f[2]})", "calls": st[1],
                "cumulative_ms": round(st[3] * 1e3, 3), "own_ms": round(st[2] * 1e3, 3)}
    # (the dispatch chain that holds the whole call, every frame ~100%, says nothing: left out)
    inner = sorted(((f, st) for f, st in mine if st[3] < 0.98 * whole), key=lambda r: -r[1][3])[:top]
    own = sorted(mine, key=lambda r: -r[1][2])[:top]
    return {"call_ms": round(ms, 3), "functions": [row(*r) for r in inner], "own": [row(*r) for r in own]}


def first_call_profile(compiled: Any, batch: Any, lengths: list[int], top: int = 12,
                       warmed: WarmedLayouts | None = None, rewarm: frozenset = frozenset(),
                       beside: dict[int, tuple[int, float]] | None = None) -> dict[str, list]:
    """Where a first call's time goes: each of ``lengths`` called once under torch.profiler (host and
    device), its ops with the most host time of their own (not their children's) first. The extra cost of a new length,
    which both backends pay (issue 41), is then named by op, not guessed; its GEMMs by their input
    shapes, the costliest first (``gemms`` beside the call's time), and with ``warmed`` (the
    bucket warm's layouts), the call's GEMM layouts the warm did not run at that size; a length
    of ``rewarm`` has the warm's calls at its size replayed just before (``rewarmed_calls``); one
    of ``beside`` is the neighbour of a dear first call (``dearest_neighbours``: ``beside_dear``)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    rows: dict[str, list] = {}
    for n in lengths:
        x = batch(n)
        rewarmed = warmed.rewarm(n) if warmed is not None and n in rewarm else None
        with profile(activities=activities, record_shapes=True) as prof:
            ms = timed(compiled, x)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        # the GEMMs by their input shapes: which of them a first call pays for (bucket_warm.py runs each once)
        gemms = sorted((e for e in prof.key_averages(group_by_input_shape=True) if e.key in GEMM_OPS),
                       key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        call = {"call_ms": round(ms, 3), **({"rewarmed_calls": rewarmed} if rewarmed is not None else {}),
                **({"beside_dear": list(beside[n])} if beside and n in beside else {}),
                "gemms": [{"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count,
                           "self_host_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in gemms]}
        if warmed is not None:
            with tempfile.TemporaryDirectory() as tmp:
                prof.export_chrome_trace(f"{tmp}/trace.json")
                durations: dict[tuple, list[float]] = {}
                served = served_gemms(json.loads(Path(f"{tmp}/trace.json").read_text()), durations)
            at_size = warmed.by_size.get(n, set())
            call["gemm_layouts"] = {"served": len(set(served)), "warmed_at_this_size": len(at_size),
                                    # each call's host ms, dearest layouts first: one dear call or all?
                                    "host_ms_per_call": [[repr(g)[:160], ms] for g, ms in sorted(
                                        durations.items(), key=lambda kv: -sum(kv[1]))][:6],
                                    "served_not_warmed": [repr(g)[:300] for g in sorted(set(served) - at_size)][:12],
                                    "warmed_examples": [repr(g)[:300] for g in sorted(at_size)][:4]}
        rows[str(n)] = [call] + [
            {"op": e.key[:90], "calls": e.count, "host_ms": round(e.cpu_time_total / 1e3, 3),
             "self_host_ms": round(e.self_cpu_time_total / 1e3, 3),
             "device_ms": round(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3, 3)}
            for e in ops]
    return rows


def spread(lengths: list[int], count: int) -> list[int]:
    """``count`` of ``lengths`` spread over their sorted range (the shortest and longest first)."""
    ordered = sorted(set(lengths))
    if not ordered or count <= 0:
        return []
    picks = [ordered[round(i * (len(ordered) - 1) / max(1, count - 1))] for i in range(count)]
    return list(dict.fromkeys(picks))


def repeat_call_profile(compiled: Any, batch: Any, lengths: list[int], top: int = 8) -> dict[str, list]:
    """A repeat call at each of ``lengths`` (visited already) under torch.profiler: the call's time,
    the device time of its kernels, and its ops by device time of their own, then by host time of
    their own (issue 41: the MoE trace's small buckets repeat slower than Inductor's)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    rows: dict[str, list] = {}

    def device(e: Any) -> float:
        return getattr(e, "self_device_time_total", 0) or 0

    def row(e: Any) -> dict[str, Any]:
        return {"op": e.key[:90], "calls": e.count, "self_host_ms": round(e.self_cpu_time_total / 1e3, 3),
                "self_device_ms": round(device(e) / 1e3, 3)}

    for n in lengths:
        x = batch(n)
        with profile(activities=activities) as prof:
            ms = timed(compiled, x)
        events = prof.key_averages()
        python = python_hot_spots(compiled, x, top)  # the host time torch.profiler leaves unnamed
        rows[str(n)] = [{"call_ms": round(ms, 3), "device_ms": round(sum(device(e) for e in events) / 1e3, 3)},
                        {"by_device": [row(e) for e in sorted(events, key=device, reverse=True)[:top] if device(e)],
                         "by_host": [row(e) for e in sorted(events, key=lambda e: e.self_cpu_time_total,
                                                            reverse=True)[:top]],
                         "python": python}]
    return rows
