"""CUDA's fused attention ops traced as the device-neutral flash op, for a chip without them.

On CUDA tensors ``F.scaled_dot_product_attention`` becomes ``aten._scaled_dot_product_flash_attention``,
``_efficient_attention`` or ``_cudnn_attention`` (and their backwards in training graphs). Their
outputs carry what only NVIDIA's kernels use: ``None`` cumulative lengths, SymInt maxima, rng
state, a logsumexp padded to 32 rows. A chip whose vendor library lacks them has no decomposition
for them either, and the host fallback cannot run them (they have no CPU kernel).

For such a target the trace maps each of them to ``aten._scaled_dot_product_flash_attention_for_cpu``
(out, logsumexp) and its backward: the same function of q, k, v (top-left causal, scale, additive
mask), with a meta function for any device. That op is what every tier handles: the attention
kernel family generates it, torch's decomposition decomposes it, the host fallback runs it on
CPU; a float64 reference exists. The extra outputs are filled in with what the originals return
when dropout is off (empty rng tensors, the sequence lengths); only the matching backward,
mapped likewise, reads them. Dropout (random) and a mask that needs its own gradient keep the
CUDA op.

One more trace-time choice of attention op lives here: an inference graph served at varying
sizes traces cuDNN's attention as CUDA's flash op (``varying_shape_attention_table``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from torch_kernelize.core.attention_reference import efficient_logsumexp

if TYPE_CHECKING:
    from torch_kernelize.core.targets import Target

aten = torch.ops.aten
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    if dropout_p != 0 or return_debug_mask:
        return NotImplemented
    out, lse = CPU_FLASH(query, key, value, 0.0, is_causal, scale=scale)
    rng = torch.empty(2, dtype=torch.uint64, device=query.device)
    unused = torch.empty((), dtype=torch.uint64, device=query.device)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], rng, unused, debug


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                    dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if dropout_p != 0:
        return NotImplemented
    return CPU_FLASH_BACKWARD(grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)


def _cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
           return_debug_mask=False, *, scale=None):
    if dropout_p != 0 or return_debug_mask:
        return NotImplemented
    out, lse = CPU_FLASH(query, key, value, 0.0, is_causal, attn_mask=attn_bias, scale=scale)
    seed = torch.empty((), dtype=torch.int64, device=query.device)
    offset = torch.empty((), dtype=torch.int64, device=query.device)
    # cuDNN's logsumexp is [B, H, L, 1]
    return out, lse.unsqueeze(-1), None, None, query.shape[2], key.shape[2], seed, offset, None


def _cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                    cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    if dropout_p != 0:
        return NotImplemented
    return CPU_FLASH_BACKWARD(grad_out, query, key, value, out, logsumexp.squeeze(-1), 0.0, is_causal,
                              attn_mask=attn_bias, scale=scale)


def _efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    if dropout_p != 0 or value.shape[-1] != query.shape[-1]:   # the CPU op needs one head dim
        return NotImplemented
    out, lse = CPU_FLASH(query, key, value, 0.0, is_causal, attn_mask=attn_bias, scale=scale)
    lse = efficient_logsumexp(lse, query, compute_log_sumexp)
    seed = torch.empty((), dtype=torch.int64, device=query.device)
    offset = torch.empty((), dtype=torch.int64, device=query.device)
    return out, lse, seed, offset


def _efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                        dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    if dropout_p != 0 or value.shape[-1] != query.shape[-1] or (attn_bias is not None and grad_input_mask[3]):
        return NotImplemented   # the CPU backward gives no gradient for the mask
    lse = aten.slice.Tensor(logsumexp, 2, 0, query.shape[2])
    dq, dk, dv = CPU_FLASH_BACKWARD(grad_out, query, key, value, out, lse, 0.0, is_causal,
                                    attn_mask=attn_bias, scale=scale)
    return dq, dk, dv, None


# CUDA op -> (its device-neutral form, its backward and that one's form)
REWRITES: dict[Any, Callable] = {
    aten._scaled_dot_product_flash_attention.default: _flash,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    aten._scaled_dot_product_efficient_attention.default: _efficient,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
    aten._scaled_dot_product_cudnn_attention.default: _cudnn,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward,
}


def _cudnn_as_flash(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                    return_debug_mask=False, *, scale=None):
    """cuDNN's attention as CUDA's flash op (same q, k, v, causal, scale; no mask). Grouped-query
    attention (fewer key/value heads, dividing the query's: Llama's 32 over 4) stays as it is:
    flash takes it natively, as SDPA's own ``enable_gqa`` dispatch to it does."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if attn_bias is not None or dropout_p != 0 or return_debug_mask or value.shape[1] != kv_heads \
            or heads % kv_heads != 0:
        return NotImplemented
    out, lse, _, _, max_q, max_k, _, _, _ = aten._scaled_dot_product_flash_attention.default(
        query, key, value, 0.0, is_causal, False, scale=scale)
    seed = torch.empty((), dtype=torch.int64, device=query.device)
    offset = torch.empty((), dtype=torch.int64, device=query.device)
    return out, lse.unsqueeze(-1), None, None, max_q, max_k, seed, offset, None


def varying_shape_attention_table(target: Target | None) -> dict[Any, Callable]:
    """For an inference graph served at varying sizes (a dynamic trace) on a CUDA target that runs
    both: cuDNN's attention traced as flash attention. cuDNN builds an execution plan at each new
    shape, 40-75 ms on the H200 (results/2026-11-30-h200-probe-sdpa-first-use.json: 75 ms warm,
    flash 0.2 ms), which every new sequence length would pay; flash has no plan. Its kernel is
    slower per call (0.039 against 0.026 ms at Llama's 8x16x512x64): a cost a server that sees
    many lengths takes for its first calls. Training graphs keep cuDNN (its backward reads its
    own outputs)."""
    flash = aten._scaled_dot_product_flash_attention.default
    cudnn = aten._scaled_dot_product_cudnn_attention.default
    if target is None or target.device != "cuda" or not (target.vendor_runs(flash) and target.vendor_runs(cudnn)):
        return {}
    return {cudnn: _cudnn_as_flash}


def neutral_attention_table(target: Target | None) -> dict[Any, Callable]:
    """The rewrites for ``target``: the CUDA attention ops its vendor
    does not run, on a CUDA device; none elsewhere (a CPU trace never shows them)."""
    if target is None or target.device != "cuda":
        return {}
    return {op: fn for op, fn in REWRITES.items() if not target.vendor_runs(op)}
