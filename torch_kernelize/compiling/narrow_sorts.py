"""Sorts of small integer keys made on the narrowest type that holds them.

An MoE router sorts its tokens' expert ids (``torch.sort(top_k_index.reshape(-1))`` in
transformers' experts code): int64 keys, though every id is below the expert count. A GPU radix
sort makes one pass per key byte it is told to sort (CUDA's sort passes all 64 bits of an int64
key), eight where one would do for eight experts. Where the keys are indices a ``topk`` (or
``argmax``/``argmin``) picked along a dim of known size n, through views, every value lies in
[0, n): the sort runs on keys cast to the narrowest signed type holding n - 1 and its values are
cast back. The order of keys, ties included (sorts are stable by then: stable_sorts.py), and the
values are the same; only the key bytes differ.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

SORTS = {aten.sort.stable, aten.sort.default}
# ops whose output holds the same values as their input (views, copies of the same dtype)
SAME_VALUES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
               aten.permute.default, aten.alias.default, aten.flatten.using_ints, aten.squeeze.dim,
               aten.unsqueeze.default, aten.expand.default, aten.t.default, aten.transpose.int}
NARROW = ((torch.int8, 127), (torch.int16, 32767), (torch.int32, 2 ** 31 - 1))


def index_bound(node: fx.Node) -> int | None:
    """n where every value of ``node`` is an index in [0, n) that an op picked (topk's,
    argmax's, argmin's along a dim of static size n), through views; None where unknown."""
    while node.op == "call_function" and node.target in SAME_VALUES:
        node = node.args[0]
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], fx.Node) \
            and node.args[0].target is aten.topk.default:
        picked = node.args[0]
        x, dim = picked.args[0], picked.args[2] if len(picked.args) > 2 else picked.kwargs.get("dim", -1)
    elif node.target in (aten.argmax.default, aten.argmin.default):
        x, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dim is None:
            return None
    else:
        return None
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    size = val.shape[dim] if isinstance(val, torch.Tensor) and val.dim() else None
    return size if isinstance(size, int) else None


def narrow_sorts(graph: fx.Graph) -> int:
    """Rewrite in place each sort of int64 (or int32) index keys onto the narrowest type that
    holds them; how many."""
    count = 0
    for sort in list(graph.nodes):
        if sort.op != "call_function" or sort.target not in SORTS:
            continue
        keys = sort.args[0]
        val = keys.meta.get("val") if isinstance(keys, fx.Node) else None
        bound = index_bound(keys) if isinstance(val, torch.Tensor) else None
        if bound is None or val.dtype not in (torch.int64, torch.int32):
            continue
        narrow = next(t for t, top in NARROW + ((val.dtype, None),) if top is None or bound - 1 <= top)
        if narrow.itemsize >= val.dtype.itemsize:
            continue
        values = [u for u in sort.users if u.target is operator.getitem and u.args[1] == 0]
        with graph.inserting_before(sort):
            cast = graph.call_function(aten._to_copy.default, (keys,), {"dtype": narrow})
        cast.meta["val"] = _like(val, narrow)
        sort.replace_input_with(keys, cast)
        _narrow_meta(sort, narrow)
        for v in values:  # the sorted keys, back to the type the graph reads
            with graph.inserting_after(v):
                wide = graph.call_function(aten._to_copy.default, (v,), {"dtype": val.dtype})
            wide.meta["val"] = v.meta["val"]
            v.replace_all_uses_with(wide, delete_user_cb=lambda u: u is not wide)
            v.meta["val"] = _like(v.meta["val"], narrow)
        count += 1
    return count


def _like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A value like ``t`` (a node's meta: fake under its mode, sizes symbolic or not) of ``dtype``."""
    with getattr(t, "fake_mode", None) or contextlib.nullcontext():
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)


def _narrow_meta(sort: fx.Node, dtype: torch.dtype) -> None:
    values, indices = sort.meta["val"]
    sort.meta["val"] = (_like(values, dtype), indices)
