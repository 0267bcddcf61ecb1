"""Timing: median milliseconds with triton.testing.do_bench, candidate and vendor on the same inputs.

Only a real device gives times that mean anything; on the interpreter target nothing is timed.
"""
from __future__ import annotations

import statistics
from typing import Callable

from torch_kernelize.core.targets import Target


def timing_available(target: Target) -> bool:
    return target.triton == "cuda"


def median_ms(fn: Callable[[], object], warmup_ms: float = 10, rep_ms: float = 50) -> float:
    """Median over ~50 ms of repetitions: enough to rank candidates (benchmarks/ time longer)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def paired_ms(vendor: Callable[[], object], candidate: Callable[[], object], rounds: int = 3) -> tuple[float, float]:
    """(vendor ms, candidate ms): medians over ``rounds`` alternating measurements of each.

    The search times the vendor kernel once, at its start, and each candidate later; the GPU's
    clocks drift between the two (power and temperature), and near a tie that drift can decide
    (a Llama head matmul stored at 1.03x ran 11% slower than cuBLAS in its graph). Alternating
    puts both under the same conditions.
    """
    v, c = [], []
    for _ in range(rounds):
        v.append(median_ms(vendor))
        c.append(median_ms(candidate))
    return statistics.median(v), statistics.median(c)


def graph_replay_ms(fn: Callable[[], object]) -> float | None:
    """Median ms of ``fn`` captured once into a CUDA graph and replayed (launch overhead gone:
    how a kernel runs inside a captured model); None where ``fn`` cannot be captured."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm on a side stream, as capture wants
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 - a host sync or an allocation capture refuses: no replay time
        return None
    return median_ms(graph.replay)
