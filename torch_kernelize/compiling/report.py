"""The coverage report: which tier runs each node, per op, coverage, misses and missing ops.

After each compile a short table goes to the log (logger ``torch_kernelize``, level INFO); with
the ``report`` option, a JSON file holding every graph compiled in the process is rewritten
atomically (and once more at exit, with the time spent in host fallbacks and, with the
``cudagraphs`` option, what CUDA graphs captured and replayed).
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from torch_kernelize.compiling.whole_graph import describe_evidence, whole_report
from torch_kernelize.core.decision import TIERS, Decision
from torch_kernelize.kernel_cache.integrity import write_file_atomic
from torch_kernelize.serving.cudagraphs import cudagraph_stats
from torch_kernelize.serving.repro_recorder import repro_counts

log = logging.getLogger("torch_kernelize")
REPORT_VERSION = 1


@dataclasses.dataclass
class GraphReport:
    graph: str               # e.g. "forward_0"
    kind: str                # inference | forward | backward | repro
    target: dict[str, Any]
    signature: str           # the concrete sizes this report was planned for
    decisions: list[Decision]
    regions: list[Decision] = dataclasses.field(default_factory=list)  # fused regions, hit or miss

    def summary(self) -> dict[str, Any]:
        tiers = collections.Counter(d.tier for d in self.decisions)
        per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for d in self.decisions:
            per_op[d.op][d.tier] += 1
        total = len(self.decisions)
        on_target = total - tiers["fallback"]
        eligible = [d for d in self.decisions if d.family is not None or d.tier == "triton"]
        return {
            "nodes": total,
            "tiers": {t: tiers.get(t, 0) for t in TIERS},
            "coverage_pct": round(100.0 * on_target / total, 1) if total else 100.0,
            "triton_nodes": tiers["triton"],
            "triton_eligible": len(eligible),
            "per_op": {op: dict(c) for op, c in sorted(per_op.items())},
            "misses": sorted({d.spec_key for d in self.decisions + self.regions if d.miss}),
            "fused_regions": sum(r.tier == "triton" for r in self.regions),
            "fused_by_kind": dict(collections.Counter(_region_kind(r) for r in self.regions if r.tier == "triton")),
            "region_misses": sum(r.miss for r in self.regions),
            "missing_ops": sorted({d.op for d in self.decisions if d.missing}),
        }

    def to_json(self) -> dict[str, Any]:
        doc = {"graph": self.graph, "kind": self.kind, "target": self.target, "signature": self.signature,
               "summary": self.summary(), "nodes": [d.to_json() for d in self.decisions],
               "regions": [r.to_json() for r in self.regions]}
        whole = whole_report(self.regions)
        if whole is not None:
            doc["whole"] = whole
        return doc

    def table(self) -> str:
        s = self.summary()
        lines = [f"kernelize: {self.graph} ({self.kind}) on target {self.target['name']!r}"
                 f"{' for ' + self.signature if self.signature else ''}: {s['nodes']} nodes, "
                 f"{s['coverage_pct']}% run on the target, "
                 f"{s['triton_nodes']}/{s['triton_eligible']} kernel-eligible nodes on triton"]
        lines.append(f"  {'op':<36}" + "".join(f"{t:>10}" for t in TIERS))
        for op, counts in s["per_op"].items():
            lines.append(f"  {op:<36}" + "".join(f"{counts.get(t, 0) or '.':>10}" for t in TIERS))
        lines.append(f"  {'total':<36}" + "".join(f"{s['tiers'][t]:>10}" for t in TIERS))
        if self.regions:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(s["fused_by_kind"].items()))
            lines.append(f"  fused regions: {s['fused_regions']} on triton{f' ({kinds})' if kinds else ''}, "
                         f"{s['region_misses']} missed (left to the regions inside them, then their nodes)")
        whole = whole_report(self.regions)
        if whole is not None:
            runs = ("its winner's program runs it whole" if whole["tier"] == "triton"
                    else "its nodes and regions run as planned")
            lines.append(f"  whole graph {whole['spec_key']}: {runs}"
                         + (f" ({describe_evidence(whole)})" if "candidates" in whole else ""))
        misses = [d for d in self.decisions + self.regions if d.miss]
        if misses:
            lines.append(f"  cache misses: {len(s['misses'])} spec(s), run on vendor "
                         f"(fill them: python -m torch_kernelize.fill_cache --repros <repro_dir>)")
        for d in self.decisions:
            if d.missing:
                lines.append(f"  MISSING {d.op}: host fallback; repro: {d.repro or '(dumping off)'}")
        return "\n".join(lines)


def _region_kind(d: Decision) -> str:
    """A region decision's kind: the first word of its description ("graph region [...] of 9 nodes")."""
    return (d.shapes or "region").split()[0]


class ReportWriter:
    """Collects the GraphReports of one process per JSON path and rewrites the file atomically."""

    _instances: dict[Path, "ReportWriter"] = {}
    _lock = threading.Lock()

    def __init__(self, path: Path):
        self.path = path
        self.reports: list[GraphReport] = []
        self._warned = False

    @classmethod
    def for_path(cls, path: Path) -> "ReportWriter":
        path = Path(path).resolve()
        with cls._lock:
            if path not in cls._instances:
                cls._instances[path] = cls(path)
            return cls._instances[path]

    def add(self, report: GraphReport) -> None:
        """Record ``report`` and rewrite the file. A report that cannot be written costs one
        warning per path, never the compile (the table is in the log all the same)."""
        with self._lock:
            self.reports.append(report)
        try:
            self.write()
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("kernelize: cannot write the coverage report to %s (%s: %s); the compile goes on "
                            "without it: point the report option (or $KERNELIZE_REPORT) at a writable file",
                            self.path, type(e).__name__, e)

    def write(self) -> None:
        from torch_kernelize.fallbacks import fallback_stats
        with self._lock:
            doc = {
                "version": REPORT_VERSION,
                "graphs": [r.to_json() for r in self.reports],
                "fallback_time": {op: {"calls": s.calls, "seconds": round(s.seconds, 6)}
                                  for op, s in sorted(fallback_stats().items())},
                "repros": repro_counts.to_json(),
            }
            names = {r.graph for r in self.reports}
            graphs = {name: s for name, s in cudagraph_stats().items() if name in names}
            if graphs:  # (option cudagraphs) per compiled graph: stretches, syncs, replays, pools
                doc["cudagraphs"] = graphs
        write_json_atomic(self.path, doc)


def write_json_atomic(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, json.dumps(doc, indent=1, sort_keys=False, default=str).encode())


@atexit.register
def _rewrite_reports_at_exit() -> None:
    for writer in list(ReportWriter._instances.values()):
        try:
            writer.write()
        except Exception:  # exit must not fail because a report could not be written
            pass
