"""fill_cache at real sizes: a sweep of realistic specs, filled one workload per process.

    python benchmarks/fill_sweep.py --out OUT                    # the H200 sweep (target cuda, budget 6)
    python benchmarks/fill_sweep.py --out OUT --target interpreter --tiny   # a dry run on CPU

Workloads: fp32 and fp16 matmuls from 4096^2 to 8192^2 and batched, a linear with its epilogue,
conv2d/conv3d with pointwise epilogue chains, norms and softmax over 8192-wide rows (1-4 GB
activations), and issue 25's GroupNorm region (Linear, GroupNorm, LeakyReLU, sum). Each runs
``python -m torch_kernelize.fill_cache`` into a fresh cache (OUT/cache-<time>, removed afterwards unless
--keep-cache) with its own summary; this script
records per spec the fill time, its split (build, reference, validation, timing), the peak
device memory the search allocated beyond what was allocated before it (fill_cache's
``peak_extra_bytes``) against the spec's own inputs plus outputs, and per workload whether it ran
out of memory or was lost (died, timed out, no summary). Results: OUT/fill_sweep.json and
OUT/fill_sweep.md, written again after each workload (a sweep cut short keeps what it did).
``--tiny`` shrinks every workload to a few hundred elements; ``--time-budget`` leaves the
workloads it has no time left for "not run" (not lost).

The make_* functions are fill_cache --model targets; they build on $KERNELIZE_SWEEP_DEVICE
(default cuda) at full size, or tiny with KERNELIZE_SWEEP_TINY=1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
TINY = os.environ.get("KERNELIZE_SWEEP_TINY") == "1"
DEV = os.environ.get("KERNELIZE_SWEEP_DEVICE", "cuda")
TARGET_MEDIAN_S, TARGET_P90_S = 10.0, 30.0   # issue 25's targets per spec, at budget 6
MEMORY_BOUND = 3.0                           # peak extra device memory <= 3x the spec's inputs + outputs


def _t(*shape, dtype=torch.float32, tiny=None):
    """A random tensor of ``shape`` (``tiny`` in a dry run) on the sweep's device."""
    return torch.randn(*(tiny if TINY else shape), device=DEV, dtype=dtype)


def _n(full: int, tiny: int) -> int:
    return tiny if TINY else full


class MatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


class LinearGelu(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return F.gelu(self.fc(x)) * 0.5


class ConvChain(nn.Module):
    """A convolution with a pointwise epilogue chain: bias, ReLU, scale, residual add, sigmoid gate."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        y = torch.relu(self.conv(x)) * 0.5 + x
        return y * torch.sigmoid(y)


class Norm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


class Softmax(nn.Module):
    def forward(self, x):
        return x.softmax(-1)


class GemmGroupNorm(nn.Module):
    """KernelBench's Matmul_GroupNorm_LeakyReLU_Sum: the region issue 25 found stored 2e-4 from eager."""

    def __init__(self, d: int, groups: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gn = nn.GroupNorm(groups, d)

    def forward(self, x):
        x = F.leaky_relu(self.gn(self.fc(x)), 0.01)
        return x + x


def _model(m: nn.Module, dtype=torch.float32) -> nn.Module:
    return m.to(DEV, dtype).eval()


def _mm(n: int, dtype):
    def make():
        torch.manual_seed(0)
        s = _n(n, 32)
        return _model(MatMul()), (_t(s, s, dtype=dtype, tiny=(s, s)), _t(s, s, dtype=dtype, tiny=(s, s)))
    return make


make_mm_fp32_4096 = _mm(4096, torch.float32)
make_mm_fp32_8192 = _mm(8192, torch.float32)
make_mm_fp16_4096 = _mm(4096, torch.float16)
make_mm_fp16_8192 = _mm(8192, torch.float16)


def make_bmm_fp16_32x2048():
    torch.manual_seed(0)
    return _model(MatMul()), (_t(32, 2048, 2048, dtype=torch.half, tiny=(2, 16, 16)),
                              _t(32, 2048, 2048, dtype=torch.half, tiny=(2, 16, 16)))


def make_bmm_fp32_16x4096x1024():  # a 1 GB output
    torch.manual_seed(0)
    return _model(MatMul()), (_t(16, 4096, 1024, tiny=(2, 16, 8)), _t(16, 1024, 4096, tiny=(2, 8, 16)))


def make_linear_gelu_fp16_8192x4096():
    torch.manual_seed(0)
    d = _n(4096, 32)
    return _model(LinearGelu(d), torch.half), (_t(8192, d, dtype=torch.half, tiny=(16, d)),)


def make_conv2d_chain_fp32_1GB():  # 64x256x128x128 fp32 activations in and out
    torch.manual_seed(0)
    c = _n(256, 4)
    return _model(ConvChain(nn.Conv2d(c, c, 3, padding=1))), (_t(64, c, 128, 128, tiny=(1, c, 8, 8)),)


def make_conv2d_chain_fp16_512MB():
    torch.manual_seed(0)
    c = _n(256, 4)
    return (_model(ConvChain(nn.Conv2d(c, c, 3, padding=1)), torch.half),
            (_t(64, c, 128, 128, dtype=torch.half, tiny=(1, c, 8, 8)),))


def make_conv3d_chain_fp32_512MB():  # 8x64x64x64x64 fp32
    torch.manual_seed(0)
    c = _n(64, 2)
    return _model(ConvChain(nn.Conv3d(c, c, 3, padding=1))), (_t(8, c, 64, 64, 64, tiny=(1, c, 4, 4, 4)),)


def make_layernorm_fp32_4GB():  # 131072 rows of 8192
    torch.manual_seed(0)
    d = _n(8192, 64)
    return _model(Norm(nn.LayerNorm(d))), (_t(131072, d, tiny=(8, d)),)


def make_rmsnorm_fp16_1GB():
    from torch_kernelize.model_zoo import RMSNorm
    torch.manual_seed(0)
    d = _n(8192, 64)
    return _model(RMSNorm(d), torch.half), (_t(65536, d, dtype=torch.half, tiny=(8, d)),)


def make_softmax_fp32_1GB():
    torch.manual_seed(0)
    d = _n(8192, 64)
    return _model(Softmax()), (_t(32768, d, tiny=(8, d)),)


def make_gemm_groupnorm_fp32():
    torch.manual_seed(0)
    d = _n(8192, 32)
    return _model(GemmGroupNorm(d, _n(32, 4))), (_t(8192, d, tiny=(8, d)),)


WORKLOADS = {name[len("make_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("make_")}


def fill_one(name: str, args: argparse.Namespace, timeout: float) -> dict:
    """fill_cache for one workload, in its own process: a crash or an OOM there loses only it."""
    summary = args.out / "summaries" / f"{name}.json"
    summary.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", "--target", args.target,
           "--cache-dir", str(args.cache), "--budget", str(args.budget), "--summary", str(summary),
           "--model", f"{Path(__file__).resolve()}:make_{name}"]
    env = dict(os.environ, KERNELIZE_SWEEP_TINY="1" if args.tiny else "0",
               KERNELIZE_SWEEP_DEVICE="cuda" if args.target == "cuda" else "cpu")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = "timeout", _text(e.stdout), _text(e.stderr)
    seconds = time.perf_counter() - t0
    with open(args.out / "fill_sweep.log", "a") as f:
        f.write(f"=== {name}: exit {code} in {seconds:.1f}s\n{out}\n--- stderr (tail) ---\n{err[-20000:]}\n")
    doc = json.loads(summary.read_text()) if summary.exists() else None
    rows = doc["specs"] if doc else []
    oom = "out of memory" in err.lower() or any(r["status"] == "too large" for r in rows)
    cut = code == "timeout" and timeout < args.timeout  # the sweep's --time-budget ran out, not its own
    return {"name": name, "returncode": code, "seconds": round(seconds, 2), "oom": oom, "cut": cut,
            "lost": not cut and (code not in (0, 1) or doc is None), "time": (doc or {}).get("time"),
            "specs": [_spec_row(r) for r in rows]}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _spec_row(r: dict) -> dict:
    peak, size = r.get("peak_extra_bytes"), r.get("bytes")
    return {"spec": r["spec"], "status": r["status"], "seconds": r.get("seconds"), "time": r.get("time"),
            "speedup": r.get("speedup"), "evaluated": r.get("evaluated"), "bytes": size,
            "peak_extra_bytes": peak, "peak_ratio": round(peak / size, 2) if peak is not None and size else None}


SEARCHED = ("stored", "vendor wins", "no correct candidate", "too large")


def summarize(workloads: list[dict]) -> dict:
    not_run = [w for w in workloads if w.get("not_run")]
    workloads = [w for w in workloads if not w.get("not_run")]
    specs = [s for w in workloads for s in w["specs"] if s["status"] in SEARCHED]
    times = sorted(s["seconds"] for s in specs if s["seconds"] is not None)
    ratios = [s["peak_ratio"] for s in specs if s["peak_ratio"] is not None]
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))] if times else None
    return {"specs": len(specs), "median_s": statistics.median(times) if times else None, "p90_s": p90,
            "ooms": sum(w["oom"] for w in workloads), "lost_runs": sum(w["lost"] for w in workloads),
            "max_peak_ratio": max(ratios, default=None),
            "over_memory_bound": sum(r > MEMORY_BOUND for r in ratios),
            "no_correct_candidate": sum(s["status"] == "no correct candidate" for s in specs),
            "not_run": [w["name"] for w in not_run], "cut": [w["name"] for w in workloads if w.get("cut")]}


def markdown(doc: dict) -> str:
    s = doc["summary"]

    def num(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)
    lines = [f"# fill_cache sweep: target {doc['target']}, budget {doc['budget']}{' (tiny dry run)' if doc['tiny'] else ''}",
             "", f"{doc['date']}; {s['specs']} specs searched; median {num(s['median_s'])} s per spec "
             f"(target <= {TARGET_MEDIAN_S:g}), p90 {num(s['p90_s'])} s (target <= {TARGET_P90_S:g}); "
             f"{s['ooms']} OOMs, {s['lost_runs']} lost runs; peak extra device memory up to "
             f"{num(s['max_peak_ratio'], '{:.2f}')}x the spec's inputs + outputs ({s['over_memory_bound']} over "
             f"{MEMORY_BOUND:g}x)." + (f" Cut short by the time budget: {', '.join(s['cut'])}." if s.get("cut") else "")
             + (f" Not run (no time left): {', '.join(s['not_run'])}." if s.get("not_run") else ""), "",
             "| workload | spec | status | fill s | generate | build | reference | validation | timing | in+out MiB | "
             "peak extra MiB | ratio | speedup |", "|" + "---|" * 13]
    for w in doc["workloads"]:
        if w.get("not_run"):
            continue
        if w.get("cut"):
            lines.append(f"| {w['name']} | - | cut short by --time-budget | {w['seconds']:.1f} |" + " - |" * 9)
        elif w["lost"] or not w["specs"]:
            lines.append(f"| {w['name']} | - | lost (exit {w['returncode']}) | {w['seconds']:.1f} |" + " - |" * 9)
        for r in w["specs"]:
            t = r["time"] or {}
            spec = r["spec"] if len(r["spec"]) <= 70 else r["spec"][:67] + "..."
            mib = (lambda b: "-" if b is None else f"{b / 2**20:.3g}")
            lines.append(f"| {w['name']} | `{spec}` | {r['status']} | {num(r['seconds'])} | "
                         + " | ".join(num(t.get(p)) for p in ("generate", "build", "reference", "validation", "timing"))
                         + f" | {mib(r['bytes'])} | {mib(r['peak_extra_bytes'])} | {num(r['peak_ratio'], '{:.2f}')} | "
                         f"{num(r['speedup'], '{:.2f}x')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON, the table, the log and the cache")
    p.add_argument("--target", default="cuda")
    p.add_argument("--budget", type=int, default=6)
    p.add_argument("--tiny", action="store_true", help="every workload at a few hundred elements (a dry run)")
    p.add_argument("--only", default="", help="comma-separated workload names (default: all): "
                   + ", ".join(WORKLOADS))
    p.add_argument("--timeout", type=int, default=900, help="seconds per workload before it counts as lost")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole sweep: a workload gets what is left (at most --timeout; one "
                        "stopped for it is 'cut', not lost); those with under 30 s left are not run")
    p.add_argument("--keep-cache", action="store_true", help="keep the sweep's kernel cache under --out")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(WORKLOADS)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache = args.out / f"cache-{time.strftime('%Y%m%d-%H%M%S')}"  # a fill, never a cache hit
    doc = {"target": args.target, "budget": args.budget, "tiny": args.tiny, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if args.target == "cuda" and torch.cuda.is_available() else "cpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "workloads": []}
    start = time.perf_counter()
    try:
        for name in names:
            left = args.timeout if args.time_budget is None else args.time_budget - (time.perf_counter() - start)
            if left < 30:
                doc["workloads"].append({"name": name, "not_run": True, "lost": False, "oom": False, "specs": []})
            else:
                w = fill_one(name, args, min(args.timeout, left))
                doc["workloads"].append(w)
                print(f"{name}: exit {w['returncode']} in {w['seconds']:.1f}s, {len(w['specs'])} spec(s)", flush=True)
            _write(doc, args.out)
    finally:
        if not args.keep_cache:
            shutil.rmtree(args.cache, ignore_errors=True)
    print(markdown(doc))
    return 0 if doc["summary"]["lost_runs"] == 0 else 1


def _write(doc: dict, out: Path) -> None:
    doc["summary"] = summarize(doc["workloads"])
    (out / "fill_sweep.json").write_text(json.dumps(doc, indent=1))
    (out / "fill_sweep.md").write_text(markdown(doc))


if __name__ == "__main__":
    sys.exit(main())
