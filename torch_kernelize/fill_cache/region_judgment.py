"""A fused region against the parts it keeps from their own winners, in the graph where both serve.

Serving tries some fused regions before a graph's stretches (after the whole graph; an MoE's gated
experts: compiling/glu_regions.py, whose kernel never stores the GEMM's product). Where such a
region hits, the stretch programs holding its nodes do not run: their other nodes run one by one
or in smaller regions. The region's own verdict compares it with the vendor running its nodes,
not with that. On an H100 Mixtral's gated-experts region was stored at 2.04x of transformers'
unfused ops and made the model slower: its 8 grouped GEMMs took 4.37 ms against 3.96 ms for the
plain grouped GEMMs plus 0.35 ms of Inductor's SiLU inside a stretch's program
(benchmarks/results/2026-12-07-h100-real-models-12).

So at the end of a fill each such region with a stored kernel is timed in its judgment unit
(whole_graph.judgment_units: the whole graph, or the region with the stretches it overlaps) as
the cache assembles it, against the same unit with the region set aside (compiling/set_aside.py),
alternately. Where the region does not make its unit faster it is stored as "vendor wins", its
note and ``judgment`` saying why, and serving runs its parts' own winners. This goes beyond
DESIGN.md, which judges each region against the vendor alone.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from torch_kernelize.core.errors import machine_error
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.fill_cache.collect import Work
from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN
from torch_kernelize.kernel_cache.interfaces import Cache

log = logging.getLogger("torch_kernelize.fill_cache")

PARTS_WIN = "its parts win"  # a summary row's status: the region was set aside in its unit


def judged(work: Sequence[Work], cache: Cache) -> list[Work]:
    """The regions of ``work`` to judge: those with a unit and a stored kernel."""
    return [w for w in work if w.judged_in is not None and cache.lookup(w.spec.key)[0] == "hit"]


def judge_regions(work: Sequence[Work], cache: Cache, measurer_for: Callable[[KernelSpec], Any],
                  rows: list[dict[str, Any]]) -> None:
    """Time each region of ``judged(work)`` in its unit with and without it (``measurer_for``:
    the unit's spec -> a CandidateMeasurer whose baseline is its assembly); store "vendor wins"
    for each that does not make its unit faster, and mark its summary row (``rows``). One after
    another: a region set aside is in the cache, so the next one's unit is assembled without it."""
    for w in judged(work, cache):
        unit = w.judged_in
        WHOLE_GRAPH_DOMAIN.pin(unit.key, w.judged_pins)  # (the router's offsets as the model made them)
        measurer = measurer_for(unit)
        try:
            times = measurer.assemblies([w.spec.key])
        except Exception as e:  # (a unit that does not lower or run: the region stays as its search stored it)
            if machine_error(e):
                raise
            log.warning("%s: its unit %s could not be timed (%s: %s); the region stays as stored",
                        w.spec.describe()[:90], unit.key, type(e).__name__, str(e)[:300])
            continue
        finally:
            measurer.close()
        if times is None:  # (nothing is timed on the interpreter)
            continue
        with_ms, without_ms = times
        kept = with_ms < without_ms
        log.info("%s: its unit %s ran %.3f ms with it, %.3f ms with its parts' own winners -> %s",
                 w.spec.describe()[:90], unit.key, with_ms, without_ms, "kept" if kept else "set aside")
        if not kept:
            _set_aside(cache, w.spec.key, unit.key, with_ms, without_ms, rows)


def _set_aside(cache: Cache, key: str, unit: str, with_ms: float, without_ms: float,
               rows: list[dict[str, Any]]) -> None:
    entry = cache.lookup(key)[1]
    note = (f"{PARTS_WIN}: the graph it serves in ({unit}) ran {with_ms:.3f} ms with it and {without_ms:.3f} ms "
            f"with its parts' own winners")
    speedup = without_ms / with_ms if with_ms > 0 else 0.0
    judgment = {"unit": unit, "with_ms": with_ms, "without_ms": without_ms}
    cache.put(dict(entry.record, winner="vendor", note=note, judgment=judgment,
                   timings=dict(entry.timings, speedup=speedup)), None, replace=True)
    for row in rows:
        if row["key"] == key:
            row.update(status=PARTS_WIN, speedup=speedup, winner=note)
