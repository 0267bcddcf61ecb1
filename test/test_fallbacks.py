"""The host fallback: results come back on the caller's device with the strides the graph was
traced with (later Triton kernels bake those strides in)."""
from __future__ import annotations

import torch

from torch_kernelize.fallbacks.host import HostFallback, fallback_stats, reset_fallback_stats
from torch_kernelize.repro.run import to_device

aten = torch.ops.aten


def test_outputs_take_the_traced_strides_and_calls_are_counted():
    reset_fallback_stats()
    x = torch.randn(4, 6)
    f = HostFallback(aten.mul.Tensor, "aten.mul.Tensor", "cpu", None, [(1, 4)])  # traced transposed
    y = f(x, 2.0)
    assert y.stride() == (1, 4) and torch.equal(y, x * 2)
    values, indices = HostFallback(aten.max.dim, "aten.max.dim", "cpu", None, [(1,), None])(x, 1)
    assert torch.equal(values, x.max(1).values) and torch.equal(indices, x.max(1).indices)
    assert fallback_stats()["aten.mul.Tensor"].calls == 1


def test_repro_inputs_keep_expanded_and_gapped_strides():
    base = torch.randn(2, 3, 8)
    gapped = base[:, 1]                      # a select: strides (24, 1) over a larger storage
    expanded = torch.randn(5, 1).expand(5, 4)  # stride 0
    for t in (gapped, expanded):  # "meta" stands in for a GPU: a real move, no data
        moved = to_device(t, "meta")
        assert moved.device.type == "meta" and moved.shape == t.shape and moved.stride() == t.stride()
