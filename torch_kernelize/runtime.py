"""The runtime: the executable of one lowered ATen graph.

Per concrete shape signature (see shapes.SymbolBinder) the graph is specialised once: each
node is bound to what its Decision says (a preloaded Triton launcher, the vendor op, or the host
fallback) and the bound graph is compiled to Python code by FX. The hot path is a key lookup
(none at all for static graphs) and the generated code: no planning, no cache access.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from torch_kernelize.fallbacks import HostFallback
from torch_kernelize.planner import Decision, GraphPlan, tensor_input_nodes
from torch_kernelize.spec import KernelSpec

log = logging.getLogger("torch_kernelize.runtime")


class TritonCall:
    """Launches a cached kernel in place of one node. A kernel that raises is disabled for the
    process and its node runs on the vendor op from then on: the answer stays right."""

    def __init__(self, spec: KernelSpec, runner: Callable, on_failure: Callable | None = None):
        self.spec = spec
        self.runner = runner
        self.disabled: str | None = None
        self.on_failure = on_failure
        self.__name__ = f"triton_{spec.op.split('.')[1] if spec.op.count('.') == 2 else 'region'}_{spec.key[:8]}"

    def vendor(self, *tensors: torch.Tensor):
        out = self.spec.run_vendor(tensors)
        return out if self.spec.tuple_output else out[0]

    def __call__(self, *tensors: torch.Tensor):
        if self.disabled is None:
            try:
                return self.runner(*tensors)
            except Exception as e:
                self.disable(f"{type(e).__name__}: {e}", tensors)
        return self.vendor(*tensors)

    def disable(self, why: str, tensors: Sequence[torch.Tensor] = ()) -> None:
        self.disabled = why
        log.error("Triton kernel for %s (spec %s) failed and is disabled for this process; its node "
                  "runs on the vendor op from now on. Cause: %s", self.spec.describe(), self.spec.key, why)
        if self.on_failure is not None:
            try:
                self.on_failure(self, why, tensors)
            except Exception:  # recording the failure must never break the run
                log.exception("could not record the failure of kernel %s", self.spec.key)


class Specialization:
    """The bound executable for one shape signature, plus the decisions it was built from."""

    def __init__(self, gm: fx.GraphModule, decisions: list[Decision], key: tuple,
                 first_call: Callable[["Specialization", list], Any] | None = None):
        self.gm = gm
        self.decisions = decisions
        self.key = key
        self._forward = gm.forward
        self._first_call = first_call
        self._lock = threading.Lock()

    def __call__(self, args: list) -> Any:
        if self._first_call is not None:
            with self._lock:
                first, self._first_call = self._first_call, None
            if first is not None:
                return first(self, args)
        return self._forward(*args)


def bind_graph(plan: GraphPlan, decisions: list[Decision],
               make_triton: Callable[[Decision], Callable | None],
               make_fallback: Callable[[Decision, Any], Callable]) -> fx.GraphModule:
    """A copy of the planned graph with every node bound to its decided implementation.

    ``make_triton(decision)`` returns the launcher for a triton decision (or None if it cannot be
    loaded: the decision is then downgraded by the caller before this point).
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(plan.gm.graph, env)
    graph.output(out)
    by_name = {d.node: d for d in decisions if d.tier in ("triton", "fallback")}
    for old, new in env.items():
        d = by_name.get(old.name)
        if d is None:
            continue
        if d.tier == "triton":
            new.target = make_triton(d)
            new.args = tuple(env[n] for n in tensor_input_nodes(old))
            new.kwargs = {}
        else:
            new.target = make_fallback(d, old.target)
    return fx.GraphModule(plan.gm, graph)


class CapturingInterpreter(fx.Interpreter):
    """Runs a bound graph once, keeping CPU copies of the inputs of chosen nodes (for repros)."""

    def __init__(self, gm: fx.GraphModule, names: set[str]):
        super().__init__(gm)
        self.names = names
        self.captured: dict[str, list[torch.Tensor]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.names:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            from torch.utils import _pytree as pytree
            flat, _ = pytree.tree_flatten((list(args), dict(kwargs)))
            self.captured[n.name] = [t.detach().to("cpu", copy=True) for t in flat if isinstance(t, torch.Tensor)]
        return super().run_node(n)
