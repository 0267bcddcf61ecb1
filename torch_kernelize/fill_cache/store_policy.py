"""What fill_cache stores for a searched spec: its best correct candidate, or "vendor wins".

A Triton winner must beat the vendor kernel clearly (``MIN_SPEEDUP``), and a near tie is timed
again before it is decided (``CONFIRM_BELOW``). For a whole graph Inductor's program is
torch.compile's own output: there the own assembly must beat it clearly instead. On a bring-up
chip whose vendor does not run some of the spec's ops, "vendor wins" would leave them to the host
fallback: there the fastest correct candidate is stored whatever its speed. Unmeasured
(interpreter) winners are stored so that the Triton tier can be exercised on CPU.
"""
from __future__ import annotations

from typing import Any

from torch_kernelize.compiling.whole_graph import is_whole_graph
from torch_kernelize.core.region_graph import spec_ops
from torch_kernelize.core.targets import Target, resolve_op

# Measured on the H200: matmuls stored at "1.01x" of cuBLAS in their own 50 ms median ran 4% slower
# than cuBLAS inside the Llama benchmark; a winner must be clearly faster than the vendor kernel.
MIN_SPEEDUP = 1.03
CONFIRM_BELOW = 1.25  # a winner this close to the vendor kernel is timed again, alternately
INTERPRETER_NOTE = ("interpreter target: timings are not measured (the Triton interpreter's speed means "
                    "nothing); this validated kernel is stored so that the Triton tier can be exercised on CPU")


def ops_not_on_vendor(target: Target, spec: Any) -> list[str]:
    """The ops of ``spec`` that the target's own library does not run. Where there are any (a
    bring-up chip), "vendor wins" would leave them to the host fallback: the fastest correct
    Triton candidate is stored whatever its speed against ATen's kernel."""
    return sorted(op for op in set(spec_ops(spec)) if not target.vendor_runs(resolve_op(op)))


def needs_confirmation(best: dict[str, Any]) -> bool:
    """Whether the best candidate is close enough to the vendor kernel to be timed again."""
    return bool(best["measured"]) and best["fitness"] < CONFIRM_BELOW


def verdict(best: dict[str, Any], target: Target, spec: Any, min_speedup: float) -> tuple[str, str]:
    """(winner, note) for the cache entry of ``spec`` whose best correct candidate is ``best``:
    winner "vendor" or "triton", and the note the entry keeps on why."""
    whole = is_whole_graph(spec)  # its baseline is kernelize's own assembly, which runs on any target
    not_on_vendor = [] if whole else ops_not_on_vendor(target, spec)
    # Inductor's program for a whole graph is what torch.compile itself runs, the user's baseline:
    # there the burden of proof turns, and the own assembly must beat the program clearly to be kept
    if whole and "mode" in (best.get("config") or {}):
        min_speedup = 1 / min_speedup
    if best["measured"] and best["fitness"] <= min_speedup and not not_on_vendor:
        if whole:
            return "vendor", f"own assembly wins: best whole-graph candidate ran at {best['fitness']:.3f}x it"
        return "vendor", f"vendor wins: best Triton candidate ran at {best['fitness']:.3f}x the vendor kernel"
    if not best["measured"]:
        return "triton", INTERPRETER_NOTE
    if best["fitness"] <= min_speedup:
        return "triton", (f"stored although it ran at {best['fitness']:.3f}x the vendor kernel: the target's "
                          f"vendor does not run {', '.join(not_on_vendor)}")
    return "triton", ""
