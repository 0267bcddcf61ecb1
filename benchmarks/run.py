"""The benchmark suite: one command on a GPU machine.

    python benchmarks/run.py --out OUT [--cache-dir DIR] [--phases fill,measure,profile,overhead,firstcall]

fill       python -m torch_kernelize.fill_cache for every workload (timed; summary kept)
measure    medians (triton.testing.do_bench, same process, same inputs) of eager, torch.compile's
           default backend (Inductor), kernelize, kernelize with CUDA graphs and Inductor's
           mode="reduce-overhead" (CUDA graphs too); max error vs eager.
           With several workloads, measure and profile run in one fresh process per workload:
           inside the process that had run the others, kernelize's MoE took 2.3 ms of host time
           per call, against 1.8 ms in a process of its own (host_profile.py, same host)
overhead   launch cost: a direct Triton launch vs kernelize's runner vs a compiled one-op graph
firstcall  first-call time of each backend in a fresh process (Inductor's caches warmed by an
           earlier process; kernelize with its kernel cache filled; eager beside them), and of
           saved artifacts loaded without Dynamo (torch_kernelize.aot; Inductor's own aot_compile);
           the median of --firstcall-repeat fresh processes (one process alone varies by 0.1 s and more),
           the backends taking turns
profile    GPU time per call by kernel (torch.profiler) for eager, Inductor and kernelize: where
           each backend's device time goes (kernel names and counts, top kernels)

Results go to OUT/results.json; benchmarks/report.py turns them into the README table and chart.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from timing import bench, coverage, host_speed_us, kernel_times, per_call_us, rel_err  # noqa: E402


# The MoE's per-expert loop gives ~170 specs (one per expert and token count): a smaller budget.
# conv1d is one spec whose seeds alone fill the default budget: room for the search's neighbours.
BUDGETS = {"moe_T4096_d1024_E16_top4_fp16": 3, "conv1d_B2048_C96_L200_k3_fp16": 16}


def _fill(args, names: list[str], budget: int, timeout: int, tag: str) -> dict:
    from torch_kernelize.model_zoo import SEED_WORKLOADS
    cmd = [sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", "--target", "cuda",
           "--cache-dir", str(args.cache_dir), "--budget", str(budget),
           "--summary", str(args.reports / f"fill_summary_{tag}.json")]
    for n in names:
        cmd += ["--model", f"torch_kernelize.model_zoo:{SEED_WORKLOADS[n].__name__}"]
    if args.resume:
        cmd.append("--resume")
    t0, faults = time.perf_counter(), 0
    while True:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=max(1, timeout - (time.perf_counter() - t0)))
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:  # what was stored so far stays valid in the cache
            code, out, err = "timeout", e.stdout or "", e.stderr or ""
            out, err = (out.decode() if isinstance(out, bytes) else out), (err.decode() if isinstance(err, bytes) else err)
        if code != 3 or faults >= 5:
            break
        faults += 1
        # exit 3: a candidate faulted the GPU and is journaled; a new process resumes the search
        with open(args.out / "fill.log", "a") as f:
            f.write(f"=== {tag}: device fault, resuming\n{out}\n--- stderr (tail) ---\n{err[-30000:]}\n")
        if "--resume" not in cmd:
            cmd = cmd + ["--resume"]
    seconds = time.perf_counter() - t0
    with open(args.out / "fill.log", "a") as f:
        f.write(f"=== {tag}: {names} budget {budget}: {seconds:.1f}s exit {code}\n{out}\n--- stderr (tail) ---\n"
                f"{err[-30000:]}\n")
    print(out[-4000:], flush=True)
    return {"workloads": names, "seconds": round(seconds, 1), "returncode": code, "budget": budget}


def phase_fill(args, names) -> dict:
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(BUDGETS.get(n, args.budget), []).append(n)
    runs = [_fill(args, group, budget, args.fill_timeout if budget == args.budget else args.fill_timeout // 2,
                  f"b{budget}") for budget, group in sorted(groups.items(), reverse=True)]
    return {"seconds": round(sum(r["seconds"] for r in runs), 1), "runs": runs,
            "budget": ", ".join(f"{r['budget']} ({', '.join(w.split('_')[0] for w in r['workloads'])})" for r in runs),
            "returncode": [r["returncode"] for r in runs]}


def _check_mode(model, inputs, ref, args) -> dict:
    import logging
    import torch

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage()[:400])

    handler = Collect()
    logging.getLogger("torch_kernelize.serving.runtime").addHandler(handler)
    try:
        torch._dynamo.reset()
        k = _kernelize(args, check=True)(model)
        err = rel_err(k(*inputs), ref)
    finally:
        logging.getLogger("torch_kernelize.serving.runtime").removeHandler(handler)
    return {"err": err, "disabled": handler.messages[:20]}


def _each_workload(names, run_one, summary=lambda row: row) -> dict:
    """run_one(name, model, inputs, row) for each workload under no_grad; an error is recorded in
    its row and the next workload runs."""
    import torch
    from torch_kernelize.model_zoo import SEED_WORKLOADS
    results = {}
    for name in names:
        row = {}
        try:
            model, inputs = SEED_WORKLOADS[name]()
            with torch.no_grad():
                run_one(name, model, inputs, row)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(name, json.dumps(summary(row)), flush=True)
        results[name] = row
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return results


def _kernelize(args, **options):
    import torch
    return lambda model: torch.compile(model, backend="kernelize", options=dict(
        {"target": "cuda", "cache_dir": str(args.cache_dir), "repro_dir": "off"}, **options))


def phase_measure(args, names) -> dict:
    import torch

    def measure(name, model, inputs, row):
        # the host's speed while this workload is measured: a row measured on a slowed host (other
        # load on a lent machine) shows it here, not only in the run's overall figure
        row["host_add_us"] = host_speed_us()
        ref = model(*inputs)
        row["eager_ms"] = bench(lambda: model(*inputs))
        torch._dynamo.reset()
        ind = torch.compile(model)
        row["inductor_err"] = rel_err(ind(*inputs), ref)
        row["inductor_ms"] = bench(lambda: ind(*inputs))
        for label, extra in (("kernelize", {}), ("kernelize_cudagraphs", {"cudagraphs": True})):
            torch._dynamo.reset()
            report = args.reports / f"report_{name}_{label}.json"
            k = _kernelize(args, report=str(report), **extra)(model)
            row[f"{label}_err"] = rel_err(k(*inputs), ref)
            row[f"{label}_ms"] = bench(lambda: k(*inputs))
            if label == "kernelize":
                row.update(coverage(report))
        torch._dynamo.reset()  # the fair pair of kernelize's CUDA graphs (issue 24)
        ind_ro = torch.compile(model, mode="reduce-overhead")
        for _ in range(2):  # its first calls record the graphs
            ind_ro(*inputs)
        row["inductor_reduce_overhead_err"] = rel_err(ind_ro(*inputs), ref)
        row["inductor_reduce_overhead_ms"] = bench(lambda: ind_ro(*inputs))
        if row["kernelize_err"] > 1e-2:  # which kernels disagree with the vendor? (check mode)
            row["check_mode"] = _check_mode(model, inputs, ref, args)
        row["speedup_vs_eager"] = row["eager_ms"] / row["kernelize_ms"]
        row["speedup_vs_inductor"] = row["inductor_ms"] / row["kernelize_ms"]

    return _each_workload(names, measure)


def phase_profile(args, names) -> dict:
    import torch

    def profile(name, model, inputs, row):
        for label, make in (("eager", lambda m: m), ("inductor", torch.compile), ("kernelize", _kernelize(args))):
            torch._dynamo.reset()
            fn = make(model)
            row[label] = kernel_times(lambda: fn(*inputs))

    return _each_workload(names, profile,
                          lambda row: {k: v.get("gpu_ms") if isinstance(v, dict) else v for k, v in row.items()})


def phase_overhead(args) -> dict:
    """Per-call host cost of a tiny kernel: direct Triton launch vs kernelize's paths."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(x, y, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out + offs, tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)

    x, y = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    out = torch.empty_like(x)
    res = {"direct_triton_launch_us": per_call_us(lambda: add_kernel[(4,)](x, y, out, 4096, BLOCK=1024)),
           "eager_torch_add_us": per_call_us(lambda: torch.add(x, y))}
    torch._dynamo.reset()
    from torch_kernelize.fill_cache.cli import main as fill
    code = fill(["--quiet", "--model", f"{HERE / 'overhead_model.py'}:make", "--target", "cuda",
                 "--cache-dir", str(args.cache_dir), "--budget", "2", "--min-speedup", "0"])
    compiled = torch.compile(lambda a, b: a + b, backend="kernelize",
                             options={"target": "cuda", "cache_dir": str(args.cache_dir), "repro_dir": "off"})
    compiled(x, y)
    from torch_kernelize.compiling.lower import Session
    from torch_kernelize.core.spec import TensorMeta
    # this add's runner: the process has loaded the earlier workloads' runners too (other shapes)
    want = [TensorMeta.of(x), TensorMeta.of(y)]
    runners = [r for r in Session._runners.values()
               if r is not None and r.spec.op == "aten.add.Tensor" and list(r.spec.inputs) == want]
    res["fill_returncode"] = code
    if runners:
        runner = runners[0]
        res["kernelize_runner_us"] = per_call_us(lambda: runner(x, y))
        res["kernelize_static_launcher"] = all(getattr(k, "static", False) for k in runner._kernels)
    res["kernelize_compiled_graph_us"] = per_call_us(lambda: compiled(x, y))
    print("overhead", json.dumps(res), flush=True)
    return res


FIRST_CALL = r"""
import functools, json, os, sys, time
t_start = time.perf_counter()
import torch
from torch_kernelize.model_zoo import SEED_WORKLOADS
backend = {backend!r}
counts = {{"triton_compile": 0}}
import triton, triton.compiler.compiler as cc
orig = cc.compile
def counting(*a, **k):
    counts["triton_compile"] += 1
    return orig(*a, **k)
cc.compile = triton.compile = counting
model, inputs = SEED_WORKLOADS[{name!r}]()
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # (CPU: the tests' dry run)
sync()
options = {{"target": "cuda", "cache_dir": {cache!r}, "repro_dir": "off"}}
artifact = {artifact!r}
if backend == "eager":
    fn = model
elif backend == "inductor":
    fn = torch.compile(model)
elif backend in ("kernelize", "kernelize_noprewarm"):  # (the latter's process has KERNELIZE_PREWARM=off)
    fn = torch.compile(model, backend="kernelize", options=options)
elif not os.path.exists(artifact):  # a saved artifact (no Dynamo when loaded): this process saves it
    with torch.no_grad():
        if backend == "kernelize_aot":
            from torch_kernelize import aot
            aot.save(model.forward, inputs, artifact, options=options)
        else:  # torch's own aot_compile with Inductor
            with torch._dynamo.config.patch(enable_aot_compile=True):
                torch.compile(model.forward, fullgraph=True).aot_compile((inputs, {{}})).save_compiled_function(artifact)
if backend.endswith("_aot"):  # what the other rows do before their first call: the same imports
    torch.compile(model)
# Every process starts the timed call from a collected heap: otherwise whether Dynamo's tracing
# crosses the threshold of a full collection (~0.15 s) depends on what the process allocated
# before (Inductor's torch.compile() imports more up front), not on the backend.
import gc
gc.collect()
in_gc = {{"s": 0.0, "full": 0, "t": 0.0}}
def gc_timer(phase, info):
    if phase == "start":
        in_gc["t"] = time.perf_counter()
    else:
        in_gc["s"] += time.perf_counter() - in_gc["t"]
        in_gc["full"] += info["generation"] == 2
gc.callbacks.append(gc_timer)
with torch.no_grad():
    t0 = time.perf_counter()
    if backend == "kernelize_aot":
        from torch_kernelize import aot
        fn = aot.load(artifact, model)
    elif backend == "inductor_aot":
        with open(artifact, "rb") as f:
            fn = functools.partial(torch.compiler.load_compiled_function(f), model)
    fn(*inputs)
    sync()
    t1 = time.perf_counter()
gc.callbacks.remove(gc_timer)
counts["gc_s"], counts["gc_full"] = in_gc["s"], in_gc["full"]
for kind in ("graph", "executable"):
    cache = sys.modules.get(f"torch_kernelize.warm_start.{{kind}}_cache")
    counts[f"{{kind}}_cache_hits"] = cache.stats["hit"] if cache is not None else 0
prewarm = sys.modules.get("torch_kernelize.warm_start.prewarm")
if prewarm is not None:  # what the background warm-up did (and whether it was done when the call was)
    alive = prewarm._thread is not None and prewarm._thread.is_alive()
    prewarm.wait()
    counts["prewarm"] = {{**prewarm.stats, "alive_after_call": alive}}
try:  # Dynamo's own tracing vs the backend's compile (the rest is running the graph)
    from torch._dynamo.utils import compile_times
    phases = dict(zip(*compile_times(repr="csv", aggregate=True)))
    if backend != "eager" and "_compile.compile_inner" in phases:
        backend_s = float(phases.get("OutputGraph.call_user_compiler", 0.0))
        counts["dynamo_s"] = float(phases["_compile.compile_inner"]) - backend_s
        counts["backend_s"] = backend_s
except Exception:  # a torch without these timers: the first call alone
    pass
print(json.dumps({{"first_call_s": t1 - t0, "process_s": t1 - t_start, **counts}}))
"""


FIRST_CALL_BACKENDS = (("eager", False), ("inductor", True), ("kernelize", True), ("kernelize_noprewarm", True),
                       ("inductor_aot", True), ("kernelize_aot", True))


def _run_child(code: str, env: dict) -> dict:
    """One fresh first-call process: its JSON line, or RuntimeError with the child's exception."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode:
        raise RuntimeError(_exception_text(proc.stderr))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_call_samples(children: dict[str, tuple[str, dict, bool]], repeat: int,
                       run_child=_run_child) -> dict[str, list[dict] | str]:
    """{backend: its ``repeat`` samples, or why it failed}. ``children`` maps a backend to its
    code, environment and whether an earlier process warms its caches. After the warm-ups the
    backends take turns, one process each per round, so that a host whose speed drifts during
    the minutes this takes moves every backend's samples alike, not one backend's."""
    samples: dict[str, list[dict] | str] = {}
    for backend, (code, env, warm) in children.items():
        samples[backend] = []
        if warm:  # an earlier process fills the on-disk caches (and writes bytecode)
            try:
                run_child(code, env)
            except Exception:  # its timed processes will say why
                pass
    for _ in range(repeat):
        for backend, (code, env, _) in children.items():
            if isinstance(samples[backend], str):
                continue  # failed: not retried
            try:
                samples[backend].append(run_child(code, env))
            except Exception as e:
                samples[backend] = f"{type(e).__name__}: {e}"[:500]
    return samples


def phase_firstcall(args, names, save=lambda rows: None) -> dict:
    results = {}
    for name in names:
        row = {}
        # Each compiler's own caches are warmed by an earlier process (Inductor's FX graph and
        # AOTAutograd caches; kernelize's graph cache), kernelize's kernel cache by fill_cache.
        # The *_aot rows load an artifact that the warm-up process saved (torch's aot_compile: no
        # Dynamo tracing when loaded; one graph only, so not every workload has them).
        # kernelize_noprewarm: kernelize without the background warm-up during tracing (prewarm.py).
        children = {}
        for backend, warm in FIRST_CALL_BACKENDS:
            artifact = str(args.cache_dir / "aot" / f"{name}.{backend}")
            Path(artifact).unlink(missing_ok=True)
            Path(artifact).parent.mkdir(parents=True, exist_ok=True)
            code = FIRST_CALL.format(backend=backend, name=name, cache=str(args.cache_dir),
                                     artifact=artifact)
            env = _child_env(**({"KERNELIZE_PREWARM": "off"} if backend == "kernelize_noprewarm" else {}))
            children[backend] = (code, env, warm)
        for backend, runs in first_call_samples(children, args.firstcall_repeat).items():
            if isinstance(runs, str):
                row[f"{backend}_error"] = runs
                continue
            r = sorted(runs, key=lambda x: x["first_call_s"])[(len(runs) - 1) // 2]  # the median process
            row[f"{backend}_first_call_s"] = round(r["first_call_s"], 3)
            if len(runs) > 1:
                row[f"{backend}_first_call_samples_s"] = [round(x["first_call_s"], 3) for x in runs]
            for part in ("dynamo_s", "backend_s", "gc_s", "gc_full"):
                if part in r:
                    row[f"{backend}_{part}"] = round(r[part], 3)
            if backend == "kernelize":
                row["kernelize_prewarm"] = r.get("prewarm")
                row["kernelize_triton_compiles"] = r["triton_compile"]
                row["kernelize_graph_cache_hits"] = r["graph_cache_hits"]
                row["kernelize_executable_cache_hits"] = r["executable_cache_hits"]
        print(name, json.dumps(row), flush=True)
        results[name] = row
        save(results)  # a run stopped by its time limit keeps the rows measured so far
    return results


def _isolated(args, names, phases) -> dict:
    """Run ``phases`` for each workload in a fresh process of this script; {name: its results}."""
    out = {}
    for name in names:
        child = args.out / "isolated" / name
        cmd = [sys.executable, __file__, "--out", str(child), "--cache-dir", str(args.cache_dir),
               "--phases", ",".join(phases), "--workloads", name, "--reports", str(args.reports)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        print(proc.stdout[-3000:], flush=True)
        try:
            out[name] = json.loads((child / "results.json").read_text())
        except (OSError, ValueError) as e:
            out[name] = {"error": f"exit {proc.returncode}: {type(e).__name__}: {e}; {proc.stderr[-1500:]}"}
    return out


def _exception_text(stderr: str) -> str:
    """The last exception a child process printed, with its whole (multi-line) message: the
    lines after the last traceback's frames (the last line alone can be a message's tail)."""
    lines = stderr.strip().splitlines()
    if not lines:
        return "no output"
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=len(lines) - 1)
    body = lines[start + 1:] or lines[-1:]
    i = max((i for i, line in enumerate(body) if line.startswith("  File ")), default=-1) + 1
    while i and i < len(body) and body[i].startswith("    "):  # the frame's source lines
        i += 1
    return " ".join(line.strip() for line in body[i:]) or lines[-1]


def _child_env(**extra: str) -> dict:
    """The environment of a first-call process: bytecode may be written, as an installed package
    has it (a fresh editable checkout under PYTHONDONTWRITEBYTECODE recompiles kernelize's ~45
    modules in every process: ~0.25 s of its first call on the H200 host, which torch's own
    compiled modules never pay)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return {**env, **extra}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--phases", default="fill,measure,profile,overhead,firstcall")
    p.add_argument("--workloads", default=None, help="comma-separated names (default: all)")
    p.add_argument("--budget", type=int, default=6)
    p.add_argument("--fill-timeout", type=int, default=420)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--firstcall-repeat", type=int, default=3,
                   help="fresh processes per first-call measurement; the median is reported (default 3)")
    p.add_argument("--reports", type=Path, default=None, help="coverage reports and fill summaries "
                   "(default: OUT/reports)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.reports = args.reports or args.out / "reports"
    args.reports.mkdir(parents=True, exist_ok=True)
    args.cache_dir = args.cache_dir or args.out / "kernel_cache"
    from torch_kernelize.model_zoo import SEED_WORKLOADS
    names = args.workloads.split(",") if args.workloads else list(SEED_WORKLOADS)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    import torch
    import triton
    results["env"] = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__,
                      "host_us_per_eager_add": host_speed_us()}
    phases = args.phases.split(",")
    isolated = [p for p in ("measure", "profile") if p in phases] if len(names) > 1 else []
    if isolated:
        results["env"]["measure_isolated"] = True
    for phase in phases:
        t0 = time.perf_counter()
        if phase == "fill":
            results["fill"] = phase_fill(args, names)
        elif phase in isolated:
            if phase == isolated[0]:  # one child per workload runs them all
                for name, child in _isolated(args, names, isolated).items():
                    for p in isolated:
                        results.setdefault(p, {})[name] = child.get(p, {}).get(name, {"error": child.get("error")})
        elif phase == "measure":
            results.setdefault("measure", {}).update(phase_measure(args, names))
        elif phase == "profile":
            results.setdefault("profile", {}).update(phase_profile(args, names))
        elif phase == "overhead":
            results["overhead"] = phase_overhead(args)
        elif phase == "firstcall":
            def save(rows):
                results.setdefault("firstcall", {}).update(rows)
                results_path.write_text(json.dumps(results, indent=1))
            save(phase_firstcall(args, names, save))
        print(f"== phase {phase}: {time.perf_counter() - t0:.1f}s", flush=True)
        results_path.write_text(json.dumps(results, indent=1))
    try:
        from report import write_report
        write_report(results, args.out)
    except Exception as e:
        print(f"report not written: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
