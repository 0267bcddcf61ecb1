"""Where to cut a graph into stretches that compete on their own: the mixes of whole_graph.py.

A graph competes as a whole (Inductor's complete program against kernelize's own assembly), and
also as stretches, each filled the same way; the graph's own assembly then runs each stretch by
its winner, so the whole graph's program meets a mix: Inductor's program where it wins, ours
where ours does, stretch by stretch. A stretch is a run of the graph's nodes in order; it is cut
where few tensors cross (a transformer's residual stream between layers, a convolution block's
output), so a program loses little fusion at its edges and identical layers give one spec.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from torch_kernelize.compiling.op_classes import NodeClass, classify
from torch_kernelize.compiling.regions import is_tensor_node

MIN_STRETCH_COMPUTE = 8  # computing nodes a stretch holds at least: less gains nothing on its own
MAX_STRETCHES = 64


def cut_stretches(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """``nodes`` (a graph's call_function nodes, in order) as stretches cut where the fewest
    tensors are live across; [] where the graph is too small to cut in two."""
    computing = [0]
    for n in nodes:
        computing.append(computing[-1] + (n.target is not operator.getitem and classify(n)[0] is NodeClass.COMPUTE))
    total = computing[-1]
    if total < 2 * MIN_STRETCH_COMPUTE:
        return []
    live = _live_across(nodes)
    # where a cut leaves at least MIN_STRETCH_COMPUTE computing nodes on either side; of those,
    # the ones the fewest tensors cross (between layers, not inside one)
    admissible = [p for p, count in enumerate(live) if count is not None
                  and computing[p + 1] >= MIN_STRETCH_COMPUTE <= total - computing[p + 1]]
    if not admissible:
        return []
    floor = min(live[p] for p in admissible)
    cuts, last = [], 0  # a cut at p: nodes[:p+1] | nodes[p+1:]
    for p in admissible:
        if live[p] == floor and computing[p + 1] - computing[last] >= MIN_STRETCH_COMPUTE \
                and len(cuts) < MAX_STRETCHES - 1:
            cuts.append(p)
            last = p + 1
    bounds = [0] + [p + 1 for p in cuts] + [len(nodes)]
    return [nodes[a:b] for a, b in zip(bounds, bounds[1:])] if cuts else []


def _live_across(nodes: list[fx.Node]) -> list[int | None]:
    """Per position p, the number of values computed at or before p that a node after p reads
    (graph inputs are every stretch's inputs: not counted); None where one of them is no tensor
    (a tuple before its getitems): no cut there."""
    order = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    last_use = [max((order.get(u, end) for u in n.users), default=-1) for n in nodes]
    counts: list[int | None] = []
    open_: dict[fx.Node, int] = {}
    for p, n in enumerate(nodes):
        if last_use[p] > p:
            open_[n] = last_use[p]
        for m in [m for m, until in open_.items() if until <= p]:
            del open_[m]
        counts.append(len(open_) if all(is_tensor_node(m) for m in open_) else None)
    counts[-1] = None  # (after the last node: nothing to cut)
    return counts
