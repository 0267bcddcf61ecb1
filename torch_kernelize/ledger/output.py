"""The ledger for people: a terminal table, a JSON file and a PNG chart of time against floor."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from torch_kernelize.ledger.profile import Profile
from torch_kernelize.ledger.rank import Row


def _us(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:.3g}"


def summary_line(profile: Profile) -> str:
    """Time per call, kernels' time, host time and launches: a host-bound model is named as such."""
    line = (f"{profile.call_s * 1e3:.3g} ms per call (median of {profile.calls}); kernels {profile.kernel_s * 1e3:.3g} ms; "
            f"{profile.launches:.0f} launches per call")
    if profile.host_s is None:
        return line + "; host and kernel time are one here (kernels run on the host)"
    verdict = "HOST-BOUND: issuing the launches takes longer than running them" if profile.host_bound else "device-bound"
    return line + f"; host {profile.host_s * 1e3:.3g} ms to issue a call: {verdict}"


def table(rows: Sequence[Row], profile: Profile, limit: int = 20) -> str:
    head = (f"{'#':>3} {'time us':>9} {'share':>6} {'launch':>6} {'floor us':>9} {'x floor':>8}  "
            f"{'served by':<14} {'best other (fill)':<20} op")
    lines = [summary_line(profile), head, "-" * len(head)]
    for i, r in enumerate(rows[:limit], 1):
        best = r.best_alternative
        # (the fill times one call of the kernel: "x N" where the model calls it N times)
        other = f"{best[0]} {best[1] * 1e3:.3g}us" + (f" x{r.calls}" if r.calls > 1 else "") if best else "-"
        dist = f"{r.distance:.1f}x" if r.distance is not None else "n/a"
        lines.append(f"{i:>3} {_us(r.seconds):>9} {100 * r.share:>5.1f}% {r.launches:>6.0f} {_us(r.floor_s):>9} "
                     f"{dist:>8}  {r.generator[:14]:<14} {other[:20]:<20} {r.op[:70]}")
        lines += _inside(r)
    if len(rows) > limit:
        rest = rows[limit:]
        lines.append(f"    ... {len(rest)} more rows, {100 * sum(r.share for r in rest):.1f}% of the kernels' time")
    return "\n".join(lines)


def _inside(r: Row, top: int = 3) -> list[str]:
    """The slowest device kernels of a row that runs several (a whole graph's program, a vendor
    op that launches more than one): where its time goes, a line each."""
    kernels = r.kernels
    if len(kernels) < 2 or not r.seconds:
        return []
    lines = [f"{'':>10}{_us(t):>9} {100 * t / r.seconds:>5.1f}% of the row  {name[:80]}"
             for name, t in list(kernels.items())[:top]]
    if len(kernels) > top:
        lines.append(f"{'':>10}... {len(kernels) - top} more kernels")
    return lines


def fusion_table(fusions: Sequence[Row], limit: int = 10) -> str:
    """The fusion opportunities: regions the planner tried whose nodes run as separate launches."""
    if not fusions:
        return "fusion opportunities: none (every region the planner formed runs fused, or has one launch)"
    lines = ["fusion opportunities (regions without a kernel, their nodes run as separate launches):"]
    for r in fusions[:limit]:
        dist = f"{r.distance:.1f}x" if r.distance is not None else "n/a"
        lines.append(f"    {_us(r.seconds):>9} us {100 * r.share:>5.1f}% {r.launches:>4.0f} launches  floor "
                     f"{_us(r.floor_s)} us ({dist})  {r.op[:90]}")
    return "\n".join(lines)


def ledger_json(rows: Sequence[Row], profile: Profile, extra: dict[str, Any],
                fusions: Sequence[Row] = ()) -> dict[str, Any]:
    return {**extra, "call_ms": profile.call_s * 1e3, "kernel_ms": profile.kernel_s * 1e3,
            "host_ms": None if profile.host_s is None else profile.host_s * 1e3, "host_bound": profile.host_bound,
            "launches": profile.launches, "calls": profile.calls, "device": profile.device,
            "rows": [r.to_json() for r in rows], "fusions": [r.to_json() for r in fusions]}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def chart(rows: Sequence[Row], path: Path, title: str, limit: int = 15) -> str:
    """A PNG of each of the slowest rows' time beside its floor; a one-line reason where there is
    no chart (matplotlib is the optional ``bench`` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart: skipped (matplotlib is not installed: pip install 'torch-kernelize[bench]')"
    shown = list(rows[:limit])[::-1]   # slowest at the top
    labels = [f"{r.op[:48]} [{r.generator[:12]}]" for r in shown]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(shown) + 1.4))
    y = range(len(shown))
    ax.barh([i + 0.2 for i in y], [r.seconds * 1e6 for r in shown], height=0.4, label="time per model call")
    ax.barh([i - 0.2 for i in y], [(r.floor_s or 0) * 1e6 for r in shown], height=0.4, label="floor")
    for i, r in zip(y, shown):
        if r.floor_s is None:
            ax.text(0, i - 0.2, " floor n/a", va="center", fontsize=7)
    values = [v for r in shown for v in (r.seconds, r.floor_s or 0) if v > 0]
    if values and max(values) > 100 * min(values):  # floors far below the times: a log scale shows both
        ax.set_xscale("log")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xlabel("microseconds per model call")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart: {path}"
