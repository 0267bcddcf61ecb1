"""Host fallback: run a missing op with ATen on the CPU, copying tensors in and out.

Correct on any target whose tensors the host can read, and slow by design: every call costs
two copies and a synchronisation. Each op warns once per process; the calls and the time they
cost are counted so that the coverage report can show what the missing op costs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from torch_kernelize.core.devices import to_device

log = logging.getLogger("torch_kernelize.fallbacks")


@dataclasses.dataclass
class FallbackStat:
    calls: int = 0
    seconds: float = 0.0


_stats: dict[str, FallbackStat] = {}
_warned: set[str] = set()
_lock = threading.Lock()
_quiet = threading.local()  # fallbacks a caller expects (fill_cache's run before the fill): no warning


def fallback_stats() -> dict[str, FallbackStat]:
    """Per op name: calls and total wall time spent in the host fallback in this process."""
    with _lock:
        return {k: dataclasses.replace(v) for k, v in _stats.items()}


@contextlib.contextmanager
def expected_fallbacks() -> Iterator[None]:
    """Within, host fallbacks neither warn nor use up their one warning: the run that collects
    a model's specs before fill_cache fills them runs on the host what the fill is about to put
    on the target (bring-up's final run then warns for what is really left there)."""
    was = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = was


def reset_fallback_stats() -> None:
    with _lock:
        _stats.clear()
        _warned.clear()


def _written(op: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``op`` writes to (per its schema), in schema order (None where not given)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i])
    return out


def _write_back(op: Any, device_call: tuple, host_call: tuple) -> None:
    """A mutating op ran on host copies: its writes go back into the caller's device tensors."""
    for dev, host in zip(_written(op, *device_call), _written(op, *host_call)):
        if isinstance(dev, torch.Tensor) and isinstance(host, torch.Tensor) and dev is not host:
            dev.copy_(host)


class HostFallback:
    """Callable standing in for ``op`` in a lowered graph."""

    def __init__(self, op: Any, name: str, target_name: str, repro: str | None = None,
                 out_strides: Sequence[tuple[int, ...] | None] | None = None):
        self.op = op
        # The strides the graph was traced with: later nodes (Triton kernels bake strides in)
        # read the outputs that way, whatever layout the host op or the copy back produced.
        self.out_strides = list(out_strides) if out_strides else None
        self.name = name
        self.target_name = target_name
        self.repro = repro
        self.__name__ = f"fallback_{name.replace('.', '_')}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        flat, spec = pytree.tree_flatten((args, kwargs))
        device = next((a.device for a in flat if isinstance(a, torch.Tensor)), torch.device("cpu"))
        if device.type != "cpu":
            flat = [a.cpu() if isinstance(a, torch.Tensor) else a for a in flat]
            flat = [torch.device("cpu") if isinstance(a, torch.device) else a for a in flat]
        host_args, host_kwargs = pytree.tree_unflatten(flat, spec)
        out = self.op(*host_args, **host_kwargs)
        if device.type != "cpu":
            _write_back(self.op, (args, kwargs), (host_args, host_kwargs))
        if device.type != "cpu" or self.out_strides:
            out = self._place(out, device)
        self._account(time.perf_counter() - start)
        return out

    def _place(self, out: Any, device: torch.device) -> Any:
        """Outputs on ``device`` with the traced strides (where known)."""
        flat, spec = pytree.tree_flatten(out)
        strides = self.out_strides or []
        tensors = iter(range(len(flat)))
        placed = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                i = next(tensors)
                want = strides[i] if i < len(strides) else None
                if want is not None and tuple(a.stride()) != tuple(want) and a.numel() > 1:
                    a = torch.empty_strided(a.shape, want, dtype=a.dtype, device=device).copy_(a)
                elif a.device != device:
                    a = to_device(a, device)
            placed.append(a)
        return pytree.tree_unflatten(placed, spec)

    def _account(self, seconds: float) -> None:
        if getattr(_quiet, "on", False):
            return
        with _lock:
            stat = _stats.setdefault(self.name, FallbackStat())
            stat.calls += 1
            stat.seconds += seconds
            first = self.name not in _warned
            _warned.add(self.name)
        if first:
            log.warning("%s has no implementation on target %r: running it on the host (CPU) with copies%s",
                        self.name, self.target_name, f"; repro: {self.repro}" if self.repro else "")
