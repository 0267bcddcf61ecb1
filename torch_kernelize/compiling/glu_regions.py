"""Gated experts: an MoE layer's gate/up grouped GEMM and the gated activation after it, as one region.

transformers' experts compute ``grouped_mm(x, gate_up, offs) -> chunk(2) -> act(gate) * up`` (and,
in some versions, zero the rows of no expert first: ``where(mask, 0, .)``). Served node by node,
the [S, 2I] product is stored, read back by a pointwise kernel and stored again at [S, I]: for
Mixtral's suite layers 184 MB each way per layer, with the pointwise kernel at its memory floor.
A region of kind ``grouped_mm_glu`` holds the GEMM, the pointwise nodes on its product before the
split, the split, and the pointwise nodes after it up to one output; the grouped_mm_glu family
(lowering/kernels/grouped_mm_glu.py) computes the gate and up tiles of an output tile together
and stores only the result. Its vendor path is the same nodes run by ATen (core/region_graph.py),
so a miss or "vendor wins" leaves them to the regions and stretches that would take them anyway.

The activation is not matched against a table: any pointwise nodes of [S, I] values that read
the two halves (and values from outside the region) qualify, and the family says which it
generates. Tried before every other region (compiling/lower.py): its nodes are also a stretch's.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torch_kernelize.compiling.regions import (MAX_REGION_NODES, Region, _same_shape, _val, is_tensor_node,
                                               pointwise_ops, reads_from, tensor_args)
from torch_kernelize.core.targets import op_name

aten = torch.ops.aten

KIND = "grouped_mm_glu"
# the grouped GEMMs whose product may be split into gate and up (input, weight, offs first)
GROUPED_MM_OPS = frozenset({"transformers.grouped_mm_fallback.default"})
SPLITS = {aten.split_with_sizes.default, aten.split.Tensor}


def find_glu_regions(gm: fx.GraphModule) -> list[Region]:
    """The gated-experts regions of ``gm``, in graph order."""
    pointwise = pointwise_ops()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = (glu_region(n, pointwise, order) for n in gm.graph.nodes
             if n.op == "call_function" and op_name(n.target) in GROUPED_MM_OPS)
    return [r for r in found if r is not None]


def _pointwise_on(node: fx.Node, like: torch.Tensor, pointwise: frozenset[str]) -> bool:
    v = _val(node)
    return (node.op == "call_function" and op_name(node.target) in pointwise
            and isinstance(v, torch.Tensor) and _same_shape(v, like))


def _halves(split: fx.Node, width: int) -> tuple[fx.Node, fx.Node] | None:
    """The split's two pieces (gate, up) where it cuts the last dim of ``width`` into equal halves."""
    x = _val(split.args[0])
    sizes = split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (-1, x.dim() - 1) or width % 2:
        return None
    if not (sizes == [width // 2] * 2 or sizes == width // 2):
        return None
    pieces = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if len(pieces) != 2 or len(split.users) != 2 or set(pieces) != {0, 1}:
        return None
    return pieces[0], pieces[1]


def glu_region(gemm: fx.Node, pointwise: frozenset[str], order: dict[fx.Node, int]) -> Region | None:
    """The region that starts at ``gemm`` (a grouped GEMM), or None where its product is not split
    into two halves that pointwise nodes join into one value."""
    product = _val(gemm)
    if not isinstance(product, torch.Tensor) or product.dim() != 2 or isinstance(product.shape[1], torch.SymInt):
        return None
    nodes, last = [gemm], gemm
    while len(last.users) == 1:  # pointwise nodes on the whole product, each the only reader of the last
        (user,) = last.users
        if user.target in SPLITS or not _pointwise_on(user, product, pointwise):
            break
        nodes.append(user)
        last = user
    (split,) = last.users if len(last.users) == 1 else (None,)
    if split is None or split.target not in SPLITS or (halves := _halves(split, int(product.shape[1]))) is None:
        return None
    nodes += [split, *halves]
    half = _val(halves[0])
    inside = set(nodes)
    stop = order[gemm]
    for node in list(gemm.graph.nodes)[order[halves[1]] + 1:]:
        if len(nodes) >= MAX_REGION_NODES:
            break
        reads = node.all_input_nodes
        if not any(a in inside for a in reads) or not _pointwise_on(node, half, pointwise):
            continue
        # a value from outside must not itself wait for the region (one call computes it all)
        if any(a not in inside and reads_from(a, inside.__contains__, order, stop) for a in reads):
            continue
        nodes.append(node)
        inside.add(node)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(outputs) != 1 or outputs[0] in (gemm, split, *halves) or not is_tensor_node(outputs[0]):
        return None
    if any(n not in (gemm, split) and not n.users for n in nodes):
        return None
    inputs = list(dict.fromkeys(a for n in nodes for a in tensor_args(n) if a not in inside))
    if inputs[:3] != list(gemm.args[:3]):  # (the family reads input, weight and offs as inputs 0-2)
        return None
    return Region(KIND, nodes, inputs, outputs)
