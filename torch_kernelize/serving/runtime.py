"""The runtime: the executable of one lowered ATen graph.

Per concrete shape signature (see shapes.SymbolBinder) the graph is specialised once: each
node is bound to what its Decision says (a preloaded Triton launcher, the vendor op, or the host
fallback) and the bound graph becomes one generated flat function (flat_code.py). The hot path
is a key lookup (none at all for static graphs) and that function: no planning, no cache access.
"""
from __future__ import annotations

import contextlib
import copy
import heapq
import logging
import operator
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from torch_kernelize.core.decision import Decision
from torch_kernelize.core.errors import IndexOutOfRange
from torch_kernelize.core.shapes import sizes_read_off
from torch_kernelize.core.spec import KernelSpec, tensor_input_nodes
from torch_kernelize.core.validate import compare_all
from torch_kernelize.serving.launch import MisalignedInput
from torch_kernelize.serving.view_folding import VIEW_OPS, FoldedView

log = logging.getLogger("torch_kernelize.serving.runtime")


class KernelState:
    """The health of one cached kernel in this process: once it fails it stays disabled."""

    _lock = threading.Lock()  # failures are rare: one lock for all states

    def __init__(self, key: str):
        self.key = key
        self.disabled: str | None = None
        self.layout_noted = False  # an input arrived in another layout than traced (logged once)

    def disable(self, why: str) -> bool:
        """Record a failure; True for the first one (whose owner logs and records it), also
        when several threads fail at once."""
        with self._lock:
            first = self.disabled is None
            self.disabled = why
        return first


class TritonCall:
    """Launches a cached kernel in place of one node (or fused region). A kernel that raises is
    disabled for the process and its node runs on the vendor op from then on: the answer stays right."""

    def __init__(self, spec: KernelSpec, runner: Callable, state: KernelState,
                 on_failure: Callable | None = None, name: str | None = None):
        self.spec = spec
        self.runner = runner
        self.state = state
        self.on_failure = on_failure
        # (input index, strides the kernel was built for) of the inputs whose layout is not
        # certain: made by a vendor op, whose output strides can differ from its meta function's
        # (guard_vendor_layouts); such a call runs on the vendor op instead of misreading them
        self.layout_checks: tuple[tuple[int, tuple[int, ...]], ...] = ()
        self.__name__ = name or f"triton_{spec.short_name}_{spec.key[:8]}"

    def checking(self, inputs: Sequence[int]) -> "TritonCall":
        """This call checking that ``inputs`` arrive with the strides its kernel was built for."""
        checked = copy.copy(self)
        checked.layout_checks = tuple((i, self.spec.inputs[i].stride) for i in inputs)
        return checked

    def vendor(self, *tensors: torch.Tensor):
        """The spec's op on the vendor kernel, its outputs in the traced layout (later kernels
        read them with the traced strides, as they would this call's kernel's outputs)."""
        out = tuple(o if not isinstance(o, torch.Tensor) or o.stride() == m.stride
                    else torch.empty_strided(m.shape, m.stride, dtype=o.dtype, device=o.device).copy_(o)
                    for o, m in zip(self.spec.run_vendor(tensors), self.spec.outputs))
        return out if self.spec.tuple_output else out[0]

    def donating(self) -> "TritonCall | None":
        """This call writing into the inputs its program may take over (see Donation), for a
        node whose such inputs nothing reads afterwards (reinplace.py decides); None if it has
        none. A failure still answers with the functional vendor op, which leaves them alone."""
        donating = getattr(self.runner, "donating", None)
        runner = donating() if donating is not None else None
        if runner is None:
            return None
        call = TritonCall(self.spec, runner, self.state, self.on_failure)
        call.layout_checks = self.layout_checks
        call.donated_inputs = frozenset(d.input for d in runner.program.donations)
        call.__name__ = self.__name__ + "_inplace"
        return call

    def __call__(self, *tensors: torch.Tensor):
        if self.state.disabled is None:
            for i, stride in self.layout_checks:
                if tensors[i].stride() != stride:
                    self._other_layout(i, tensors[i])
                    return self.vendor(*tensors)
            try:
                return self.runner(*tensors)
            except Exception as e:
                return self.failed(e, tensors)
        return self.vendor(*tensors)

    def failed(self, e: Exception, tensors: Sequence[torch.Tensor]):
        """The answer of a call whose kernel raised ``e``: the vendor op's. A misaligned input
        sends this call only there; an index out of range is the caller's (eager's IndexError,
        raised on); any other failure disables the kernel."""
        if isinstance(e, IndexOutOfRange):
            raise e
        if not isinstance(e, MisalignedInput):
            self.disable(f"{type(e).__name__}: {e}", tensors, "failure")
        return self.vendor(*tensors)

    def _other_layout(self, i: int, t: torch.Tensor) -> None:
        if not self.state.layout_noted:
            self.state.layout_noted = True
            log.warning("Triton kernel for %s (spec %s): input %d arrived with strides %s, not the traced %s "
                        "(a vendor op laid out its output differently from its meta function); such calls run "
                        "on the vendor op", self.spec.describe(), self.spec.key, i, tuple(t.stride()),
                        self.spec.inputs[i].stride)

    def disable(self, why: str, tensors: Sequence[torch.Tensor] = (), kind: str = "failure") -> None:
        if not self.state.disable(why):
            return
        log.error("Triton kernel for %s (spec %s) is disabled for this process; its node runs on the "
                  "vendor op from now on. Cause: %s", self.spec.describe(), self.spec.key, why)
        if self.on_failure is not None:
            try:
                self.on_failure(self, why, tensors, kind)
            except Exception:  # recording the failure must never break the run
                log.exception("could not record the failure of kernel %s", self.spec.key)


class CheckedTritonCall(TritonCall):
    """Check mode: every launch also runs the vendor op; a mismatch disables the kernel, is
    recorded (and minified by the owner), and the vendor's answer is returned. ``resolve_ties``
    is the spec's family's (``KernelFamily.resolve_ties``), where it has one: topk's index of an
    equal element is as right as the vendor's."""

    def __init__(self, spec: KernelSpec, runner: Callable, state: KernelState,
                 on_failure: Callable | None = None, resolve_ties: Callable | None = None, name: str | None = None):
        super().__init__(spec, runner, state, on_failure, name)
        self.resolve_ties = resolve_ties

    def donating(self) -> None:
        return None  # the vendor op runs after the kernel on the same inputs: they must stay intact

    def __call__(self, *tensors: torch.Tensor):
        if self.state.disabled is not None:
            return self.vendor(*tensors)
        try:
            got = self.runner(*tensors)
        except MisalignedInput:
            return self.vendor(*tensors)
        except IndexOutOfRange:
            raise
        except Exception as e:
            self.disable(f"{type(e).__name__}: {e}", tensors, "failure")
            return self.vendor(*tensors)
        want = self.vendor(*tensors)
        gots, wants = (got, want) if self.spec.tuple_output else ((got,), (want,))
        wants64 = [w.to(torch.float64) if w.is_floating_point() else w for w in wants]
        if self.resolve_ties is not None:
            gots = self.resolve_ties(self.spec, tensors, gots, wants64)
        c = compare_all(gots, wants64, self.spec, factor=2.0)  # the tolerances validation uses
        if not c.ok:
            self.disable(f"mismatch against the vendor op: {c.reason}", tensors, "mismatch")
            return want
        return got


class CallClock:
    """When this process last started a call of a bound graph: background work that contends for
    the interpreter lock (the repro writer: repro_recorder.BackgroundWriter) waits for a quiet
    spell rather than stretching the model's calls."""

    started = 0.0

    def quiet_s(self) -> float:
        return time.perf_counter() - self.started


calls = CallClock()


class Specialization:
    """The bound executable for one shape signature, plus the decisions it was built from."""

    def __init__(self, gm: fx.GraphModule, decisions: list[Decision], key: tuple,
                 first_call: Callable[["Specialization", list], Any] | None = None,
                 forward: Callable[..., Any] | None = None):
        """``forward`` runs the bound graph ``gm`` (its generated flat function, flat_code.py);
        by default ``gm``'s own FX code."""
        self.gm = gm
        self.decisions = decisions
        self.key = key
        self.regions: list[Decision] = []  # fused regions looked up, hit or miss (for the report)
        self.lookups: dict[str, Any] = {}  # kernel-cache key -> witness of its lookup (executable cache)
        # each checked miss's size symbols and its verdict (the signatures it is shared with count them)
        self.miss_symbols: list[tuple[frozenset, str]] = []
        self._forward = forward if forward is not None else gm.forward
        self._first_call = first_call
        self._lock = threading.Lock()

    @property
    def has_first_call_work(self) -> bool:
        """Whether the first call still has work of its own to do (capture repros, refuse ops)."""
        return self._first_call is not None

    @contextlib.contextmanager
    def running(self, forward: Callable[..., Any]):
        """Run ``forward`` (the bound graph's inputs -> its outputs) in place of the generated code
        while the block lasts: the bottleneck ledger times the bound graph node by node this way,
        and serving pays nothing for it."""
        saved, self._forward = self._forward, forward
        try:
            yield
        finally:
            self._forward = saved

    def __call__(self, args: list) -> Any:
        calls.started = time.perf_counter()
        if self._first_call is not None:
            # One thread runs the first call; the others wait for it, then run what it left
            # (the generated code, or the refusal of a strict graph with missing ops).
            with self._lock:
                first = self._first_call
                if first is not None:
                    try:
                        return first(self, args)
                    finally:
                        self._first_call = None
        return self._forward(*args)


def bind_graph(gm: fx.GraphModule, decisions: list[Decision],
               make_triton: Callable[[Decision], Callable],
               make_fallback: Callable[[Decision, Any], Callable],
               fused: Sequence[tuple[Any, Callable]] = (),
               passes: Sequence[Callable[[fx.Graph], Any]] = (),
               guarded_inputs: bool = True) -> fx.GraphModule:
    """A copy of the planned graph with every node bound to its decided implementation.

    ``fused`` lists (Region, launcher) pairs: each region's nodes are replaced by one call of
    its launcher (the decisions of those nodes are then not consulted). ``passes`` then rewrite
    the bound graph (view folding, reinplacing) before its code is generated, once.
    ``guarded_inputs``: the graph's inputs have their traced layouts (Dynamo guards them; not so
    a backward graph's saved tensors), see guard_vendor_layouts.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    in_region = {n.name for region, _ in fused for n in region.nodes}
    by_name = {d.node: d for d in decisions if d.tier in ("triton", "fallback") and d.node not in in_region}
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
    replaced: dict[fx.Node, fx.Node] = {}  # outputs of regions fused so far -> their new values
    for region, launcher in fused:
        inputs = [replaced.get(env[n], env[n]) for n in region.inputs]
        replaced.update(_fuse(graph, [env[n] for n in region.nodes], inputs, [env[n] for n in region.outputs],
                              launcher))
    if fused:
        _stable_toposort(graph)
    for rewrite in passes:
        rewrite(graph)
    guard_vendor_layouts(graph, guarded_inputs)
    graph.lint()
    # lazy: its FX code is generated only if something asks for it (calls run flat_code's function)
    return _LazyGraphModule(gm, graph)


def guard_vendor_layouts(graph: fx.Graph, guarded_inputs: bool = True) -> int:
    """Give each cached-kernel call a stride check for the inputs whose layout the trace does not
    pin down. A kernel bakes its inputs' traced strides in; graph inputs are guarded by Dynamo
    (``guarded_inputs``), and kernels and host fallbacks produce exactly the traced layout, but a
    vendor op's output can be laid out otherwise than its meta function said. Returns the number
    of checks."""

    checks = 0
    for node in graph.nodes:
        call = node.target
        if node.op != "call_function" or not isinstance(call, TritonCall):
            continue
        unsure = tuple(i for i, a in enumerate(node.args)
                       if i < len(call.spec.inputs) and not has_traced_layout(a, guarded_inputs))
        if unsure:
            node.target = call.checking(unsure)
            checks += len(unsure)
    return checks


def has_traced_layout(node: Any, guarded_inputs: bool = True) -> bool:
    """Whether a bound graph's value certainly has its traced layout at run time: a guarded graph
    input, or the output of a cached kernel or host fallback (they allocate the traced strides),
    or a piece or view of one. A vendor op's output need not."""
    while isinstance(node, fx.Node) and node.op == "call_function" and (
            node.target is operator.getitem or node.target in VIEW_OPS or isinstance(node.target, FoldedView)):
        node = node.args[0]  # a piece of a tuple, or a view: exact if what it views is
    if not isinstance(node, fx.Node):
        return False
    if node.op == "placeholder":
        return guarded_inputs
    target = node.target
    return isinstance(target, TritonCall) or bool(getattr(target, "out_strides", None))


def _fuse(graph: fx.Graph, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
          launcher: Callable) -> dict[fx.Node, fx.Node]:
    """Replace ``nodes`` by one call of ``launcher(*inputs)``; return {old output: new value}.
    Each new value keeps its output's metadata (``val``: what later passes and prewarm's record
    of a vendor call read off an argument)."""
    with graph.inserting_after(nodes[-1]):
        call = graph.call_function(launcher, tuple(inputs))
    _reread_sizes(nodes, [*inputs, *outputs])
    replacements = {}
    if len(outputs) == 1:
        replacements[outputs[0]] = call
    else:
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        for i, o in enumerate(outputs):
            with graph.inserting_after(call):
                replacements[o] = graph.call_function(operator.getitem, (call, i))
    for old, new in replacements.items():
        new.meta.update(old.meta)
        old.replace_all_uses_with(new)
    for n in reversed(nodes):
        graph.erase_node(n)
    return replacements


def _reread_sizes(nodes: list[fx.Node], boundary: list[fx.Node]) -> None:
    """A dynamic graph's size read off a value inside ``nodes`` is read off an input or output of
    theirs of that size instead (core/shapes.sizes_read_off): the value goes with the fusion, and
    the toposort after puts the read after the fused call."""
    reads = sizes_read_off(nodes, boundary)
    if reads is None:  # (whole_graph.py offers no such stretch)
        raise ValueError("a size read off a value inside a fused region is no size of its inputs or outputs")
    for reader, (tensor, dim) in reads:
        reader.args = (tensor, dim)


def _stable_toposort(graph: fx.Graph) -> None:
    """Reorder nodes topologically, keeping the existing order wherever it is already valid
    (a fused call sits at its last member's place; early readers of its outputs move after it)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        ordered.append(n)
        for u in n.users:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, index[u])
    if ordered == nodes:
        return
    for prev, n in zip(ordered, ordered[1:]):
        prev.append(n)


def copy_value(t: torch.Tensor, on_device: bool) -> torch.Tensor:
    """A copy of ``t`` for a reproducer: on the host, or with ``on_device`` on ``t``'s device (a
    serving call then never waits for a device-to-host copy, which cost a Mixtral server's first
    call of a new bucket ~150 ms on an H100: the repro writer's thread makes those,
    repro_writer.host_copies). Where the device has no room for a copy, the host takes it at once."""
    t = t.detach()
    if on_device and t.device.type != "cpu":
        try:
            return t.clone()
        except torch.OutOfMemoryError:
            pass
    return t.to("cpu", copy=True)


class ValueCapture:
    """What one call keeps of a bound graph's values (for repros): copies of the tensor inputs of
    the nodes named in ``inputs_of`` (``captured``) and of the values of the nodes named in
    ``values_of`` (``values``). The generated code calls it (flat_code.py), or an interpreter."""

    def __init__(self, inputs_of: set[str], values_of: set[str] = frozenset(), on_device: bool = False):
        self.inputs_of, self.values_of, self.on_device = inputs_of, values_of, on_device
        self.captured: dict[str, list[torch.Tensor]] = {}
        self.values: dict[str, torch.Tensor] = {}

    def inputs(self, name: str, args: Any, kwargs: Any) -> None:
        flat, _ = pytree.tree_flatten((list(args), dict(kwargs)))
        self.captured[name] = [copy_value(t, self.on_device) for t in flat if isinstance(t, torch.Tensor)]

    def value(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.values[name] = copy_value(value, self.on_device)


class CapturingInterpreter(fx.Interpreter):
    """Runs a bound graph once through FX's interpreter, keeping what ``ValueCapture`` keeps (its
    copies on the host, or with ``on_device`` on their device): for graphs the generated code does
    not render, and for values the bound graph no longer holds (a planned graph's)."""

    def __init__(self, gm: fx.GraphModule, inputs_of: set[str], values_of: set[str] = frozenset(),
                 on_device: bool = False):
        super().__init__(gm)
        self.capture = ValueCapture(inputs_of, values_of, on_device)
        self.captured, self.values = self.capture.captured, self.capture.values

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.capture.inputs_of:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self.capture.inputs(n.name, args, kwargs)
        result = super().run_node(n)
        if n.name in self.capture.values_of:
            self.capture.value(n.name, result)
        return result
