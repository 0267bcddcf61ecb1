"""A whole graph as one region (kind "whole"): graphs compete as wholes.

Every static graph kernelize serves (a Dynamo graph: inference, or a training graph's forward
or backward) is also one region of every node it computes, keyed like any region (its canonical
FX code, compiling/regions.py's ``region_spec``). fill_cache measures candidates for it as a
whole (fill_cache/graph_candidates.py): Inductor's complete output captured as a program
(fill_cache/inductor_program.py), against kernelize's own assembly (the graph as the planner
serves it from the cache: nodes and smaller regions on their tiers). Serving looks this region
up first: a hit runs the winner's program in place of the whole graph; a miss, or an entry
whose winner is the assembly ("vendor wins" for this kind: the graph's own ops, as planned),
leaves every node and region to its own lookup, as before.

A graph is offered whole only where one call of a program can stand for it: every node an ATen
op (no collectives or other passthrough ops, no symbolic-size bookkeeping), nothing random
(a captured program's random stream could not match the reference) or mutating, and every
output a tensor that a node computes (not an input, not a number; None is fine). A tensor
constant (``get_attr``) is one more input, as the graph's inputs are.
"""
from __future__ import annotations

import json
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.op_classes import NodeClass, classify, is_random
from torch_kernelize.compiling.regions import Region, is_tensor_node
from torch_kernelize.core.encoding import encode_arg
from torch_kernelize.core.graph_accuracy import WHOLE
from torch_kernelize.core.graph_accuracy import is_whole as is_whole_graph  # noqa: F401 (its name here)

MIN_COMPUTE_NODES = 2


def whole_graph_region(gm: fx.GraphModule) -> tuple[Region | None, str]:
    """(the whole-graph region of ``gm``, "") or (None, why the graph is not offered whole)."""
    nodes, inputs, computing = [], [], 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):  # a constant is one more input of the program
            if node.users and not is_tensor_node(node):
                return None, f"input {node.name} is not a tensor"
            if is_tensor_node(node):
                inputs.append(node)
            continue
        if node.op == "output":
            continue
        if node.op != "call_function":
            return None, f"node {node.name} is a {node.op}"
        if node.target is not operator.getitem:
            klass, why = classify(node)
            if klass in (NodeClass.STRUCTURAL, NodeClass.PASSTHROUGH):
                return None, f"{node.name}: {why}"
            if is_random(node.target, node.args, node.kwargs):
                return None, f"{node.name} draws random numbers"
            if node.target._schema.is_mutable:
                return None, f"{node.name} mutates its arguments"
            computing += klass is NodeClass.COMPUTE
        nodes.append(node)
    if computing < MIN_COMPUTE_NODES:
        return None, f"{computing} computing node(s): nothing to gain as a whole"
    outputs: list[fx.Node] = []
    for out in pytree.tree_leaves(gm.graph.output_node().args):
        if out is None or out in outputs:
            continue
        if not isinstance(out, fx.Node) or out.op != "call_function" or not is_tensor_node(out):
            return None, f"output {out} is not a tensor a node computes"
        outputs.append(out)
    if not outputs:
        return None, "no tensor output"
    used = {a for n in nodes for a in n.all_input_nodes}
    for n in nodes:  # (region_spec writes them when the graph is looked up: it must not fail there)
        for leaf in pytree.tree_leaves((n.args, n.kwargs)):
            if not isinstance(leaf, fx.Node):
                try:
                    encode_arg(leaf)
                except TypeError as e:
                    return None, f"{n.name}: an argument cannot be written in its canonical form ({e})"
    return Region(WHOLE, nodes, [n for n in inputs if n in used], outputs), ""


def whole_report(regions: list[Any]) -> dict[str, Any] | None:
    """The whole graph's line of the coverage report: its spec, whether its program runs, and
    (where its entry has them) the candidates the fill measured, their times and the winner."""
    d = next((r for r in regions if (r.shapes or "").startswith(f"{WHOLE} region")), None)
    if d is None:
        return None
    out = {"spec_key": d.spec_key, "tier": d.tier, "reason": d.reason}
    evidence = (getattr(d.entry, "record", None) or {}).get("graph")
    if evidence:
        out.update(candidates=evidence["candidates"], winner=evidence["winner"])
    return out


def step_tier_ops(program: Any) -> frozenset[str]:
    """The op packets (``aten.addmm``) a program runs as vendor steps: a node of those ops inside
    the program is reported on the vendor tier, every other one on triton (generator inductor)."""
    return frozenset(s.op.rsplit(".", 1)[0] for s in getattr(program, "steps", ()))


def describe_evidence(evidence: dict[str, Any]) -> str:
    """One line: ``inductor default 1.20 ms, assembly 1.50 ms -> inductor default``."""
    def ms(c: dict[str, Any]) -> str:
        if not c["correct"]:
            return "wrong"
        return f"{c['ms']:.3f} ms" if c.get("ms") is not None else "unmeasured"
    parts = ", ".join(f"{c['name']} {ms(c)}" for c in evidence["candidates"])
    return f"{parts} -> {evidence['winner']}"
