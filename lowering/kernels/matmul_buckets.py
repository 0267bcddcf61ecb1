"""Shape buckets of the matmul family: which of a GEMM's (or a group's) sizes vary at run time (M,
and bmm's batch), or why a bucket's dims cannot (K and N are literals of the kernel, strides that
depend on M, variables that size nothing the kernel reads)."""
from __future__ import annotations

import dataclasses
import json

from torch_kernelize.core.buckets import Dim, contiguous_strides, unbucketable
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.lowering.kernels.matmul_group import Group
from torch_kernelize.lowering.kernels.matmul_plan import Plan


@dataclasses.dataclass(frozen=True)
class Varying:
    """The sizes a bucketed GEMM takes at run time: the variable (buckets.py) that is M, the one
    that is bmm's batch, and the tensors whose batch stride is a multiple of M (a contiguous
    [B, M, *] tensor): pointer tile name ("a", "in<i>", "out<o>") -> that multiple."""
    m: int | None
    batch: int | None
    m_scaled: dict[str, int]


def varying_of(spec: KernelSpec, plan: Plan | Group, dims: tuple[Dim, ...]) -> Varying | str:
    """What of ``plan`` varies with ``dims``, or why the kernel cannot take those sizes at run time."""
    if isinstance(plan, Group):
        return _group_varying(plan, dims)
    rank = 3 if plan.op == "bmm" else 2
    if plan.a == plan.b and any(s == "in" and i == plan.a for s, i, _, _ in dims):
        return "A and B are one tensor: its sizes would vary as both M and K"
    gemm = lambda rows, cols: {rank - 2: rows, rank - 1: cols, **({0: "batch"} if rank == 3 else {})}
    # each pointer tile of the kernel: its tensor, and the role of each of that tensor's dims
    tiles: list[tuple[str, tuple[str, int], dict[int, str]]] = [
        ("a", ("in", plan.a), gemm("M", "K")), ("b", ("in", plan.b), gemm("K", "N"))]
    for i, (sb, sm, sn) in plan.tile_inputs.items():
        r = len(spec.inputs[i].shape)
        tiles.append((f"in{i}", ("in", i), {d: role for d, role, st in ((r - 3, "batch", sb), (r - 2, "M", sm),
                                                                        (r - 1, "N", sn)) if d >= 0 and st}))
    tiles += [(f"out{o}", ("out", o), gemm("M", "N")) for o in range(len(spec.outputs))]
    roles: dict[tuple[str, int, int], str] = {}
    for _, (side, i), rs in tiles:
        for d, role in rs.items():
            if roles.setdefault((side, i, d), role) != role and "M" in (role, roles[(side, i, d)]):
                return f"{side}put {i} dim {d} is M of one operand and {role} of another"
    read = {t for _, t, _ in tiles}
    var_of: dict[str, int] = {}
    for side, i, d, v in dims:
        if (side, i) not in read:
            continue   # an input the kernel does not read (addmm's self when beta == 0)
        role = roles.get((side, i, d))
        if role in ("K", "N"):
            return (f"{role} varies ({side}put {i} dim {d}): the kernel takes M (and bmm's batch) at run time, "
                    f"K and N are literals (a model's weights)")
        if role is None:
            return unbucketable(spec, dims) or f"{side}put {i} dim {d} varies, but the kernel broadcasts that dim"
        if var_of.setdefault(role, v) != v:
            return f"{role} is two variables ({var_of[role]} and {v})"
    if (problem := unbucketable(spec, dims)) is not None:   # (after K and N: the clearer reason)
        return problem
    if "M" in var_of and var_of["M"] == var_of.get("batch"):
        return "the batch and M are one variable"
    if any(v not in var_of.values() for *_, v in dims):
        return "a variable sizes only inputs the kernel does not read"
    marked = {(side, i, d) for side, i, d, _ in dims}
    for (side, i, d), role in roles.items():
        if role in var_of and (side, i, d) not in marked:
            return f"{side}put {i} has {role} in dim {d}, but that dim does not vary with {role}"
    m_scaled: dict[str, int] = {}
    for name, (side, i), rs in tiles:
        m_dim = next((d for d, role in rs.items() if role == "M"), None)
        if "M" in var_of and m_dim is not None and m_dim > 0:
            # a contiguous [B, M, *] tensor: its batch stride is M times the rest
            shape = (spec.inputs if side == "in" else spec.outputs)[i].shape
            m_scaled[name] = contiguous_strides(shape[:m_dim] + (1,) + shape[m_dim + 1:])[0]
    return Varying(var_of.get("M"), var_of.get("batch"), m_scaled)


def _group_varying(group: Group, dims: tuple[Dim, ...]) -> Varying | str:
    """A group serves a bucket when every member's M is one variable (the tokens every projection
    of a layer reads): each member is checked as a GEMM of its own, its dims renumbered."""
    if (problem := unbucketable(group.spec, dims)) is not None:
        return problem
    node_maps = json.loads(group.spec.graph)["members"]
    found: list[Varying] = []
    for j, (sub, plan, ins, outs, idxs) in enumerate(zip(group.member_specs, group.members, group.in_maps,
                                                         group.out_maps, node_maps)):
        local = {"in": ins, "out": outs, "node": idxs}
        sub_dims = tuple((side, local[side].index(i), d, v) for side, i, d, v in dims if i in local[side])
        v = varying_of(sub, plan, sub_dims) if sub_dims else None
        if isinstance(v, str):
            return f"member {j}: {v}"
        if v is None or v.m is None:
            return f"member {j}: its M does not vary (a group's members take one run-time M)"
        found.append(v)
    if len({v.m for v in found}) > 1:
        return f"the members' M are different variables ({sorted({v.m for v in found})}): one launch takes one M"
    if len({m.M for m in group.members}) > 1:
        return f"the members' M differ at the representative ({[m.M for m in group.members]}) though one variable sizes them"
    return found[group.template]
