"""The split plan of a bound graph for CUDA graphs: the stretches that can be captured, and the
host syncs between them that run eagerly.

A CUDA graph replays device work only: a node that reads a device value on the host (``.item()``,
a custom op's ``tolist()``), sizes its output from device data (nonzero), copies between devices,
or runs on the host, cannot be captured (torch raises during capture, or the capture freezes what
the host saw once). ``sync_reason`` says which nodes are such syncs, from the table ``SYNC_OPS``
and a few rules (outputs with data-dependent sizes, tensors on another device, host fallbacks,
custom ops not known to be capture-safe); ``split_plan`` cuts the graph at them, in graph order:
every stretch between two syncs becomes its own function (flat_code.py), to be captured as its
own CUDA graph (cudagraphs.py), and each run of syncs one eagerly run function. A stretch that
would cost at least as many launches replayed (a copy of each input a sync made, then the graph)
as run joins the syncs around it and runs eagerly (``_cheaper_run_eagerly``).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from torch_kernelize.fallbacks import HostFallback
from torch_kernelize.serving.flat_code import flat_function
from torch_kernelize.serving.view_folding import VIEW_OPS, FoldedView

aten = torch.ops.aten

# op (packet) -> why a CUDA graph cannot hold it. Ops that make a size from device data are also
# caught by their outputs' new unbacked sizes (see sync_reason); listing them names the reason.
SYNC_OPS: dict[Any, str] = {
    aten._local_scalar_dense: "reads a device value on the host (.item())",
    aten.item: "reads a device value on the host (.item())",
    aten.is_nonzero: "reads a device value on the host",
    aten.equal: "reads a device value on the host",
    aten.nonzero: "its output size depends on device data",
    aten.masked_select: "its output size depends on device data",
    aten.unique_consecutive: "its output size depends on device data",
    aten.unique_dim: "its output size depends on device data",
    aten._unique2: "its output size depends on device data",
    aten.repeat_interleave: "its output size depends on device data",
    aten.bincount: "its output size depends on device data",
}
# ops that take a list of indices: a boolean one is turned into positions by nonzero (a sync)
MASK_INDEXED = frozenset({aten.index, aten.index_put, aten.index_put_, aten._unsafe_index_put})
# namespaces whose ops launch device work only (unless SYNC_OPS or their tags say otherwise)
CAPTURE_SAFE_NAMESPACES = frozenset({"aten", "prims"})
# custom ops (``namespace::name``) their authors know to be capture-safe; others are syncs
CAPTURE_SAFE_OPS: set[str] = set()


def sync_reason(node: fx.Node, device: torch.device) -> str | None:
    """Why ``node`` cannot be inside a CUDA graph capture on ``device``; None if it can."""
    if node.op not in ("call_function", "call_method"):
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        reason = op_sync_reason(target)
        if reason is not None:
            return reason
        if target.overloadpacket in MASK_INDEXED and _bool_index(node):
            return "a boolean mask index (its positions are found on the host)"
    elif isinstance(target, HostFallback) and device.type != "cpu":
        return "host fallback (copies to the CPU and back)"
    vals = [v for v in pytree.tree_leaves(node.meta.get("val")) if v is not None]
    if _unbacked(vals) - _unbacked(pytree.tree_leaves([a.meta.get("val") for a in node.all_input_nodes])):
        # it makes a size from device data (a node that only uses one, read on the host before,
        # is captured per value of it)
        return "its output size depends on device data"
    # A tensor elsewhere than on the device: work a replay would not redo, or a value (a CPU
    # scalar tensor read by a device op) that the capture would freeze into the graph.
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    devices = {v.device.type for v in vals + ins if isinstance(v, torch.Tensor)}
    if devices - {device.type}:
        return "copies between devices" if device.type in devices else "computes on the CPU"
    return None


def op_sync_reason(op: torch._ops.OpOverload) -> str | None:
    """Why every call of ``op`` cannot be inside a capture (the table, its tags, a custom op not
    known to be capture-safe); None where that depends on the call, or it can."""
    reason = SYNC_OPS.get(op.overloadpacket)
    if reason is not None:
        return reason
    unsafe = getattr(torch._C.Tag, "cudagraph_unsafe", None)
    if unsafe is not None and unsafe in op.tags:
        return "tagged cudagraph_unsafe"
    if op.namespace not in CAPTURE_SAFE_NAMESPACES and op.name().split(".")[0] not in CAPTURE_SAFE_OPS:
        return "custom op not known to be capture-safe (it may read device values on the host)"
    return None


def _bool_index(node: fx.Node) -> bool:
    indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
    return any(isinstance(i, fx.Node) and isinstance(i.meta.get("val"), torch.Tensor)
               and i.meta["val"].dtype in (torch.bool, torch.uint8) for i in pytree.tree_leaves(indices))


def _unbacked(values: list) -> set:
    return {s for v in values if isinstance(v, (torch.Tensor, torch.SymInt, torch.SymBool))
            for s in free_unbacked_symbols(v)}


def launches(node: fx.Node) -> bool:
    """Whether ``node`` runs device work (a view, a tuple's piece or a graph attribute does not)."""
    if node.op != "call_function":
        return node.op == "call_method"
    target = node.target
    if target is operator.getitem or target in VIEW_OPS or isinstance(target, FoldedView):
        return False
    if isinstance(target, torch._ops.OpOverload):  # (size checks and asserts make no tensor)
        val = node.meta.get("val")
        return val is None or any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(val))
    return getattr(target, "__module__", None) not in ("_operator", "operator", "math", "builtins")


def launch_count(node: fx.Node) -> int:
    """How many kernels ``node`` launches: a cached program's launches and vendor steps (a whole
    graph's program, Inductor's, has a hundred), one for any other node that ``launches``."""
    if not launches(node):
        return 0
    program = getattr(getattr(node.target, "runner", None), "program", None)
    return max(1, len(program.launches) + len(program.steps)) if program is not None else 1


@dataclasses.dataclass
class Segment:
    """A stretch (captured) or a run of syncs (eager): its function of ``inputs`` (value slots)
    returning a tuple for ``outputs`` (slots)."""
    index: int
    eager: bool
    nodes: list[fx.Node]
    inputs: list[int] = dataclasses.field(default_factory=list)
    outputs: list[int] = dataclasses.field(default_factory=list)
    fn: Callable[..., tuple] | None = None
    syncs: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (op, reason) of its syncs
    mutated: list[int] = dataclasses.field(default_factory=list)  # positions of the inputs it writes


@dataclasses.dataclass
class SplitPlan:
    segments: list[Segment]
    n_inputs: int
    n_slots: int
    out_leaves: list[Any]  # a slot index (int) for a graph value, else a constant wrapped in a 1-tuple
    out_spec: Any

    @property
    def stretches(self) -> list[Segment]:
        return [s for s in self.segments if not s.eager]

    @property
    def syncs(self) -> list[tuple[str, str]]:
        return [x for s in self.segments for x in s.syncs]

    def output(self, env: list) -> Any:
        return pytree.tree_unflatten([env[x] if type(x) is int else x[0] for x in self.out_leaves], self.out_spec)


def split_plan(gm: fx.GraphModule, device: torch.device) -> SplitPlan:
    """Cut the bound graph ``gm`` at its syncs (``sync_reason``), in graph order. Nodes that launch
    nothing join the segment they follow; a stretch that would launch nothing runs eagerly."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    groups: list[tuple[bool, list[fx.Node], list[tuple[str, str]]]] = []
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        reason = sync_reason(n, device)
        eager = reason is not None or (not launches(n) and bool(groups) and groups[-1][0])
        if not groups or groups[-1][0] != eager:
            groups.append((eager, [], []))
        groups[-1][1].append(n)
        if reason is not None:
            groups[-1][2].append((_op_name(n), reason))
    merged = _merged([(eager or not any(launches(n) for n in members), members, syncs)
                      for eager, members, syncs in groups])
    merged = _merged(_cheaper_run_eagerly(merged))
    slot = {n: i for i, n in enumerate(placeholders)}
    segments = []
    for i, (eager, members, syncs) in enumerate(merged):
        seg = Segment(i, eager, members, syncs=syncs)
        for n in members:
            slot[n] = len(slot)
        segments.append(seg)
    for seg in segments:
        _close(gm, seg, slot)
    leaves, spec = pytree.tree_flatten(nodes[-1].args[0])
    out_leaves = [slot[x] if isinstance(x, fx.Node) else (x,) for x in leaves]
    return SplitPlan(segments, len(placeholders), len(slot), out_leaves, spec)


def _merged(groups: list[tuple[bool, list[fx.Node], list]]) -> list[tuple[bool, list[fx.Node], list]]:
    """Adjacent eager groups as one."""
    merged: list[tuple[bool, list[fx.Node], list]] = []
    for eager, members, syncs in groups:
        if merged and merged[-1][0] and eager:
            merged[-1][1].extend(members)
            merged[-1][2].extend(syncs)
        else:
            merged.append((eager, list(members), list(syncs)))
    return merged


def _cheaper_run_eagerly(groups: list[tuple[bool, list[fx.Node], list]]) -> list[tuple[bool, list[fx.Node], list]]:
    """Each stretch that costs at least as many launches replayed as run: it runs eagerly.

    A replay copies each input an eager segment made (a new tensor every call) into the captured
    buffer, then launches the graph: 1 + those copies. Run eagerly, the stretch launches its own
    kernels, and each of its outputs that a later stretch reads becomes such a copy there. Where
    the first is no cheaper, the stretch runs eagerly: no more launches, and the copies' bytes are
    saved (Mixtral's SiLU-and-multiply between its two expert matmuls, one fused kernel, took a
    184 MB copy of the gate/up output per layer on the H200). Stretches that take nothing from an
    eager segment are kept (a graph without syncs stays one CUDA graph)."""
    owner = {n: i for i, (_, members, _) in enumerate(groups) for n in members}
    out = [[eager, members, syncs] for eager, members, syncs in groups]
    for i, (eager, members, _) in enumerate(out):
        if eager:
            continue
        inside = set(members)
        copied = len({a for n in members for a in n.all_input_nodes  # (a scalar a sync read is no copy)
                      if a not in inside and a in owner and out[owner[a]][0]
                      and isinstance(a.meta.get("val"), torch.Tensor)})
        if not copied:
            continue
        read_later = {(n, owner[u]) for n in members for u in n.users
                      if u in owner and owner[u] > i and not out[owner[u]][0]}
        if sum(map(launch_count, members)) + len(read_later) <= 1 + copied:
            out[i][0] = True
    return [(eager, members, syncs) for eager, members, syncs in out]


def _close(gm: fx.GraphModule, seg: Segment, slot: dict[fx.Node, int]) -> None:
    """Give ``seg`` its inputs, outputs and function (a graph of its own nodes, as flat code), and
    the inputs it writes to (per the ops' schemas: a replay copies them back)."""
    inside = set(seg.nodes)
    ins = list(dict.fromkeys(a for n in seg.nodes for a in n.all_input_nodes if a not in inside))
    outs = [n for n in seg.nodes if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env = {a: graph.placeholder(f"in_{a.name}") for a in ins}
    for a, p in env.items():
        p.meta.update(a.meta)
    for n in seg.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outs))
    sub = fx.GraphModule(gm, graph)
    seg.inputs = [slot[a] for a in ins]
    seg.outputs = [slot[n] for n in outs]
    seg.fn = flat_function(sub)
    seg.mutated = mutated_inputs(sub)


def mutated_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of the graph's inputs that an op writes to (per the ops' schemas)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        arguments = n.target._schema.arguments
        named = {a.name: a for a in arguments}
        for arg, value in [*zip(arguments, n.args), *((named.get(k), v) for k, v in n.kwargs.items())]:
            if arg is not None and arg.alias_info is not None and arg.alias_info.is_write:
                # (a Tensor(a!)[] argument, as the _foreach_ ops take, is a list of them)
                written.update(placeholders[v] for v in pytree.tree_leaves(value) if v in placeholders)
    return sorted(written)


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "name", None) or getattr(target, "__name__", None) or str(target)
