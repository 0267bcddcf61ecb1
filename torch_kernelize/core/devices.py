"""Moving tensors between devices with their layout kept (the layout contract of every tier)."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``t`` on ``device`` with its strides and storage offset kept.

    Kernels bake the spec's strides in, so their inputs must have exactly those strides.
    ``Tensor.to`` keeps strides only for non-overlapping dense tensors: a view with gaps (k of a
    packed kv projection: a select of a permute) or an expanded one arrives contiguous, and the
    kernel reads wrong elements. So the storage span is moved and viewed again.
    """
    device = torch.device(device)
    if t.device.type == device.type and device.index in (None, t.device.index):
        return t
    if not t.numel():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    off = t.storage_offset()
    span = off + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    flat = torch.as_strided(t.detach(), (span,), (1,), 0).to(device)
    return torch.as_strided(flat, t.shape, t.stride(), off)
