"""One trace per distinct node: a graph's identical nodes share their decomposition's trace.

Planning for a chip that lacks most ops traces the decomposition of nearly every node
(decompositions.trace_decomposition: make_fx, milliseconds each), and a model's layers repeat the
same nodes: same op, same argument sizes, strides and constants. The trace depends on nothing
else, so within one graph (one fake mode, one set of size symbols) it is made once per key and
spliced wherever the key recurs; a decomposition that declines is declined once too.

The key holds everything the trace reads: the op, the arguments' structure, each constant, each
tensor argument's size, strides, offset, dtype and device, which arguments are the same node
(``mul(x, x)`` traces one input), the layout of the node's own outputs (``keep_layout`` copies
into it) and which of a tuple's outputs the graph reads. A node whose arguments hold anything
else (a tensor that carries a constant's values, an object without a plain value) is traced on
its own, every time.

The nodes of each splice after the first get value objects of their own (``spliced``):
make_fx binds a traced input by its tensor object, so two nodes spliced from one trace, holding
the trace's ``meta["val"]`` objects, would become one input of any later trace they both feed.
"""
from __future__ import annotations

import contextlib
from typing import Any, Hashable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.decompositions import NotDecomposable, trace_decomposition, used_outputs

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class _Opaque(Exception):
    """Something in the node the key cannot describe: trace it without the memo."""


def _value_key(v: Any) -> Hashable:
    if isinstance(v, _SYMBOLIC):  # one graph, one shape environment: the expression names it
        return type(v).__name__, str(v)
    if isinstance(v, _PLAIN):
        return type(v).__name__, v
    if isinstance(v, torch.Tensor):
        if getattr(v, "constant", None) is not None or v.layout is not torch.strided:
            raise _Opaque  # a fake tensor with real values a trace may read; a sparse one
        return ("tensor", tuple(map(_value_key, v.shape)), tuple(map(_value_key, v.stride())),
                _value_key(v.storage_offset()), v.dtype, v.device, v.requires_grad)
    if isinstance(v, (tuple, list)):
        return type(v).__name__, tuple(map(_value_key, v))
    raise _Opaque


def decomposition_key(node: fx.Node) -> Hashable | None:
    """What ``trace_decomposition(node)`` depends on, as a key; None if it cannot be told."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    first: dict[fx.Node, int] = {}
    try:
        leaves = tuple(("node", first.setdefault(a, i), _value_key(a.meta.get("val")))
                       if isinstance(a, fx.Node) else _value_key(a) for i, a in enumerate(flat))
        out = _value_key(node.meta.get("val"))
    except _Opaque:
        return None
    used = used_outputs(node)
    return node.target, str(spec), leaves, out, None if used is None else frozenset(used)


class DecompositionMemo:
    """``trace(node)``: trace_decomposition's result for ``node``, made once per key (one graph);
    ``spliced(sub, nodes)`` after each splice of it."""

    def __init__(self) -> None:
        self._traces: dict[Hashable, fx.GraphModule | NotDecomposable] = {}
        self._splices: dict[int, int] = {}  # a kept trace's id -> how often it was spliced

    def trace(self, node: fx.Node) -> fx.GraphModule:
        key = decomposition_key(node)
        if key is None:
            return trace_decomposition(node)
        if key not in self._traces:
            try:
                self._traces[key] = trace_decomposition(node)
                self._splices[id(self._traces[key])] = 0
            except NotDecomposable as e:
                self._traces[key] = e
        got = self._traces[key]
        if isinstance(got, NotDecomposable):
            raise NotDecomposable(str(got))
        return got

    def spliced(self, sub: fx.GraphModule, nodes: list[fx.Node]) -> None:
        """``nodes`` were spliced from ``sub``: after its first splice, they get values of their own."""
        before = self._splices.get(id(sub))
        if before is None:  # a trace of its own
            return
        self._splices[id(sub)] = before + 1
        if before == 0:
            return
        vals = [n.meta["val"] for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        fake_mode = detect_fake_mode(vals)
        for n in nodes:
            if "val" in n.meta:
                n.meta["val"] = pytree.tree_map_only(torch.Tensor, lambda t: _like(t, fake_mode), n.meta["val"])


def _like(t: torch.Tensor, fake_mode: Any) -> torch.Tensor:
    """A tensor of ``t``'s size, strides, offset, dtype, device and storage size (no values)."""
    if t.layout is not torch.strided:  # (no storage to copy the shape of; not met in a decomposition)
        return t
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        storage = torch.empty_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,),
                                      dtype=t.dtype, device=t.device)
        new = storage.as_strided(t.shape, t.stride(), t.storage_offset())
    if t.requires_grad:
        new.requires_grad_(True)
    if getattr(t, "constant", None) is not None:
        new.constant = t.constant
    return new
