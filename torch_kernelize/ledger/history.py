"""The ledger's history: one JSON line per run beside the cache, so that a run after a candidate
or a new fill shows the model's time per call before and after.

    <cache-dir>/<target namespace>/ledger-history.jsonl
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from torch_kernelize.kernel_cache.interfaces import Cache

HISTORY_FILE = "ledger-history.jsonl"


def history_path(cache: Cache) -> Path:
    return Path(cache.dir) / HISTORY_FILE


def last_run(path: Path, model: str) -> dict[str, Any] | None:
    """The latest record of ``model`` (None: its first run); unreadable lines are skipped."""
    if not path.exists():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("model") == model:
            found = r
    return found


def run_record(model: str, target: str, profile: Any, rows: Sequence[Any], top: int = 10) -> dict[str, Any]:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": model, "target": target, "call_ms": profile.call_s * 1e3,
            "kernel_ms": profile.kernel_s * 1e3, "host_ms": None if profile.host_s is None else profile.host_s * 1e3,
            "launches": profile.launches,
            "top": [{"key": r.key, "op": r.op, "ms": r.seconds * 1e3, "generator": r.generator} for r in rows[:top]]}


def append(path: Path, record: dict[str, Any]) -> None:
    """One line, appended whole (O_APPEND): concurrent runs never interleave within a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def compare(before: dict[str, Any] | None, after: dict[str, Any]) -> str:
    """One line: the model's time per call now, and before where there was a run."""
    now = f"{after['call_ms']:.3g} ms per call"
    if before is None:
        return f"time per call: {now} (first run: kept in the history for the next)"
    speed = before["call_ms"] / after["call_ms"] if after["call_ms"] else float("inf")
    ratio = f"{speed:.3g}x faster" if speed >= 1 else f"{1 / speed:.3g}x slower"
    moved = {r["key"]: r["ms"] for r in before.get("top", [])}
    changed = [f"{r['op'][:40]} {moved[r['key']]:.3g} -> {r['ms']:.3g} ms" for r in after["top"]
               if r["key"] in moved and abs(moved[r["key"]] - r["ms"]) > 0.05 * max(moved[r["key"]], 1e-9)]
    line = (f"time per call: {before['call_ms']:.3g} ms before ({before['date']}) -> {now} ({ratio})")
    return line + ("\n  " + "\n  ".join(changed[:5]) if changed else "")
