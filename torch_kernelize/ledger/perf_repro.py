"""Performance reproducers: a slow row of the ledger as a reproducer folder with a time to beat.

The folder is the reproducer format (serving/repro_writer.py: spec.json, graph.py, the captured
inputs, the float64 reference, repro.py) of kind ``slow``, with task.md and check_candidate.py
(repro/task.py) and ``perf.json``: the time to beat (the served implementation's median, and its
time under CUDA-graph replay on CUDA), the floor and what the fill measured. task.md gets a
section that says what to beat, how to check a candidate with timing, and how to hand it back.
A later run of the ledger refreshes perf.json and task.md in place (the captured inputs stay).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.core.targets import Target
from torch_kernelize.ledger.floors import Ceilings
from torch_kernelize.ledger.rank import Row
from torch_kernelize.repro.task import TASK_FILE, write_task
from torch_kernelize.serving.repro_writer import write_repro

PERF_FILE = "perf.json"


def served_times(row: Row, inputs: Sequence[torch.Tensor], target: Target) -> tuple[float, float | None]:
    """(median us, CUDA-graph replay us) of one call of the row's served implementation. On CUDA
    timed alone on the captured inputs (triton.testing.do_bench), as check_candidate --time times
    a candidate; elsewhere the ledger's in-model time per node call, and no replay."""
    per_call = row.seconds / row.calls * 1e6
    if target.device != "cuda" or row.region is not None:  # (a fusion's launches: timed in the model)
        return per_call, None
    from torch_kernelize.core.devices import to_device
    from torch_kernelize.fill_cache.benchmark import graph_replay_ms, median_ms
    call: Callable = row.nodes[0].call or (lambda *t: row.spec.run_vendor(t))
    on_device = [to_device(t, "cuda") for t in inputs]
    replay = graph_replay_ms(lambda: call(*on_device))
    return median_ms(lambda: call(*on_device), rep_ms=200) * 1e3, (replay * 1e3 if replay is not None else None)


def perf_record(row: Row, target: Target, ceilings: Ceilings, model: str, median_us: float,
                replay_us: float | None) -> dict[str, Any]:
    calls = row.calls
    return {
        "model": model, "target": target.name, "where": row.where,
        "time_to_beat_us": median_us, "graph_replay_us": replay_us,
        "timed": ("per call inside the model, on the host (not a GPU time)" if target.device != "cuda" else
                  "per call inside the model (torch.profiler device time)" if row.region is not None else
                  "median, alone on the captured inputs (triton.testing.do_bench)"),
        "fusion_of": [f"{n.graph}:{n.node} {n.op}" for n in row.nodes] if row.region is not None else None,
        "served_by": row.generator, "tier": row.tier, "share_of_call": row.share, "calls_per_model_call": calls,
        "floor_us": row.floor_s / calls * 1e6 if row.floor_s else None, "bound": row.bound,
        "bytes": row.bytes, "flops": row.flops, "ceilings": ceilings.to_json(),
        "fill_measured_ms": row.alternatives,
    }


def performance_section(perf: dict[str, Any], folder: Path) -> str:
    replay = perf["graph_replay_us"]
    floor = perf["floor_us"]
    alts = ", ".join(f"{k} {v * 1e3:.3g} us" for k, v in sorted(perf["fill_measured_ms"].items(), key=lambda kv: kv[1]))
    return "\n".join([
        "## Time to beat (bottleneck ledger)",
        "",
        f"This spec is one of the slowest of `{perf['model']}` on target `{perf['target']}`: "
        f"{100 * perf['share_of_call']:.1f}% of the kernels' time per model call, {perf['calls_per_model_call']} "
        f"call(s) per model call ({', '.join(perf['where'][:4])}{', ...' if len(perf['where']) > 4 else ''}), "
        f"served by `{perf['served_by']}` ({perf['tier']}).",
        *(["", "A fusion opportunity: the region's nodes run as separate kernels now, each writing what the next "
           "reads back. One kernel for the whole region (its inputs above, its outputs only) beats their sum:", "",
           *[f"  - {x}" for x in perf["fusion_of"]]] if perf.get("fusion_of") else []),
        "",
        f"- time to beat: {perf['time_to_beat_us']:.3g} us, {perf['timed']}"
        + (f"; {replay:.3g} us under CUDA-graph replay" if replay is not None else ""),
        f"- floor: {floor:.3g} us ({perf['bound']}-bound: {perf['bytes']:,} bytes, {perf['flops']:,} FLOPs at "
        f"{perf['ceilings']['source']} ceilings)" if floor is not None else
        "- floor: n/a (the target has no ceilings: give `bandwidth_gbs` and `[tflops]` in its chip file)",
        f"- the fill measured: {alts}" if alts else "- the fill measured no times here (timing needs a GPU)",
        "",
        "A candidate must be correct (everything above) and faster than the time to beat, alone and replayed. "
        "Check it with timing, then hand it back; the ledger's next run shows the model's time before and after:",
        "",
        "```",
        "python check_candidate.py my_kernel.py --time          # on a GPU: its median and replay times beside these",
        f"python -m torch_kernelize.fill_cache --repros {folder.parent} --candidate my_kernel.py --target <target>",
        "python -m torch_kernelize.bottlenecks --model <the same model> --target <target>   # re-measure",
        "```",
        "",
        "(`repro.py` checks the served answer only; speed is what `--time` and the ledger measure.)",
        "",
    ])


def write_perf_repro(root: Path, row: Row, inputs: Sequence[torch.Tensor], target: Target, cache_dir: Path | None,
                     ceilings: Ceilings, model: str) -> Path:
    """The reproducer folder of ``row`` under ``root`` (written, or refreshed where it exists)."""
    spec = row.spec
    folder = Path(root) / f"perf-{spec.slug}"
    median_us, replay_us = served_times(row, inputs, target)
    perf = perf_record(row, target, ceilings, model, median_us, replay_us)
    if not (folder / "spec.json").exists():
        write_repro(folder, spec, inputs, target, "slow", cache_dir, {"perf": perf})
    (folder / PERF_FILE).write_text(json.dumps(perf, indent=1))
    write_task(folder)
    with open(folder / TASK_FILE, "a") as f:
        f.write("\n" + performance_section(perf, folder))
    return folder
