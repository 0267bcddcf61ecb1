"""What a program's uninitialised buffers hold in a validation run.

Validation runs a kernel once per fill on the same inputs (``validate.validate``): first with every
output and uninitialised temporary poisoned (NaN; integers near their minimum; True), then with a
seeded pattern of ordinary values. A kernel whose results depend on what its buffers held before
the run (one that reads its output, or leaves part of it unwritten) gives different bits on the two
runs, whatever it guesses the poison to be. Serving allocates without a fill: ``fill_``
is called only where a runner is asked to poison (``ProgramRunner.run_poisoned``).

The current fill is a context variable, so every runner a validation calls (bucket runners, a
wrapper that moves inputs off alignment) fills alike without passing it through.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
from typing import Iterator

import torch

POISON, PATTERN = "poison", "pattern"
_current: contextvars.ContextVar[tuple[str, int, Iterator[int]]] = contextvars.ContextVar(
    "torch_kernelize_fill", default=(POISON, 0, itertools.count()))


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """The poison of the first run: what makes an unwritten element show up against the reference."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min + 7


@contextlib.contextmanager
def filling(kind: str, seed: int = 0) -> Iterator[None]:
    """Runs inside fill their buffers with ``kind`` (POISON or PATTERN, drawn from ``seed``)."""
    token = _current.set((kind, seed, itertools.count()))
    try:
        yield
    finally:
        _current.reset(token)


def fill_(t: torch.Tensor) -> None:
    """Fill a freshly allocated buffer as the current run asks (each buffer of a run draws its own
    part of the pattern)."""
    kind, seed, counter = _current.get()
    if kind == POISON or t.numel() == 0:
        t.fill_(poison_value(t.dtype))
        return
    g = torch.Generator(device=t.device)
    g.manual_seed((seed * 1_000_003 + next(counter)) & 0x7FFF_FFFF_FFFF_FFFF)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        # finite values of either sign and varied magnitude: no kernel can tell them from a result
        values = torch.randn(t.shape, generator=g, device=t.device) * 2.0 ** torch.randint(
            -8, 9, t.shape, generator=g, device=t.device)
    elif t.dtype == torch.bool:
        values = torch.randint(0, 2, t.shape, generator=g, device=t.device)
    else:
        info = torch.iinfo(t.dtype)
        values = torch.randint(max(info.min, -2**31), min(info.max, 2**31 - 1), t.shape, generator=g,
                               device=t.device)
    t.copy_(values)
