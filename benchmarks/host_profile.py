"""Where kernelize's host time goes, per call of one workload (cProfile), on a GPU machine.

For a host-bound row of the results table: compiles the workload with a filled cache, warms it
up, then profiles calls and prints the functions that take the host's time, how each cached
kernel is launched (torch's static launcher, Triton's, or the driver for CUDA C++), and the host time per call beside
the GPU time per call:

    python -m torch_kernelize.fill_cache --model torch_kernelize.model_zoo:make_seed_llama --cache-dir DIR
    python benchmarks/host_profile.py llama4L_d1024_b8_s512_fp16 --cache-dir DIR
    python benchmarks/host_profile.py llama4L_d1024_b8_s512_fp16 --cache-dir DIR --first-call [--timers]
    python benchmarks/host_profile.py llama4L_d1024_b8_s512_fp16 --cache-dir DIR --first-run
    python benchmarks/host_profile.py benchmarks/real_models.py:make_resnet50 --cache-dir DIR   (a real model)

``--first-run`` times each node of the bound graphs' first run, with a sync after each, beside
their second run: what a first call pays for the first use of the vendor libraries (cuBLAS,
cuDNN) and of lazily loaded kernel modules, which no compiler's cache removes.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def census(graphs: list) -> dict[str, int]:
    """Calls per graph run, by kind: cached kernels, folded views, and each other op by name."""
    from torch_kernelize.serving.runtime import TritonCall
    from torch_kernelize.serving.view_folding import FoldedView
    counts = collections.Counter()
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            kind = ("cached kernel" if isinstance(n.target, TritonCall) else
                    "folded view" if isinstance(n.target, FoldedView) else str(getattr(n.target, "__name__", n.target)))
            counts[kind] += 1
    return dict(counts.most_common())


def time_runs_by_node(runs: list, sync) -> Any:
    """Make ``Specialization.__call__`` run its graph node by node, appending to ``runs`` one
    [(seconds, node name, callable name)] per run (``sync`` after each node); returns the original."""
    import torch.fx as fx
    from torch_kernelize.serving.runtime import Specialization

    original = Specialization.__call__

    def timed(self, args: list) -> Any:
        times = []

        class Timed(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                if n.op != "call_function":
                    return super().run_node(n)
                sync()
                t0 = time.perf_counter()
                out = super().run_node(n)
                sync()
                times.append((time.perf_counter() - t0, n.name, getattr(n.target, "__name__", str(n.target))))
                return out
        out = Timed(self.gm).run(*args)
        runs.append(times)
        return out
    Specialization.__call__ = timed
    return original


def first_run_table(first: list, second: list, top: int) -> str:
    """Per callable (cached kernels by family, ATen ops by name): first run against second run, ms."""
    def by_callable(runs: list) -> collections.Counter:
        c = collections.Counter()
        for times in runs:
            for seconds, _, name in times:
                c[name.split("_")[0] + "_" + name.split("_")[1] if name.startswith("triton_") else name] += seconds
        return c
    a, b = by_callable(first), by_callable(second)
    lines = [f"first run {sum(a.values()) * 1e3:.1f} ms, second {sum(b.values()) * 1e3:.1f} ms (sync after each node)",
             f"  {'callable':50s} {'first ms':>9} {'second ms':>10}"]
    for name in sorted(a, key=lambda k: b.get(k, 0.0) - a[k])[:top]:
        lines.append(f"  {name:50s} {a[name] * 1e3:9.2f} {b.get(name, 0.0) * 1e3:10.2f}")
    lines.append("  slowest nodes of the first run:")
    for seconds, node, name in sorted((t for times in first for t in times), reverse=True)[:top // 2]:
        lines.append(f"    {seconds * 1e3:8.2f} ms  {node} ({name})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", help="a seed workload's name, or a --model reference (benchmarks/real_models.py:make_resnet50)")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--cudagraphs", action="store_true")
    p.add_argument("--first-call", action="store_true",
                   help="profile the first call instead (run in a fresh process, caches warm)")
    p.add_argument("--timers", action="store_true",
                   help="with --first-call: wall-clock time of kernelize's phases instead of cProfile "
                        "(which inflates Python-heavy phases several times)")
    p.add_argument("--save", type=Path, default=None, help="also write the cProfile stats here (pstats format)")
    p.add_argument("--first-run", action="store_true",
                   help="time each node of the graphs' first run against their second (fresh process, caches warm)")
    p.add_argument("--target", default="cuda", help="kernelize target (a CPU dry run: interpreter or cpu)")
    args = p.parse_args(argv)

    import torch
    import torch_kernelize.compiling.lower as lower
    from torch_kernelize.model_zoo import SEED_WORKLOADS
    from torch_kernelize.compiling.lower import Session

    lowered = []  # the executables (bound by lowering or restored from the executable cache)
    publish = lower.LoweredGraph._publish
    lower.LoweredGraph._publish = lambda self, *a: lowered.append(self) or publish(self, *a)
    if ":" in args.workload:  # a --model reference (a real model of real_models.py: make_resnet50)
        from torch_kernelize.fill_cache.collect import load_model
        model, inputs = load_model(args.workload)
        device = "cuda" if args.target == "cuda" else "cpu"
        model, inputs = model.to(device), [t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs]
    else:
        model, inputs = SEED_WORKLOADS[args.workload]()
    fn = torch.compile(model, backend="kernelize", options={
        "target": args.target, "cache_dir": args.cache_dir, "repro_dir": "off", "cudagraphs": args.cudagraphs})
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if args.first_run:
        runs: list = []
        time_runs_by_node(runs, sync)
        with torch.no_grad():
            fn(*inputs)
            n = len(runs)  # one run per graph (MoE: two)
            fn(*inputs)
        print(f"{args.workload}: {n} graph(s)")
        print(first_run_table(runs[:n], runs[n:], args.top))
        return 0
    if args.first_call:
        timers: dict[str, float] = {}
        prof = None if args.timers else cProfile.Profile()
        if args.timers:
            sys.path.insert(0, str(HERE.parent / "tools"))
            from first_call import install_timers
            install_timers(timers)
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            fn(*inputs)
            torch.cuda.synchronize()
            if prof:
                prof.disable()
        how = "wall-clock timers" if args.timers else "cProfile"
        print(f"{args.workload}: first call {time.perf_counter() - t0:.3f} s (under {how})")
        from torch._dynamo.utils import compile_times
        phases = dict(zip(*compile_times(repr="csv", aggregate=True)))
        backend_s = float(phases.get("OutputGraph.call_user_compiler", 0.0))
        print(f"Dynamo's tracing {float(phases.get('_compile.compile_inner', 0.0)) - backend_s:.3f} s, "
              f"kernelize's backend {backend_s:.3f} s (both under {how})")
        for label, seconds in sorted(timers.items(), key=lambda kv: -kv[1]):
            print(f"  {label:58s} {seconds:.3f}")
        if prof and args.save:
            prof.dump_stats(args.save)
        for order in ("cumtime", "tottime") if prof else ():  # where the time is spent below, and in itself
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(args.top)
            print(out.getvalue())
        return 0
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn(*inputs)
        host = (time.perf_counter() - t0) / args.calls * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.calls * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn(*inputs)
        torch.cuda.synchronize()
        prof.disable()

    launchers = collections.Counter()
    for runner in Session._runners.values():
        for k in getattr(runner, "_kernels", ()) if runner is not None else ():
            kind = ("torch's static launcher" if getattr(k, "static", False) else
                    "CUDA driver (CUDA C++ kernel)" if type(k).__name__ == "CubinLaunch" else "Triton's launcher")
            launchers[kind] += 1
    print(f"{args.workload}: host {host:.3f} ms per call to enqueue, {wall:.3f} ms per call with the GPU; "
          f"launchers loaded: {dict(launchers)}")
    print("what one call runs, by callable:", census([lo.static_specialization().gm for lo in lowered]))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    if args.save:
        prof.dump_stats(args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
