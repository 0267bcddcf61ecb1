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
import shlex
import threading
from pathlib import Path
from typing import Any

from torch_kernelize.compiling.whole_graph import describe_evidence, whole_reports
from torch_kernelize.core.decision import TIERS, Decision
from torch_kernelize.kernel_cache.integrity import write_file_atomic
from torch_kernelize.serving.cudagraphs import cudagraph_stats
from torch_kernelize.serving.repro_recorder import repro_counts

log = logging.getLogger("torch_kernelize")
REPORT_VERSION = 1


# The table's columns: the tiers, with the views and factories of the vendor tier apart (they
# run no kernel: "vendor 189" would otherwise hide how few real vendor kernels a chip needs).
COLUMNS = ("decompose", "triton", "vendor", "view", "fallback")
TASK_COMMAND = "python -m torch_kernelize.repros task"  # task.md + check_candidate.py


def column(d: Decision) -> str:
    """The table column of one decision."""
    return "view" if d.tier == "vendor" and d.view else d.tier


def coverage(decisions: list[Decision]) -> dict[str, Any]:
    """The one coverage figure (the report, the log and bring-up all use it): of the nodes that
    run (a decomposed node is replaced by its decomposition's, which are counted instead), the
    share not on the host fallback."""
    ran = [d for d in decisions if d.tier != "decompose"]
    on_target = sum(d.tier != "fallback" for d in ran)
    return {"nodes": len(ran), "on_target": on_target,
            "coverage_pct": round(100.0 * on_target / len(ran), 1) if ran else 100.0}


def fill_command(target: dict[str, Any], repro_dir: Any, cache_dir: Any = None) -> str:
    """The fill_cache command that fills the misses recorded under ``repro_dir`` for ``target``
    (a ``Target.describe()``), as it runs when pasted: the target's file or name included."""
    cmd = ["python", "-m", "torch_kernelize.fill_cache", "--repros", str(repro_dir or "<repro_dir>"),
           "--target", str(target.get("source") or target["name"])]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    return " ".join(shlex.quote(c) if not c.startswith("<") else c for c in cmd)


def missing_lines(decisions: list[Decision]) -> list[str]:
    """One line per missing op and shape (several nodes of one spec share one reproducer); an op
    no generator fills points to the external-candidate route instead of fill_cache."""
    groups: dict[tuple, list[Decision]] = {}
    for d in decisions:
        if d.missing:
            groups.setdefault((d.op, d.spec_key or d.shapes or d.node), []).append(d)
    lines = []
    for ds in groups.values():
        d = ds[0]
        what = f"{d.shapes if d.shapes and d.shapes.startswith(d.op) else d.op}{f' ({len(ds)} nodes)' if len(ds) > 1 else ''}"
        where = f"repro: {d.repro}" if d.repro else "no reproducer (repro dumping off, or no fixed shape)"
        how = ("" if d.family or d.spec is None else
               f"; no generator fills it: write a kernel for it ({TASK_COMMAND} {d.repro or '<repro folder>'})")
        lines.append(f"MISSING {what}: host fallback; {where}{how}")
    return lines


@dataclasses.dataclass
class Planning:
    """How a dynamic graph's signatures were served (lower.py): planned anew (specs, lookups,
    binding and code generation: tens of milliseconds of a first call) or by the specialization
    of their shape class (shape_classes.py); why a planned one serves only its own signature; and
    the symbols that every value of is a class of its own (pinned), and by what."""
    planned: int = 0
    shared: int = 0
    unshared: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # why -> signatures
    pinned: dict[str, str] = dataclasses.field(default_factory=dict)  # symbol -> what pinned it
    # bucket programs bound without one generated call for all sizes (each new size makes its own
    # launch plan in the first call there): why -> buckets
    per_size: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def to_json(self) -> dict[str, Any]:
        return {"planned": self.planned, "shared": self.shared, "unshared": dict(self.unshared.most_common()),
                "pinned": dict(self.pinned), "per_size": dict(self.per_size.most_common())}


@dataclasses.dataclass
class GraphReport:
    graph: str               # e.g. "forward_0"
    kind: str                # inference | forward | backward | repro
    target: dict[str, Any]
    signature: str           # the concrete sizes this report was planned for
    decisions: list[Decision]
    regions: list[Decision] = dataclasses.field(default_factory=list)  # fused regions, hit or miss
    fill_hint: str | None = None  # the command that fills this graph's misses (fill_command)
    planning: Planning | None = None  # a dynamic graph's, counted on as it serves (written with the report)

    def summary(self) -> dict[str, Any]:
        tiers = collections.Counter(d.tier for d in self.decisions)
        per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for d in self.decisions:
            per_op[d.op][column(d)] += 1
        eligible = [d for d in self.decisions if d.family is not None or d.tier == "triton"]
        return {
            **coverage(self.decisions),
            "tiers": {t: tiers.get(t, 0) for t in TIERS},
            "views": sum(column(d) == "view" for d in self.decisions),
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
        wholes = whole_reports(self.regions)
        if wholes:
            doc["wholes"] = wholes
        if self.planning is not None:
            doc["planning"] = self.planning.to_json()
        return doc

    def table(self) -> str:
        s = self.summary()
        lines = [f"kernelize: {self.graph} ({self.kind}) on target {self.target['name']!r}"
                 f"{' for ' + self.signature if self.signature else ''}: {s['nodes']} nodes, "
                 f"{s['coverage_pct']}% run on the target, "
                 f"{s['triton_nodes']}/{s['triton_eligible']} kernel-eligible nodes on triton"]
        lines += op_table({op: collections.Counter(c) for op, c in s["per_op"].items()})
        if self.regions:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(s["fused_by_kind"].items()))
            lines.append(f"  fused regions: {s['fused_regions']} on triton{f' ({kinds})' if kinds else ''}, "
                         f"{s['region_misses']} missed (left to the regions inside them, then their nodes)")
        for whole in whole_reports(self.regions):
            runs = ("its winner's program runs it whole" if whole["tier"] == "triton"
                    else "its nodes and regions run as planned")
            what = f"stretch of {whole['nodes']} nodes" if whole["stretch"] else "whole graph"
            lines.append(f"  {what} {whole['spec_key']}: {runs}"
                         + (f" ({describe_evidence(whole)})" if "candidates" in whole else ""))
        if s["misses"]:
            lines.append(f"  cache misses: {len(s['misses'])} spec(s), run on vendor "
                         f"(fill them: {self.fill_hint or fill_command(self.target, None)})")
        lines += ["  " + line for line in missing_lines(self.decisions)]
        return "\n".join(lines)


def op_table(per_op: dict[str, collections.Counter], indent: str = "  ") -> list[str]:
    """Per op, the nodes in each column, and their total; the op column as wide as its longest name."""
    width = max([len("op"), *map(len, per_op)]) + 2
    lines = [f"{indent}{'op':<{width}}" + "".join(f"{c:>10}" for c in COLUMNS)]
    for op, counts in sorted(per_op.items()):
        lines.append(f"{indent}{op:<{width}}" + "".join(f"{counts.get(c, 0) or '.':>10}" for c in COLUMNS))
    total = sum(per_op.values(), collections.Counter())
    lines.append(f"{indent}{'total':<{width}}" + "".join(f"{total.get(c, 0):>10}" for c in COLUMNS))
    return lines


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
