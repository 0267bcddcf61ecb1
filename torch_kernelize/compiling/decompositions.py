"""The decomposition table (tier 1): torch._decomp's table plus our own rows for ops it lacks.

``decompose_node`` rewrites ONE node of an ATen graph into its decomposition (re-traced with
make_fx under the graph's fake mode with a one-entry table) and splices the result in place, so
that the new nodes can be planned again, each on its own.
"""
from __future__ import annotations

import itertools
import math
import operator
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx
from torch._decomp import decomposition_table as _torch_table
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.backward_decompositions import BACKWARD_DECOMPOSITIONS
from torch_kernelize.compiling.decomposition_registry import registrar
from torch_kernelize.compiling.decompositions_conv import CONV_DECOMPOSITIONS
from torch_kernelize.compiling.decompositions_sampling import SAMPLING_DECOMPOSITIONS
from torch_kernelize.compiling.decompositions_elementwise import ELEMENTWISE_DECOMPOSITIONS, ELEMENTWISE_OVERRIDES
from torch_kernelize.compiling.decompositions_histogram import HISTOGRAM_DECOMPOSITIONS, HISTOGRAM_OVERRIDES
from torch_kernelize.compiling.decompositions_scatter import SCATTER_DECOMPOSITIONS, SCATTER_OVERRIDES
from torch_kernelize.compiling.decompositions_triangular import TRIANGULAR_DECOMPOSITIONS
from torch_kernelize.compiling.ranking_decompositions import RANKING_DECOMPOSITIONS
from torch_kernelize.core.shapes import dense_order

if TYPE_CHECKING:
    from torch_kernelize.core.targets import Target

aten = torch.ops.aten

# --- our own decompositions, for ops torch has none for ------------------------------------------
# Each one uses only ops that have their own lowering (or decomposition), so a chip without a
# matrix unit or a convolution engine still runs these models, node by node.

OWN_DECOMPOSITIONS: dict[Any, Callable] = {}
# Ops whose torch decomposition does not compute what the op returns, so that ours is used instead
OVERRIDES: set[Any] = set()
_register = registrar(OWN_DECOMPOSITIONS, OVERRIDES)


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


@_register(aten.max.default)
def _max_all(x: torch.Tensor):
    return aten.amax.default(x, []) if x.numel() else NotImplemented  # (max of nothing raises)


@_register(aten.min.default)
def _min_all(x: torch.Tensor):
    return aten.amin.default(x, []) if x.numel() else NotImplemented


@_register(aten.kthvalue.default)
def _kthvalue(x: torch.Tensor, k: int, dim: int = -1, keepdim: bool = False):
    """The k-th smallest along ``dim`` from a stable sort (the sort family's): NaN counts as the
    largest, as in ATen; of equal values, the first one's index."""
    if x.dim() == 0 or not 1 <= k <= x.size(dim):
        return NotImplemented  # (a 0-d input, or k out of range: ATen's own error)
    values, indices = torch.sort(x, dim=dim, stable=True)
    values, indices = values.narrow(dim, k - 1, 1), indices.narrow(dim, k - 1, 1)
    return (values, indices) if keepdim else (values.squeeze(dim), indices.squeeze(dim))


@_register(aten.median.default)
def _median(x: torch.Tensor):
    """The lower median of all elements from a sort; NaN where any element is NaN (sorted last)."""
    if x.numel() == 0:
        return NotImplemented
    ordered = torch.sort(x.reshape(-1), stable=True).values
    last, middle = ordered[-1], ordered[(x.numel() - 1) // 2]
    return torch.where(last != last, last, middle)


@_register(aten.copy.default)
def _copy(x: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
    """The functional copy (src's values in x's dtype and shape) as one conversion of the
    broadcast src, which the elementwise family generates; x's layout is kept (keep_layout)."""
    if src.device != x.device:
        return NotImplemented  # a transfer, not a kernel
    return aten._to_copy.default(src.expand(x.shape), dtype=x.dtype)


@_register(aten.sum.dim_IntList, override=True)  # torch's is prims.sum: a rename, not a lowering
def _count_true(x: torch.Tensor, dim, keepdim: bool = False, *, dtype=None):
    """A sum of bools (a count) as a float32 mean times the count of elements, rounded (the
    reductions family generates the mean; a float sum would be this op again): exact while the
    count stays below 2**24; any other sum declines (the families take it whole)."""
    if x.dtype != torch.bool or x.numel() > 2**24:
        return NotImplemented
    dims = [d % max(x.dim(), 1) for d in (dim if dim else range(x.dim()))]
    n = math.prod(x.size(d) for d in dims) if x.dim() else 1
    if n == 0:
        return NotImplemented
    mean = x.to(torch.float32).mean(dims, keepdim)
    return torch.floor(mean * n + 0.5).to(dtype or torch.int64)


@_register(aten.cat.default, override=True)  # torch's is prims.cat: a rename, not a lowering
def _cat(tensors, dim: int = 0):
    """cat from gathers and selects, for a chip whose runtime has no cat (a fused region covers
    most cats, but not one whose pieces read the same tensor: RoPE's ``cat((freqs, freqs))``).
    Each piece is gathered along ``dim`` to the output's size and later pieces are selected
    where the index falls in them."""
    pieces = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]  # cat skips legacy 1-D empties
    if not pieces:
        return NotImplemented
    if len(pieces) == 1:
        return pieces[0].clone()
    dim = dim % pieces[0].dim()
    n = sum(p.size(dim) for p in pieces)
    index = torch.arange(n, device=pieces[0].device)
    where_dim = [1] * pieces[0].dim()
    where_dim[dim] = n
    out, start = None, 0
    for p in pieces:
        size = p.size(dim)
        if size == 0:
            continue
        part = p.index_select(dim, (index - start).clamp(0, size - 1))
        out = part if out is None else torch.where((index >= start).reshape(where_dim), part, out)
        start += size
    return out


@_register(aten.constant_pad_nd.default, override=True)  # torch's is prims.copy_to into a full tensor
def _constant_pad_nd(x: torch.Tensor, pad: list[int], value: float = 0.0):
    """Padding as a gather and a select per padded dim: output index i reads input i - low where
    that lies inside the input, else ``value``; a negative pad crops the same way."""
    if len(pad) % 2 or len(pad) // 2 > x.dim():
        return NotImplemented
    out = x
    for k in range(len(pad) // 2):
        dim, low, high = x.dim() - 1 - k, pad[2 * k], pad[2 * k + 1]
        if low == 0 and high == 0:
            continue
        n = out.size(dim)
        size = n + low + high
        if size <= 0 or n == 0:
            return NotImplemented  # an empty result or an empty input: nothing to gather from
        index = torch.arange(size, device=x.device) - low
        inside = (index >= 0) & (index < n)
        picked = out.index_select(dim, torch.where(inside, index, 0))
        shape = [1] * out.dim()
        shape[dim] = size
        out = torch.where(inside.reshape(shape), picked, torch.full((), value, dtype=x.dtype, device=x.device))
    return out.clone() if out is x else out


@_register(aten.index_select.default, override=True)
def _index_select(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """torch's decomposition (``x[..., index]``), but ``index``'s rule counts a negative index
    from the end where index_select raises, as eager does: a negative index is made out of range
    first, so the gather raises eager's IndexError instead of returning other rows."""
    size = x.shape[dim] if x.dim() else 1
    return _torch_table[aten.index_select.default](x, dim, torch.where(index < 0, size, index))


@_register(aten.flip.default, override=True)  # torch's is prims.rev: a rename, not a lowering
def _flip(x: torch.Tensor, dims: list[int]):
    out = x
    for d in dims:
        d %= max(x.dim(), 1)
        if x.dim() and x.size(d) > 1:
            out = out.index_select(d, torch.arange(x.size(d) - 1, -1, -1, device=x.device))
    return out.clone() if out is x else out


@_register(aten.searchsorted.Tensor)
def _searchsorted(sorted_sequence, values, *, out_int32: bool = False, right: bool = False, side=None,
                  sorter=None):
    """searchsorted of a 1-D sequence is bucketize (the same search, which decomposes); of rows
    (one sequence per row of ``values``), the count of each row's elements below each value
    (at or below: right), summed as float32 (exact below 2**24); a NaN value goes past the end."""
    right = right or side == "right"
    if sorter is not None:
        return NotImplemented
    if sorted_sequence.dim() == 1:
        return torch.bucketize(values, sorted_sequence, out_int32=out_int32, right=right)
    if sorted_sequence.shape[:-1] != values.shape[:-1] or sorted_sequence.size(-1) > 2**24:
        return NotImplemented
    seq, v = sorted_sequence.unsqueeze(-2), values.unsqueeze(-1)
    below = (seq <= v) if right else (seq < v)
    count = torch.where(values != values, float(sorted_sequence.size(-1)), below.to(torch.float32).sum(-1))
    return count.to(torch.int32 if out_int32 else torch.int64)


def _arg_best(x: torch.Tensor, dim: int | None, keepdim: bool, largest: bool):
    """The first index of the row's max (min); a NaN counts as the best, as ATen's argmax/argmin.
    The indices are reduced as float32 (the reductions family's type): exact below 2**24."""
    if dim is None:
        flat = x.reshape(-1)
        i = _arg_best(flat, 0, False, largest)
        return i.reshape([1] * x.dim()) if keepdim else i
    dim %= max(x.dim(), 1)
    if x.dim() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    if x.size(dim) > 2**24:
        return NotImplemented
    best = x.amax(dim, keepdim=True) if largest else x.amin(dim, keepdim=True)
    hit = (x == best) | (x != x)
    shape = [1] * x.dim()
    shape[dim] = x.size(dim)
    index = torch.arange(x.size(dim), device=x.device, dtype=torch.float32).reshape(shape)
    return torch.where(hit, index, float(x.size(dim))).amin(dim, keepdim=keepdim).to(torch.int64)


@_register(aten.argmax.default)
def _argmax(x: torch.Tensor, dim: int | None = None, keepdim: bool = False):
    return _arg_best(x, dim, keepdim, True) if x.numel() else NotImplemented


@_register(aten.argmin.default)
def _argmin(x: torch.Tensor, dim: int | None = None, keepdim: bool = False):
    return _arg_best(x, dim, keepdim, False) if x.numel() else NotImplemented


def _window_sum(x: torch.Tensor, kernel: list[int], stride: list[int], outs: list[int]) -> torch.Tensor:
    """The sum over each pooling window of the last len(kernel) dims: one strided slice (a view)
    per kernel offset, added up (a fused region's work)."""
    k, total = len(kernel), None
    for offsets in itertools.product(*(range(n) for n in kernel)):
        v = x
        for d, o in enumerate(offsets):
            v = aten.slice.Tensor(v, x.dim() - k + d, o, o + (outs[d] - 1) * stride[d] + 1, stride[d])
        total = v if total is None else total + v
    return total


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, k: int):
    """Average pooling of the last ``k`` dims as a sum of strided slices over the window and a
    division (ceil_mode, whose windows run past the input, declines)."""
    def each(v):
        return list(v) * k if len(v) == 1 else list(v)
    kernel, pad = each(kernel_size), each(padding)
    step = each(stride) if stride else kernel
    if math.prod(kernel) > 64:
        return NotImplemented
    if ceil_mode:  # taken only where no window starts past the input (the sizes agree with floor's)
        for d in range(k):
            size = x.size(-k + d) + 2 * pad[d] - kernel[d]
            ceil_out = -(-size // step[d]) + 1
            if (ceil_out - 1) * step[d] >= x.size(-k + d) + pad[d]:
                ceil_out -= 1
            if ceil_out != size // step[d] + 1:
                return NotImplemented
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    pads = [p for d in reversed(pad) for p in (d, d)]
    padded = torch.constant_pad_nd(x.to(acc), pads, 0.0) if any(pad) else x.to(acc)
    outs = [(padded.size(-k + d) - kernel[d]) // step[d] + 1 for d in range(k)]
    total = _window_sum(padded, kernel, step, outs)
    if divisor_override:
        return (total / divisor_override).to(x.dtype)
    if count_include_pad or not any(pad):
        return (total / math.prod(kernel)).to(x.dtype)
    ones = torch.constant_pad_nd(torch.ones(x.shape[-k:], dtype=acc, device=x.device), pads, 0.0)
    return (total / _window_sum(ones, kernel, step, outs)).to(x.dtype)


@_register(aten.avg_pool2d.default)
def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    return _avg_pool(x, kernel_size, stride, [padding] if isinstance(padding, int) else padding, ceil_mode,
                     count_include_pad, divisor_override, 2)


@_register(aten.avg_pool3d.default)
def _avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    return _avg_pool(x, kernel_size, stride, [padding] if isinstance(padding, int) else padding, ceil_mode,
                     count_include_pad, divisor_override, 3)


def _attention_math(query, key, value, attn_mask, is_causal: bool, scale):
    """Attention as matmuls and a softmax: (output, logsumexp of each row of scores), the
    logsumexp in fp32 for half inputs, as flash attention kernels return it."""
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if k.size(1) != q.size(1):  # grouped-query attention: each K/V head serves a group of Q heads
        k = k.repeat_interleave(q.size(1) // k.size(1), 1)
        v = v.repeat_interleave(q.size(1) // v.size(1), 1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale)
    if is_causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(acc))
    lse = torch.logsumexp(scores, -1)
    # a row with every score masked has lse = -inf: its weights are 0, not NaN
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.matmul(p, v).to(query.dtype), lse


@_register(aten._scaled_dot_product_flash_attention_for_cpu.default, override=True)
def _sdpa_flash_cpu(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask=None,
                    scale=None):
    """CPU flash attention as math, with the op's real second output, the logsumexp. torch's
    decomposition returns the attention weights there, which the op's backward, reading a
    logsumexp, turns into wrong gradients."""
    if dropout_p != 0.0:
        return NotImplemented
    return _attention_math(query, key, value, attn_mask, is_causal, scale)


# The CUDA attention ops have no decomposition in torch. Ours computes the output and the
# logsumexp; their bookkeeping outputs (sequence offsets, RNG state, debug mask) are None, so the
# decomposition applies only where nothing reads them (decompose_node checks): inference graphs,
# and training graphs whose backward reads a logsumexp of the same shape.
@_register(aten._scaled_dot_product_flash_attention.default)
def _sdpa_flash_cuda(query, key, value, dropout_p: float = 0.0, is_causal: bool = False,
                     return_debug_mask: bool = False, *, scale=None):
    if dropout_p != 0.0 or return_debug_mask:
        return NotImplemented
    out, lse = _attention_math(query, key, value, None, is_causal, scale)
    return out, lse, None, None, query.size(2), key.size(2), None, None, None


@_register(aten._scaled_dot_product_efficient_attention.default)
def _sdpa_efficient_cuda(query, key, value, attn_bias, compute_log_sumexp: bool, dropout_p: float = 0.0,
                         is_causal: bool = False, *, scale=None):
    if dropout_p != 0.0:
        return NotImplemented
    out, lse = _attention_math(query, key, value, attn_bias, is_causal, scale)
    return out, lse, None, None


@_register(aten._scaled_dot_product_cudnn_attention.default)
def _sdpa_cudnn_cuda(query, key, value, attn_bias, compute_log_sumexp: bool, dropout_p: float = 0.0,
                     is_causal: bool = False, return_debug_mask: bool = False, *, scale=None):
    if dropout_p != 0.0 or return_debug_mask:
        return NotImplemented
    out, lse = _attention_math(query, key, value, attn_bias, is_causal, scale)
    return out, lse, None, None, query.size(2), key.size(2), None, None, None


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


def host_implementation(op: Any) -> Callable:
    """What runs ``op`` on the host CPU for the host fallback: the op itself, or, for an op the
    CPU has no kernel for (CUDA's flash attention), its decomposition run eagerly there."""
    if isinstance(op, torch._ops.OpOverload):
        name = op.name()
        if not any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
                   for key in ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd")):
            fn = decomposition_for(op)
            if fn is not None:
                return fn
    return op


def trace_decompositions(target: Target | None = None, varying: bool = False) -> dict[Any, Callable]:
    """The table aot_autograd traces with: torch's core ATen decompositions, minus the ops above;
    on a CUDA target without vendor attention, CUDA's attention ops as the device-neutral flash op;
    ``varying`` (an inference graph of varying sizes), cuDNN's attention as flash's
    (neutral_attention.py)."""
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    for op in KEEP_WHOLE_AT_TRACE:
        table.pop(op, None)
    table.update(_attention_rewrites(target, varying))
    return table


def trace_rewrites(target: Target | None, varying: bool = False) -> list[str]:
    """The ops ``target``'s trace rewrites beyond the common table (part of a traced graph's key)."""
    from torch_kernelize.core.targets import op_name
    return sorted(op_name(op) for op in _attention_rewrites(target, varying))


def _attention_rewrites(target: Target | None, varying: bool) -> dict[Any, Callable]:
    from torch_kernelize.compiling.neutral_attention import neutral_attention_table, varying_shape_attention_table
    table = varying_shape_attention_table(target) if varying else {}
    table.update(neutral_attention_table(target))  # (a chip without cuDNN's: the neutral op wins)
    return table


def decomposition_for(op: Any) -> Callable | None:
    """torch's decomposition first (it is the maintained one), then ours; ours where torch's
    does not compute the op's outputs (OVERRIDES)."""
    if op in OVERRIDES:
        return OWN_DECOMPOSITIONS[op]
    return _torch_table.get(op) or OWN_DECOMPOSITIONS.get(op)


# --- the layout contract ---------------------------------------------------------------------------
# A decomposition computes the op's values, not its layout: the math decomposition of CPU flash
# attention returns a contiguous (B, H, S, D) tensor where the op returns (B, S, H, D) memory,
# and the graph then views ``out.transpose(1, 2)`` as contiguous (functionalization dropped the
# ``.contiguous()`` that was a no-op at trace time). So each output whose strides differ from the
# traced ones is copied into the traced layout, with ops the planner can still place.

LAYOUT_COPY = "kernelize_layout_copy"  # node.meta flag: a copy into the traced layout, never decomposed


def _hinted(v: Any) -> int:
    return int(v.node.hint) if isinstance(v, torch.SymInt) and v.node.hint is not None else int(v)


def _same_layout(shape, got, want) -> bool:
    """Strides equal wherever they matter (dims of size 1 have no stride to speak of)."""
    return all(_hinted(n) <= 1 or _hinted(g) == _hinted(w) for n, g, w in zip(shape, got, want))


def keep_layout(out: Any, traced: Any) -> Any:
    """``out`` (a decomposition's result) with each tensor in the strides of ``traced`` (the
    replaced node's ``val``). A dense layout is made by a contiguous clone of the permuted
    tensor, permuted back (views and a clone: ops every tier runs); any other by a copy into an
    ``empty_strided`` buffer."""
    if isinstance(out, (tuple, list)) and isinstance(traced, (tuple, list)):
        return type(out)(keep_layout(o, t) for o, t in zip(out, traced))
    if not (isinstance(out, torch.Tensor) and isinstance(traced, torch.Tensor)) or out.dim() != traced.dim():
        return out
    if _same_layout(out.shape, out.stride(), traced.stride()):
        return out
    order = dense_order(traced.shape, traced.stride())
    if order is not None:
        inverse = sorted(range(len(order)), key=order.__getitem__)
        y = aten.clone.default(aten.permute.default(out, order), memory_format=torch.contiguous_format)
        return aten.permute.default(y, inverse)
    buf = aten.empty_strided.default(traced.shape, traced.stride(), dtype=out.dtype, device=out.device)
    return aten.copy.default(buf, out)


# --- splicing one node ---------------------------------------------------------------------------

class NotDecomposable(Exception):
    pass


def _is_layout_copy(n: fx.Node, out: Any) -> bool:
    """Whether ``n`` is one of keep_layout's copies: it feeds an output (through the permute back)."""
    outs = set(out) if isinstance(out, (tuple, list)) else {out}
    return n in outs or any(u in outs and u.target is aten.permute.default for u in n.users)


def decompose_node(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """Replace ``node`` by the graph of its decomposition; return the new nodes.

    Raises NotDecomposable when the op has no decomposition or the decomposition declines these
    inputs (it returns NotImplemented, or its trace still contains the op itself).
    """
    return splice_decomposition(gm, node, trace_decomposition(node))


def trace_decomposition(node: fx.Node) -> fx.GraphModule:
    """The decomposition of ``node`` as its own graph (inputs: the node's tensor arguments), its
    outputs in the node's traced layout (see keep_layout). Raises NotDecomposable."""
    op = node.target
    fn = decomposition_for(op)
    if fn is None:
        raise NotDecomposable(f"no decomposition for {op}")
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    node_pos = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    vals = [flat[i].meta["val"] for i in node_pos]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    traced = node.meta.get("val")

    def call(*leaves):
        new = list(flat)
        for i, v in zip(node_pos, leaves):
            new[i] = v
        args, kwargs = pytree.tree_unflatten(new, spec)
        return keep_layout(op(*args, **kwargs), traced)

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
    got = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    problem = _output_mismatch(pytree.tree_map(lambda n: n.meta.get("val") if isinstance(n, fx.Node) else n, got),
                               traced, used_outputs(node))
    if problem:  # a decomposition that computes something else must never stand in for the op
        raise NotDecomposable(f"the decomposition of {op} returns other outputs than the op: {problem}")
    return sub


def used_outputs(node: fx.Node) -> set[int] | None:
    """The indices of a tuple-valued node's outputs that the graph reads (None: not a tuple); a
    getitem nothing reads does not count."""
    if not isinstance(node.meta.get("val"), (tuple, list)):
        return None
    return {u.args[1] for u in node.users if u.target is operator.getitem and u.users}


def _output_mismatch(got: Any, want: Any, used: set[int] | None = None) -> str:
    """What differs between a decomposition's outputs and the op's traced ones ('' if nothing);
    of a tuple, only the ``used`` outputs count."""
    if used is not None:
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"not a tuple of {len(want)} outputs"
        gots, wants = [got[i] for i in sorted(used)], [want[i] for i in sorted(used)]
    else:
        gots, wants = [got], [want]
    for i, (g, w) in enumerate(zip(gots, wants)):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"output {i} is not a tensor"
            if g.dtype != w.dtype or len(g.shape) != len(w.shape) or any(
                    _hinted(a) != _hinted(b) for a, b in zip(g.shape, w.shape)):
                return f"output {i} is {g.dtype} {list(g.shape)}, the op's {w.dtype} {list(w.shape)}"
    return ""


def _bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return _hinted(val.numel()) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return 0


def materialized_bytes(sub: fx.GraphModule) -> int:
    """Bytes of the fresh tensors a decomposition's graph makes besides its outputs (views and
    factory fills excluded): what running it node by node writes to memory on the way."""
    from torch_kernelize.compiling.op_classes import NodeClass, classify
    outputs = set(pytree.tree_leaves(next(n for n in sub.graph.nodes if n.op == "output").args))
    return sum(_bytes(n.meta.get("val")) for n in sub.graph.nodes
               if n.op == "call_function" and n not in outputs and classify(n)[0] is NodeClass.COMPUTE)


def own_bytes(node: fx.Node) -> int:
    """Bytes of a node's own tensors: its tensor inputs and its outputs."""
    ins = {a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)}
    return sum(_bytes(a.meta.get("val")) for a in ins) + _bytes(node.meta.get("val"))


def splice_decomposition(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule) -> list[fx.Node]:
    """Put ``sub`` (trace_decomposition of ``node``) in the place of ``node``; return the new nodes."""
    op = node.target
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    node_pos = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    if isinstance(node.meta.get("val"), (tuple, list)) and any(u.target is not operator.getitem for u in node.users):
        raise NotDecomposable(f"tuple output of {op} used other than by getitem")  # checked before any change
    graph = gm.graph
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    val_map = {ph: flat[i] for ph, i in zip(placeholders, node_pos)}
    before = set(graph.nodes)
    with graph.inserting_before(node):
        out = graph.graph_copy(sub.graph, val_map)
    new_nodes = [n for n in graph.nodes if n not in before]
    for n in new_nodes:  # the copies keep_layout made: decomposing them would lose the layout again
        if n.target in (aten.clone.default, aten.copy.default) and _is_layout_copy(n, out):
            n.meta[LAYOUT_COPY] = True
    if isinstance(out, (tuple, list)):
        for user in list(node.users):
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)
    return new_nodes


OWN_DECOMPOSITIONS.update(BACKWARD_DECOMPOSITIONS)  # convolution_backward (backward_decompositions.py)
OWN_DECOMPOSITIONS.update(SCATTER_DECOMPOSITIONS)  # scatters, running max/min, pooling... (decompositions_scatter.py)
OVERRIDES.update(SCATTER_OVERRIDES)
# embedding bags and their backward, segment_reduce, repeat_interleave (ranking_decompositions.py)
OWN_DECOMPOSITIONS.update(RANKING_DECOMPOSITIONS)
OWN_DECOMPOSITIONS.update(CONV_DECOMPOSITIONS)  # convolutions, 1-D to 3-D, transposed (decompositions_conv.py)
OWN_DECOMPOSITIONS.update(SAMPLING_DECOMPOSITIONS)  # grid_sampler_3d, antialiased bilinear (decompositions_sampling.py)
# frexp, casts to complex (decompositions_elementwise.py)
OWN_DECOMPOSITIONS.update(ELEMENTWISE_DECOMPOSITIONS)
OVERRIDES.update(ELEMENTWISE_OVERRIDES)
# bucketize and the histograms (decompositions_histogram.py)
OWN_DECOMPOSITIONS.update(HISTOGRAM_DECOMPOSITIONS)
OVERRIDES.update(HISTOGRAM_OVERRIDES)
# triangular_solve, lu_unpack, lu_solve, lu_factor_ex, slogdet, cholesky (decompositions_triangular.py)
OWN_DECOMPOSITIONS.update(TRIANGULAR_DECOMPOSITIONS)
