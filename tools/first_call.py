"""First-call time in fresh processes: eager, Inductor (cold, then warm caches) and kernelize
(cold, then warm caches), on small CPU instances of the benchmark workloads.

    python tools/first_call.py [--workloads conv1d,rmsnorm,...] [--repeat 3] [--breakdown]

Each number is the median over ``--repeat`` fresh interpreters of the time from just before the
first call of the compiled model to its return (torch is imported before; Dynamo's tracing, the
backend's imports and compile work all count). "warm" runs after a process with the same cache
directories: Inductor's TORCHINDUCTOR_CACHE_DIR, kernelize's cache_dir (kernel cache and graph
cache). ``--breakdown`` times the phases of kernelize's first call in one extra warm process.
"kz aot" loads an artifact an earlier process saved (torch_kernelize.aot: no Dynamo; "—" where the
model breaks its graph), after the same imports that ``torch.compile(...)`` makes for the others.
"kz nogc" is a warm kernelize process with KERNELIZE_GRAPH_CACHE=off: kernelize as it was before
its graph cache, measured under the same machine load as the other columns; "kz noexe" one with
KERNELIZE_EXECUTABLE_CACHE=off (the graph cache only: lowering runs).

Children may write bytecode (.pyc) as an installed package would have it, even where the
environment sets PYTHONDONTWRITEBYTECODE (``--keep-env`` keeps that: every import of
torch_kernelize then compiles its sources, ~0.07 s more for kernelize's first call on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path



def _workloads() -> dict:
    """Small CPU instances of the benchmarks' seed workloads (torch_kernelize.model_zoo: tracing
    cost depends on the graph, not on the sizes)."""
    import torch
    from torch_kernelize import model_zoo as z
    f32 = torch.float32
    return {"conv1d": lambda: z.make_conv1d_layer(batch=4, c_in=96, c_out=96, length=200, dtype=f32, device="cpu"),
            "histc": lambda: z.make_histc_fixed(n=1 << 16),
            "rmsnorm": lambda: z.make_rmsnorm(rows=64, d=1024),
            "moe": lambda: z.make_moe(tokens=64, d=64, f=32, experts=4, k=2),
            "llama4L": lambda: z.make_llama(layers=4, d=256, vocab=1000, batch=1, seq=64)}


def install_timers(t: dict[str, float]) -> None:
    """Wrap kernelize's phases with inclusive timers (seconds summed over calls)."""
    import torch_kernelize.backend as backend
    import torch_kernelize.compiling.lower as lower
    from torch_kernelize.compiling import decompositions

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t[label] = t.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, name, wrapper)

    timed(backend, "kernelize", "backend (all)")
    timed(decompositions, "trace_decompositions", "trace_decompositions")
    from torch._dynamo.backends import common
    timed(common, "aot_module_simplified", "aot_module_simplified (incl. lowering)")
    timed(lower, "plan_graph", "lowering: plan_graph")
    timed(lower, "find_regions", "lowering: find_regions")
    timed(lower, "find_graph_regions", "lowering: find_graph_regions")
    timed(lower.LoweredGraph, "_specialize", "lowering: specialise (lookups, bind, FX codegen)")
    timed(lower.GraphPlan, "decide", "lowering: specialise: decide nodes (cache lookups)")
    timed(lower.Session, "load_runner", "lowering: specialise: load runners (binaries)")
    timed(lower.LoweredGraph, "_decide_regions", "lowering: specialise: decide regions")
    timed(lower, "bind_graph", "lowering: specialise: bind (view folding, FX codegen)")
    timed(lower.LoweredGraph, "__init__", "lowering: LoweredGraph total")
    try:
        from torch_kernelize.warm_start import graph_cache
        timed(graph_cache, "probe", "graph cache: key")
        timed(graph_cache.GraphCache, "load", "graph cache: load")
        timed(graph_cache.GraphCache, "save", "graph cache: save")
        from torch_kernelize.warm_start import executable_cache
        timed(executable_cache, "key_for", "executable cache: key")
        timed(executable_cache.ExecutableCache, "load", "executable cache: load (incl. runners, codegen)")
        timed(executable_cache.ExecutableCache, "_restore", "executable cache: load: restore")
        timed(executable_cache.ExecutableCache, "save", "executable cache: save")
    except ImportError:
        pass


def child(backend: str, workload: str, cache_dir: str, breakdown: bool) -> None:
    import torch
    torch.manual_seed(0)
    model, inputs = _workloads()[workload]()
    timers: dict[str, float] = {}
    options = {"target": "cpu", "cache_dir": cache_dir, "repro_dir": "off"}
    artifact = Path(cache_dir) / f"{workload}.kz"
    if backend == "eager":
        fn = model
    elif backend == "inductor":
        fn = torch.compile(model)
    elif backend == "kernelize_aot":  # a saved artifact: saved by the first such process, loaded after
        from torch_kernelize import aot
        if not artifact.exists():
            with torch.no_grad():
                aot.save(model.forward, inputs, artifact, options=options)
        torch.compile(model)  # the imports the other rows make before their first call
    else:
        if breakdown:
            install_timers(timers)
        fn = torch.compile(model, backend="kernelize", options=options)
    import gc
    gc.collect()  # a collected heap for every backend (see benchmarks/run.py's FIRST_CALL)
    with torch.no_grad():
        t0 = time.perf_counter()
        if backend == "kernelize_aot":
            fn = aot.load(artifact, model)
        fn(*inputs)
        t1 = time.perf_counter()
    print(json.dumps({"first_call_s": t1 - t0, "timers": timers}))


_KEEP_ENV = False


def _run(backend: str, workload: str, cache_dir: Path, breakdown: bool = False, graph_cache: bool = True,
         executable_cache: bool = True) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"))
    if not graph_cache:
        env["KERNELIZE_GRAPH_CACHE"] = "off"
    if not executable_cache:
        env["KERNELIZE_EXECUTABLE_CACHE"] = "off"
    if not _KEEP_ENV:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, __file__, "--child", backend, workload, str(cache_dir / "kernelize"),
                           *(["--breakdown"] if breakdown else [])], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} {workload} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="conv1d,histc,rmsnorm,moe,llama4L")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    p.add_argument("--keep-env", action="store_true", help="keep PYTHONDONTWRITEBYTECODE if set")
    p.add_argument("--child", nargs=3, metavar=("BACKEND", "WORKLOAD", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child, breakdown=args.breakdown)
        return 0
    global _KEEP_ENV
    _KEEP_ENV = args.keep_env
    with tempfile.TemporaryDirectory(prefix="first_call_") as d:  # imports settle (bytecode written)
        _run("kernelize", "histc", Path(d))
    results = {}
    print(f"{'workload':10} {'eager':>7} {'ind cold':>9} {'ind warm':>9} {'kz cold':>8} {'kz nogc':>8} "
          f"{'kz noexe':>9} {'kz warm':>8} {'nogc/ind':>9} {'kz/ind':>7} {'kz aot':>7} {'aot/ind':>8}")
    for name in args.workloads.split(","):
        row: dict[str, float] = {}
        samples: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="first_call_") as d:
                d = Path(d)
                samples.setdefault("eager", []).append(_run("eager", name, d)["first_call_s"])
                for backend in ("inductor", "kernelize"):
                    samples.setdefault(f"{backend}_cold", []).append(_run(backend, name, d)["first_call_s"])
                    samples.setdefault(f"{backend}_warm", []).append(_run(backend, name, d)["first_call_s"])
                samples.setdefault("kernelize_warm_nogc", []).append(
                    _run("kernelize", name, d, graph_cache=False)["first_call_s"])
                samples.setdefault("kernelize_warm_noexe", []).append(
                    _run("kernelize", name, d, executable_cache=False)["first_call_s"])
                try:  # one process saves the artifact, the next loads it (one graph only)
                    _run("kernelize_aot", name, d)
                    samples.setdefault("kernelize_aot", []).append(_run("kernelize_aot", name, d)["first_call_s"])
                except RuntimeError:
                    pass  # a graph break (MoE): no artifact
                if args.breakdown and "breakdown" not in row:
                    row["breakdown"] = _run("kernelize", name, d, breakdown=True)  # type: ignore[assignment]
        row.update({k: round(statistics.median(v), 3) for k, v in samples.items()})
        results[name] = row
        print(f"{name:10} {row['eager']:7.3f} {row['inductor_cold']:9.3f} {row['inductor_warm']:9.3f} "
              f"{row['kernelize_cold']:8.3f} {row['kernelize_warm_nogc']:8.3f} {row['kernelize_warm_noexe']:9.3f} "
              f"{row['kernelize_warm']:8.3f} "
              f"{row['kernelize_warm_nogc'] / row['inductor_warm']:9.2f} "
              f"{row['kernelize_warm'] / row['inductor_warm']:7.2f} "
              + (f"{row['kernelize_aot']:7.3f} {row['kernelize_aot'] / row['inductor_warm']:8.2f}"
                 if "kernelize_aot" in row else f"{'—':>7} {'—':>8}"), flush=True)
        if "breakdown" in row:
            b = row["breakdown"]
            print(f"    breakdown of one warm kernelize first call ({b['first_call_s']:.3f} s):")
            for label, s in sorted(b["timers"].items(), key=lambda kv: -kv[1]):
                print(f"      {label:50} {s:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
