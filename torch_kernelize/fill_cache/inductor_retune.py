"""Inductor's kernel configs, chosen again by their time inside the program they serve in.

Inductor picks a kernel's config (block sizes, warps, stages) on its first call by timing each
config on its own, and that pick is neither stable nor always the pick for the program: in one
H100 run (benchmarks/results/2026-12-06-h100-real-models-3) the capture of ViT-B/16 ran its GELU kernel with
8 warps x 512 where torch.compile's own process ran 4 x 1024, 42 against 31 us per call in the
program; ResNet-50's batch-norm kernels differed between the two processes either way.

The retune runs the compiled graph under the profiler once per variant: in variant k every
kernel with several configs runs its k-th candidate (0: Inductor's choice; then its other
configs), so K variants time every candidate of every kernel in place, after the kernels that
run before it, at a cost of K profiled calls. Each kernel then records with the candidate that
took least of its time, Inductor's own unless another is faster by more than ``MARGIN``. Kernels
below ``SHARE`` of the graph's GPU time keep Inductor's choice (compiling their other configs
costs more than they could gain). Whole graphs on a GPU only: a node or region runs alone, as
Inductor timed it, and the interpreter has no times to go by.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.fill_cache.inductor_output import _autotuner_launches, _autotuners

log = logging.getLogger("torch_kernelize.fill_cache")

MARGIN = 0.03   # another config replaces Inductor's where it takes less than (1 - MARGIN) of its time
SHARE = 0.005   # kernels under this share of the graph's GPU time keep Inductor's config
CALLS = 3       # profiled calls per variant (after one that compiles and warms)
MAX_VARIANTS = 8

Timer = Callable[[Callable[[], Any], int], dict[str, float]]


@dataclasses.dataclass
class Retuning:
    """Per autotuner (by id) the config its launches record with; ``report``: per kernel retuned,
    its candidates' times (ms per call of the graph) and the one chosen."""

    configs: dict[int, Any]
    report: list[dict[str, Any]]

    def config_of(self, autotuner: Any) -> Any | None:
        return self.configs.get(id(autotuner))


def kernel_ms(run: Callable[[], Any], calls: int) -> dict[str, float]:
    """GPU time per call of ``run`` by kernel name, from torch.profiler (after one unprofiled
    call: Triton compiles a config on its first launch)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(evt, "self_device_time_total", None)
            times[evt.key] = (us if us is not None else evt.self_cuda_time_total) / 1e3 / calls
    return times


def offered_configs(modules: Sequence[Any]) -> dict[int, list[Any]]:
    """Per autotuner (by id) of the output modules, the configs it offers, read before its first
    call: that call keeps only the one it chooses (and Inductor drops ``configs`` once compiled,
    keeping a launcher per config that compiled)."""
    offered = {}
    for module in modules:
        for autotuner in _autotuners(module).values():
            launchers = getattr(autotuner, "launchers", None) or ()
            offered[id(autotuner)] = [l.config for l in launchers] or list(autotuner.configs or ())
    return offered


def candidates(autotuner: Any, offered: Sequence[Any]) -> list[Any]:
    """Inductor's choice (its one launcher's config; before any choice, the first offered), then
    the other configs ``offered``, each once."""
    chosen = autotuner.launchers[0].config if len(getattr(autotuner, "launchers", None) or ()) == 1 else None
    out = [chosen] if chosen is not None else []
    for cfg in offered:
        if all(_signature(cfg) != _signature(c) for c in out):
            out.append(cfg)
    return out


def _signature(cfg: Any) -> tuple:
    return tuple(sorted(cfg.kwargs.items())), cfg.num_warps, cfg.num_stages


def choose(times: Sequence[float | None], margin: float = MARGIN) -> int:
    """The candidate to record with, from each candidate's time (None: not seen run): the fastest
    where it beats the first (Inductor's) by more than ``margin``, else the first."""
    seen = [(t, i) for i, t in enumerate(times) if t is not None]
    if times[0] is None or not seen:
        return 0
    best, i = min(seen)
    return i if best < (1 - margin) * times[0] else 0


def retune(compiled: Callable, module: Any, inputs: Sequence[Any], offered: dict[int, list[Any]],
           timer: Timer = kernel_ms) -> Retuning:
    """Each multi-config kernel of Inductor's output ``module`` on the config fastest in the program
    (see the module docstring); ``compiled`` runs that output on ``inputs``; ``offered``: what
    ``offered_configs`` read before its first call."""
    tuners = {name: (a, candidates(a, offered.get(id(a), ()))) for name, a in _autotuners(module).items()}
    tuners = {name: (a, c) for name, (a, c) in tuners.items() if len(c) > 1}
    if not tuners:
        return Retuning({}, [])
    by_id = {id(a): name for name, (a, _) in tuners.items()}

    def run_variant(k: int, names: set[str]) -> dict[str, float]:
        """The graph's kernel times with each kernel in ``names`` on its k-th candidate (where it
        has one), every other on Inductor's choice."""
        def config_of(autotuner: Any) -> Any | None:
            name = by_id.get(id(autotuner))
            if name is None:
                return None
            cands = tuners[name][1]
            return cands[k] if name in names and k < len(cands) else cands[0]

        def call() -> None:
            with _autotuner_launches(_launch, config_of), torch.no_grad():
                compiled(*inputs)
        return timer(call, CALLS)

    base = run_variant(0, set())
    total = sum(base.values())
    worth = {n for n in tuners if base.get(n, 0.0) >= SHARE * total}
    times = {n: [base.get(n)] + [None] * (len(tuners[n][1]) - 1) for n in worth}
    for k in range(1, min(MAX_VARIANTS, max((len(tuners[n][1]) for n in worth), default=1))):
        try:
            measured = run_variant(k, worth)
        except Exception as e:  # e.g. a config that does not fit this GPU: that variant stays untimed
            log.info("Inductor's configs of variant %d did not run (%s: %s)", k, type(e).__name__, str(e)[:200])
            continue
        for n in worth:
            if k < len(times[n]):
                times[n][k] = measured.get(n)
    configs, report = {}, []
    for n in sorted(worth):
        autotuner, cands = tuners[n]
        pick = choose(times[n])
        configs[id(autotuner)] = cands[pick]
        report.append({"kernel": n, "ms": [None if t is None else round(t, 4) for t in times[n]],
                       "configs": [_describe(c) for c in cands], "chosen": pick})
        if pick:
            log.info("Inductor's %s: %s in the program (%.4f ms per call) in place of its own %s (%.4f ms)",
                     n, _describe(cands[pick]), times[n][pick], _describe(cands[0]), times[n][0])
    return Retuning(configs, report)


def _launch(fn: Any, args: tuple, kwargs: dict, grid: tuple) -> None:
    """A launch through Triton's JIT (it compiles each config once per process)."""
    fn[grid](*args, **kwargs)


def _describe(cfg: Any) -> str:
    return " ".join([*(f"{k}={v}" for k, v in sorted(cfg.kwargs.items())),
                     f"num_warps={cfg.num_warps}", f"num_stages={cfg.num_stages}"])
