"""How the benchmark scripts measure one callable: per-call median, GPU time and kernel launches per
call, host time per call, and its error against a reference. Shared by run.py (the seed workloads)
and real_models.py (the real-model suite), so that both tables mean the same by each column.

On a machine without a GPU (the scripts' CPU dry runs) the median is a wall-clock one and there
is no GPU profile.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn: Callable[[], Any], warmup: int = 50, rep: int = 300) -> float:
    """Median ms per call: ``triton.testing.do_bench`` (``warmup``/``rep`` in ms) on a GPU, else the
    median wall-clock time of calls during ``rep`` ms (at least 3)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    times: list[float] = []
    end = time.perf_counter() + rep / 1e3
    while len(times) < 3 or (time.perf_counter() < end and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def calls(fn: Callable[[], Any], n: int) -> None:
    """n calls of fn, then wait for the GPU."""
    for _ in range(n):
        fn()
    sync()


def host_ms_per_call(fn: Callable[[], Any], n: int = 20) -> float:
    """The host's time to enqueue one call, ms (median of n): each call starts on an idle GPU and is
    timed until it returns, without waiting for its kernels. Timing back-to-back calls instead
    would count GPU time once the launch queue fills (about a thousand pending kernels: a
    GPU-bound model's few calls), so a host faster than its GPU would look as slow as the GPU."""
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e3


def syncs_per_call(fn: Callable[[], Any], n: int = 3) -> float:
    """Synchronizing CUDA operations per call (torch's sync debug mode): a backend whose host
    waits for the GPU on every call is host-bound by as much as its GPU time."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(n):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught) / n


def _profiled(fn: Callable[[], Any], iters: int) -> tuple[Any, dict[str, tuple[float, float]]]:
    """The profile of ``iters`` calls and, per kernel name, (calls, GPU ms) per call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        calls(fn, iters)
    kernels = {}
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = getattr(evt, "self_device_time_total", None)
        ms = (ms if ms is not None else evt.self_cuda_time_total) / 1e3 / iters
        if ms > 0:
            kernels[evt.key] = (evt.count / iters, ms)
    return prof, kernels


def gpu_ms_per_call(fn: Callable[[], Any], iters: int = 5) -> float:
    """GPU time per call of fn alone (kernel_times' total, without its host and sync measures)."""
    calls(fn, 2)
    return round(sum(ms for _, ms in _profiled(fn, iters)[1].values()), 4)


def kernel_times(fn: Callable[[], Any], iters: int = 5, host_calls: int = 20) -> dict[str, Any]:
    """GPU time per call of fn, in total and by kernel name (torch.profiler, after a warm-up),
    kernels launched per call, the host's time per call to enqueue it (``host_ms_per_call``) and
    the host's waits for the GPU per call. Kernels replayed from a CUDA graph count as launched."""
    calls(fn, 3)
    host_ms = host_ms_per_call(fn, host_calls)
    prof, kernels = _profiled(fn, iters)
    try:  # (the shapes are a diagnosis: a trace that cannot be written leaves them out)
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
            shapes = launch_shapes(json.loads((Path(tmp) / "trace.json").read_text()))
    except (OSError, RuntimeError, ValueError):
        shapes = {}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {"gpu_ms": round(sum(ms for _, ms in kernels.values()), 4), "host_ms": round(host_ms, 4),
            "syncs_per_call": round(syncs_per_call(fn), 2),
            "launches": round(sum(c for c, _ in kernels.values()), 1),
            "kernels": [{"name": k[:120], "calls": round(c, 2), "ms": round(ms, 4),
                         **({"launch": shapes[k]} if k in shapes else {})} for k, (c, ms) in top[:15]]}


def launch_shapes(trace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per kernel name, how its first launch in a profiler trace (Chrome format) was shaped: grid,
    block, registers per thread and shared memory. Two backends' kernels of one name and
    different times then show whether they ran another configuration (warps are block / 32)."""
    keys = {"grid": "grid", "block": "block", "registers per thread": "registers", "shared memory": "shared"}
    out: dict[str, dict[str, Any]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel" and e.get("name") not in out:
            args = e.get("args", {})
            out[e["name"]] = {mine: args[theirs] for theirs, mine in keys.items() if theirs in args}
    return out


def coverage(report: Path) -> dict[str, int]:
    """Nodes, nodes on the triton tier, fused regions on triton and graphs, from kernelize's JSON
    coverage report of the process."""
    graphs = json.loads(report.read_text())["graphs"]
    nodes = [n for g in graphs for n in g["nodes"]]
    return {"nodes": len(nodes), "nodes_on_triton": sum(n["tier"] == "triton" for n in nodes),
            "fused_regions": sum(g["summary"].get("fused_regions", 0) for g in graphs), "graphs": len(graphs),
            # graphs whose filled winner is a whole program (Inductor's, issue 35) and runs in one call,
            # and stretches of graphs run by their programs (between ops no program calls, or a mix)
            "graphs_served_whole": sum(any(w["tier"] == "triton" and not w["stretch"] for w in g.get("wholes", ()))
                                       for g in graphs),
            "stretches_served": sum(w["tier"] == "triton" and w["stretch"] for g in graphs for w in g.get("wholes", ()))}


def per_call_us(fn: Callable[[], Any], n: int = 3000) -> float:
    """Host time per call of a function whose GPU work is tiny (launch-bound), in microseconds."""
    calls(fn, 50)
    t0 = time.perf_counter()
    calls(fn, n)
    return (time.perf_counter() - t0) / n * 1e6


def host_speed_us() -> float:
    """eager torch.add of two 4096-element tensors, per call: the host's speed, recorded with every
    run (host-bound rows, e.g. Inductor's MoE, move with it from one lent machine to the next)."""
    x = torch.randn(4096, device="cuda" if torch.cuda.is_available() else "cpu")
    return round(per_call_us(lambda: torch.add(x, x)), 2)


def rel_err(out: Any, ref: Any) -> float:
    """The worst over outputs of max |out - ref| / max |ref|; inf where the outputs differ in number
    or shape."""
    from torch_kernelize.bringup import flat_tensors
    outs, refs = flat_tensors(out), flat_tensors(ref)
    if len(outs) != len(refs) or any(o.shape != r.shape for o, r in zip(outs, refs)):
        return float("inf")
    worst = 0.0
    for o, r in zip(outs, refs):
        if not o.numel():
            continue
        o, r = o.detach().float(), r.detach().float()
        worst = max(worst, float((o - r).abs().max() / r.abs().max().clamp_min(1e-6)))
    return worst


# The H200's measured ceilings (benchmarks/README.md's floors): dense fp16/bf16 matmul, copy.
H200_FLOPS, H200_BYTES_PER_S = 729e12, 4.2e12


def work_floor(model: torch.nn.Module, inputs: tuple, out: Any) -> dict[str, float]:
    """What one call must do at least: its FLOPs (torch's FlopCounterMode over one more call: the ops
    it has formulas for, matmuls, convolutions, CUDA attention and grouped GEMMs; others count nothing) and bytes
    (parameters, buffers, inputs and outputs, each moved once), and on an H200 the time that takes
    at its ceilings."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch_kernelize.bringup import flat_tensors
    from torch_kernelize.core.costs import flop_formulas
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        model(*inputs)
    tensors = [*model.parameters(), *model.buffers(), *flat_tensors(inputs), *flat_tensors(out)]
    flops, nbytes = float(counter.get_total_flops()), float(sum(t.numel() * t.element_size() for t in tensors))
    floor = {"gflop": float(f"{flops / 1e9:.4g}"), "mbytes": float(f"{nbytes / 1e6:.4g}")}
    if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name():
        floor["ms"] = round(max(flops / H200_FLOPS, nbytes / H200_BYTES_PER_S) * 1e3, 4)
    return floor
