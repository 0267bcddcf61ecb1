"""CUDA graphs for lowered inference graphs (option ``cudagraphs``, or mode="reduce-overhead").

Per input signature (shapes, strides, dtypes) the bound graph is cut at its host syncs
(graph_split.py: ``.item()``, a custom op's ``tolist()``, data-dependent sizes, copies between
devices, host fallbacks): each stretch between two syncs is run twice on a side stream (warm-up:
allocator and first-call work settle), then captured as its own CUDA graph, and the syncs run
eagerly between the replays (with the stretches that are no cheaper replayed than run: a
replay copies each input a sync made first). A graph without syncs is one stretch. A stretch is
captured per signature of its own inputs (the sizes and values a sync hands it), up to ``MAX_SIZES`` of them;
beyond that it runs ungraphed, counted. The CUDA graphs captured in one call (all of them, for a
graph whose stretches see one size) share one memory pool: torch allows graphs to share a pool
when they replay in the order they were captured, and every later call replays them in that
order (the plan's). A stretch's new size captured in a later call goes into a new pool: it replays
before graphs captured earlier, whose scratch memory a shared pool could have given its outputs.

A replay copies the stretch's inputs into the captured input buffers (skipped for inputs that are
the very same tensors: parameters, buffers, and an earlier stretch's captured outputs) and returns
the captured outputs; inputs the stretch writes to (in-place ops such as ``index_add_``) are copied
back from their buffers after the replay. As with torch.compile's "reduce-overhead", the returned
tensors are overwritten by the next call of the same compiled graph: clone what you keep. Graphs
that are not inference graphs, checked graphs, or whose inputs are not all CUDA tensors are not
captured (logged once, counted in the report) and run as they are.

Threads: as with Inductor's CUDA graph trees, each thread captures and replays its own graphs
(their buffers are a replay's state, which two threads at once would overwrite), and captures
take turns across the process (a capture in one thread must not see another thread's work).

The capture itself goes through a backend object (``CudaCapture``); tests on a machine without a
GPU inject one that records what would be captured and replays by re-running the stretch.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.serving.graph_split import Segment, SplitPlan, mutated_inputs, split_plan

__all__ = ["wrap_cudagraphs", "mutated_inputs", "is_static_input", "cudagraph_stats", "cudagraph_summary",
           "CudaCapture"]

log = logging.getLogger("torch_kernelize.serving.cudagraphs")
_capture_lock = threading.Lock()
MAX_SIZES = 8  # signatures captured per stretch; data-dependent sizes beyond that run ungraphed


def is_static_input(a: Any) -> bool:
    """A tensor whose address Dynamo treats as fixed across calls: a parameter, or a module buffer
    or other tensor Dynamo marked so (``_dynamo_static_input_type``; e.g. RoPE's cos/sin tables)."""
    return isinstance(a, torch.nn.Parameter) or getattr(a, "_dynamo_static_input_type", None) is not None


class CudaCapture:
    """Captures and replays CUDA graphs, in memory pools of its own making."""

    device_type = "cuda"

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[list], Any], args: list, pool: Any) -> tuple[Any, Any]:
        """Warm ``run`` up on a side stream, then capture it into ``pool``: (graph, outputs)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run(list(args))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = run(list(args))
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()

    def pool_bytes(self, pools: Sequence[Any]) -> int:
        """Bytes the allocator holds in ``pools`` (segments reserved for them)."""
        ids = {tuple(p) for p in pools}
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) in ids)


class _Captured:
    """One CUDA graph of one stretch at one input signature."""

    def __init__(self, run: Callable[[list], Any], args: list, mutated: Sequence[int], backend: Any, pool: Any,
                 keep: Sequence[int] = ()):
        self.mutated = list(mutated)
        self.backend = backend
        # Inputs are copied into buffers the graph reads; parameters and buffers, and the captured
        # outputs of an earlier stretch (``keep``), passed again as the same tensors, are read in
        # place (their copy would be a no-op costing a launch and bandwidth per call). One that
        # moves is copied into the captured one, like any input.
        self.static_inputs = [a.clone() if isinstance(a, torch.Tensor) and not is_static_input(a) and i not in keep
                              else a for i, a in enumerate(args)]
        with _capture_lock:
            self.graph, self.outputs = backend.capture(run, self.static_inputs, pool)

    def replay(self, args: list) -> Any:
        for dst, src in zip(self.static_inputs, args):
            if isinstance(src, torch.Tensor) and dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.backend.replay(self.graph)
        for i in self.mutated:  # the replay wrote to the buffer: the caller's tensor must see it
            if self.static_inputs[i].data_ptr() != args[i].data_ptr():
                args[i].copy_(self.static_inputs[i])
        return self.outputs


def _signature(args: Sequence[Any]) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class GraphStats:
    """What CUDA graphs did for one compiled graph, all threads together (the report's
    ``cudagraphs`` entry). Counts are not locked: under threads they may miss an increment."""

    def __init__(self, name: str):
        self.name = name
        self.calls = 0
        self.replays = 0
        self.graphs = 0  # CUDA graphs captured
        self.per_call: dict[str, int] = {}  # the latest call's graphs, stretches and syncs
        self.plans: dict[str, dict[str, Any]] = {}  # signature it was made at -> its stretches and syncs
        self.not_graphed: collections.Counter = collections.Counter()  # reason -> runs
        self.pools: list[Any] = []
        self.pool_bytes = 0

    def to_json(self) -> dict[str, Any]:
        return {"calls": self.calls, "graphs_captured": self.graphs, "graph_replays": self.replays,
                "per_call": dict(self.per_call), "plans": dict(self.plans),
                "not_graphed": dict(self.not_graphed), "pools": len(self.pools), "pool_bytes": self.pool_bytes}


_stats: list[GraphStats] = []


def cudagraph_stats() -> dict[str, dict[str, Any]]:
    """Each compiled graph's CUDA graph record (by graph name), for the report."""
    return {s.name: s.to_json() for s in list(_stats)}


def cudagraph_summary() -> dict[str, Any]:
    """One call of everything captured in this process (a model's graphs, one after another): its
    CUDA graphs, stretches and syncs, what ran ungraphed and why, and the pools' bytes."""
    entries = [s.to_json() for s in list(_stats)]
    total = {key: sum(e["per_call"].get(key, 0) for e in entries) for key in ("graphs", "stretches", "syncs")}
    not_graphed: collections.Counter = collections.Counter()
    for e in entries:
        not_graphed.update(e["not_graphed"])
    return {"per_call": total, "not_graphed": dict(not_graphed), "pool_bytes": sum(e["pool_bytes"] for e in entries),
            "compiled_graphs": len(entries)}


class _Stretch:
    """A stretch's CUDA graphs in one thread, by the signature of the inputs that can vary."""

    def __init__(self, seg: Segment, n_inputs: int, captured_slots: set[int]):
        self.seg = seg
        # the graph's own inputs are fixed by the call's signature (a Piecewise serves one): only
        # values made by the segments before it can differ (a sync's sizes and scalars)
        self.varying = [i for i, s in enumerate(seg.inputs) if s >= n_inputs]
        self.keep = [i for i, s in enumerate(seg.inputs) if s in captured_slots]
        self.graphs: dict[tuple, _Captured] = {}
        self.ungraphed: str | None = None  # why it now runs ungraphed


class Piecewise:
    """One bound graph's split plan, at one call signature, its stretches replayed as CUDA graphs."""

    def __init__(self, plan: SplitPlan, backend: Any, stats: GraphStats, max_sizes: int):
        self.plan, self.backend, self.stats, self.max_sizes = plan, backend, stats, max_sizes
        self.pool = None  # the pool of the graphs captured in the current call (see the module docstring)
        captured_slots = {s for seg in plan.stretches for s in seg.outputs}
        self.stretches = {seg.index: _Stretch(seg, plan.n_inputs, captured_slots) for seg in plan.stretches}

    def __call__(self, args: list) -> Any:
        plan = self.plan
        env = list(args) + [None] * (plan.n_slots - len(args))
        replays = 0
        self.pool = None
        for seg in plan.segments:
            ins = [env[i] for i in seg.inputs]
            if seg.eager:
                outs = seg.fn(*ins)
            else:
                outs, replayed = self._stretch(self.stretches[seg.index], ins)
                replays += replayed
            for s, v in zip(seg.outputs, outs):
                env[s] = v
        stats = self.stats
        stats.calls += 1
        stats.replays += replays
        stats.per_call = {"graphs": replays, "stretches": len(self.stretches), "syncs": len(plan.syncs)}
        return plan.output(env)

    def _stretch(self, st: _Stretch, ins: list) -> tuple[Any, int]:
        if st.ungraphed is None:
            key = _signature([ins[i] for i in st.varying]) if st.varying else ()
            captured = st.graphs.get(key)
            if captured is None:
                captured = self._capture(st, ins, key)
            if captured is not None:
                return captured.replay(ins), 1
        self.stats.not_graphed[st.ungraphed] += 1
        return st.seg.fn(*ins), 0

    def _capture(self, st: _Stretch, ins: list, key: tuple) -> _Captured | None:
        seg = st.seg
        if len(st.graphs) >= self.max_sizes:
            st.ungraphed = (f"stretch {seg.index}: more than {self.max_sizes} input signatures "
                            "(data-dependent sizes); it runs ungraphed")
            log.info("cudagraphs: %s: %s", self.stats.name, st.ungraphed)
            return None
        stats = self.stats
        if self.pool is None:  # this call's first capture
            self.pool = self.backend.new_pool()
            stats.pools.append(self.pool)
        try:
            captured = st.graphs[key] = _Captured(lambda a: seg.fn(*a), ins, seg.mutated, self.backend, self.pool,
                                                  st.keep)
        except Exception as e:  # an op that syncs but that the table does not know: run it as it is
            st.ungraphed = f"stretch {seg.index}: capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            log.warning("cudagraphs: %s: %s; it runs ungraphed (if an op in it reads device values on the host, "
                        "add it to graph_split.SYNC_OPS)", self.stats.name, st.ungraphed)
            return None
        stats.graphs += 1
        try:
            stats.pool_bytes = self.backend.pool_bytes(stats.pools)
        except Exception:  # the memory record is for the report only
            log.debug("cudagraphs: could not measure the memory pools", exc_info=True)
        return captured


def wrap_cudagraphs(run: Callable[[list], Any], example_inputs: Sequence[Any], kind: str,
                    backend: Any = None, max_sizes: int | None = None) -> Callable[[list], Any]:
    """``run`` (a LoweredGraph) replayed as CUDA graphs, cut at its host syncs; ``backend``
    captures and replays (``CudaCapture()`` by default); ``max_sizes``: signatures captured per
    stretch (``MAX_SIZES`` by default)."""
    max_sizes = max_sizes if max_sizes is not None else MAX_SIZES
    name = getattr(run, "name", f"graph_{len(_stats)}")
    stats = GraphStats(name)
    _stats.append(stats)
    backend = backend if backend is not None else CudaCapture()
    why = _not_captured(run, example_inputs, kind, backend)
    if why is not None:
        log.info("cudagraphs: %s: %s; it runs without CUDA graphs", name, why)

        def plain(args: list) -> Any:
            stats.not_graphed[why] += 1
            return run(args)
        return plain
    device = torch.device(backend.device_type)
    per_thread = threading.local()
    plans: dict[Any, SplitPlan] = {}  # per Specialization (one may serve several signatures), all threads

    def replay(args: list) -> Any:
        key = _signature(args)
        pieces = getattr(per_thread, "pieces", None)
        if pieces is None:
            pieces = per_thread.pieces = {}
        piecewise = pieces.get(key)
        if piecewise is None:
            spec = run.specialization(args)
            if spec.has_first_call_work:  # (records reproducers, or refuses the graph): once, ungraphed
                stats.not_graphed["first call of a signature (records reproducers)"] += 1
                return spec(args)
            plan = plans.get(spec)
            if plan is None:
                plan = plans[spec] = split_plan(spec.gm, device)
                _describe(stats, plan, spec.key)
            piecewise = pieces[key] = Piecewise(plan, backend, stats, max_sizes)
        return piecewise(args)
    return replay


def _not_captured(run: Any, example_inputs: Sequence[Any], kind: str, backend: Any) -> str | None:
    """Why ``run`` is not captured at all; None if it is."""
    if getattr(run, "mutated_inputs", None) is None or not hasattr(run, "specialization"):
        return "not a lowered graph"  # nothing says which inputs it writes to: capturing could lose a write
    if kind != "inference":
        return f"a {kind} graph (only inference graphs are captured)"
    if run.session.options.check:
        return "check mode compares kernels with vendor ops on the host"
    tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)]
    if not all(a.device.type == backend.device_type for a in tensors):
        return f"inputs are not all {backend.device_type} tensors"
    if backend.device_type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def _describe(stats: GraphStats, plan: SplitPlan, key: tuple) -> None:
    """Record a new signature's plan in the report, and say it in the log (one line)."""
    syncs = plan.syncs
    signature = ", ".join(map(str, key)) or "static"
    stats.plans[signature] = {"stretches": len(plan.stretches), "syncs": [f"{op}: {why}" for op, why in syncs]}
    if syncs:
        reasons = "; ".join(f"{op}: {why}" for op, why in dict.fromkeys(syncs))
        log.info("kernelize: %s under CUDA graphs: %d stretch(es) captured, %d sync(s) run eagerly between them "
                 "(%s)", stats.name, len(plan.stretches), len(syncs), reasons)
    else:
        log.info("kernelize: %s under CUDA graphs: one graph, no host syncs", stats.name)
