"""The cheapest Python entry to an ATen op overload that runs that very overload.

``torch.ops.aten.add.Tensor(x, y)`` costs, on top of the kernel, two attribute lookups, a Python
frame (``OpOverload.__call__``) and argument parsing against the schema; eager's ``torch.add(x, y)``
takes the generated C++ binding (PythonArgParser) straight to the dispatcher, ~0.6 us less per op
on a CPU host. The generated code of a specialization (flat_code.py) calls the binding chosen here.

A public binding (``torch.<name>``, ``Tensor.<name>``, ``torch._C._nn.<name>``, ...) picks its
overload by the Python types of its arguments, so it is used only where it dispatches the node's
own overload with the same arguments: checked once per (overload, argument types) by running both
on meta tensors of the node's layouts under a dispatch mode that records what reaches the
dispatcher. Otherwise the overload's ``_op`` (what ``OpOverload.__call__`` calls) is used.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("torch_kernelize.serving.runtime")

# Where aten's public Python bindings live (attributes of torch._C), most common first; Tensor
# methods (TensorBase) are tried after these.
_PLACES = {n: getattr(torch._C, n) for n in ("_VariableFunctions", "_nn", "_special", "_linalg", "_fft", "TensorBase")
           if hasattr(torch._C, n)}
_NAMESPACES = tuple(v for k, v in _PLACES.items() if k != "TensorBase")

_chosen: dict[tuple, Callable] = {}
_lock = threading.Lock()


def convert_element_type(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``prims.convert_element_type`` as ATen's ``_to_copy``: the same new tensor (``empty_like``'s
    layout, the values cast). The prim runs a Python implementation, ~50 us a call on a CPU host;
    dynamic graphs have it around every tensorified Python float (an RMSNorm's epsilon, a rotary
    scale: 14 calls a call of the MoE trace's decoder)."""
    return _TO_COPY(a, dtype=dtype)


_TO_COPY = torch.ops.aten._to_copy.default._op
# prims the trace leaves in a graph -> an ATen call computing the same (test_flat_code checks each)
PRIM_EQUIVALENTS: dict[Any, Callable] = {torch.ops.prims.convert_element_type.default: convert_element_type}


def fast_binding(op: Any, args: tuple, kwargs: dict) -> Any:
    """What the generated code calls for ``op`` on a node with these arguments (fx.Nodes among
    them, with a traced ``val``): a public binding checked to dispatch ``op`` itself, a prim's
    ATen equivalent, else ``op._op``; anything that is not a plain OpOverload is returned as it is."""
    if type(op) is not torch._ops.OpOverload:
        return op
    if op in PRIM_EQUIVALENTS and not kwargs:
        return PRIM_EQUIVALENTS[op]
    key = _signature(op, args, kwargs)
    if key is None:
        return op._op
    hit = _chosen.get(key)
    if hit is None:
        found = _verified(op, args, kwargs)
        with _lock:
            hit = _chosen.setdefault(key, found)
    return hit


class _Unchecked(Exception):
    """An argument whose traced value is no tensor of static layout: no binding is checked."""


def binding_name(fn: Any) -> str | None:
    """``"place.name"`` of a public binding (what the executable cache stores), else None."""
    name = getattr(fn, "__name__", None)
    for place, where in _PLACES.items():
        if name and getattr(where, name, None) == fn:
            return f"{place}.{name}"
    return None


def binding_by_name(text: str) -> Callable | None:
    """The public binding ``binding_name`` named; None for a name that names none."""
    place, _, name = text.partition(".")
    fn = getattr(_PLACES.get(place), name, None) if place in _PLACES and name.isidentifier() else None
    return fn if callable(fn) and binding_name(fn) == text else None


def _kind(a: Any) -> Any:
    """What a Python binding's overload resolution sees of an argument: its type."""
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or not _static(val):
            raise _Unchecked
        return torch.Tensor
    if isinstance(a, (list, tuple)):
        return type(a), tuple(_kind(x) for x in a)
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Unchecked
    return type(a)


def _static(val: torch.Tensor) -> bool:
    try:
        return all(type(s) is int for s in (*val.shape, *val.stride()))
    except Exception:  # sparse, nested or opaque
        return False


def _signature(op: Any, args: tuple, kwargs: dict) -> tuple | None:
    try:
        return op, tuple(_kind(a) for a in args), tuple((k, _kind(v)) for k, v in sorted(kwargs.items()))
    except _Unchecked:
        return None


def _candidates(op: Any, first_is_tensor: bool) -> list[Callable]:
    if op.namespace != "aten":
        return []
    name = op._schema.name.split("::", 1)[1]
    found = [getattr(ns, name) for ns in _NAMESPACES if callable(getattr(ns, name, None))]
    method = getattr(torch._C.TensorBase, name, None)
    if first_is_tensor and method is not None and type(method).__name__ == "method_descriptor":
        found.append(method)
    return found


class _Recorder(TorchDispatchMode):
    """Records each (op, args, kwargs) that reaches the dispatcher's Python key."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _meta(a: Any) -> Any:
    """An argument as the check runs it: tensors (and devices, so that factories allocate
    nothing) on the meta device."""
    if isinstance(a, fx.Node):
        val = a.meta["val"]
        return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
    if isinstance(a, torch.device):
        return torch.device("meta")
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(x) for x in a) if not hasattr(a, "_fields") else a
    return a


def _same(x: Any, y: Any, inputs: set[int]) -> bool:
    """Whether two recorded arguments (or results) are the same: an input tensor must be the very
    same object; a tensor made along the way (a wrapped Python number) must agree in layout and value."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return False
        if id(x) in inputs or id(y) in inputs:
            return x is y
        if (x.shape, x.stride(), x.dtype, x.device) != (y.shape, y.stride(), y.dtype, y.device):
            return False
        return x.device.type == "meta" or bool((x == y).all())
    if isinstance(x, (list, tuple)) or isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(a, b, inputs) for a, b in zip(x, y))
    if isinstance(x, dict) or isinstance(y, dict):
        return type(x) is type(y) and x.keys() == y.keys() and all(_same(x[k], y[k], inputs) for k in x)
    return type(x) is type(y) and x == y


def _verified(op: Any, args: tuple, kwargs: dict) -> Callable:
    """The first candidate binding that dispatches exactly what ``op`` does, else ``op._op``."""
    try:
        with unset_fake_temporarily():  # plain meta tensors, outside the graph's fake mode
            margs, mkwargs = _meta(args), {k: _meta(v) for k, v in kwargs.items()}
            leaves = torch.utils._pytree.tree_leaves((margs, mkwargs))
            inputs = {id(t) for t in leaves if isinstance(t, torch.Tensor)}
            candidates = _candidates(op, bool(margs) and isinstance(margs[0], torch.Tensor))
            if not candidates or not any(isinstance(t, (torch.Tensor, torch.device)) for t in leaves):
                return op._op  # (a factory without a device would allocate on the CPU for real)
            with _Recorder() as want:
                want_out = op._op(*margs, **mkwargs)
            for fn in candidates:
                try:
                    with _Recorder() as got:
                        got_out = fn(*margs, **mkwargs)
                except Exception:  # e.g. the binding takes these arguments otherwise
                    continue
                if len(got.calls) == len(want.calls) and all(
                        g[0] is w[0] and _same(g[1], w[1], inputs) and _same(g[2], w[2], inputs)
                        for g, w in zip(got.calls, want.calls)) and _same_result(got_out, want_out):
                    return fn
    except Exception as e:  # no meta kernel, or an argument meta tensors cannot stand for
        log.debug("no binding checked for %s: %s: %s", op, type(e).__name__, e)
    return op._op


def _same_result(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same_result(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and (x == y if not isinstance(x, torch.Tensor) else True)
