"""Host fallback: run a missing op with ATen on the CPU, copying tensors in and out.

Correct on any target whose tensors the host can read, and slow by design: every call costs
two copies and a synchronisation. Each op warns once per process; the calls and the time they
cost are counted so that the coverage report can show what the missing op costs.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger("torch_kernelize.fallbacks")


@dataclasses.dataclass
class FallbackStat:
    calls: int = 0
    seconds: float = 0.0


_stats: dict[str, FallbackStat] = {}
_warned: set[str] = set()
_lock = threading.Lock()


def fallback_stats() -> dict[str, FallbackStat]:
    """Per op name: calls and total wall time spent in the host fallback in this process."""
    with _lock:
        return {k: dataclasses.replace(v) for k, v in _stats.items()}


def reset_fallback_stats() -> None:
    with _lock:
        _stats.clear()
        _warned.clear()


class HostFallback:
    """Callable standing in for ``op`` in a lowered graph."""

    def __init__(self, op: Any, name: str, target_name: str, repro: str | None = None):
        self.op = op
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
            out = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)
        self._account(time.perf_counter() - start)
        return out

    def _account(self, seconds: float) -> None:
        with _lock:
            stat = _stats.setdefault(self.name, FallbackStat())
            stat.calls += 1
            stat.seconds += seconds
            first = self.name not in _warned
            _warned.add(self.name)
        if first:
            log.warning("%s has no implementation on target %r: running it on the host (CPU) with copies%s",
                        self.name, self.target_name, f"; repro: {self.repro}" if self.repro else "")
