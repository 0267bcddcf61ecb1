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


Timer = Callable[[Callable[[], object]], float]


def paired_ms(vendor: Callable[[], object], candidate: Callable[[], object], rounds: int = 3,
              time_vendor: Timer | None = None, time_candidate: Timer | None = None) -> tuple[float, float]:
    """(vendor ms, candidate ms): medians over ``rounds`` alternating measurements of each (by
    ``time_vendor`` and ``time_candidate``: median_ms unless the spec is served otherwise).

    The search times the vendor kernel once, at its start, and each candidate later; the GPU's
    clocks drift between the two (power and temperature), and near a tie that drift can decide
    (a Llama head matmul stored at 1.03x ran 11% slower than cuBLAS in its graph). Alternating
    puts both under the same conditions.
    """
    v, c = [], []
    for _ in range(rounds):
        v.append((time_vendor or median_ms)(vendor))
        c.append((time_candidate or median_ms)(candidate))
    return statistics.median(v), statistics.median(c)


def _captured(fn: Callable[[], object]) -> Callable[[], object] | None:
    """``fn`` captured once into a CUDA graph: its replay; None where ``fn`` cannot be captured."""
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
    except Exception:  # noqa: BLE001 - a host sync or an allocation capture refuses: no replay
        return None
    return graph.replay


def graph_replay_ms(fn: Callable[[], object]) -> float | None:
    """Median ms of ``fn`` captured once into a CUDA graph and replayed (launch overhead gone:
    how a kernel runs inside a captured model); None where ``fn`` cannot be captured."""
    replay = _captured(fn)
    return median_ms(replay) if replay is not None else None


def with_split_copies(run: Callable[[list], object]) -> Callable[[list], object]:
    """``run`` (inputs -> outputs) followed by what a CUDA-graph split adds after an op that syncs:
    each tensor it made copied into a buffer of its own, the next captured stretch's static input
    (serving/cudagraphs.py). A graphed race's vendor side pays it as served (Mixtral's 4 split
    points copied 0.49 ms a call on the H100); a candidate that keeps the op on the device is
    captured with its neighbours and copies nothing."""
    import torch
    from torch.utils._pytree import tree_leaves
    static: list = []

    def call(inputs: list) -> object:
        outs = run(inputs)
        made = [t for t in tree_leaves(outs) if isinstance(t, torch.Tensor)]
        if [t.shape for t in static] != [t.shape for t in made]:
            static[:] = [torch.empty_like(t) for t in made]
        for dst, src in zip(static, made):
            dst.copy_(src)
        return outs
    call.buffers = static  # (the next stretch's inputs, as they stand)
    return call


QUEUED_MS = 2.0  # GPU work queued ahead of a call timed as a captured model serves it
_cycles_per_ms: list[float] = []


def queued_ms(fn: Callable[[], object], graphed: bool = False) -> float:
    """Median ms that ``fn`` adds behind QUEUED_MS of GPU work already queued (a spin kernel), as a
    call inside a captured model is issued while the work before it still runs: a call that reads
    the device on the host waits for that work, then issues its own onto an idle GPU; one that does
    not was queued behind it and starts the moment it ends. ``graphed``: ``fn`` is captured and
    replayed, as it is served (where it cannot be captured, it runs as it is)."""
    import torch
    run = (_captured(fn) if graphed else None) or fn
    if not _cycles_per_ms:  # (clock rates differ between cards: measured once per process)
        _cycles_per_ms.append(1e6 / median_ms(lambda: torch.cuda._sleep(1_000_000)))
    cycles = int(QUEUED_MS * _cycles_per_ms[0])

    def queued() -> None:
        torch.cuda._sleep(cycles)
        run()
    alone = median_ms(lambda: torch.cuda._sleep(cycles))
    return max(1e-4, median_ms(queued) - alone)
