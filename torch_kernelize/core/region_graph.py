"""A fused region's graph as a KernelSpec holds it (``spec.graph``, canonical JSON of its nodes):
decoded to run it with ATen (the vendor run and the float64 reference), to an FX graph (for
reproducers), and to a one-line description. ``spec`` is a region KernelSpec throughout (not
imported: the spec imports this module). Forming regions and encoding them is
compiling/regions.py."""
from __future__ import annotations

import collections
import json
import operator
import types
from typing import Any, Sequence

import torch
import torch.fx as fx

from torch_kernelize.core.float64_references import float64_reference
from torch_kernelize.core.encoding import decode_arg
from torch_kernelize.core.targets import resolve_op

aten = torch.ops.aten


def region_graph(spec: Any) -> dict[str, Any]:
    return json.loads(spec.graph)


def spec_ops(spec: Any) -> list[str]:
    """The ATen ops a spec computes: its op, or every node's op of a fused region."""
    if spec.graph is None:
        return [spec.op]
    return [n["op"] for n in region_graph(spec)["nodes"] if n["op"] != GETITEM]


GETITEM = "getitem"   # a piece of a tuple-valued node: {"op": "getitem", "args": [{"node": j}, i]}


def _node_target(name: str) -> Any:
    return operator.getitem if name == GETITEM else resolve_op(name)


def _replayable(target: Any, args: list, kwargs: dict) -> tuple[list, dict]:
    """Arguments with which ATen replays a traced node on the reference's inputs: float64 (and on
    the CPU) has no half-to-float softmax, whose result is then the float64 softmax itself."""
    if target in (aten._softmax.default, aten._log_softmax.default) and len(args) > 2 and args[2]:
        x = args[0]
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return [x, args[1], False], kwargs
    return args, kwargs


def _in_layout(t: Any, meta: Any) -> Any:
    """``t`` with the traced strides of its output (the layout contract of every tier)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(meta.shape) or t.numel() <= 1:
        return t
    if all(st == ms for st, ms, sz in zip(t.stride(), meta.stride, t.shape) if sz != 1):
        return t
    return torch.empty_strided(t.shape, meta.stride, dtype=t.dtype, device=t.device).copy_(t)


def laid_out_as_traced(value: Any, meta: Any) -> Any:
    """A written-out reference's result with the strides the traced op gave (``meta``: a node's
    TensorMeta JSON, or a list of them per piece): CUDA's attention returns its output in the
    query's memory order, and a graph views it as only that layout allows."""
    if isinstance(value, (tuple, list)) and isinstance(meta, list):
        return type(value)(laid_out_as_traced(v, m) for v, m in zip(value, meta)) if len(value) == len(meta) \
            else value
    if isinstance(value, torch.Tensor) and isinstance(meta, dict):
        return _in_layout(value, types.SimpleNamespace(shape=meta["shape"], stride=meta["stride"]))
    return value


def _float64(v: Any) -> Any:
    """The reference's value of a node: a floating tensor in float64 (after the rounding that the
    node's own dtype, e.g. an explicit cast to fp16, makes)."""
    if isinstance(v, (tuple, list)):
        return type(v)(_float64(x) for x in v)
    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def run_region_graph(spec: Any, tensors: Sequence[torch.Tensor], reference: bool = False) -> list[torch.Tensor]:
    """Run a region's nodes one by one with ATen on the tensors' device (vendor and reference);
    the outputs come in the spec's (the traced) strides. ``reference``: the tensors are the
    float64 reference's, and every floating value stays float64 (casts round, then widen again)."""
    graph = region_graph(spec)
    values: list[Any] = []
    device = tensors[0].device.type if tensors else None
    # an intermediate goes once its last reader has run: a float64 reference of a region over a
    # 1 GB fp16 tensor holds 4 GB per node otherwise
    last = {i: j for j, n in enumerate(graph["nodes"]) for i in _node_refs([n["args"], list(n["kwargs"].values())])}
    keep = set(graph["outputs"])
    for j, n in enumerate(graph["nodes"]):
        target = _node_target(n["op"])
        args, kwargs = _replayable(target, [_decoded(a, tensors, values, device) for a in n["args"]],
                                   {k: _decoded(v, tensors, values, device) for k, v in n["kwargs"].items()})
        # (CUDA's fused attention, aten._grouped_mm run no float64: float64_references.py)
        written_out = reference and float64_reference(target, args)
        value = written_out(*args, **kwargs) if written_out else target(*args, **kwargs)
        if written_out:  # in the layout the op itself gives: the nodes after it may view it so
            value = laid_out_as_traced(value, n["meta"])
        values.append(_float64(value) if reference else value)
        del args, kwargs, value
        for i in _node_refs([n["args"], list(n["kwargs"].values())]):
            if last[i] == j and i not in keep:
                values[i] = None
    return [_in_layout(values[i], m) for i, m in zip(graph["outputs"], spec.outputs)]


def node_ref(a: Any) -> tuple[str, int] | None:
    """What an encoded node argument names: ("input", i) for region input i, ("node", j) for the
    value of node j; None for a constant (or a list). The one decoder of the graph format above."""
    if isinstance(a, dict) and len(a) == 1:
        (kind, value), = a.items()
        if kind in ("input", "node"):
            return kind, int(value)
    return None


def node_arg(a: Any) -> Any:
    """A KernelSpec's encoded argument ({"tensor": i} for spec input i) as a node argument of
    this format ({"input": i}): a single op read as a one-node region."""
    if isinstance(a, dict) and set(a) == {"tensor"}:
        return {"input": a["tensor"]}
    return [node_arg(x) for x in a] if isinstance(a, list) else a


def _decoded(a: Any, tensors: Sequence[torch.Tensor], values: list[Any], device: str | None) -> Any:
    """An encoded node argument: a region input, an earlier node's value, or a constant.

    A module function, not a closure: a recursive closure is a reference cycle, which held the
    inputs and every value of each run until Python's cycle collector came by (on an H200, 108 GB
    of a region's trials at once).
    """
    if r := node_ref(a):
        return tensors[r[1]] if r[0] == "input" else values[r[1]]
    if isinstance(a, list):
        return [_decoded(x, tensors, values, device) for x in a]
    return decode_arg(a, tensors, device)


def _node_refs(a: Any) -> set[int]:
    """The nodes an encoded argument reads."""
    if (r := node_ref(a)) and r[0] == "node":
        return {r[1]}
    if isinstance(a, dict):
        return set().union(*(_node_refs(v) for v in a.values()))
    if isinstance(a, (list, tuple)):
        return set().union(*(_node_refs(v) for v in a))
    return set()


def region_graph_module(spec: Any) -> fx.GraphModule:
    """The region as a readable FX graph (placeholders in spec input order), for repros."""
    graph = region_graph(spec)
    g = fx.Graph()
    phs = [g.placeholder(f"arg{i}") for i in range(len(spec.inputs))]
    values: list[fx.Node] = []

    def dec(a: Any) -> Any:
        if r := node_ref(a):
            return phs[r[1]] if r[0] == "input" else values[r[1]]
        if isinstance(a, list):
            return [dec(x) for x in a]
        return decode_arg(a, [])

    for n in graph["nodes"]:
        values.append(g.call_function(_node_target(n["op"]), tuple(dec(a) for a in n["args"]),
                                      {k: dec(v) for k, v in n["kwargs"].items()}))
    outs = [values[i] for i in graph["outputs"]]
    g.output(tuple(outs) if spec.tuple_output else (outs[0],))
    return fx.GraphModule(torch.nn.Module(), g)


DESCRIBED_OPS = 12   # a longer region is described by its op counts


def describe_region(spec: Any) -> str:
    graph = region_graph(spec)
    members = graph.get("members")
    ops = [graph["nodes"][j]["op"].split(".")[1] for j in (members[0] if members else range(len(graph["nodes"])))
           if graph["nodes"][j]["op"] != GETITEM]
    group = f" of {len(members)} GEMMs, each" if members else ""
    if len(ops) > DESCRIBED_OPS:
        counts = collections.Counter(ops)
        ops = [f"{op}x{c}" if c > 1 else op for op, c in counts.most_common()]
    return f"{graph['kind']} region{group} [{' '.join(ops)}]"
