"""Bring-up on the H200 with a chip file whose vendor runs only GEMMs: node share on the target after
one fill_cache, results against eager, and time per call beside the full ``cuda`` target.

    python benchmarks/bringup_gpu.py --out OUT [--models llama,bert] [--budget 2]

For each model and each target (``cuda``; ``gemm-only``: device cuda, Triton on cuda, vendor runs
mm/addmm/bmm/convolution only) one fresh process fills the cache (fill_cache --model), a second
compiles the model, checks it against eager and times it with triton.testing.do_bench (median)
beside eager. Everything lands in OUT/bringup.json and OUT/bringup.md, from this one run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torch_kernelize.model_zoo import hf_model

HERE = Path(__file__).resolve()
GEMM_ONLY = """name = "gemm-only"
device = "cuda"
triton = "cuda"
[ops]
supported = ["aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"]
"""


def make_llama():
    """transformers' Llama, 4 layers of d1024 (the seed workload's shape), batch 8 x 512, fp16."""
    import transformers
    return hf_model(transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                             num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                                             max_position_embeddings=1024), 8, 512, torch.float16)


def make_bert():
    """transformers' BERT-base encoder (12 layers, d768), batch 8 x 512, fp16."""
    import transformers
    return hf_model(transformers.BertConfig(), 8, 512, torch.float16)


def make_mixtral():
    """transformers' Mixtral, 4 layers of d1024 with 8 experts (top 2), batch 8 x 512, fp16."""
    import transformers
    return hf_model(transformers.MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                                               num_local_experts=8, num_experts_per_tok=2,
                                               max_position_embeddings=1024), 8, 512, torch.float16)


MODELS = {"llama": make_llama, "bert": make_bert, "mixtral": make_mixtral}


def _run(cmd: list[str], timeout: int) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr)[-4000:], time.perf_counter() - start
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout}s: {(e.stdout or '')[-2000:]}", time.perf_counter() - start


def measure(model_name: str, target: str, cache_dir: str) -> dict:
    """In this process: compile, compare with eager, time both (one model, one target)."""
    import triton.testing
    from torch_kernelize.bringup import compare_outputs, flat_tensors

    model, (x,) = MODELS[model_name]()
    model, x = model.cuda(), x.cuda()
    report = Path(cache_dir) / f"report-{model_name}-{Path(target).stem}.json"
    compiled = torch.compile(model, backend="kernelize",
                             options={"target": target, "cache_dir": cache_dir, "repro_dir": "off",
                                      "report": str(report)})
    with torch.no_grad():
        want, got = model(x), compiled(x)
        err, _ = compare_outputs(got, want)
        scale = max(float(t.abs().max()) for t in flat_tensors(want) if t.is_floating_point())
        eager_ms = triton.testing.do_bench(lambda: model(x), warmup=50, rep=300)
        kz_ms = triton.testing.do_bench(lambda: compiled(x), warmup=50, rep=300)
        inductor_ms = None
        if target == "cuda":  # torch.compile's default beside it, in the same process
            inductor = torch.compile(model)
            inductor(x)
            inductor_ms = triton.testing.do_bench(lambda: inductor(x), warmup=50, rep=300)
    from torch_kernelize.compiling.report import ReportWriter
    ReportWriter.for_path(report).write()
    graphs = json.loads(report.read_text())["graphs"]
    tiers: dict[str, int] = {}
    for g in graphs:
        for n in g["nodes"]:
            if n["tier"] != "decompose":
                tiers[n["tier"]] = tiers.get(n["tier"], 0) + 1
    nodes = sum(tiers.values())
    return {"model": model_name, "target": Path(target).stem, "tiers": tiers, "nodes": nodes,
            "on_target_pct": round(100.0 * (nodes - tiers.get("fallback", 0)) / max(nodes, 1), 1),
            "max_err": err, "max_abs_eager": scale, "eager_ms": eager_ms, "kernelize_ms": kz_ms,
            "inductor_ms": inductor_ms}


def _ms(v: float | None) -> str:
    return f"{v:.3f}" if v is not None else ""


def write_tables(out: Path, budget: int, rows: list[dict]) -> None:
    """OUT/bringup.json and OUT/bringup.md from the rows measured so far in this run."""
    import triton
    doc = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "budget": budget, "rows": rows}
    (out / "bringup.json").write_text(json.dumps(doc, indent=1, default=str))
    lines = [f"Bring-up run {doc['date']}, {doc['gpu']}, torch {doc['torch']}, triton {doc['triton']}, "
             f"fill budget {budget}", "",
             "| model | target | nodes | on target | fallback | max err (max abs) | eager ms | inductor ms | kernelize ms | fill s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["model"], r["target"]): r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['target']} | error | | | | | | | {r['fill_s']} |")
            continue
        lines.append(f"| {r['model']} | {r['target']} | {r['nodes']} | {r['on_target_pct']}% | "
                     f"{r['tiers'].get('fallback', 0)} | {r['max_err']:.2e} ({r['max_abs_eager']:.1f}) | "
                     f"{r['eager_ms']:.3f} | {_ms(r.get('inductor_ms'))} | "
                     f"{r['kernelize_ms']:.3f} | {r['fill_s']} |")
    for name in dict.fromkeys(r["model"] for r in rows):
        a, b = by.get((name, "cuda")), by.get((name, "gemm-only"))
        if a and b and "kernelize_ms" in a and "kernelize_ms" in b:
            lines.append(f"\n{name}: gemm-only / cuda per call = {b['kernelize_ms'] / a['kernelize_ms']:.2f}x")
    (out / "bringup.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budget", type=int, default=2)
    p.add_argument("--fill-timeout", type=int, default=240)
    p.add_argument("--measure-one", nargs=3, metavar=("MODEL", "TARGET", "CACHE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure_one:
        print("RESULT " + json.dumps(measure(*args.measure_one)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    chip = args.out / "gemm-only.toml"
    chip.write_text(GEMM_ONLY)
    caches = Path(tempfile.mkdtemp(prefix="bringup-caches-"))  # kept out of OUT: binaries need not travel back
    rows: list[dict] = []
    for name in args.models.split(","):
        for target in ("cuda", str(chip)):
            cache = str(caches / f"{name}-{Path(target).stem}")
            code, log, fill_s = _run([sys.executable, "-m", "torch_kernelize.fill_cache", "--model",
                                      f"{HERE}:make_{name}", "--target", target, "--cache-dir", cache,
                                      "--budget", str(args.budget), "--quiet"], args.fill_timeout)
            row = {"model": name, "target": Path(target).stem, "fill_exit": code, "fill_s": round(fill_s, 1)}
            mcode, mlog, _ = _run([sys.executable, str(HERE), "--out", str(args.out), "--measure-one", name, target,
                                   cache], 600)
            result = [line for line in mlog.splitlines() if line.startswith("RESULT ")]
            row.update(json.loads(result[-1][7:]) if result else {"error": mlog[-1500:]})
            if code != 0:
                row["fill_log"] = log[-1500:]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if "log" not in k}), flush=True)
            write_tables(args.out, args.budget, rows)  # after every row: a run cut short keeps what it measured
    print((args.out / "bringup.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
