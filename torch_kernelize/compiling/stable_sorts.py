"""Sorts made stable, so that every implementation of a graph orders equal keys alike.

``aten.sort`` (stable=False) leaves the order of equal keys unspecified, and ATen, Inductor's
Triton sort and our sort family each leave it differently. A node's index output is validated
tie-aware (core/index_ties.py), but a graph that sorts keys with many ties and then gathers by
the order (an MoE router sorting tokens by expert id) returns outputs that only one tie order
reproduces: a whole graph's candidate could never match its reference. A stable sort is one of
the orders an unstable sort may return, so every ``aten.sort.default`` of a lowered graph becomes
``aten.sort.stable(stable=True)``: one answer, which every implementation gives (ATen's CUDA and
CPU sorts are stable when asked, and so is the sort family).
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def stable_sorts(graph: fx.Graph) -> int:
    """Rewrite ``graph``'s unstable sorts in place; how many there were."""
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.sort.default:
            args = dict(zip(("dim", "descending"), node.args[1:]), **node.kwargs)
            node.target = aten.sort.stable
            node.args = (node.args[0],)
            node.kwargs = {"stable": True, **args}
            count += 1
    return count
