"""The planner: for every node of an ATen graph, one Decision (tier + why each higher tier was not taken).

Tier ladder, most abstract first:
  1 decompose  the target cannot run the op, but an ATen decomposition exists: the node is
               rewritten in place and its new nodes are planned again, one by one;
  2 triton     the node's KernelSpec has a validated cache entry whose winner is a Triton kernel;
  3 vendor     the target's own library runs the op (a node with a generator but no cache
               entry is a MISS, recorded for fill_cache);
  4 fallback   nothing on the target runs it: the host fallback runs it (a MISSING OP).

Fused regions are tried before their nodes (``decide_regions``: graph regions, GEMM groups,
then the smaller kinds): a region whose kernel is stored runs whole and its nodes' decisions say
so; a miss, a kernel that cannot be loaded or a region that would close a cycle leaves the nodes
to their own rungs. A stored kernel that cannot be loaded drops a node to the next rung
(``downgrade``). At run time a kernel that fails is disabled and its call runs the vendor op
(serving/runtime.py's TritonCall): the one rung that is taken while the model runs.

Planning is split in two: ``plan_graph`` does the shape-independent work once per graph
(decompositions, op classes, vendor support), ``GraphPlan.decide`` does the shape-dependent part
(specs and cache lookups) once per concrete shape signature.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.decomposition_memo import DecompositionMemo
from torch_kernelize.compiling.decompositions import (LAYOUT_COPY, NotDecomposable, decomposition_for,
                                                     materialized_bytes, own_bytes, splice_decomposition)
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.compiling.op_classes import NodeClass, classify, is_random, ladder_decides, runs_as_given
from torch_kernelize.compiling.regions import Region, closes_cycle, region_spec
from torch_kernelize.compiling.whole_graph import WHOLE
from torch_kernelize.core.targets import Target, op_name
from torch_kernelize.core.decision import Decision
from torch_kernelize.core.region_graph import describe_region
from torch_kernelize.core.shapes import concrete_value
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.kernel_cache.entry import CacheEntry
from torch_kernelize.kernel_cache.interfaces import Lookups

log = logging.getLogger("torch_kernelize.compiling.planner")

MAX_DECOMPOSE_ROUNDS = 16  # a decomposition whose ops decompose again, and so on: bounded
# A decomposition that writes more than this many times the op's own inputs and outputs on the
# way (mm -> broadcast multiply + sum: an [M, K, N] product) is not taken while a kernel family
# generates the op whole: the op stays for tier 2, and its miss is recorded as the op itself.
MAX_DECOMPOSITION_GROWTH = 4.0


@dataclasses.dataclass
class NodeFacts:
    """Shape-independent facts about one node that counts in coverage."""
    node: fx.Node
    op: str
    klass: NodeClass
    klass_reason: str
    vendor: bool
    no_decompose_reason: str


class GraphPlan:
    def __init__(self, gm: fx.GraphModule, target: Target, decompositions: list[Decision],
                 facts: list[NodeFacts]):
        self.gm = gm
        self.target = target
        self.decompositions = decompositions
        self.facts = facts

    def decide(self, bindings: dict[sympy.Symbol, int], cache: Lookups | None, resolve: bool = True
               ) -> list[Decision]:
        """Decisions for one concrete shape signature (``bindings`` fix every size symbol);
        ``cache``: its lookups (None: no kernel cache).

        ``resolve=False`` leaves cache misses' families pending, for a caller that may cover those
        nodes with a fused region first (then ``resolve_family`` the decisions that remain)."""
        decisions = list(self.decompositions)
        for f in self.facts:
            decisions.append(self._decide_node(f, bindings, cache))
        return [resolve_family(d) for d in decisions] if resolve else decisions

    def _decide_node(self, f: NodeFacts, bindings: dict[sympy.Symbol, int], cache: Lookups | None) -> Decision:
        if not ladder_decides(f.klass):
            return Decision(f.node.name, f.op, "vendor", f.klass_reason, view=f.klass is NodeClass.VIEW)
        if f.klass is NodeClass.MUTATING:
            return _decide_mutating(f, self.target)
        rejected = {"decompose": "the target runs it" if f.vendor else f.no_decompose_reason}
        spec = None
        try:
            spec = build_spec(f.node, bindings)
        except (TypeError, ValueError) as e:
            spec_problem = f"no KernelSpec: {e}"
        else:
            spec_problem = "data-dependent shape: no fixed KernelSpec" if spec is None else ""
        random = is_random(f.node.target, f.node.args, f.node.kwargs)
        status, entry, why = "miss", None, ""
        if self.target.has_triton and spec is not None and not random:  # (a dynamic graph's: shape buckets too)
            status, entry, why = ("miss", None, "no kernel cache") if cache is None else cache.lookup_node(f.node, spec)
        # which family generates a missed spec is asked later (resolve_family): a fused region
        # may cover the node, and the first question imports every generator module
        pending = status == "miss" and spec is not None and not random and self.target.has_triton
        family = family_name(spec, entry) if spec is not None and not random and not pending else None
        common = dict(spec_key=spec.key if spec else None, shapes=spec.describe() if spec else None,
                      family=family, spec=spec, family_pending=pending)
        if not self.target.has_triton:
            rejected["triton"] = f"target {self.target.name!r} has no Triton backend"
        elif random:
            rejected["triton"] = "random op: never replaced by a cached kernel"
        elif spec is None:
            rejected["triton"] = spec_problem
        else:
            if status == "hit":
                return Decision(f.node.name, f.op, "triton", why, rejected, entry=entry, **common)
            if status == "miss":
                why = f"cache miss (spec {spec.key})"  # or no generator at all: resolve_family says
            rejected["triton"] = why
        if f.vendor:  # a MISS (a generator exists, no entry) once resolve_family knows the family
            return Decision(f.node.name, f.op, "vendor", "the target's vendor kernel runs it", rejected, **common)
        rejected["vendor"] = f"target {self.target.name!r} does not run {f.op}"
        return Decision(f.node.name, f.op, "fallback", "nothing on the target runs it: host fallback",
                        rejected, missing=True, **common)


def _decide_mutating(f: NodeFacts, target: Target) -> Decision:
    """A mutating op the ladder could not decompose: the vendor's if the chip runs it, else the
    host's (which keeps its writes). No kernel: a cached kernel returns fresh outputs only."""
    rejected = {"decompose": "the target runs it" if f.vendor else f.no_decompose_reason,
                "triton": "mutating op: no kernel writes to its arguments"}
    if f.vendor:
        return Decision(f.node.name, f.op, "vendor", "the target's vendor kernel runs it", rejected)
    rejected["vendor"] = f"target {target.name!r} does not run {f.op}"
    return Decision(f.node.name, f.op, "fallback", "nothing on the target runs it: host fallback",
                    rejected, missing=True)


def downgrade(d: Decision, why: str, target: Target) -> Decision:
    """A node whose stored kernel cannot be used after all (``why``): the next rung down."""
    rejected = dict(d.rejected, triton=why)
    if target.vendor_runs(d.spec.op_overload if d.spec else None):
        return dataclasses.replace(d, tier="vendor", reason="the target's vendor kernel runs it", rejected=rejected)
    return dataclasses.replace(d, tier="fallback", reason="nothing on the target runs it: host fallback",
                               rejected=rejected, missing=True)


CYCLE = "fused with the regions before it, it would wait for its own outputs"


def decide_regions(regions: list[Region], bindings: dict[sympy.Symbol, int], decisions: list[Decision],
                   cache: Lookups, target: Target, load_runner: Callable[[KernelSpec, CacheEntry], Any],
                   take_wholes: bool = True) -> list[tuple[Region, Decision, Any]]:
    """The region rung: every region (in ``regions``' order, larger kinds first) looked up in
    ``cache``; (region, its decision, the loaded runner or None) per region looked up. A hit's
    nodes, in ``decisions``, are marked as run by it; a region overlapping one already taken is
    skipped, as is one whose spec cannot be built. Without ``take_wholes`` (fill_cache's survey
    of a model) a whole graph's or stretch's hit is looked up but not taken, so that every region
    below it is looked up too."""
    looked_up: list[tuple[Region, Decision, Any]] = []
    by_node = {d.node: i for i, d in enumerate(decisions) if d.tier != "decompose"}
    covered: set[str] = set()
    taken: list[Region] = []
    for region in regions:
        if covered & region.names:
            continue  # a member of a group that runs fused
        spec = region_spec(region, bindings)
        if spec is None:  # (a region of ops the vendor cannot run is looked up too: a bring-up chip's)
            continue
        # (only groups can close a cycle: two of them each feeding the other; the first one fused
        # stays). Such a group is not looked up: it could never run fused, so it is no miss to fill.
        cycle = region.kind == "matmul_group" and bool(taken) and closes_cycle(region, taken)
        if cycle:
            status, entry, why = "cycle", None, CYCLE
        else:  # (a dynamic graph's lookups find shape buckets too)
            status, entry, why = cache.lookup_region(region, spec)
        # a whole graph: no family is asked (that would import every generator module in a warm
        # process whose whole graph has no entry); without an entry it is no miss (fill_cache
        # collects whole graphs from LoweredGraph.wholes, and a reproducer of one would copy every weight)
        if region.kind == WHOLE:
            own = entry.family if entry is not None else None
        else:
            own = family_name(spec, entry)
        family = own or offline_generator(region.kind, target)
        what = f"{describe_region(spec)} of {len(region.nodes)} nodes" + (f", {region.stretch}" if region.stretch else "")
        d = Decision(f"region:{region.nodes[0].name}", "region", "vendor", "", spec_key=spec.key,
                     shapes=what, family=family, spec=spec, entry=entry, members=tuple(sorted(region.names)))
        if status == "hit" and region.kind != "matmul_group" and closes_cycle(region, taken):  # (should one)
            status, why = "cycle", CYCLE
        if status == "hit" and region.kind == WHOLE and not take_wholes:
            d.reason = f"nodes run one by one: {why} (a survey: its program is not taken)"
            looked_up.append((region, d, None))
            continue
        if status == "hit":
            runner = load_runner(spec, entry)
            if runner is not None:
                d.tier, d.reason = "triton", f"fused {what}: {why}"
                taken.append(region)
                covered |= region.names
                _run_fused(decisions, by_node, region, d)
                looked_up.append((region, d, runner))
                continue
            why = "the cache entry could not be loaded"
        elif status == "miss":
            why = f"region cache miss (spec {spec.key})" if family else f"no Triton generator for this {what}"
        d.reason = f"nodes run one by one: {why}"
        d.miss = status == "miss" and family is not None
        looked_up.append((region, d, None))
    return looked_up


def _run_fused(decisions: list[Decision], by_node: dict[str, int], region: Region, d: Decision) -> None:
    """Mark the nodes of ``region`` in ``decisions`` as run by its kernel (``d``, a hit): neither a
    miss nor missing (strict mode, the report's MISSING lines and the repros read these flags)."""
    for n in region.nodes:
        i = by_node.get(n.name)
        if i is not None:  # (a getitem: not an op, no decision)
            decisions[i] = dataclasses.replace(decisions[i], tier="triton", miss=False, missing=False, repro=None,
                                               family=d.family, reason=f"in fused region {d.spec_key}: {d.shapes}")


def resolve_family(d: Decision) -> Decision:
    """Complete a cache miss's decision: the family that generates its spec, whether that makes
    the vendor run a MISS (recorded for fill_cache), and the rejection's text. A node that ended
    up on Triton (covered by a fused region) needs none of it."""
    if not d.family_pending:
        return d
    if d.tier == "triton":
        return dataclasses.replace(d, family_pending=False)
    family = family_name(d.spec)
    why = f"cache miss (spec {d.spec_key})" if family else f"no Triton generator for {d.op} with these arguments"
    return dataclasses.replace(d, family=family, miss=d.tier == "vendor" and family is not None,
                               rejected=dict(d.rejected, triton=why), family_pending=False)


def family_name(spec: KernelSpec, entry: CacheEntry | None = None) -> str | None:
    """The name of the family that generates ``spec``: a stored cache entry names it; asking the
    families is needed for misses only (the first question imports every generator module)."""
    if entry is not None and entry.family:
        return entry.family
    return getattr(family_for(spec), "name", None)


def offline_generator(region_kind: str, target: Target) -> str | None:
    """The generator that fill_cache asks by default for a region no kernel family generates:
    Inductor, on a target whose Triton is CUDA, takes any graph region (fill_cache/inductor.py).
    Such a region's miss is then recorded like any other (a reproducer, a spec to fill); named
    here and not asked, because the generators sit above the planner."""
    return "inductor" if region_kind == "graph" and target.triton == "cuda" else None


def build_spec(node: fx.Node, bindings: dict[sympy.Symbol, int]) -> KernelSpec | None:
    """The concrete KernelSpec of a node under ``bindings``; None when a size depends on data."""
    flat, tree = pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    leaves = []
    for a in flat:
        if isinstance(a, fx.Node):
            v = concrete_value(a.meta.get("val"), bindings)
            if v is None:
                return None
            leaves.append(v)
        else:
            leaves.append(a)
    out = concrete_value(node.meta.get("val"), bindings)
    if out is None:
        return None
    if isinstance(out, (tuple, list)) and any(o is None for o in out):
        raise ValueError("the op returns optional (None) outputs")
    args, kwargs = pytree.tree_unflatten(leaves, tree)
    return KernelSpec.from_call(node.target, args, kwargs, out)


def _hint_bindings(node: fx.Node) -> dict[sympy.Symbol, int]:
    """Every size symbol of the node's graph bound to its example value."""
    from torch._guards import detect_fake_mode
    vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    mode = detect_fake_mode([v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
    env = getattr(mode, "shape_env", None)
    if env is None:
        return {}
    values = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val  # renamed after 2.11
    return dict(values)


def _generated_whole(node: fx.Node, sub: fx.GraphModule, target: Target) -> str | None:
    """Why ``node`` stays whole instead of taking the decomposition ``sub`` (None: decompose),
    when a kernel family generates the op as it is: the decomposition materializes far more than
    the op's own tensors, or it needs ops that neither the vendor nor a family runs (clamp's
    isnan of an integer tensor). Judged on the graph's example sizes."""
    bindings = _hint_bindings(node)

    def family_of(n: fx.Node) -> Any:
        try:
            spec = build_spec(n, bindings)
        except (TypeError, ValueError):
            return None
        return family_for(spec) if spec is not None else None

    family = family_of(node)
    if family is None:
        return None
    whole = f"the {family.name} family generates {op_name(node.target)} whole (tier 2)"
    extra, own = materialized_bytes(sub), own_bytes(node)
    if extra > MAX_DECOMPOSITION_GROWTH * max(own, 1):
        return f"its decomposition would write {extra / own:.0f}x the op's own {own / 2**20:.2f} MiB on the way; {whole}"
    uncovered = sorted({op_name(n.target) for n in sub.graph.nodes
                        if n.op == "call_function" and classify(n)[0] is NodeClass.COMPUTE
                        and not target.vendor_runs(n.target) and family_of(n) is None})
    if uncovered:
        return f"its decomposition needs {', '.join(uncovered)}, which nothing on the target runs; {whole}"
    return None


def _on_vendor(node: fx.Node, klass: NodeClass, target: Target) -> bool:
    """The vendor rung takes ``node`` as it is: the ladder does not decide its class, it is another
    library's op (run as given), or the target's vendor runs it."""
    return not ladder_decides(klass) or runs_as_given(node.target) or target.vendor_runs(node.target)


def plan_graph(gm: fx.GraphModule, target: Target) -> GraphPlan:
    """Decompose what the target cannot run (one node at a time, re-planning new nodes)."""
    decompositions: list[Decision] = []
    not_decomposable: dict[fx.Node, str] = {}
    memo = DecompositionMemo()  # a model's repeated layers: one trace per distinct node
    for _ in range(MAX_DECOMPOSE_ROUNDS):
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node in not_decomposable:
                continue
            klass, _ = classify(node)
            if _on_vendor(node, klass, target):
                continue
            name = op_name(node.target)
            if node.meta.get(LAYOUT_COPY):
                not_decomposable[node] = "a copy into the traced layout: its decomposition would lose the layout"
                continue
            if decomposition_for(node.target) is None:
                not_decomposable[node] = f"no ATen decomposition for {name}"
                continue
            try:
                sub = memo.trace(node)
                whole = _generated_whole(node, sub, target) if target.has_triton else None
                if whole is not None:
                    not_decomposable[node] = whole
                    continue
                new_nodes = splice_decomposition(gm, node, sub)
                memo.spliced(sub, new_nodes)
            except NotDecomposable as e:
                not_decomposable[node] = str(e)
                continue
            ops = sorted({op_name(n.target).split(".")[1] for n in new_nodes
                          if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)})
            decompositions.append(Decision(
                node.name, name, "decompose",
                f"target {target.name!r} does not run {name}; decomposed into {len(new_nodes)} node(s): "
                f"{', '.join(ops)}"))
            changed = True
        if not changed:
            break
    else:
        log.warning("decomposition did not settle after %d rounds", MAX_DECOMPOSE_ROUNDS)
    gm.graph.lint()
    gm.recompile()

    facts = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        klass, why = classify(node)
        if klass is NodeClass.STRUCTURAL:
            continue
        vendor = _on_vendor(node, klass, target)
        facts.append(NodeFacts(node, op_name(node.target), klass, why, vendor,
                               not_decomposable.get(node, "not needed")))
    return GraphPlan(gm, target, decompositions, facts)
