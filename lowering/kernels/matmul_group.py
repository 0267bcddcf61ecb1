"""Matmul groups (matmul_group regions: one launch for several GEMMs of one structure, e.g. an MoE's
experts or a layer's Q/K/V projections): each member as a matmul region spec of its own, and the
group's plan, whose members must differ in M only (they run one body)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from torch_kernelize.core.region_graph import node_ref
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.lowering.kernels.matmul_plan import Plan


@dataclasses.dataclass
class Group:
    """A matmul_group region: its members' plans, each in its own numbering (member specs), and
    the maps from a member's input / output numbers to the group's."""
    spec: KernelSpec
    members: list[Plan]
    member_specs: list[KernelSpec]
    in_maps: list[list[int]]
    out_maps: list[list[int]]

    @property
    def template(self) -> int:
        """The member whose code every member runs: one with the largest M (a member of one row
        may carry any stride along M, or 0 for its broadcast inputs; the template's must be real)."""
        return max(range(len(self.members)), key=lambda j: self.members[j].M)

    @property
    def rep(self) -> Plan:
        """The template's plan: tile sizes are checked against the largest M."""
        return self.members[self.template]

    def tiles(self, bm: int, bn: int) -> int:
        return sum(-(-m.M // bm) * -(-m.N // bn) for m in self.members)


def _member_specs(spec: KernelSpec, graph: dict[str, Any]) -> list[tuple[KernelSpec, list[int], list[int]]] | str:
    """Each member of a matmul_group graph as a matmul region spec of its own (inputs numbered
    by first use), with its input and output maps into the group's numbering."""
    members, nodes, outputs = graph.get("members"), graph["nodes"], list(graph["outputs"])
    if not members or len(members) < 2:
        return "a matmul group needs two members or more"
    if sorted(j for m in members for j in m) != list(range(len(nodes))):
        return "the members do not partition the group's nodes"
    out = []
    for idxs in members:
        local = {j: k for k, j in enumerate(idxs)}
        ins: list[int] = []

        def enc(a: Any) -> Any:
            r = node_ref(a)
            if r is not None and r[0] == "input" and "input" in a:
                if r[1] not in ins:
                    ins.append(r[1])
                return {"input": ins.index(r[1])}
            if r is not None and r[0] == "node":
                if r[1] not in local:
                    raise ValueError(f"a member reads node {r[1]} of another member")
                return {"node": local[r[1]]}
            return [enc(x) for x in a] if isinstance(a, list) else a

        try:
            sub = [{"op": nodes[j]["op"], "args": enc(nodes[j]["args"]),
                    "kwargs": {k: enc(v) for k, v in nodes[j]["kwargs"].items()}, "meta": nodes[j]["meta"]}
                   for j in idxs]
        except ValueError as e:
            return str(e)
        outs = [o for o, j in enumerate(outputs) if j in local]
        sub_graph = {"kind": "matmul", "nodes": sub, "outputs": [local[outputs[o]] for o in outs]}
        out.append((KernelSpec("region", [], {}, tuple(spec.inputs[i] for i in ins), tuple(spec.outputs[o] for o in outs),
                               len(outs) > 1, json.dumps(sub_graph, sort_keys=True, separators=(",", ":"))), ins, outs))
    if sorted(o for _, _, outs in out for o in outs) != list(range(len(spec.outputs))):
        return "the members do not partition the group's outputs"
    return out


def _shape_free(plan: Plan, spec: KernelSpec, one_row: bool = False) -> tuple:
    """Everything the generated GEMM bakes in, except M: members that agree here share a body.
    ``one_row``: leave out the strides along M too (a member of one row reads row 0 only)."""
    m = (lambda st, i: st[:i] + (None,) + st[i + 1:]) if one_row else (lambda st, i: tuple(st))
    nodes = tuple((n.index, n.op, json.dumps(n.args, sort_keys=True, default=str), tuple(n.operands), n.dtype,
                   n.compare_dtype) for n in plan.nodes)
    return (plan.op, plan.dtype, plan.B, plan.N, plan.K, plan.a, m(plan.a_strides, 1), plan.b, plan.b_strides,
            plan.bias, plan.beta, plan.alpha, nodes, tuple(plan.outputs),
            tuple(sorted((i, m(st, 1)) for i, st in plan.tile_inputs.items())), tuple(plan.helpers),
            tuple((o.dtype, m(tuple(o.stride), 0)) for o in spec.outputs),
            tuple((i.dtype, tuple(i.shape[1:]), i.device) for i in spec.inputs))


def group_plan(spec: KernelSpec, graph: dict[str, Any], plan_of: Callable[[KernelSpec], Any]) -> Group | str:
    """The plan of a matmul_group graph: each member planned as a GEMM of its own (``plan_of``, the
    family's memoized ``plan``), then checked to differ from the template in M only."""
    parts = _member_specs(spec, graph)
    if isinstance(parts, str):
        return parts
    plans = []
    for j, (sub, _, _) in enumerate(parts):
        plan = plan_of(sub)
        if isinstance(plan, str):
            return f"member {j}: {plan}"
        if plan.B != 1:
            return f"member {j}: batched (bmm) GEMMs are not grouped"
        plans.append(plan)
    group = Group(spec, plans, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts])
    t = group.template
    for j in range(len(plans)):
        one = plans[j].M == 1
        if _shape_free(plans[j], parts[j][0], one) != _shape_free(plans[t], parts[t][0], one):
            return f"member {j} differs from member {t} in more than M (operands, strides, epilogue or sizes)"
    return group
