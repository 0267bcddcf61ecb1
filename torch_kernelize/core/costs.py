"""What a kernel must cost at least: the bytes it moves and the FLOPs it computes.

A spec's floor on a chip is the larger of its bytes at the chip's copy bandwidth and its FLOPs
at the chip's matmul rate (the ceilings: targets.py, ledger/floors.py). Both counts are lower
bounds: every distinct element of every input and output once (an expanded input's once), and
the FLOPs torch's own ``FlopCounterMode`` counts for the op or region (matmuls, convolutions,
attention; elementwise work counts as none).
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


def flops(spec: Any) -> int:
    """The FLOPs of ``spec`` as torch.utils.flop_counter counts them, run on meta tensors (no
    memory, no compute); 0 for an op it does not count or cannot run there."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = [m.empty("meta") for m in spec.inputs]
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            spec.run_vendor(inputs)
    except Exception:  # an op without a meta kernel: it has no FLOPs we could count
        return 0
    return int(counter.get_total_flops())


def compute_dtype(spec: Any) -> str:
    """The dtype the spec's FLOPs are done in: its first floating input's."""
    return next((m.dtype for m in spec.inputs if m.torch_dtype.is_floating_point), "float32")
