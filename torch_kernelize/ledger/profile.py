"""Profile a served model node by node: what each kernel call costs per model call.

The model runs as it is served (``torch.compile(backend="kernelize")``, the kernel cache as it
is). Served calls are timed whole (wall time; on CUDA also the host's time to issue one). Then
each bound graph runs node by node through an ``fx.Interpreter`` in place of its generated code
(``Specialization.running``): the same kernel calls, vendor ops and host fallbacks, each timed
(CPU and the interpreter: wall time around the node; CUDA: torch.profiler's device time of the
kernels each node's ``record_function`` range launched). Serving itself has no hook and pays
nothing. Each node keeps its graph, name, tier, spec and cache entry key: rank.py maps them to
the cache's records.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import operator
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.lower import specializations
from torch_kernelize.core.region_graph import describe_region, region_graph
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import op_name
from torch_kernelize.serving.runtime import CapturingInterpreter, TritonCall
from torch_kernelize.serving.view_folding import VIEW_OPS, FoldedView

if TYPE_CHECKING:
    from torch_kernelize.compiling.lower import LoweredGraph

RANGE = "kernelize|"  # record_function ranges: kernelize|<graph>|<node>
# region kinds that are no fusion opportunity: a whole graph's program (whole_graph.py) competes
# as a whole in the fill, and its "own assembly wins" leaves the graph to its regions
NOT_FUSIONS = frozenset({"whole"})


@dataclasses.dataclass
class NodeRun:
    """One node (or fused region) of a served graph, per model call."""
    graph: str
    node: str
    tier: str                  # triton | vendor | fallback | view
    op: str
    spec: KernelSpec | None
    entry_key: str | None      # the cache entry serving it (a shape bucket's key differs from the spec's)
    launches: float = 0.0      # kernel launches per model call
    seconds: float = 0.0       # time per model call
    call: Any = dataclasses.field(default=None, repr=False)  # the bound kernel call (TritonCall), to time alone
    # CUDA: the device kernels its launches ran, name -> seconds per model call (a whole graph's
    # program, or a vendor op that runs several, broken down)
    kernels: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str | None:
        return self.spec.key if self.spec is not None else None


@dataclasses.dataclass
class RegionRun:
    """A fused region the planner tried that did not get a kernel: its nodes run as separate
    launches (a fusion opportunity, whose spec a kernel for it would be served by)."""
    graph: str
    spec: KernelSpec
    members: list[str]         # its nodes' names in the bound graph
    inputs: list[tuple[str, int]]  # per spec input: a member node reading it, and which of its tensor inputs
    served: str                # why it is not fused now (the region decision's reason)


@dataclasses.dataclass
class Profile:
    device: str                 # "cuda" or "cpu"
    calls: int
    call_s: float               # one served call, wall time (median)
    host_s: float | None        # CUDA: the host's time to issue one call; None where kernels run on the host
    nodes: list[NodeRun]
    regions: list[RegionRun] = dataclasses.field(default_factory=list)

    @property
    def kernel_s(self) -> float:
        return sum(n.seconds for n in self.nodes)

    @property
    def launches(self) -> float:
        return sum(n.launches for n in self.nodes)

    @property
    def host_bound(self) -> bool | None:
        """Whether issuing a call takes longer than its kernels run (None: not known here)."""
        return None if self.host_s is None else self.host_s > self.kernel_s


def _classify(n: fx.Node, decisions: dict[str, Any]) -> NodeRun | None:
    """What node ``n`` of a bound graph runs, with its nominal launches (None: it runs nothing)."""
    target = n.target
    if n.op != "call_function" or target is operator.getitem:
        return None
    if isinstance(target, TritonCall):  # a cached kernel (a node's, a fused region's, a bucket's)
        spec = target.spec
        program = getattr(target.runner, "program", None)
        return NodeRun("", n.name, "triton", _describe(spec),
                       spec, target.state.key, len(program.launches) if program is not None else 1, call=target)
    d = decisions.get(n.name)
    spec = getattr(d, "spec", None)
    if isinstance(target, FoldedView) or target in VIEW_OPS:
        return NodeRun("", n.name, "view", "view (folded)" if isinstance(target, FoldedView) else op_name(target),
                       None, None, 0)
    tier = getattr(d, "tier", "vendor") if d is not None else "vendor"
    host_op = getattr(target, "name", None)  # a host fallback names its op
    name = _describe(spec) if spec is not None else host_op if isinstance(host_op, str) else op_name(target)
    entry = getattr(getattr(d, "entry", None), "key", None)
    return NodeRun("", n.name, tier if tier in ("vendor", "fallback") else "vendor", name, spec, entry, 1)


def _describe(spec: KernelSpec) -> str:
    """One op's description; a fused region's kind, ops and input shapes."""
    if spec.graph is None:
        return spec.describe()
    return f"{describe_region(spec)} " + " ".join(m.short() for m in spec.inputs)


def _unfused_regions(graph: LoweredGraph, spec: Any, bound: set[str]) -> list[RegionRun]:
    """The regions of a specialization that were tried and missed, whose nodes are in the bound
    graph under their names (views that were folded aside): run there as separate launches."""
    out = []
    for d in spec.regions:
        region = _decided_region(graph, d) if d.tier != "triton" and d.spec is not None else None
        if region is None or region.kind in NOT_FUSIONS:
            continue
        members = [n.name for n in region.nodes if n.name in bound]
        if any(n.name not in bound and n.target not in VIEW_OPS for n in region.nodes):
            continue
        sources = _input_sources(region, set(members))
        if sources is not None:
            out.append(RegionRun(graph.name, d.spec, members, sources, d.reason or "not in the cache"))
    return out


def _input_sources(region: Any, bound: set[str]) -> list[tuple[str, int]] | None:
    """Where each region input can be captured: a bound member that reads it, and its position
    among that member's tensor inputs (a view of it may have been folded into the argument: the
    same tensor). None where an input has no such reader."""
    sources = []
    for x in region.inputs:
        for m in region.nodes:
            tensors = [a for a in pytree.tree_leaves((m.args, m.kwargs))
                       if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            if m.name in bound and x in tensors:
                sources.append((m.name, tensors.index(x)))
                break
        else:
            return None
    return sources


def _decided_region(graph: LoweredGraph, d: Any) -> Any:
    """The Region a region decision was made for. Identical regions (a model's layers) share a
    spec key, so it is found by its first node (the decision's name) and its kind and size."""
    first = d.node.partition(":")[2]
    kind, size = region_graph(d.spec)["kind"], len(region_graph(d.spec)["nodes"])
    return next((r for r in graph.regions if r.nodes and r.nodes[0].name == first and r.kind == kind
                 and len(r.nodes) == size), None)


class _Timed(fx.Interpreter):
    """Runs a bound graph node by node, adding each node's time (``clock``) to ``spent``; on CUDA
    inside a record_function range named after it instead."""

    def __init__(self, gm: fx.GraphModule, graph: str, watched: set[str], spent: dict, clock: Callable[[], float],
                 cuda: bool):
        super().__init__(gm)
        self.graph_name, self.watched, self.spent, self.clock, self.cuda = graph, watched, spent, clock, cuda

    def run_node(self, n: fx.Node) -> Any:
        if n.name not in self.watched:
            return super().run_node(n)
        if self.cuda:
            with torch.profiler.record_function(f"{RANGE}{self.graph_name}|{n.name}"):
                return super().run_node(n)
        started = self.clock()
        try:
            return super().run_node(n)
        finally:
            self.spent[(self.graph_name, n.name)] += self.clock() - started


def _served_times(call: Callable[[], Any], calls: int, cuda: bool, clock: Callable[[], float]
                  ) -> tuple[float, float | None]:
    """(wall seconds, host seconds to issue) of one served call, medians over ``calls``."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    walls, issues = [], []
    for _ in range(calls):
        sync()
        started = clock()
        call()
        issued = clock()
        sync()
        walls.append(clock() - started)
        issues.append(issued - started)
    return statistics.median(walls), (statistics.median(issues) if cuda else None)


def profile_model(compiled: Callable, inputs: Sequence[Any], graphs: Sequence[Any], cuda: bool, calls: int = 3,
                  clock: Callable[[], float] = time.perf_counter) -> Profile:
    """Profile ``calls`` calls of the compiled model on ``inputs`` (it has run once: graphs made,
    first calls done); ``graphs`` are the LoweredGraphs it made. ``clock`` is injected in tests."""
    def call() -> Any:
        with torch.no_grad():
            return compiled(*inputs)

    call()  # warm: a first call's work (reproducer capture) is not profiled
    call_s, host_s = _served_times(call, calls, cuda, clock)
    runs: dict[tuple[str, str], NodeRun] = {}
    regions: list[RegionRun] = []
    for graph, spec in specializations(graphs):
        decisions = {d.node: d for d in spec.decisions}
        for n in spec.gm.graph.nodes:
            r = _classify(n, decisions)
            if r is not None:
                runs[(graph.name, n.name)] = dataclasses.replace(r, graph=graph.name)
        regions += _unfused_regions(graph, spec, {n.name for n in spec.gm.graph.nodes})
    spent: dict[tuple[str, str], float] = collections.defaultdict(float)
    kernels: dict[tuple[str, str], dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    with _running_timed(graphs, {k[1] for k in runs}, spent, clock, cuda):
        if cuda:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    call()
                torch.cuda.synchronize()
            _read_ranges(prof.events(), spent, kernels)
        else:
            samples = _per_call(call, calls, spent)
    for k, r in runs.items():
        # on the host, the median call's time: a busy machine's preemptions hit single calls
        r.seconds = spent.get(k, 0.0) / calls if cuda else statistics.median(samples.get(k, [0.0]))
        if cuda:
            ran = kernels.get(k, {})
            r.launches = ran.get(LAUNCHES, 0.0) / calls
            r.kernels = {name: t / calls for name, t in ran.items() if name != LAUNCHES}
    return Profile("cuda" if cuda else "cpu", calls, call_s, host_s, list(runs.values()), regions)


def _per_call(call: Callable[[], Any], calls: int, spent: dict) -> dict[tuple[str, str], list[float]]:
    """Each node's time in each of ``calls`` calls (what ``spent`` gained in it; 0.0 where the
    node did not run in a call)."""
    samples: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for i in range(calls):
        before = dict(spent)
        call()
        for k, v in spent.items():
            samples[k] += [0.0] * (i - len(samples[k])) + [v - before.get(k, 0.0)]
    for k in samples:
        samples[k] += [0.0] * (calls - len(samples[k]))
    return samples


@contextlib.contextmanager
def _running_timed(graphs: Sequence[Any], watched: set[str], spent: dict, clock: Callable[[], float], cuda: bool):
    """Every specialization runs through ``_Timed`` while the block lasts."""
    with contextlib.ExitStack() as stack:
        for graph, s in specializations(graphs):
            stack.enter_context(s.running(_Timed(s.gm, graph.name, watched, spent, clock, cuda).run))
        yield


LAUNCHES = ""  # (the key that counts a range's kernels beside their names)


def _read_ranges(events: Sequence[Any], spent: dict, kernels: dict) -> None:
    """Each node range's device time (s), and the kernels it ran (name -> seconds; LAUNCHES: how
    many), from torch.profiler's events: a range's kernels are those of the launches under it."""
    def walk(ev: Any, into: dict) -> None:
        for k in getattr(ev, "kernels", ()):
            into[k.name] += k.duration * 1e-6   # (microseconds)
            into[LAUNCHES] += 1
        for child in ev.cpu_children:
            walk(child, into)

    for ev in events:
        if ev.name.startswith(RANGE) and ev.device_type == torch.autograd.DeviceType.CPU:
            _, graph, node = ev.name.split("|", 2)
            spent[(graph, node)] += ev.device_time_total * 1e-6
            walk(ev, kernels[(graph, node)])


def capture_inputs(compiled: Callable, inputs: Sequence[Any], graphs: Sequence[Any],
                   wanted: set[tuple[str, str]]) -> dict[tuple[str, str], list[torch.Tensor]]:
    """CPU copies of the tensor inputs of the ``wanted`` (graph, node)s, from one served call."""
    interpreters = []
    with contextlib.ExitStack() as stack:
        for graph, spec in specializations(graphs):
            names = {node for g, node in wanted if g == graph.name}
            if names:
                interp = CapturingInterpreter(spec.gm, names)
                interpreters.append((graph.name, interp))
                stack.enter_context(spec.running(interp.run))
        with torch.no_grad():
            compiled(*inputs)
    return {(g, node): t for g, i in interpreters for node, t in i.captured.items()}
