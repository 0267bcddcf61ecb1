"""Region inputs that view folding removed from a bound graph, recovered for a reproducer.

A missed region's inputs are captured during the first call (compiling/lower.py). Where view
folding replaced a chain of views by one re-striding call, an input that was a view inside the
chain is no longer a value of the bound graph. It is a view of one that is (the chain's root), so
the capture keeps the root and replays the chain's view ops, with the size arithmetic they read,
on the root's copy after the call: a few metadata ops, where running the whole planned graph
through FX's interpreter cost a second forward pass (Mixtral's first call of a new bucket:
~100 ms on an H100). A value that depends on any other tensor op not in the bound graph is not
replayed here (``plan`` gives None: the caller runs the planned graph).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from torch_kernelize.serving.runtime import copy_value
from torch_kernelize.serving.view_folding import VIEW_OPS


class _NotReplayable(Exception):
    pass


class FoldedReplay:
    """How to recompute the folded values ``names`` from captured ``roots`` (values of the bound
    graph, graph inputs among them) and the graph's non-tensor inputs."""

    def __init__(self, gm: fx.GraphModule, names: set[str], bound: set[str]):
        self.names = set(names)
        self.roots: set[str] = set()
        self._order: list[fx.Node] = []
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        nodes = {n.name: n for n in gm.graph.nodes}
        seen: set[str] = set()
        for name in sorted(names):
            self._visit(nodes[name], bound, seen)

    def _visit(self, n: fx.Node, bound: set[str], seen: set[str]) -> None:
        if n.name in seen:
            return
        seen.add(n.name)
        tensor = isinstance(n.meta.get("val"), torch.Tensor)
        if tensor and (n.op == "placeholder" or n.name in bound) and n.name not in self.names:
            self.roots.add(n.name)  # (a graph input too: the call may write it, its copy is taken first)
            return
        if n.op == "placeholder":
            return  # a size: read from the call's arguments
        if n.op != "call_function" or (tensor and n.target not in VIEW_OPS):
            raise _NotReplayable(f"{n.name} ({n.op} {n.target})")
        for a in n.all_input_nodes:
            self._visit(a, bound, seen)
        self._order.append(n)

    def copied_roots(self, mutated: set[int]) -> set[str]:
        """The roots the call must copy: values of the graph, and the inputs it writes (``mutated``:
        their positions); the others are read off the call's arguments."""
        position = {n.name: i for i, n in enumerate(self._placeholders)}
        return {r for r in self.roots if position.get(r) is None or position[r] in mutated}

    def run(self, args: Sequence[Any], roots: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of the folded values (on their device, compact: a view of a large root does not
        keep the root), from the call's ``args`` and the copied roots."""
        env: dict[str, Any] = {n.name: a for n, a in zip(self._placeholders, args)}
        env.update(roots)
        for n in self._order:
            fetch = lambda a: env[a.name]  # noqa: E731
            env[n.name] = n.target(*fx.map_arg(n.args, fetch), **fx.map_arg(n.kwargs, fetch))
        return {name: copy_value(env[name], on_device=True) for name in self.names}


def plan(gm: fx.GraphModule, names: set[str], bound: set[str]) -> FoldedReplay | None:
    """The replay of the folded values ``names`` of the planned graph ``gm`` from values of the
    bound graph (named ``bound``); None where one depends on a tensor op the bound graph lacks."""
    try:
        return FoldedReplay(gm, names, bound)
    except _NotReplayable:
        return None
