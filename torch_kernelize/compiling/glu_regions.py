"""Gated experts: an MoE layer's gate/up grouped GEMM and the gated activation after it, as one region.

transformers' experts compute ``grouped_mm(x, gate_up, offs) -> chunk(2) -> act(gate) * up`` (and,
in some versions, zero the rows of no expert first: ``where(mask, 0, .)``). Served node by node,
the [S, 2I] product is stored, read back by a pointwise kernel and stored again at [S, I]: for
Mixtral's suite layers 184 MB each way per layer, with the pointwise kernel at its memory floor.
A region of kind ``grouped_mm_glu`` holds the GEMM, the pointwise nodes on its product before the
split, its halves (two slices: ``halve_products`` writes the split so before planning), and the
pointwise nodes after them up to one output; the grouped_mm_glu family
(lowering/kernels/grouped_mm_glu.py) computes the gate and up tiles of an output tile together
and stores only the result. Its vendor path is the same nodes run by ATen (core/region_graph.py),
so a miss or "vendor wins" leaves them to the regions and stretches that would take them anyway.

The activation is not matched against a table: any pointwise nodes of [S, I] values that read
the two halves (and values from outside the region) qualify, and the family says which it
generates. Tried after the whole graph and before every other region (compiling/lower.py): its
nodes are also a stretch's, and fill_cache judges it in the graph where both serve
(fill_cache/region_judgment.py).
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
GROUPED_MM_OPS = frozenset({"transformers.grouped_mm_fallback.default", "aten._grouped_mm.default"})
SPLITS = {aten.split_with_sizes.default, aten.split.Tensor}


def halve_products(graph: fx.Graph) -> int:
    """Rewrite in place each split of a grouped GEMM's product into two equal halves of its last
    dim (through the pointwise nodes on it) as two slices of it; how many. The same views, each of
    one tensor: a region's canonical graph keeps a tuple's sizes in one list, which a shape bucket
    does not abstract, while a slice's value is a tensor whose rows vary with S."""
    pointwise, count = pointwise_ops(), 0
    for gemm in list(graph.nodes):
        if gemm.op != "call_function" or op_name(gemm.target) not in GROUPED_MM_OPS:
            continue
        last = _product_chain(gemm, pointwise)[-1]
        split = next(iter(last.users)) if len(last.users) == 1 else None
        if split is None or split.target not in SPLITS or (halves := _halves(split, _val(last))) is None:
            continue
        dim, width = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0), _val(last).shape[-1]
        for k, piece in enumerate(halves):
            with graph.inserting_before(piece):
                cut = graph.call_function(aten.slice.Tensor, (last, dim, k * width // 2, (k + 1) * width // 2))
            cut.meta.update(piece.meta)
            piece.replace_all_uses_with(cut)
            graph.erase_node(piece)
        graph.erase_node(split)
        count += 1
    return count


def find_glu_regions(gm: fx.GraphModule) -> list[Region]:
    """The gated-experts regions of ``gm`` (its splits halved: ``halve_products``), in graph order."""
    pointwise = pointwise_ops()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = (glu_region(n, pointwise, order) for n in gm.graph.nodes
             if n.op == "call_function" and op_name(n.target) in GROUPED_MM_OPS)
    return [r for r in found if r is not None]


def _pointwise_on(node: fx.Node, like: torch.Tensor, pointwise: frozenset[str]) -> bool:
    v = _val(node)
    return (node.op == "call_function" and op_name(node.target) in pointwise
            and isinstance(v, torch.Tensor) and _same_shape(v, like))


def _product_chain(gemm: fx.Node, pointwise: frozenset[str]) -> list[fx.Node]:
    """The GEMM and the pointwise nodes on its whole product after it, each the only reader of
    the one before."""
    chain = [gemm]
    while len(chain[-1].users) == 1 and _pointwise_on(next(iter(chain[-1].users)), _val(gemm), pointwise):
        chain.append(next(iter(chain[-1].users)))
    return chain


def _halves(split: fx.Node, product: torch.Tensor) -> tuple[fx.Node, fx.Node] | None:
    """The split's two pieces (gate, up) where it cuts the last dim of 2-D ``product`` in halves."""
    sizes = split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    width = product.shape[-1] if isinstance(product, torch.Tensor) and product.dim() == 2 else None
    if not isinstance(width, int) or dim not in (-1, 1) or width % 2:
        return None
    if not (sizes == [width // 2] * 2 or sizes == width // 2):
        return None
    pieces = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if len(pieces) != 2 or len(split.users) != 2 or set(pieces) != {0, 1}:
        return None
    return pieces[0], pieces[1]


def _slices(last: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two slices (gate, up) of ``last``, a 2-D product, into halves of its last dim."""
    width = _val(last).shape[-1]
    cuts = {}
    for u in last.users:
        if u.target is not aten.slice.Tensor or len(u.args) != 4 or u.kwargs or u.args[1] not in (-1, 1):
            return None
        cuts[tuple(u.args[2:])] = u
    half = width // 2
    if width % 2 or set(cuts) != {(0, half), (half, width)}:
        return None
    return cuts[(0, half)], cuts[(half, width)]


def glu_region(gemm: fx.Node, pointwise: frozenset[str], order: dict[fx.Node, int]) -> Region | None:
    """The region that starts at ``gemm`` (a grouped GEMM), or None where its product is not cut
    into two halves that pointwise nodes join into one value."""
    product = _val(gemm)
    if not isinstance(product, torch.Tensor) or product.dim() != 2 or not isinstance(product.shape[1], int):
        return None
    nodes = _product_chain(gemm, pointwise)
    last = nodes[-1]
    halves = _slices(last)
    if halves is None:
        return None
    nodes += halves
    half = _val(halves[0])
    inside = set(nodes)
    stop = order[gemm]
    for node in list(gemm.graph.nodes)[max(order[h] for h in halves) + 1:]:
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
    if len(outputs) != 1 or outputs[0] in (gemm, last, *halves) or not is_tensor_node(outputs[0]):
        return None
    if any(not n.users for n in nodes):
        return None
    inputs = list(dict.fromkeys(a for n in nodes for a in tensor_args(n) if a not in inside))
    if inputs[:3] != list(gemm.args[:3]):  # (the family reads input, weight and offs as inputs 0-2)
        return None
    return Region(KIND, nodes, inputs, outputs)
