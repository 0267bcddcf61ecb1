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
output a tensor that a node computes (not an input, not a number; None is fine), and no op that
picks positions by comparing floats whose picked indices are used (an MoE router's top-k: float64
cannot judge a program across a near-tie, op_classes.picks_by_rounded_floats). A tensor
constant (``get_attr``) is one more input, as the graph's inputs are. Where ops no program may
call break a graph (a custom op passed through, as transformers' MoE experts are, a collective,
a router's top-k), each stretch between them is offered the same way: a region of kind "whole" of
its own, whose inputs and outputs are the tensors it reads from and gives to the rest of the graph
(this goes beyond DESIGN.md, which names whole graphs and partitions only).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.graph_cuts import cut_stretches
from torch_kernelize.compiling.op_classes import (NodeClass, classify, is_random, picks_by_rounded_floats,
                                                 runs_as_given)
from torch_kernelize.compiling.regions import Region, is_tensor_node, region_spec
from torch_kernelize.core.encoding import encode_arg
from torch_kernelize.core.graph_accuracy import WHOLE
from torch_kernelize.core.shapes import sizes_read_off
from torch_kernelize.core.graph_accuracy import is_whole as is_whole_graph  # noqa: F401 (its name here)

MIN_COMPUTE_NODES = 2
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
# a stretch's lookup says which it is (planner.py); the fill searches cut ones at --budget 2 and more
BROKEN = "a stretch between ops no program calls"
CUT = "a stretch of the graph, for a mix"
JUDGED = "a fused region with the stretches it overlaps, where fill_cache judges it"


def whole_graph_region(gm: fx.GraphModule, symbolic: bool = False) -> tuple[Region | None, str]:
    """(the whole-graph region of ``gm``, "") or (None, why the graph is not offered whole).
    ``symbolic``: a dynamic graph's sizes (its SymInt inputs, the size arithmetic on them) are
    left out of the region, as region_spec reads them under its bindings (dynamic_whole)."""
    nodes, inputs, computing = [], [], 0
    for node in gm.graph.nodes:
        if symbolic and _is_symbolic(node) and node.op in ("placeholder", "call_function"):
            continue
        if node.op in ("placeholder", "get_attr"):  # a constant is one more input of the program
            if node.users and not is_tensor_node(node):
                return None, f"input {node.name} is not a tensor"
            if is_tensor_node(node):
                inputs.append(node)
            continue
        if node.op == "output":
            continue
        why = _breaks(node)
        if why:
            return None, why
        computing += node.target is not operator.getitem and classify(node)[0] is NodeClass.COMPUTE
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
    why = _unwritable(nodes)
    if why:
        return None, why
    used = {a for n in nodes for a in n.all_input_nodes}
    return Region(WHOLE, nodes, [n for n in inputs if n in used], outputs), ""


@dataclasses.dataclass(frozen=True)
class DynamicWhole:
    """A dynamic graph offered whole over the sizes of one symbol (a sequence length): its
    region, the symbol, and each input and output dim that holds it (a bucket's dims, variable
    0), each of size ``factor`` times the symbol: 1 where a dim is the symbol itself; else (an
    MoE router's stretch, which sees only token counts) a product of the other symbols and an
    integer (``2*s0``: batch s0 times the symbol, times two experts per token)."""
    region: Region
    symbol: Any
    dims: tuple[tuple[str, int, int, int], ...]
    factor: Any = 1

    def scale(self, bindings: dict) -> int | None:
        """``factor`` at ``bindings`` (what a dim of ``dims`` holds per unit of the symbol);
        None where a symbol of it is unbound."""
        value = sympy.sympify(self.factor).subs(bindings)
        return int(value) if value.is_Integer and value > 0 else None


def dynamic_whole(gm: fx.GraphModule, symbol: Any) -> tuple[DynamicWhole | None, str]:
    """``gm`` (a dynamic graph) whole over the sizes of ``symbol``, or (None, why not)."""
    region, why = whole_graph_region(gm, symbolic=True)
    return whole_over(region, symbol) if region is not None else (None, why)


def whole_over(region: Region, symbol: Any) -> tuple[DynamicWhole | None, str]:
    """``region`` (a dynamic graph whole, or a stretch of one) over the sizes of ``symbol``, or
    (None, why not): the dims that are that size itself (a bucket's variable, read off the
    call's tensors); where none is, the dims of one multiple of it (the first an input has: a
    token count, batch x length), the variable read off them divided by their factor. Any other
    dim of another size of it follows from it: serving gives the outputs their sizes from the
    graph's at the size (lower.py ``_region_outputs_at``), and the fill compiles such dims
    dynamic too."""
    sized = [(side, i, d, _expr(size)) for side, nodes in (("in", region.inputs), ("out", region.outputs))
             for i, n in enumerate(nodes) for d, size in enumerate(n.meta["val"].shape)]
    exact = tuple((side, i, d, 0) for side, i, d, e in sized if e == symbol)
    if exact:
        return DynamicWhole(region, symbol, exact), ""
    factor = next((f for side, _, _, e in sized if side == "in" for f in [_factor(e, symbol)] if f is not None), None)
    if factor is None:
        return None, f"no input dim is {symbol} or a multiple of it"
    dims = tuple((side, i, d, 0) for side, i, d, e in sized if _factor(e, symbol) == factor)
    return DynamicWhole(region, symbol, dims, factor), ""


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _factor(e: Any, symbol: Any) -> Any:
    """``e / symbol`` where that is a product of other size symbols and a positive integer
    (``e`` grows with the symbol in proportion); None otherwise."""
    if not isinstance(e, sympy.Expr) or symbol not in e.free_symbols:
        return None
    f = e / symbol
    parts = sympy.Mul.make_args(f)
    if symbol in f.free_symbols or not all(p.is_Symbol or (p.is_Integer and p > 0) for p in parts):
        return None
    return f


def dynamic_wholes(gm: fx.GraphModule, symbols: Any) -> list[DynamicWhole]:
    """``gm`` whole over each of its size ``symbols`` that it can be, or where ops no program may
    call break it (an MoE router's top-k, its experts' custom op), each stretch between them:
    serving looks each one's buckets up (compiling/bucket_lookup.py)."""
    region, _ = whole_graph_region(gm, symbolic=True)
    regions = [region] if region is not None else dynamic_stretches(gm)
    return [w for r in regions for w in (whole_over(r, s)[0] for s in symbols) if w is not None]


def dynamic_stretches(gm: fx.GraphModule) -> list[Region]:
    """The stretches of a dynamic graph between the ops no program may call, each a region
    (BROKEN) of its tensors: its size bookkeeping stays outside, read under the bindings as a
    whole graph's is."""
    stretches = _broken_stretches(gm, symbolic=True)
    if len(stretches) == 1:
        return []
    return [r for r in (_stretch_region(s, BROKEN, symbolic=True) for s in stretches) if r is not None]


# sizes the varying symbol takes to write a dynamic graph's canonical form: two, so that no other
# graph (a literal where this one has the symbol) agrees with it at both; primes no model dim is
PROBES = (1009, 2003)


def whole_probe_keys(whole: DynamicWhole, bindings: dict) -> tuple[str, ...] | None:
    """The keys of ``whole``'s region with its symbol at each of PROBES and the others as
    ``bindings`` give them (core/buckets.probe_prefix makes its buckets' key prefix of them).
    None where a size is unbound."""
    keys = []
    for probe in PROBES:
        spec = region_spec(whole.region, {**bindings, whole.symbol: probe})
        if spec is None:
            return None
        # a size-1 dim's stride is a symbol of its own in a dynamic trace, whatever the caller's
        # tensor had there: no part of what the graph computes, so none of its key
        inputs = tuple(dataclasses.replace(m, stride=tuple(0 if n == 1 else st for n, st in zip(m.shape, m.stride)))
                       for m in spec.inputs)
        keys.append(dataclasses.replace(spec, inputs=inputs).key)
    return tuple(keys)


def size_symbols(whole: DynamicWhole) -> frozenset:
    """The symbols of its inputs' sizes other than the varying one: with it, what its key depends on."""
    found = set()
    for n in whole.region.inputs:
        for size in n.meta["val"].shape:
            if isinstance(size, torch.SymInt):
                found |= size.node.expr.free_symbols
    return frozenset(found - {whole.symbol})


def whole_graph_regions(gm: fx.GraphModule) -> tuple[list[Region], str]:
    """The regions that compete as wholes in ``gm``, and why the graph is not one of them: the
    whole graph where it can be one program, then the stretches it is cut into for a mix
    (graph_cuts.py); else, where ops no program may call break it (a custom op passed through,
    a collective, a random or mutating op), each stretch between them that can (MoE models whose
    experts run in a custom op: their attention, router and norms)."""
    region, why = whole_graph_region(gm)
    if region is not None:
        cuts = [_stretch_region(s, CUT) for s in cut_stretches(region.nodes)]
        return [region] + [r for r in cuts if r is not None], ""
    stretches = _broken_stretches(gm)
    if len(stretches) == 1:  # nothing breaks the graph: it is not offered whole for another reason
        return [], why
    return [r for r in (_stretch_region(s, BROKEN) for s in stretches) if r is not None], why


def judgment_units(gm: fx.GraphModule, regions: list[Region]) -> list[tuple[Region, Region]]:
    """(region, unit) for each region that serving tries before the graph's stretches (``regions``,
    LoweredGraph.regions: serving's order; an MoE's gated experts) and that shares nodes with one:
    the unit is the smallest graph in which the region competes with the parts it keeps from their
    own winners (fill_cache/region_judgment.py). A stretch of the mix (CUT) is cut where the whole
    graph is, so that graph is the unit; a stretch around ops no program calls (BROKEN) is cut by
    its ops, so the region with those stretches is one, whose assembly finds the same stretches
    (and keys) again."""
    first = next((i for i, r in enumerate(regions) if r.kind == WHOLE and r.stretch), None)
    if first is None:
        return []
    wholes = [r for r in regions if r.kind == WHOLE]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    units = []
    for region in regions[:first]:
        overlap = [s for s in wholes if s.stretch and s.names & region.names] if region.kind != WHOLE else []
        if not overlap:
            continue
        if overlap[0].stretch == CUT:
            unit = next((w for w in wholes if not w.stretch), None)
        else:
            unit = _stretch_region(sorted(set(region.nodes).union(*(s.nodes for s in overlap)), key=order.__getitem__),
                                   JUDGED)
        if unit is not None:
            units.append((region, unit))
    return units


def _broken_stretches(gm: fx.GraphModule, symbolic: bool = False) -> list[list[fx.Node]]:
    """``gm``'s call_function nodes split at each node no program may hold (and its getitems);
    ``symbolic``: a dynamic graph's size bookkeeping is in no stretch and breaks none."""
    stretches, stretch, broken = [], [], set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or (symbolic and _is_symbolic(node)):
            continue
        if node.op != "call_function" or _breaks(node) or any(a in broken for a in node.all_input_nodes
                                                              if node.target is operator.getitem):
            broken.add(node)
            stretches.append(stretch)
            stretch = []
        else:
            stretch.append(node)
    stretches.append(stretch)
    return stretches


def _is_symbolic(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), _SYMBOLIC)


def _breaks(node: fx.Node) -> str:
    """Why no program may hold ``node`` ("" if one may)."""
    if node.op != "call_function":
        return f"node {node.name} is a {node.op}"
    if node.target is operator.getitem:
        return ""
    klass, why = classify(node)
    # (a prims op, such as a dynamic trace's convert_element_type, is one more op of the program:
    # Inductor compiles it and the reference runs it; other namespaces' ops pass through untouched)
    if klass is NodeClass.STRUCTURAL or (klass is NodeClass.PASSTHROUGH and node.target.namespace != "prims"):
        return f"{node.name}: {why}"
    if runs_as_given(node.target):  # (a FAMILY_OPS op: Inductor's program would call it as given, host syncs and all)
        return f"{node.name}: {node.target.namespace} op: served between programs"
    if is_random(node.target, node.args, node.kwargs):
        return f"{node.name} draws random numbers"
    if node.target._schema.is_mutable:
        return f"{node.name} mutates its arguments"
    if picks_by_rounded_floats(node):
        return f"{node.name} picks positions by comparing floats: served as its own op, judged as one"
    return ""


def _stretch_region(nodes: list[fx.Node], kind: str, symbolic: bool = False) -> Region | None:
    """A stretch of a graph (``kind``: BROKEN or CUT) as a region competing as a whole; None
    where it cannot be one (too little compute, a value it reads or gives that is no tensor;
    ``symbolic``: a size it reads is read under the bindings, as region_spec does)."""
    inside = set(nodes)
    computing = sum(n.target is not operator.getitem and classify(n)[0] is NodeClass.COMPUTE for n in nodes)
    if computing < MIN_COMPUTE_NODES or _unwritable(nodes):
        return None
    inputs, outputs = [], []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs and not (symbolic and _is_symbolic(a)):
                if not is_tensor_node(a):
                    return None
                inputs.append(a)
        if any(u not in inside and not (symbolic and _is_symbolic(u)) for u in n.users):
            if not is_tensor_node(n):
                return None
            outputs.append(n)
    if symbolic and sizes_read_off(nodes, inputs + outputs) is None:
        return None  # (a size the rest of the graph reads off a value inside: fused, it would be gone)
    return Region(WHOLE, nodes, inputs, outputs, stretch=kind) if outputs else None


def _unwritable(nodes: list[fx.Node]) -> str:
    """Why the nodes' literal arguments cannot be written in a region's canonical form ("" if
    they can: region_spec writes them when the graph is looked up, and must not fail there)."""
    for n in nodes:
        for leaf in pytree.tree_leaves((n.args, n.kwargs)):
            if not isinstance(leaf, fx.Node):
                try:
                    encode_arg(leaf)
                except TypeError as e:
                    return f"{n.name}: an argument cannot be written in its canonical form ({e})"
    return ""


def whole_reports(regions: list[Any]) -> list[dict[str, Any]]:
    """The report's lines of the whole graph (or its stretches): each one's spec, whether its
    program runs, and (where its entry has them) the candidates the fill measured, their times
    and the winner."""
    out = []
    for d in regions:
        if not (d.shapes or "").startswith(f"{WHOLE} region"):
            continue
        line = {"spec_key": d.spec_key, "tier": d.tier, "reason": d.reason, "nodes": len(d.members),
                "stretch": BROKEN in d.shapes or CUT in d.shapes}
        evidence = (getattr(d.entry, "record", None) or {}).get("graph")
        if evidence:
            line.update(candidates=evidence["candidates"], winner=evidence["winner"])
        out.append(line)
    return out


def step_tier_ops(program: Any) -> frozenset[str]:
    """The op packets (``aten.addmm``) a program runs as vendor steps: a node of those ops inside
    the program is reported on the vendor tier, every other one on triton (generator inductor)."""
    return frozenset(s.op.rsplit(".", 1)[0] for s in getattr(program, "steps", ()))


def describe_evidence(evidence: dict[str, Any]) -> str:
    """One line: ``inductor default 1.20 ms, assembly 1.50 ms -> inductor default``; times that
    were taken again, alternately, to decide a near tie say ``(confirmed)``."""
    def ms(c: dict[str, Any]) -> str:
        if not c["correct"]:
            return "wrong"
        if c.get("ms") is None:
            return "unmeasured"
        return f"{c['ms']:.3f} ms" + (" (confirmed)" if c.get("confirmed") else "")
    parts = ", ".join(f"{c['name']} {ms(c)}" for c in evidence["candidates"])
    return f"{parts} -> {evidence['winner']}"
