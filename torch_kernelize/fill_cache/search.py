"""The search policy over one spec's configurations, under a budget, checkpointed by a journal.

Start from the family's seed configurations, in order; when they are spent, expand the best
correct ones (their neighbours: one block size, warp count or stage count away), best first.
The order is deterministic, so a resumed search takes up exactly where the journal stops.
A candidate that faults the device (an illegal memory access leaves the CUDA context unusable)
is journaled as failed, then DeviceFault ends the run, unless the fault was contained in a
measure worker that was replaced (measure_worker.py); no later run evaluates it again.
Measurement is injected (``evaluate``): the policy knows nothing of Triton or devices.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch_kernelize.lowering.kernels import Config, KernelFamily
from torch_kernelize.core.spec import KernelSpec

BEAM = 3  # how many of the best correct candidates are expanded at each step


class DeviceFault(RuntimeError):
    """A candidate faulted the device. Its evaluation is in the journal; this process must end."""

    def __init__(self, spec: KernelSpec, result: dict[str, Any]):
        self.spec, self.result = spec, result
        config = " ".join(f"{k}={v}" for k, v in sorted(result["config"].items()))
        super().__init__(f"candidate {config} of {spec.describe()} faulted the device: {result['error'][:300]}")


@dataclasses.dataclass
class SearchResult:
    evaluated: list[dict[str, Any]]   # every evaluation (journal order), resumed ones included
    resumed: int                      # how many came from the journal
    best: dict[str, Any] | None       # the best correct evaluation, or None

    @property
    def new(self) -> int:
        return len(self.evaluated) - self.resumed


def run_search(spec: KernelSpec, family: KernelFamily, evaluate: Callable[[Config], dict[str, Any]],
               budget: int, previous: list[dict[str, Any]] = (),
               record: Callable[[dict[str, Any]], None] = lambda r: None,
               on_step: Callable[[dict[str, Any]], None] = lambda r: None,
               prepare: Callable[[list[Config]], None] = lambda cs: None) -> SearchResult:
    """Evaluate at most ``budget`` configurations in total (``previous`` ones count).

    ``prepare(configs)`` is told, before they are evaluated, which configurations come next (the
    builder compiles them in parallel meanwhile).
    """
    evaluated: dict[str, dict[str, Any]] = {}
    for r in previous:
        evaluated.setdefault(Config.from_json(r["config"]).key, r)
    resumed = len(evaluated)
    queue: list[Config] = [c for c in family.seed_configs(spec)]
    expanded: set[str] = set()

    def announce() -> None:
        prepare([c for c in queue if c.key not in evaluated][:max(0, budget - len(evaluated))])

    announce()

    def next_config() -> Config | None:
        while True:
            while queue:
                c = queue.pop(0)
                if c.key not in evaluated:
                    return c
            ranked = sorted((r for r in evaluated.values() if r["correct"] and _key(r) not in expanded),
                            key=lambda r: -r["fitness"])
            if not ranked:
                return None
            for r in ranked[:BEAM]:
                expanded.add(_key(r))
                queue.extend(n for n in family.neighbours(spec, Config.from_json(r["config"]))
                             if n.key not in evaluated and n not in queue)
            announce()

    while len(evaluated) < budget:
        config = next_config()
        if config is None:
            break
        result = evaluate(config)
        record(result)
        evaluated[config.key] = result
        on_step(result)
        if result.get("fault") and not result.get("contained"):
            raise DeviceFault(spec, result)

    correct = [r for r in evaluated.values() if r["correct"]]
    best = max(correct, key=lambda r: r["fitness"], default=None)
    return SearchResult(list(evaluated.values()), resumed, best)


def _key(r: dict[str, Any]) -> str:
    return Config.from_json(r["config"]).key
