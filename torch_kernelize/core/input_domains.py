"""What an op requires of its integer inputs beyond their shapes and dtypes, as a table.

An op like ``_embedding_bag`` rejects most inputs of the right shapes: its offsets must rise
from 0, its ids must name rows of the table. Validation trials, reproducers' task.md and
check_candidate.py draw uniform integers in [-8, 9) by default, which the reference then
rejects; the rows below say, per op and input, what the op requires (recorded in a reproducer
beside the captured values) and remake a drawn input so that it holds (``constrain``): the same
values for the same generator, so a trial's seed still fixes its inputs.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import resolve_op

# a rule: (arguments by schema name, input metas' shapes) -> {input name: (requirement, remake)}
# where remake(drawn tensor, generator, arguments' tensors by name) -> a tensor that holds it
Remake = Callable[[torch.Tensor, torch.Generator, dict[str, torch.Tensor]], torch.Tensor]


def _ids_below(rows_of: str, dim: int = 0) -> tuple[str, Remake]:
    def remake(t: torch.Tensor, g: torch.Generator, named: dict[str, torch.Tensor]) -> torch.Tensor:
        n = named[rows_of].size(dim)
        return torch.randint(0, max(n, 1), t.shape, generator=g, device=g.device).to(t.dtype) if n else t
    return f"ids in [0, {rows_of}.size({dim}))", remake


def _offsets(ids: str, include_last: bool) -> tuple[str, Remake]:
    def remake(t: torch.Tensor, g: torch.Generator, named: dict[str, torch.Tensor]) -> torch.Tensor:
        n, bags = named[ids].numel(), t.numel()
        cuts = torch.randint(0, n + 1, (max(bags - 1, 0),), generator=g, device=g.device).sort().values
        out = torch.cat([torch.zeros(1, dtype=cuts.dtype, device=cuts.device), cuts])[:bags]
        if include_last and bags:
            out[-1] = n
        return out.to(t.dtype)
    last = f", the last == {ids}.numel()" if include_last else f", at most {ids}.numel()"
    return f"non-decreasing from 0{last}", remake


def _sorted_last_dim() -> tuple[str, Remake]:
    return "sorted along its last dim", lambda t, g, named: t.sort(-1).values


def _lengths_summing_to(data: str) -> tuple[str, Remake]:
    def remake(t: torch.Tensor, g: torch.Generator, named: dict[str, torch.Tensor]) -> torch.Tensor:
        total, parts = named[data].size(0), t.numel()
        cuts = torch.randint(0, total + 1, (max(parts - 1, 0),), generator=g, device=g.device).sort().values
        edges = torch.cat([torch.zeros(1, dtype=cuts.dtype, device=cuts.device), cuts,
                           torch.full((1,), total, dtype=cuts.dtype, device=cuts.device)])
        return edges.diff()[:parts].to(t.dtype).reshape(t.shape) if parts else t
    return f"non-negative, summing to {data}.size(0)", remake


def _counts_summing_to(total: int) -> tuple[str, Remake]:
    def remake(t: torch.Tensor, g: torch.Generator, named: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = t.numel()
        cuts = torch.randint(0, total + 1, (max(parts - 1, 0),), generator=g, device=g.device).sort().values
        edges = torch.cat([torch.zeros(1, dtype=cuts.dtype, device=cuts.device), cuts,
                           torch.full((1,), total, dtype=cuts.dtype, device=cuts.device)])
        return edges.diff()[:parts].to(t.dtype).reshape(t.shape) if parts else t
    return f"non-negative, summing to output_size ({total})", remake


def _group_ends(rows_of: str) -> tuple[str, Remake]:
    """A grouped matmul's ``offs``: each group's end, non-decreasing in [0, rows]; the last is the
    row count in half the draws (every row routed), below it in the others (rows of no group)."""
    def remake(t: torch.Tensor, g: torch.Generator, named: dict[str, torch.Tensor]) -> torch.Tensor:
        n, groups = named[rows_of].size(0), t.numel()
        ends = torch.randint(0, n + 1, (groups,), generator=g, device=g.device).sort().values
        if groups and bool(torch.randint(0, 2, (1,), generator=g, device=g.device)):
            ends[-1] = n
        return ends.to(t.dtype)
    return f"each group's end, non-decreasing in [0, {rows_of}.size(0)]", remake


def _embedding_bag(args: dict[str, Any]) -> dict[str, tuple[str, Remake]]:
    return {"indices": _ids_below("weight"), "offsets": _offsets("indices", bool(args.get("include_last_offset")))}


def _searchsorted(args: dict[str, Any]) -> dict[str, tuple[str, Remake]]:
    return {} if isinstance(args.get("sorter"), dict) else {"sorted_sequence": _sorted_last_dim()}


RULES: dict[str, Callable[[dict[str, Any]], dict[str, tuple[str, Remake]]]] = {
    "aten._embedding_bag.default": _embedding_bag,
    "aten._embedding_bag_forward_only.default": _embedding_bag,
    "aten.embedding_bag.padding_idx": _embedding_bag,
    "aten.embedding.default": lambda args: {"indices": _ids_below("weight")},
    "aten.searchsorted.Tensor": _searchsorted,
    "aten.bucketize.Tensor": lambda args: {"boundaries": _sorted_last_dim()},
    "aten.repeat_interleave.Tensor": lambda args: ({"repeats": _counts_summing_to(int(args["output_size"]))}
                                                   if args.get("output_size") is not None else {}),
    "aten.segment_reduce.default": lambda args: ({"lengths": _lengths_summing_to("data")}
                                                 if args.get("axis", 0) == 0 else {}),
    # transformers' MoE experts (integrations/moe.py): rows sorted by expert, offs the groups' ends
    "transformers.grouped_mm_fallback.default": lambda args: {"offs": _group_ends("input")},
    "aten._grouped_mm.default": lambda args: {"offs": _group_ends("self")},
}


def _bound(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An op's arguments by schema name (tensors stay {"tensor": i})."""
    schema = resolve_op(op)._schema
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    return {**dict(zip(positional, args)), **kwargs}


def _as_spec_input(a: Any) -> Any:
    """A region node's argument with a region input ({"input": i}) written as a spec's ({"tensor": i})."""
    if isinstance(a, dict) and set(a) == {"input"}:
        return {"tensor": a["input"]}
    return [_as_spec_input(x) for x in a] if isinstance(a, list) else a


def _sites(spec: KernelSpec) -> list[tuple[Callable, dict[str, Any]]]:
    """(rule, bound arguments) of the spec's op, or of each node of a region whose op has a rule
    (the inputs it reads directly are the region's: a region holding transformers' grouped matmul
    draws its offs as the op alone does)."""
    if spec.graph is None:
        rule = RULES.get(spec.op)
        return [(rule, _bound(spec.op, spec.args, spec.kwargs))] if rule is not None else []
    nodes = json.loads(spec.graph).get("nodes", [])
    return [(RULES[n["op"]], _bound(n["op"], _as_spec_input(n["args"]),
                                    {k: _as_spec_input(v) for k, v in n["kwargs"].items()}))
            for n in nodes if n["op"] in RULES]


def _tensor_names(args: dict[str, Any]) -> dict[str, int]:
    return {k: int(v["tensor"]) for k, v in args.items() if isinstance(v, dict) and set(v) == {"tensor"}}


def requirements(spec: KernelSpec) -> dict[int, str]:
    """Per input index, what the op (a region's ops) requires of its values ({} without a rule)."""
    out = {}
    for rule, args in _sites(spec):
        names = _tensor_names(args)
        out.update({names[k]: f"{k}: {text}" for k, (text, _) in rule(args).items() if k in names})
    return out


def constrain(spec: KernelSpec, tensors: Sequence[torch.Tensor], g: torch.Generator) -> list[torch.Tensor]:
    """``tensors`` (a trial's drawn inputs) with each input the op (a region's ops) constrains
    remade to hold its requirement (seeded by ``g``); the rest as drawn. Strides are kept."""
    out = list(tensors)
    for rule, args in _sites(spec):
        names = _tensor_names(args)
        for name, (_, remake) in rule(args).items():  # in the rule's order: ids before their offsets
            if name in names:
                i = names[name]
                valid = remake(out[i], g, {k: out[j] for k, j in names.items()})
                out[i] = torch.empty_strided(out[i].shape, out[i].stride(), dtype=out[i].dtype,
                                             device=out[i].device).copy_(valid)
    return out
