"""CUDA graphs for lowered inference graphs (option ``cudagraphs``, or mode="reduce-overhead").

Per input signature (shapes, strides, dtypes) the lowered graph is run twice on a side stream
(warm-up: allocator and first-call work settle), then captured. A replay copies the call's
inputs into the captured input buffers (skipped for inputs that are the very same tensors:
parameters and buffers) and returns the captured outputs; inputs the graph writes to (in-place
ops such as ``index_add_``) are copied back from their buffers after the replay. As with torch.compile's
"reduce-overhead", the returned tensors are overwritten by the next call of the same compiled
graph: clone what you keep. Graphs that are not inference graphs, or whose inputs are not all CUDA tensors, are not
captured (logged once) and run as they are.

Threads: as with Inductor's CUDA graph trees, each thread captures and replays its own graphs
(their buffers are a replay's state, which two threads at once would overwrite), and captures
take turns across the process (a capture in one thread must not see another thread's work).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("torch_kernelize.serving.cudagraphs")
_capture_lock = threading.Lock()


def is_static_input(a: Any) -> bool:
    """A tensor whose address Dynamo treats as fixed across calls: a parameter, or a module buffer
    or other tensor Dynamo marked so (``_dynamo_static_input_type``; e.g. RoPE's cos/sin tables)."""
    return isinstance(a, torch.nn.Parameter) or getattr(a, "_dynamo_static_input_type", None) is not None


class _Captured:
    def __init__(self, run: Callable[[list], Any], args: list, mutated: Sequence[int] = ()):
        self.mutated = list(mutated)
        # Inputs are copied into buffers the graph reads; parameters and buffers, passed again as
        # the same tensors, are read in place (their copy would be a no-op costing a launch and
        # bandwidth per call). One that moves is copied into the captured one, like any input.
        self.static_inputs = [a.clone() if isinstance(a, torch.Tensor) and not is_static_input(a) else a
                              for a in args]
        with _capture_lock:
            self._capture(run)

    def _capture(self, run: Callable[[list], Any]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run(list(self.static_inputs))
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = run(list(self.static_inputs))

    def replay(self, args: list) -> Any:
        for dst, src in zip(self.static_inputs, args):
            if isinstance(src, torch.Tensor) and dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.graph.replay()
        for i in self.mutated:  # the replay wrote to the buffer: the caller's tensor must see it
            if self.static_inputs[i].data_ptr() != args[i].data_ptr():
                args[i].copy_(self.static_inputs[i])
        return self.outputs


def _signature(args: Sequence[Any]) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def mutated_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Positions of the graph's inputs that an op writes to (per the ops' schemas)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        for arg, value in zip(n.target._schema.arguments, n.args):
            if arg.alias_info is not None and arg.alias_info.is_write and value in placeholders:
                written.add(placeholders[value])
        for name, value in n.kwargs.items():
            arg = next((a for a in n.target._schema.arguments if a.name == name), None)
            if arg is not None and arg.alias_info is not None and arg.alias_info.is_write and value in placeholders:
                written.add(placeholders[value])
    return sorted(written)


def wrap_cudagraphs(run: Callable[[list], Any], example_inputs: Sequence[Any], kind: str) -> Callable[[list], Any]:
    mutated = getattr(run, "mutated_inputs", None)
    if mutated is None:  # nothing says which inputs it writes to: capturing could lose a write
        log.info("cudagraphs: not a lowered graph; it runs without CUDA graphs")
        return run
    if kind != "inference":
        log.info("cudagraphs: %s graphs run without CUDA graphs (only inference graphs are captured)", kind)
        return run
    if not all(isinstance(a, torch.Tensor) and a.is_cuda for a in example_inputs
               if isinstance(a, torch.Tensor)) or not torch.cuda.is_available():
        log.info("cudagraphs: inputs are not all CUDA tensors; running without CUDA graphs")
        return run
    per_thread = threading.local()

    def replay(args: list) -> Any:
        key = _signature(args)
        graphs = getattr(per_thread, "graphs", None)
        if graphs is None:
            graphs = per_thread.graphs = {}
        captured = graphs.get(key)
        if captured is None:
            captured = graphs[key] = _Captured(run, list(args), mutated)
        return captured.replay(args)
    return replay
