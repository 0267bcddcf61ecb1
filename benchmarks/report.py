"""Turn benchmarks/run.py's results.json into a Markdown table (benchmarks/README.md, between
markers) and a PNG chart. Runs anywhere matplotlib is installed:

    python benchmarks/report.py OUT/results.json [--readme benchmarks/README.md] [--png benchmarks/results.png]

The table is one run's: rows from several runs are never merged into it (machines are noisy,
and a row measured after a fix describes other code than its neighbours).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# Issue #5's targets: (description, predicate on (eager ms, inductor ms, kernelize ms))
TARGETS = {
    "conv1d_B2048_C96_L200_k3_fp16": (">= 4x eager and >= 3x inductor", lambda e, i, k: e >= 4 * k and i >= 3 * k),
    "histc_16M_256bins_fixed": (">= 3x eager", lambda e, i, k: e >= 3 * k),
    "histc_16M_256bins_data_range": (">= 3x eager", lambda e, i, k: e >= 3 * k),
    "rmsnorm_4096x8192_fp16": ("within 10% of inductor", lambda e, i, k: k <= 1.1 * i),
    "moe_T4096_d1024_E16_top4_fp16": (">= 1.2x inductor", lambda e, i, k: i >= 1.2 * k),
    "llama4L_d1024_b8_s512_fp16": (">= 1.0x inductor", lambda e, i, k: i >= k),
}


def target_met(name: str, r: dict) -> str | None:
    """'yes', 'with CUDA graphs' (met only by kernelize's cudagraphs option), 'no', or None."""
    if name not in TARGETS:
        return None
    ok = TARGETS[name][1]
    if ok(r["eager_ms"], r["inductor_ms"], r["kernelize_ms"]):
        return "yes"
    graphs = r.get("kernelize_cudagraphs_ms")
    if graphs and r.get("kernelize_cudagraphs_err", 1.0) <= 1e-2 and ok(r["eager_ms"], r["inductor_ms"], graphs):
        return "with CUDA graphs"
    return "no"


def _f(v, fmt="{:.3f}"):
    return fmt.format(v) if isinstance(v, (int, float)) else "—"


def _aot(row: dict, backend: str) -> str:
    """A saved artifact's first call, or why there is none (one graph only: a break refuses it)."""
    if f"{backend}_aot_first_call_s" in row:
        return _f(row[f"{backend}_aot_first_call_s"])
    error = row.get(f"{backend}_aot_error", "")
    # Dynamo names the user code where a data-dependent branch broke the one graph aot needs
    broken = "graph" in error.lower() or "from user code" in error
    return "graph break" if broken else "error" if error else "—"


def _gc(row: dict, backend: str) -> str:
    """Seconds the call spent in garbage collections (full ones counted), where recorded."""
    if f"{backend}_gc_s" not in row:
        return "—"
    return f"{row[f'{backend}_gc_s']:.3f} ({row.get(f'{backend}_gc_full', 0)} full)"


def table(results: dict) -> str:
    env = results.get("env", {})
    host = (f" Host speed: {env['host_us_per_eager_add']} us per eager torch.add call (host-bound rows move with it)."
            if "host_us_per_eager_add" in env else "")
    lines = [f"Measured {env.get('date', '?')} on {env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
             f"triton {env.get('triton', '?')}; medians of triton.testing.do_bench in one process"
             f"{' per workload' if env.get('measure_isolated') else ''}, same inputs.{host}",
             "",
             "| workload | eager ms | inductor ms | kernelize ms | kernelize+CUDA graphs ms | inductor reduce-overhead ms "
             "| vs eager | vs inductor | target | met | nodes on triton | max rel err | host µs per eager add |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.get("measure", {}).items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:120]} |||||||||||")
            continue
        desc = TARGETS.get(name, ("", None))[0]
        met = target_met(name, r)
        lines.append(
            f"| {name} | {_f(r['eager_ms'])} | {_f(r['inductor_ms'])} | {_f(r['kernelize_ms'])} | "
            f"{_f(r.get('kernelize_cudagraphs_ms'))} | {_f(r.get('inductor_reduce_overhead_ms'))} | "
            f"{_f(r['speedup_vs_eager'], '{:.2f}x')} | "
            f"{_f(r['speedup_vs_inductor'], '{:.2f}x')} | {desc} | {met or ''} | "
            f"{r.get('nodes_on_triton', '—')}/{r.get('nodes', '—')} | {_f(r.get('kernelize_err'), '{:.1e}')} | "
            f"{_f(r.get('host_add_us'), '{:.1f}')} |")
    fc = results.get("firstcall", {})
    if fc:
        lines += ["", "First call in a fresh process (seconds; Inductor with its caches warmed by an earlier "
                  "process, kernelize with a filled kernel cache and its graph and executable caches warmed "
                  "by an earlier process; "
                  "where the garbage-collection column has figures, the median of several fresh processes, each "
                  "timed from a collected heap; target: kernelize <= half of Inductor):", "",
                  "| workload | eager | inductor (warm) | kernelize (warm caches) | ratio | target met | Triton compiles "
                  "in kernelize | kernelize cache hits: graph / executable | Dynamo's tracing: inductor / kernelize | backend "
                  "compile: inductor / kernelize | garbage collection in the call: inductor / kernelize "
                  "| saved artifact, loaded without Dynamo: inductor / kernelize |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in fc.items():
            ratio = (r["kernelize_first_call_s"] / r["inductor_first_call_s"]
                     if "kernelize_first_call_s" in r and "inductor_first_call_s" in r else None)
            lines.append(f"| {name} | {_f(r.get('eager_first_call_s'))} | {_f(r.get('inductor_first_call_s'))} | "
                         f"{_f(r.get('kernelize_first_call_s'))} | {_f(ratio, '{:.2f}')} | "
                         f"{'—' if ratio is None else 'yes' if ratio <= 0.5 else 'no'} | "
                         f"{r.get('kernelize_triton_compiles', '—')} | {r.get('kernelize_graph_cache_hits', '—')} / "
                         f"{r.get('kernelize_executable_cache_hits', '—')} | "
                         f"{_f(r.get('inductor_dynamo_s'))} / {_f(r.get('kernelize_dynamo_s'))} | "
                         f"{_f(r.get('inductor_backend_s'))} / {_f(r.get('kernelize_backend_s'))} | "
                         f"{_gc(r, 'inductor')} / {_gc(r, 'kernelize')} | "
                         f"{_aot(r, 'inductor')} / {_aot(r, 'kernelize')} |")
    prof = results.get("profile", {})
    if prof:
        lines += ["", "GPU time per call by backend (torch.profiler, sum of kernel times; launches per call; "
                  "host ms: the host's time per call to enqueue it, where recorded, and per launched kernel "
                  "— above the GPU time, that "
                  "backend is host-bound; syncs: the host waits for the GPU that often per call), and "
                  "kernelize's three most expensive kernels:", "",
                  "| workload | eager GPU ms (launches) host ms | inductor GPU ms (launches) host ms "
                  "| kernelize GPU ms (launches) host ms | kernelize top kernels (ms) |", "|---|---|---|---|---|"]
        for name, r in prof.items():
            def cell(b: str) -> str:
                if not isinstance(r.get(b), dict):
                    return "—"
                host = f" {_f(r[b]['host_ms'])}" if "host_ms" in r[b] else ""
                if host and r[b].get("launches"):  # issue 24's bound: <= 5 us per launched kernel
                    host += f" ({r[b]['host_ms'] * 1e3 / r[b]['launches']:.1f} µs/launch)"
                if r[b].get("syncs_per_call"):  # the host waits for the GPU within each call
                    host += f", {r[b]['syncs_per_call']:g} syncs"
                return f"{_f(r[b].get('gpu_ms'))} ({r[b].get('launches', '—')}){host}"
            top = "; ".join(f"{k['name'][:48]} x{k['calls']:g}: {k['ms']:.3f}"
                            for k in (r.get("kernelize") or {}).get("kernels", [])[:3])
            lines.append(f"| {name} | {cell('eager')} | {cell('inductor')} | {cell('kernelize')} | {top or '—'} |")
    if "fill" in results:
        f = results["fill"]
        lines += ["", f"fill_cache for all workloads: {f.get('seconds')} s (budget {f.get('budget')} candidates per "
                  f"spec, exit {f.get('returncode')})."]
    if "overhead" in results:
        o = results["overhead"]
        lines += ["", "Launch overhead, host time per call of a 4096-element add (µs): "
                  f"direct Triton launch {_f(o.get('direct_triton_launch_us'), '{:.1f}')}, kernelize runner "
                  f"{_f(o.get('kernelize_runner_us'), '{:.1f}')} (static launcher: {o.get('kernelize_static_launcher')}), "
                  f"kernelize compiled graph {_f(o.get('kernelize_compiled_graph_us'), '{:.1f}')}, eager torch.add "
                  f"{_f(o.get('eager_torch_add_us'), '{:.1f}')}."]
    return "\n".join(lines)


def chart(results: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in results.get("measure", {}).items() if "error" not in v}
    names = list(rows)
    series = [("eager", "eager_ms"), ("inductor", "inductor_ms"), ("kernelize", "kernelize_ms"),
              ("kernelize + CUDA graphs", "kernelize_cudagraphs_ms")]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.2
    for i, (label, key) in enumerate(series):
        vals = [rows[n]["eager_ms"] / rows[n][key] if rows[n].get(key) else 0 for n in names]
        ax.bar([j + (i - 1.5) * width for j in range(len(names))], vals, width, label=label)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.split("_")[0] + "\n" + "_".join(n.split("_")[1:3]) for n in names], fontsize=8)
    ax.set_ylabel("speedup over eager (higher is better)")
    env = results.get("env", {})
    ax.set_title(f"torch_kernelize seed workloads — {env.get('gpu', '')}, {env.get('date', '')}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def write_report(results: dict, out: Path, readme: Path = HERE / "README.md", png: Path | None = None) -> None:
    text = table(results)
    (Path(out) / "table.md").write_text(text + "\n")
    if readme.exists():
        doc = readme.read_text()
        if BEGIN in doc and END in doc:
            head, rest = doc.split(BEGIN, 1)
            readme.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    try:
        chart(results, png or Path(out) / "results.png")
    except ImportError:
        print("matplotlib is not installed: no chart")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--readme", type=Path, default=HERE / "README.md")
    p.add_argument("--png", type=Path, default=HERE / "results.png")
    args = p.parse_args()
    results = json.loads(args.results.read_text())
    write_report(results, args.results.parent, args.readme, args.png)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
