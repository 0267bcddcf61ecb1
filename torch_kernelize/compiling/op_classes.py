"""What kind of node is this? Classes of FX nodes that the planner treats differently.

- structural: not an ATen computation (getitem, SymInt arithmetic, sym_size, asserts); runs as is
  and is not counted in coverage.
- passthrough: ops the backend must not touch (collectives and their waits, other namespaces'
  ops): they run exactly as given, on the vendor tier, and are never kernels. An op of another
  namespace that a kernel family implements (``FAMILY_OPS``) is compute instead: a cached kernel
  may serve it, and otherwise it runs as given (its vendor rung, on any target).
- view: ops that only make a new view of a tensor's storage, allocations (an op whose outputs
  are all empty is one), and the write-back of an input mutation (a same-dtype, same-shape
  ``copy_``): no compute, nothing to generate.
- mutating: ATen ops that write to an argument (``_native_batch_norm_legit``'s running stats).
  They compute, so the ladder decides them against the chip's op list like any compute node
  (decomposition, vendor, host fallback with its writes kept), but they never take a kernel.
- compute: everything else. These are the nodes the tier ladder decides.
"""
from __future__ import annotations

import enum
import operator
from typing import Any

import torch
import torch.fx as fx

from torch_kernelize.core.targets import REGISTERED_BY, op_name

aten = torch.ops.aten


class NodeClass(enum.Enum):
    STRUCTURAL = "structural"
    PASSTHROUGH = "passthrough"
    VIEW = "view"
    MUTATING = "mutating"
    COMPUTE = "compute"


_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"}
_STRUCTURAL_ATEN = {
    aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
    aten._assert_async.msg, aten._assert_scalar.default, aten._local_scalar_dense.default,
}
# Ops that return a fresh tensor but are still just a reinterpretation of the same data.
_VIEW_LIKE = {aten._unsafe_view.default, aten.view.dtype, aten.lift_fresh_copy.default}
# Factory ops create a tensor from nothing but sizes and a value; the vendor fills memory.
_FACTORY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_permuted.default, aten.full.default,
            aten.zeros.default, aten.ones.default, aten.scalar_tensor.default, aten.arange.start_step,
            aten.arange.default, aten.arange.start, aten.empty_like.default, aten.full_like.default,
            aten.zeros_like.default, aten.ones_like.default, aten.new_empty.default, aten.new_zeros.default,
            aten.new_full.default}


# Ops of other namespaces whose semantics a kernel family implements (lowering/kernels/): the
# family's module documents the op it repeats (transformers' MoE experts: grouped_mm.py), and
# core/targets.REGISTERED_BY names the module that registers each.
FAMILY_OPS = frozenset(REGISTERED_BY)


def runs_as_given(target: Any) -> bool:
    """An op of another namespace than ATen's and prims': the vendor rung runs it as it is called,
    whatever the chip's op list says (its own code decides where it runs)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims")


def classify(node: fx.Node) -> tuple[NodeClass, str]:
    """The class of a call_function node and a short reason for it."""
    target = node.target
    if target is operator.getitem or not isinstance(target, torch._ops.OpOverload):
        return NodeClass.STRUCTURAL, "not an ATen op"
    if target in _STRUCTURAL_ATEN:
        return NodeClass.STRUCTURAL, "shape/assert bookkeeping"
    if target.namespace in _COLLECTIVE_NAMESPACES:
        return NodeClass.PASSTHROUGH, "collective: passed through untouched"
    if target.namespace != "aten":
        if op_name(target) in FAMILY_OPS:
            return NodeClass.COMPUTE, ""
        return NodeClass.PASSTHROUGH, f"{target.namespace} op: passed through untouched"
    if target.is_view or target in _VIEW_LIKE:
        return NodeClass.VIEW, "view op: no data to compute"
    if target in _FACTORY:
        return NodeClass.VIEW, "factory op: fills new memory, nothing to generate"
    if target._schema.is_mutable:
        if target is aten.copy_.default and _is_write_back(node):
            return NodeClass.VIEW, "write-back of an input mutation: a memory copy, no compute"
        return NodeClass.MUTATING, "mutating op: decided by the ladder, never a kernel"
    if _only_empty_outputs(node):
        return NodeClass.VIEW, "empty output: an allocation, nothing to compute"
    return NodeClass.COMPUTE, ""


def _only_empty_outputs(node: fx.Node) -> bool:
    """Every output of the node has no elements (sizes known at trace time): nothing to compute."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    return bool(tensors) and len(tensors) == len(vals) and all(
        isinstance(t.numel(), int) and t.numel() == 0 for t in tensors)


def _is_write_back(node: fx.Node) -> bool:
    """A ``copy_`` that only moves bytes: source and destination of one dtype and shape (the
    write-back functionalization keeps for a mutated graph input); a conversion or a broadcast
    computes."""
    dst, src = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[:2])
    return (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.dtype == src.dtype
            and dst.shape == src.shape)


def ladder_decides(klass: NodeClass) -> bool:
    """Whether the tier ladder decides nodes of this class (the chip's op list is consulted)."""
    return klass in (NodeClass.COMPUTE, NodeClass.MUTATING)


def is_view_op(target: Any) -> bool:
    """Ops that only view their input's storage (not allocations, empty outputs or write-backs)."""
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _VIEW_LIKE)


def is_factory(target: Any) -> bool:
    """Ops that fill new memory from sizes and a value (some take a tensor only for its metadata)."""
    return target in _FACTORY


def is_random(target: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Ops that draw random numbers (dropout, attention with dropout): never replaced by a
    cached kernel, whose stream of random numbers could not match. An op whose only randomness
    is a ``dropout_p`` argument (the attention ops, tagged seeded as a whole) draws nothing when
    ``args``/``kwargs`` give it dropout_p == 0."""
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    schema = target._schema.arguments
    names = [a.name for a in schema]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    if kwargs and "dropout_p" in kwargs:
        p = kwargs["dropout_p"]
    elif i < len(args) and not schema[i].kwarg_only:
        p = args[i]
    else:
        p = schema[i].default_value if schema[i].has_default_value() else None
    return not (isinstance(p, (int, float)) and p == 0)


# Ops that pick positions by comparing values: op -> which output holds the picked indices
# (None: the op's one output). On floating inputs, a rounding difference decides a near-tie
# otherwise (an MoE router's top-k experts), and every later result that the picked indices
# route moves with it (the stable sort of the expert ids): float64 cannot judge a program
# across such an op, so whole-graph programs end before it (whole_graph.py).
_PICKS_POSITIONS = {
    aten.topk.default: 1, aten.sort.default: 1, aten.sort.stable: 1, aten.kthvalue.default: 1,
    aten.max.dim: 1, aten.min.dim: 1, aten.median.dim: 1, aten.nanmedian.dim: 1, aten.mode.default: 1,
    aten.max_pool2d_with_indices.default: 1, aten.max_pool3d_with_indices.default: 1,
    aten.adaptive_max_pool2d.default: 1, aten.adaptive_max_pool3d.default: 1,
    aten.argmax.default: None, aten.argmin.default: None, aten.argsort.default: None, aten.argsort.stable: None,
    aten.searchsorted.Tensor: None, aten.bucketize.Tensor: None,
}


def picks_by_rounded_floats(node: fx.Node) -> bool:
    """``node`` picks positions by comparing floating values, and the picked indices are used
    (a max-pool whose indices nothing reads picks nothing: ResNet stays one graph)."""
    if node.op != "call_function" or node.target not in _PICKS_POSITIONS:
        return False
    compared = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if not (isinstance(compared, torch.Tensor) and compared.dtype.is_floating_point):
        return False
    at = _PICKS_POSITIONS[node.target]
    if at is None:
        return bool(node.users)
    return any(u.target is operator.getitem and u.args[1] == at and u.users for u in node.users)


def is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and classify(node)[0] is NodeClass.COMPUTE


def counts_in_coverage(node: fx.Node) -> bool:
    return node.op == "call_function" and classify(node)[0] is not NodeClass.STRUCTURAL


def describe_target(target: Any) -> str:
    from torch_kernelize.core.targets import op_name
    return op_name(target)
