"""The real-model suite's results (benchmarks/real_models.py): issue 35's, 24's and 38's targets
judged over the models' rows, and the markdown tables of a run."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

# issue 35 (23's before it): kernelize's median per call against torch.compile's default, its GPU
# time against the smaller of eager's and Inductor's, reduce-overhead against Inductor's; issue 24:
# host time; issue 38: reduce-overhead where Inductor's fails, against Inductor's default
SPEEDUP_EACH, SPEEDUP_GEOMEAN, HOST_US_PER_LAUNCH, RO_WHERE_INDUCTOR_FAILS = 1.0, 1.15, 5.0, 1.2


def write_json(path: Path, doc: dict) -> None:
    """Atomically: a reader (the parent, after it killed the child writing it) sees the last whole doc."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def _speedup(row: dict, base: str, label: str) -> float | None:
    a, b = row.get("backends", {}).get(base, {}), row.get("backends", {}).get(label, {})
    if a.get("median_ms") and b.get("median_ms"):
        return float(f"{a['median_ms'] / b['median_ms']:.4g}")  # (not rounded to 0: the interpreter is that slow)
    return None


def _why_slow(row: dict, need_ms: float) -> str:
    """What a missed speedup needs, beside the floor and where kernelize's time goes."""
    k, floor = row["backends"]["kernelize"], row.get("floor", {})
    parts = [f"needs <= {need_ms:.3f} ms per call"]
    if "ms" in floor:
        parts.append(f"floor {floor['ms']:.3f} ms ({floor['gflop']:.0f} GFLOP, {floor['mbytes']:.0f} MB)")
    if k.get("gpu_ms") is not None and k.get("host_ms") is not None:
        bound = "host-bound" if k["host_ms"] > k["gpu_ms"] else "GPU-bound"
        parts.append(f"kernelize GPU {k['gpu_ms']:.3f} ms, host {k['host_ms']:.3f} ms: {bound}")
    return "; ".join(parts)


def _same_kernels(mine: list[dict], theirs: list[dict]) -> str:
    """Kernel by kernel (the profiles' top kernels): the time of those both ran alike (name and
    calls), then of the rest; a difference on the same kernels is the GPU's, not a choice's."""
    by_name = {k["name"]: k for k in theirs}
    same = [(k, by_name[k["name"]]) for k in mine if k["name"] in by_name and k["calls"] == by_name[k["name"]]["calls"]]
    a, b = sum(k["ms"] for k, _ in same), sum(t["ms"] for _, t in same)
    rest_a = sum(k["ms"] for k in mine) - a
    rest_b = sum(k["ms"] for k in theirs) - b
    return (f"the same {len(same)} kernels {a:.3f} ms against {b:.3f}" + (f" ({a / b:.2f}x)" if b else "")
            + f", the other top kernels {rest_a:.3f} against {rest_b:.3f}")


def _gpu_vs_best(row: dict) -> dict[str, Any]:
    """Kernelize's GPU time per call against the smaller of eager's and Inductor's."""
    b = row.get("backends", {})
    k = b.get("kernelize", {}).get("gpu_ms")
    base = min((n for n in ("eager", "inductor") if b.get(n, {}).get("gpu_ms")), key=lambda n: b[n]["gpu_ms"],
               default=None)
    if k is None or base is None:
        return {"met": False, "distance": "not measured"}
    out = {"kernelize_ms": k, "best_ms": b[base]["gpu_ms"], "met": k <= b[base]["gpu_ms"],
           "distance": f"{k / b[base]['gpu_ms'] - 1:+.0%} of {base}'s"}
    if not out["met"] and b["kernelize"].get("kernels") and b[base].get("kernels"):
        out["distance"] += f"; {_same_kernels(b['kernelize']['kernels'], b[base]['kernels'])}"
    return out


def _reduce_overhead(row: dict) -> tuple[str, dict[str, Any]] | None:
    """Kernelize's reduce-overhead against Inductor's (issue 35), or against Inductor's default
    where Inductor's fails (issue 38); None where kernelize's did not run."""
    b = row.get("backends", {})
    if not b.get("kernelize_reduce_overhead", {}).get("median_ms"):
        return None
    if b.get("inductor_reduce_overhead", {}).get("median_ms"):
        s = _speedup(row, "inductor_reduce_overhead", "kernelize_reduce_overhead")
        return "both", {"speedup": s, "met": s >= 1.0, "distance": f"{s - 1:+.0%}"}
    s = _speedup(row, "inductor", "kernelize_reduce_overhead")
    if s is None:
        return None
    return "inductor_fails", {"speedup": s, "met": s >= RO_WHERE_INDUCTOR_FAILS,
                              "distance": f"{s / RO_WHERE_INDUCTOR_FAILS - 1:+.0%} (of Inductor's default)"}


def judge(models: dict[str, dict]) -> dict[str, Any]:
    """Issue 35's, 24's and 38's targets over the suite's rows: per model and overall, met or missed
    and by how much. A model without the measurements a target needs counts as missing it."""
    each, host, launch, speedups, gpu, ro = {}, {}, {}, [], {}, {"both": {}, "inductor_fails": {}}
    for name, row in models.items():
        if "skipped" in row:
            continue
        gpu[name] = _gpu_vs_best(row)
        judged = _reduce_overhead(row)
        if judged:
            ro[judged[0]][name] = judged[1]
        k, i = row.get("backends", {}).get("kernelize", {}), row.get("backends", {}).get("inductor", {})
        s = _speedup(row, "inductor", "kernelize")
        if s is None:
            each[name] = {"met": False, "distance": "not measured"}
        else:
            speedups.append(s)
            each[name] = {"speedup": s, "met": s >= SPEEDUP_EACH, "distance": f"{s / SPEEDUP_EACH - 1:+.0%}"}
            if s < SPEEDUP_EACH:
                each[name]["distance"] += f" ({_why_slow(row, i['median_ms'] / SPEEDUP_EACH)})"
        if k.get("host_ms") is not None and i.get("host_ms") is not None:
            host[name] = {"kernelize_ms": k["host_ms"], "inductor_ms": i["host_ms"],
                          "met": k["host_ms"] <= i["host_ms"],
                          "distance": f"{k['host_ms'] / i['host_ms'] - 1:+.0%} of Inductor's"}
        else:
            host[name] = {"met": False, "distance": "not measured"}
        if k.get("host_us_per_launch") is not None:
            us = k["host_us_per_launch"]
            launch[name] = {"us": us, "met": us <= HOST_US_PER_LAUNCH,
                            "distance": f"{us / HOST_US_PER_LAUNCH:.1f}x the bound"}
        else:
            launch[name] = {"met": False, "distance": "not measured"}
    geo = math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups else None
    return {
        "speedup_each": {"target": f">= {SPEEDUP_EACH}x torch.compile default", "models": each,
                         "met": bool(each) and all(v["met"] for v in each.values())},
        "speedup_geomean": {"target": f">= {SPEEDUP_GEOMEAN}x", "value": round(geo, 3) if geo else None,
                            "of": len(speedups), "met": geo is not None and geo >= SPEEDUP_GEOMEAN
                            and len(speedups) == len(each),
                            "distance": f"{geo / SPEEDUP_GEOMEAN - 1:+.0%}" if geo else "not measured"},
        "host_vs_inductor": {"target": "kernelize host ms per call <= Inductor's", "models": host,
                             "met": bool(host) and all(v["met"] for v in host.values())},
        "host_per_launch": {"target": f"<= {HOST_US_PER_LAUNCH} us of host time per launched kernel",
                            "models": launch, "met": bool(launch) and all(v["met"] for v in launch.values())},
        "gpu_vs_best": {"target": "kernelize GPU ms per call <= the smaller of eager's and Inductor's",
                        "models": gpu, "met": bool(gpu) and all(v["met"] for v in gpu.values())},
        "ro_vs_ro": {"target": "kernelize reduce-overhead >= Inductor's, where both run", "models": ro["both"],
                     "met": all(v["met"] for v in ro["both"].values())},
        "ro_where_inductor_fails": {
            "target": f"kernelize reduce-overhead >= {RO_WHERE_INDUCTOR_FAILS}x Inductor's default, where Inductor's "
                      "reduce-overhead fails", "models": ro["inductor_fails"],
            "met": all(v["met"] for v in ro["inductor_fails"].values())},
    }


LABELS = {"eager": "eager", "inductor": "inductor", "kernelize": "kernelize",
          "inductor_reduce_overhead": "inductor reduce-overhead",
          "kernelize_reduce_overhead": "kernelize reduce-overhead"}


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "" if v is None else fmt.format(v)


def markdown(doc: dict) -> str:
    """The run's tables: per model, per backend, the targets, then what failed or was skipped."""
    env = doc["env"]
    lines = [f"Real-model suite, one run {env['date']}, {env['device']}, torch {env['torch']}, triton "
             f"{env['triton']}, {', '.join(f'{k} {v}' for k, v in env['packages'].items())}; kernelize target "
             f"{env['target']}, fill budget {env['fill_budget']} per spec; time limit {env['time_limit_s']:.0f} s, "
             f"took {doc.get('elapsed_s', 0):.0f} s; host speed {_f(env.get('host_us_per_eager_add'), '{:.1f}')} "
             f"us per eager add" + ("; SMOKE (tiny configs)" if env["smoke"] else ""), "",
             "| model | eager ms | inductor ms | kernelize ms | kernelize vs inductor | inductor r-o ms | "
             "kernelize r-o ms | r-o vs r-o | floor ms | kernelize max rel err | fill s | "
             "first call s: inductor / kernelize |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in doc["models"].items():
        if "skipped" in row:
            continue
        b = row.get("backends", {})
        ms = {k: _f(b.get(k, {}).get("median_ms")) for k in LABELS}
        fill = row.get("fill", {})
        lines.append(
            f"| {name} | {ms['eager']} | {ms['inductor']} | {ms['kernelize']} | "
            f"{_f(_speedup(row, 'inductor', 'kernelize'), '{:.2f}x')} | {ms['inductor_reduce_overhead']} | "
            f"{ms['kernelize_reduce_overhead']} | "
            f"{_f(_speedup(row, 'inductor_reduce_overhead', 'kernelize_reduce_overhead'), '{:.2f}x')} | "
            f"{_f(row.get('floor', {}).get('ms'))} | "
            f"{_f(b.get('kernelize', {}).get('max_rel_err'), '{:.1e}')} | "
            f"{_f(fill.get('seconds'), '{:.0f}')}{' (stopped)' if fill.get('stopped_at_limit') else ''}"
            f"{_f(fill.get('entries_added'), ', {} entries')} | "
            f"{_f(b.get('inductor', {}).get('first_call_s'), '{:.2f}')} / "
            f"{_f(b.get('kernelize', {}).get('first_call_s'), '{:.2f}')} |")
    lines += ["", "| model | backend | median ms | rounds ms | GPU ms | launches | host ms | host us per launch | syncs | "
              "max rel err | first call s | nodes on triton |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in doc["models"].items():
        for label, r in row.get("backends", {}).items():
            if "error" in r:
                lines.append(f"| {name} | {LABELS[label]} | error: {r['error'][:200]} | | | | | | | | | |")
                continue
            triton = f"{r['nodes_on_triton']}/{r['nodes']}" if "nodes" in r else ""
            rounds = r.get("median_rounds_ms")
            spread = f"{min(rounds):.3f}-{max(rounds):.3f}" if rounds else r.get("rounds_error", "")[:80]
            lines.append(f"| {name} | {LABELS[label]} | {_f(r.get('median_ms'))} | {spread} | {_f(r.get('gpu_ms'))} | "
                         f"{_f(r.get('launches'), '{:.0f}')} | {_f(r.get('host_ms'))} | "
                         f"{_f(r.get('host_us_per_launch'), '{:.1f}')} | {_f(r.get('syncs_per_call'), '{:g}')} | "
                         f"{_f(r.get('max_rel_err'), '{:.1e}')} | {_f(r.get('first_call_s'), '{:.3g}')} | {triton} |")
    graphs = [(name, g) for name, row in doc["models"].items() for g in row.get("fill", {}).get("graphs", [])]
    if graphs:  # issue 35: graphs compete as wholes
        lines += ["", "| model | whole graph | candidates (ms per call) | winner |", "|---|---|---|---|"]
        for name, g in graphs:
            cands = ", ".join(f"{c['name']} {_f(c.get('ms')) if c['correct'] else 'wrong'}" for c in g["candidates"]) \
                or f"{g['status']}: {g.get('why', '')[:160]}"
            lines.append(f"| {name} | {g['key'][:12]} | {cands} | {g['winner']} |")
    t = doc.get("targets")
    if t:
        def per_model(target: dict) -> str:
            return "; ".join(f"{n} {'met' if v['met'] else 'missed'} ({v['distance']})"
                             for n, v in target["models"].items())

        def line(issue: str, key: str) -> str:
            return f"- issue {issue}, {t[key]['target']}: **{'met' if t[key]['met'] else 'missed'}**: {per_model(t[key])}"
        g = t["speedup_geomean"]
        lines += ["", "Targets (medians, this run):",
                  f"- issue 35, every model {t['speedup_each']['target']}: "
                  f"**{'met' if t['speedup_each']['met'] else 'missed'}**: {per_model(t['speedup_each'])}",
                  f"- issue 35, geomean {g['target']}: **{'met' if g['met'] else 'missed'}**: "
                  + (f"{g['value']:.2f}x over {g['of']} model(s) ({g['distance']})" if g["value"] else "not measured")]
        lines += [line("35", k) for k in ("gpu_vs_best", "ro_vs_ro") if k in t]  # (older runs' JSON lacks them)
        lines += [line("24", "host_vs_inductor"), line("24", "host_per_launch")]
        if t.get("ro_where_inductor_fails", {}).get("models"):
            lines.append(line("38", "ro_where_inductor_fails"))
    notes = [f"- {n}: {row['skipped']}" for n, row in doc["models"].items() if "skipped" in row]
    notes += [f"- {n}: {row['error']}" for n, row in doc["models"].items() if "error" in row]
    notes += [f"- {n}: fill_cache: {row['fill']['error']}" for n, row in doc["models"].items()
              if "error" in row.get("fill", {})]
    if notes:
        lines += ["", "Not measured or failed:"] + notes
    return "\n".join(lines) + "\n"


def results_stem(env: dict) -> str:
    """``<date>-<chip>-real-models[-smoke]``: the name the committed results take (results/)."""
    chip = re.search(r"\b[A-Z]\d{2,4}\w*", env["device"]) if env["device"].startswith("NVIDIA") else None
    chip_name = chip.group(0).lower() if chip else env["device"].split()[0].lower()
    return f"{env['date']}-{chip_name}-real-models" + ("-smoke" if env["smoke"] else "")


def write_results(doc: dict, out: Path) -> Path:
    """Rewrite OUT/<stem>.json and .md; the markdown's path."""
    doc["targets"] = judge(doc["models"])
    stem = results_stem(doc["env"])
    write_json(out / f"{stem}.json", doc)
    (out / f"{stem}.md").write_text(markdown(doc))
    return out / f"{stem}.md"
