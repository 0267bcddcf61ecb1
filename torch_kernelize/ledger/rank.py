"""The ledger's rows: the profiled nodes grouped by spec, ranked by time per model call, each
against its floor and beside what the fill measured for it.

A row is one spec (every node of the model that runs it: a Llama's four identical layers make
one row with four times the launches), or one op for nodes without a spec (views, host ops).
Its generator is the cache entry's provenance (whichever generator made the served kernel, a
whole graph's program included); its alternatives are the best median each generator reached in
the fill's journal (ours, inductor, external, ...), and the vendor kernel's.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from torch_kernelize.compiling.whole_graph import is_whole_graph
from torch_kernelize.core.region_graph import describe_region
from torch_kernelize.ledger.floors import Ceilings, Floor, floor
from torch_kernelize.ledger.profile import NodeRun, Profile

if TYPE_CHECKING:
    from torch_kernelize.kernel_cache.entry import CacheEntry
    from torch_kernelize.kernel_cache.interfaces import Cache

ABOVE_FLOOR = 1.5   # a row this many times its floor (or more) is worth a performance reproducer


@dataclasses.dataclass
class Row:
    key: str                      # spec key, or "op:<name>" for nodes without a spec
    op: str
    tier: str
    generator: str                # what made the served implementation (the entry's provenance)
    seconds: float                # per model call
    launches: float               # per model call
    share: float = 0.0            # of the kernels' time per call
    floor_s: float | None = None  # per model call (every node of the row at its floor)
    bound: str = "n/a"            # memory | compute | n/a
    bytes: int = 0                # per node call
    flops: int = 0
    alternatives: dict[str, float] = dataclasses.field(default_factory=dict)  # generator -> best ms (fill)
    calls: int = 1                # calls of the spec per model call
    nodes: list[NodeRun] = dataclasses.field(default_factory=list, repr=False)
    # a fusion opportunity's: its region spec, and per input the (graph, node, which tensor input)
    # to capture it from
    region: Any = dataclasses.field(default=None, repr=False)
    input_sources: list[tuple[str, str, int]] | None = dataclasses.field(default=None, repr=False)

    def capture_points(self) -> list[tuple[str, str]]:
        """The (graph, node)s whose inputs the row's reproducer needs."""
        if self.input_sources is None:
            return [(self.nodes[0].graph, self.nodes[0].node)]
        return [(g, n) for g, n, _ in self.input_sources]

    def inputs_from(self, captured: dict) -> list | None:
        """The row's kernel inputs out of ``capture_inputs``' result; None where one is missing."""
        if self.input_sources is None:
            return captured.get((self.nodes[0].graph, self.nodes[0].node))
        got = [captured.get((g, n)) for g, n, _ in self.input_sources]
        if any(t is None or i >= len(t) for t, (_, _, i) in zip(got, self.input_sources)):
            return None
        return [t[i] for t, (_, _, i) in zip(got, self.input_sources)]

    @property
    def distance(self) -> float | None:
        """Time over floor (1.0: at the floor); None where the floor is not known."""
        return self.seconds / self.floor_s if self.floor_s else None

    @property
    def above_floor(self) -> bool:
        """Worth a reproducer: far from its floor, or its floor is unknown (nothing says it is fine)."""
        return self.distance is None or self.distance >= ABOVE_FLOOR

    @property
    def best_alternative(self) -> tuple[str, float] | None:
        """The fastest implementation the fill measured other than the served one (name, ms)."""
        others = {k: v for k, v in self.alternatives.items() if k != self.generator}
        return min(others.items(), key=lambda kv: kv[1]) if others else None

    @property
    def spec(self) -> Any:
        return self.region if self.region is not None else (self.nodes[0].spec if self.nodes else None)

    @property
    def where(self) -> list[str]:
        return [f"{n.graph}:{n.node}" for n in self.nodes]

    @property
    def kernels(self) -> dict[str, float]:
        """The device kernels its launches ran (CUDA), name -> seconds per model call, slowest first."""
        kernels: dict[str, float] = {}
        for n in self.nodes:
            for name, t in n.kernels.items():
                kernels[name] = kernels.get(name, 0.0) + t
        return dict(sorted(kernels.items(), key=lambda kv: -kv[1]))

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("nodes", "region", "input_sources")}
        best = self.best_alternative
        out.update(where=self.where, distance=self.distance, above_floor=self.above_floor,
                   best_alternative={"generator": best[0], "ms": best[1]} if best else None,
                   kernels=self.kernels)
        return out


def journal_best(journal: Path) -> dict[str, float]:
    """Per generator, the best correct candidate's median ms in a fill journal, and the vendor
    kernel's ("vendor"); empty where nothing was timed (the interpreter times nothing)."""
    best: dict[str, float] = {}
    if not journal.exists():
        return best

    def keep(name: str, ms: Any) -> None:
        if isinstance(ms, (int, float)) and ms > 0:
            best[name] = min(best.get(name, float("inf")), float(ms))

    for line in journal.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue   # a line cut short by a kill
        if not isinstance(r, dict):
            continue   # valid JSON of the wrong shape (fill_cache/journal.py skips it too)
        keep("vendor", r.get("vendor_ms"))
        if r.get("correct"):
            config = r.get("config")   # tagged by another generator, a candidate file's, or the family's
            config = config if isinstance(config, dict) else {}
            name = config.get("generator") or ("external" if "external" in config else
                                               str(r.get("family") or "ours").split("+")[0])
            keep(name, r.get("candidate_ms"))
    return best


def _generator(tier: str, entry: CacheEntry | None, spec: Any) -> str:
    if tier == "triton" and entry is not None:
        return entry.provenance.get("generator") or entry.family or "triton"
    if tier == "vendor":
        return "vendor" if entry is not None or spec is None else "vendor (miss)"
    return {"fallback": "host", "view": "view"}.get(tier, tier)


def _alternatives(cache: Cache, key: str, entry: CacheEntry | None) -> dict[str, float]:
    from torch_kernelize.kernel_cache.store import JOURNALS_DIR
    found = journal_best(Path(cache.dir) / JOURNALS_DIR / f"{key}.jsonl")
    if entry is not None and entry.timings.get("measured"):   # the stored winner's own (confirmed) times
        t = entry.timings
        if t.get("vendor_ms"):
            found["vendor"] = min(found.get("vendor", float("inf")), t["vendor_ms"])
        if t.get("candidate_ms") and entry.winner == "triton":
            name = entry.provenance.get("generator") or entry.family or "triton"
            found[name] = min(found.get(name, float("inf")), t["candidate_ms"])
    return found


def rank(profile: Profile, cache: Cache | None, ceilings: Ceilings) -> list[Row]:
    """The profile's nodes grouped into rows, slowest first. ``cache``: the KernelCache the model
    was served from (None: no entries, no alternatives)."""
    groups: dict[str, list[NodeRun]] = {}
    for n in profile.nodes:
        groups.setdefault(n.key or f"op:{n.op}", []).append(n)
    total = sum(n.seconds for n in profile.nodes) or 1.0
    rows = []
    for key, nodes in groups.items():
        first = nodes[0]
        entry_key = first.entry_key or first.key
        entry = cache.get(entry_key) if cache is not None and entry_key else None
        row = Row(key, first.op, first.tier, _generator(first.tier, entry, first.spec),
                  sum(n.seconds for n in nodes), sum(n.launches for n in nodes), calls=len(nodes), nodes=nodes)
        row.share = row.seconds / total
        _at_floor(row, ceilings)
        if first.spec is not None and cache is not None:
            row.alternatives = _alternatives(cache, entry_key, entry)
        rows.append(row)
    return sorted(rows, key=lambda r: -r.seconds)


def _at_floor(row: Row, ceilings: Ceilings) -> None:
    if row.spec is not None:
        f: Floor = floor(row.spec, ceilings)
        row.bytes, row.flops, row.bound = f.bytes, f.flops, f.bound
        row.floor_s = f.us * 1e-6 * row.calls if f.us is not None else None


def fusions(profile: Profile, ceilings: Ceilings) -> list[Row]:
    """Fusion opportunities: the regions the planner tried without a kernel whose nodes run as
    two or more launches, one row per region spec (identical layers add up, as kernels do). Its
    time is its nodes'; its floor the region's, whose intermediates never leave the chip. A region
    overlapping a larger one is left out."""
    by_node = {(n.graph, n.node): n for n in profile.nodes}
    found = []
    for r in profile.regions:
        members = [by_node[(r.graph, m)] for m in r.members if (r.graph, m) in by_node]
        if sum(n.launches > 0 for n in members) >= 2:
            found.append((sum(n.seconds for n in members), r, members))
    taken: set[tuple[str, str]] = set()
    groups: dict[str, list[tuple[Any, list[NodeRun]]]] = {}
    for _, r, members in sorted(found, key=lambda f: -f[0]):
        mine = {(n.graph, n.node) for n in members}
        if not mine & taken:
            taken |= mine
            groups.setdefault(r.spec.key, []).append((r, members))
    total = sum(n.seconds for n in profile.nodes) or 1.0
    rows = []
    for key, regions in groups.items():
        first, nodes = regions[0][0], [n for _, members in regions for n in members]
        launches = sum(n.launches for n in nodes)
        row = Row(key, f"fuse {launches / len(regions):.0f} launches: {describe_region(first.spec)}", "fusion",
                  f"{launches:.0f} kernels ({first.served[:40]})", sum(n.seconds for n in nodes), launches,
                  calls=len(regions), nodes=nodes, region=first.spec,
                  input_sources=[(first.graph, m, i) for m, i in first.inputs])
        row.share = row.seconds / total
        _at_floor(row, ceilings)
        rows.append(row)
    return sorted(rows, key=lambda r: -r.seconds)


def worth_a_reproducer(rows: Sequence[Row], top: int) -> list[Row]:
    """The ``top`` slowest rows with a kernel spec that are above their floor. Not a whole
    graph's program: it competes whole in every fill already, and its reproducer would carry
    every weight of the model (its slowest kernels are listed under its row)."""
    return [r for r in rows if r.spec is not None and r.tier in ("triton", "vendor", "fusion") and r.above_floor
            and not is_whole_graph(r.spec)][:top]
