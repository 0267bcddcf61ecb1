"""float64 references of CUDA's fused attention ops, for a graph's float64 reference.

A whole graph (compiling/whole_graph.py) keeps CUDA's ``_scaled_dot_product_flash_attention``,
``_efficient_attention`` and ``_cudnn_attention`` where the vendor runs them, and its float64
reference replays every node in float64 (region_graph.py): those kernels take fp16/bf16 (fp32)
only. Replayed on float64 tensors, each becomes the attention it computes, written out (scores,
causal and additive masks, softmax, logsumexp) on the same device, with its other outputs as the
op returns them when dropout is off (compiling/neutral_attention.py does the same for chips that
lack the ops). Dropout is random, so such a graph is never offered whole; it is refused here too.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

aten = torch.ops.aten


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp over the keys): softmax(q k^T * scale + mask) v, top-left causal."""
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise ValueError("attention with dropout has no deterministic reference")


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _no_dropout(dropout_p)
    out, lse = _attention(q, k, v, None, is_causal, scale)
    rng = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    return out, lse, None, None, q.shape[2], k.shape[2], rng, unused, torch.empty(0, dtype=q.dtype, device=q.device)


def _efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    _no_dropout(dropout_p)
    out, lse = _attention(q, k, v, attn_bias, is_causal, scale)
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    return out, efficient_logsumexp(lse, q, compute_log_sumexp), seed, torch.empty((), dtype=torch.int64, device=q.device)


def efficient_logsumexp(lse: torch.Tensor, q: torch.Tensor, compute: bool) -> torch.Tensor:
    """The logsumexp as CUDA's efficient attention returns it: padded to a multiple of 32 rows
    (+inf past the sequence), or empty where it was not asked for."""
    L = q.shape[2]
    if compute:
        return aten.constant_pad_nd.default(lse, [0, math.ceil(L / 32) * 32 - L], float("inf"))
    return torch.empty((q.shape[0], q.shape[1], 0), dtype=torch.float32, device=q.device)


def _cudnn(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
           scale=None):
    _no_dropout(dropout_p)
    out, lse = _attention(q, k, v, attn_bias, is_causal, scale)
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    return out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, offset, None


ATTENTION: dict[Any, Callable] = {  # (float64_references.py holds the table of every such op)
    aten._scaled_dot_product_flash_attention.default: _flash,
    aten._scaled_dot_product_efficient_attention.default: _efficient,
    aten._scaled_dot_product_cudnn_attention.default: _cudnn,
}
