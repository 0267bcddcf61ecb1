"""The decomposition table (tier 1): torch._decomp's table plus our own rows for ops it lacks.

``decompose_node`` rewrites ONE node of an ATen graph into its decomposition (re-traced with
make_fx under the graph's fake mode with a one-entry table) and splices the result in place, so
that the new nodes can be planned again, each on its own.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._decomp import decomposition_table as _torch_table
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

aten = torch.ops.aten

# --- our own decompositions, for ops torch has none for ------------------------------------------
# Each one uses only ops that have their own lowering (or decomposition), so a chip without a
# matrix unit or a convolution engine still runs these models, node by node.

OWN_DECOMPOSITIONS: dict[Any, Callable] = {}


def _register(*ops):
    def deco(fn):
        for op in ops:
            OWN_DECOMPOSITIONS[op] = fn
        return fn
    return deco


@_register(aten.mm.default)
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # (M, K, 1) * (1, K, N) summed over K: a matmul from multiply and sum.
    return (a.unsqueeze(2) * b.unsqueeze(0)).sum(1)


@_register(aten.bmm.default)
def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.unsqueeze(3) * b.unsqueeze(1)).sum(2)


@_register(aten.max.dim)
def _max_dim(x: torch.Tensor, dim: int, keepdim: bool = False):
    return aten.amax.default(x, [dim], keepdim), aten.argmax.default(x, dim, keepdim)


@_register(aten.min.dim)
def _min_dim(x: torch.Tensor, dim: int, keepdim: bool = False):
    return aten.amin.default(x, [dim], keepdim), aten.argmin.default(x, dim, keepdim)


@_register(aten.convolution.default)
def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """Non-transposed 1-D and 2-D convolution as im2col (unfold) + batched matmul."""
    if transposed or weight.dim() not in (3, 4):
        return NotImplemented
    one_d = weight.dim() == 3
    if one_d:  # treat (N, C, L) as (N, C, 1, L)
        x, weight = x.unsqueeze(2), weight.unsqueeze(2)
        stride, padding, dilation = [1, stride[0]], [0, padding[0]], [1, dilation[0]]
    n = x.shape[0]
    cout, cin_g, kh, kw = weight.shape
    cols = torch.nn.functional.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
    oh = (x.shape[2] + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (x.shape[3] + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    # cols: (N, C*kh*kw, L) -> (N*G, C/G*kh*kw, L); weight: (G, Cout/G, C/G*kh*kw)
    cols = cols.reshape(n * groups, cin_g * kh * kw, oh * ow)
    w = weight.reshape(groups, cout // groups, cin_g * kh * kw)
    w = w.unsqueeze(0).expand(n, groups, cout // groups, cin_g * kh * kw).reshape(n * groups, cout // groups, -1)
    out = torch.bmm(w, cols).reshape(n, cout, oh, ow)
    if bias is not None:
        out = out + bias.reshape(1, cout, 1, 1)
    return out.squeeze(2) if one_d else out


# Ops torch's core decomposition table would break up while tracing, but that vendors run as one
# fused kernel (flash attention): aot_autograd keeps them whole, and the tier ladder decomposes
# them (tier 1) only on a target that cannot run them.
KEEP_WHOLE_AT_TRACE = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_attention_math.default,
    # index_add decomposes into index_put(accumulate=True), which CUDA runs as a sort of the indices
    # plus bounds checks and asserts: about a dozen kernels per call (measured in the MoE benchmark
    # on the H200: 0.37 of its 1.04 ms of GPU time); ATen's index_add and the indexing family's
    # kernel add with atomics in one pass
    aten.index_add.default,
    aten.index_add_.default,
)


def trace_decompositions(target: Any = None) -> dict[Any, Callable]:
    """The table aot_autograd traces with: torch's core ATen decompositions, minus the ops above;
    on a CUDA target without vendor attention, CUDA's attention ops as the device-neutral flash op
    (neutral_attention.py)."""
    from torch._decomp import core_aten_decompositions

    from torch_kernelize.lowering.neutral_attention import neutral_attention_table
    table = dict(core_aten_decompositions())
    for op in KEEP_WHOLE_AT_TRACE:
        table.pop(op, None)
    table.update(neutral_attention_table(target))
    return table


def trace_rewrites(target: Any) -> list[str]:
    """The ops ``target``'s trace rewrites beyond the common table (part of a traced graph's key)."""
    from torch_kernelize.lowering.neutral_attention import neutral_attention_table
    from torch_kernelize.lowering.targets import op_name
    return sorted(op_name(op) for op in neutral_attention_table(target))


def decomposition_for(op: Any) -> Callable | None:
    """torch's decomposition first (it is the maintained one), then ours."""
    return _torch_table.get(op) or OWN_DECOMPOSITIONS.get(op)


# --- splicing one node ---------------------------------------------------------------------------

class NotDecomposable(Exception):
    pass


def decompose_node(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """Replace ``node`` by the graph of its decomposition; return the new nodes.

    Raises NotDecomposable when the op has no decomposition or the decomposition declines these
    inputs (it returns NotImplemented, or its trace still contains the op itself).
    """
    op = node.target
    fn = decomposition_for(op)
    if fn is None:
        raise NotDecomposable(f"no decomposition for {op}")
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    node_pos = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    vals = [flat[i].meta["val"] for i in node_pos]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])

    def call(*leaves):
        new = list(flat)
        for i, v in zip(node_pos, leaves):
            new[i] = v
        args, kwargs = pytree.tree_unflatten(new, spec)
        return op(*args, **kwargs)

    try:
        if fake_mode is not None:
            with fake_mode:
                sub = make_fx(call, decomposition_table={op: fn})(*vals)
        else:
            sub = make_fx(call, decomposition_table={op: fn})(*vals)
    except Exception as e:  # a decomposition that cannot trace these inputs declines them
        raise NotDecomposable(f"decomposition of {op} failed to trace: {type(e).__name__}: {e}") from e
    if any(n.target == op for n in sub.graph.nodes):
        raise NotDecomposable(f"the decomposition of {op} does not apply to these inputs")
    prims = sorted({str(n.target) for n in sub.graph.nodes
                    if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "prims"})
    if prims:  # e.g. aten.erf -> prims.erf: the same computation under another name, not a lowering
        raise NotDecomposable(f"{op} decomposes only to primitives ({', '.join(prims)})")

    graph = gm.graph
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    val_map = {ph: flat[i] for ph, i in zip(placeholders, node_pos)}
    before = set(graph.nodes)
    with graph.inserting_before(node):
        out = graph.graph_copy(sub.graph, val_map)
    new_nodes = [n for n in graph.nodes if n not in before]
    if isinstance(out, (tuple, list)):
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise NotDecomposable(f"tuple output of {op} used other than by getitem")
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)
    return new_nodes
