"""Timing: median milliseconds with triton.testing.do_bench, candidate and vendor on the same inputs.

Only a real device gives times that mean anything; on the interpreter target nothing is timed.
"""
from __future__ import annotations

from typing import Callable

from torch_kernelize.lowering.targets import Target


def timing_available(target: Target) -> bool:
    return target.triton == "cuda"


def median_ms(fn: Callable[[], object], warmup_ms: float = 10, rep_ms: float = 50) -> float:
    """Median over ~50 ms of repetitions: enough to rank candidates (benchmarks/ time longer)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
