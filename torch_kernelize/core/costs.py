"""What a kernel must cost at least: the bytes it moves and the FLOPs it computes.

A spec's floor on a chip is the larger of its bytes at the chip's copy bandwidth and its FLOPs
at the chip's matmul rate (the ceilings: targets.py, ledger/floors.py). Both counts are lower
bounds: every distinct element of every input and output once (an expanded input's once), and
the FLOPs torch's own ``FlopCounterMode`` counts for the op or region (matmuls, convolutions,
attention; elementwise work counts as none), with the formulas it lacks (``flop_formulas``).
"""
from __future__ import annotations

import math
from typing import Any

import torch


def span_bytes(m: Any) -> int:
    """Bytes a kernel must touch at least of one TensorMeta: each distinct element once."""
    if not m.numel:
        return 0
    distinct = math.prod(s for s, st in zip(m.shape, m.stride) if st != 0)
    return distinct * torch.empty((), dtype=m.torch_dtype).element_size()


def bytes_moved(spec: Any) -> int:
    """Bytes read and written at least by a kernel of ``spec`` (a KernelSpec)."""
    return sum(span_bytes(m) for m in spec.inputs + spec.outputs)


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Attention's two matmuls (Q K^T, then P V) at the query's heads: torch's own formula asserts
    that K and V have as many heads as Q, which grouped-query attention (Llama's 4 KV heads for 32)
    does not."""
    *batch, s_q, d_qk = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * math.prod(batch) * s_q * s_k * (d_qk + d_v)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A grouped GEMM's multiply-adds: every row of ``a`` meets one group's weight. ``aten._grouped_mm``
    and transformers' ``grouped_mm_fallback`` (an opaque custom op around a loop of mm: the counter sees
    none of its mms) take tokens (S, K) by experts (E, K, N), or groups batched (G, M, K) x (G, K, N),
    or groups along K or N of 2-D operands; none has a formula in torch, so an MoE model's experts,
    most of its work, counted nothing."""
    m, k, n = a_shape[-2], a_shape[-1], b_shape[-1]
    batched = len(a_shape) == 3 and len(b_shape) == 3  # (G, M, K) x (G, K, N)
    # else (S, K) x (E, K, N), (M, K_total) x (K_total, N) or (G, M, K) x (K, N_total): once over M, K and N
    return 2 * (a_shape[0] if batched else 1) * m * k * n


def _grouped_mm_backward_flops(a_shape, b_shape, offs_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
    """The fallback's backward: the input's gradient and the weights', each a grouped GEMM's work."""
    return 2 * _grouped_mm_flops(a_shape, b_shape)


# op packet (by namespace and name) -> the formula FlopCounterMode lacks for it
FLOP_FORMULAS = {
    **{("aten", n): _sdpa_flops for n in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                          "_scaled_dot_product_cudnn_attention",
                                          "_scaled_dot_product_flash_attention_for_cpu")},
    ("aten", "_grouped_mm"): _grouped_mm_flops,
    ("transformers", "grouped_mm_fallback"): _grouped_mm_flops,  # registered once transformers' MoE is imported
    ("transformers", "grouped_mm_fallback_backward"): _grouped_mm_backward_flops,
}


def flop_formulas() -> dict:
    """FlopCounterMode's ``custom_mapping``: the formulas of FLOP_FORMULAS for the ops this process has."""
    found = {}
    for (namespace, name), formula in FLOP_FORMULAS.items():
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            found[packet] = formula
    return found


def flops(spec: Any) -> int:
    """The FLOPs of ``spec`` as torch.utils.flop_counter counts them (with ``flop_formulas``), run
    on meta tensors (no memory, no compute); 0 for an op it does not count or cannot run there."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = [m.empty("meta") for m in spec.inputs]
    counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
    try:
        with counter:
            spec.run_vendor(inputs)
    except Exception:  # an op without a meta kernel: it has no FLOPs we could count
        return 0
    return int(counter.get_total_flops())


def compute_dtype(spec: Any) -> str:
    """The dtype the spec's FLOPs are done in: its first floating input's."""
    return next((m.dtype for m in spec.inputs if m.torch_dtype.is_floating_point), "float32")
