"""Builder and runner for candidates: generate -> build -> load -> validate -> benchmark.

One ``Measurer`` per spec. ``evaluate(config)`` never raises for a bad candidate: a candidate
that fails to generate, compile, run or validate scores 0 with the error recorded.
"""
from __future__ import annotations

import dataclasses
import traceback
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from torch_kernelize.fill_cache.builder import Builder
from torch_kernelize.fill_cache.benchmark import median_ms, paired_ms, timing_available
from torch_kernelize.launch import load_program
from torch_kernelize.lowering.kernels import Config, KernelFamily
from torch_kernelize.lowering.kernels.base import to_device
from torch_kernelize.lowering.targets import Target
from torch_kernelize.spec import KernelSpec
from torch_kernelize.validate import validate

BENCH_SEED = 12345
LARGE_SPEC_ELEMENTS = 1 << 20


@dataclasses.dataclass
class Evaluation:
    config: dict[str, Any]
    correct: bool
    fitness: float
    candidate_ms: float | None = None
    vendor_ms: float | None = None
    error: str = ""
    validation: dict[str, Any] | None = None
    measured: bool = False
    fault: bool = False  # the candidate faulted the device: the process can no longer use it

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# CUDA errors that leave the context unusable (every later call fails): the candidate that raised
# one is journaled as failed and the run must end (search.DeviceFault).
_FAULTS = ("illegal memory access", "misaligned address", "unspecified launch failure",
           "illegal instruction", "hardware stack error")


def device_fault(error: str) -> bool:
    return any(f in error for f in _FAULTS)


class Measurer:
    def __init__(self, spec: KernelSpec, family: KernelFamily, target: Target,
                 extra_inputs: Sequence[Sequence[torch.Tensor]] = (), builder: Builder | None = None):
        self.spec = spec
        self.family = family
        self.target = target
        self.builder = builder or Builder(target)
        self.device = "cuda" if target.device == "cuda" else "cpu"
        self.timed = timing_available(target)
        self.extra_inputs = [list(x) for x in extra_inputs]
        self._vendor_ms: float | None = None
        self._bench_inputs: list[torch.Tensor] | None = None
        self._trials: dict = {}  # (seed, kind) -> (inputs, reference): shared by all candidates
        # float64 references of large specs on the GPU: a CPU would spend seconds per trial
        size = sum(m.numel for m in spec.inputs) + sum(m.numel for m in spec.outputs)
        self.reference_device = "cuda" if self.device == "cuda" and size > LARGE_SPEC_ELEMENTS else "cpu"

    # --- builder --------------------------------------------------------------------------------
    def prepare(self, configs: Sequence[Config]) -> None:
        """Start building candidates the search will evaluate next (in parallel on CUDA)."""
        self.builder.submit(self.spec, self.family, list(configs))

    def build(self, config: Config) -> tuple[Path, Any]:
        """The built candidate's folder and its loaded runner."""
        directory = self.builder.build(self.spec, self.family, config)
        return directory, load_program(directory, self.spec, self.target.triton,
                                       module_name=f"torch_kernelize_candidates.k{self.spec.key}_{abs(hash(config.key))}")

    # --- runner ---------------------------------------------------------------------------------
    def bench_inputs(self) -> list[torch.Tensor]:
        if self._bench_inputs is None:
            self._bench_inputs = self.family.sample_inputs(self.spec, BENCH_SEED, "random", self.device)
        return self._bench_inputs

    def vendor_ms(self) -> float | None:
        if self.timed and self._vendor_ms is None:
            inputs = self.bench_inputs()
            self._vendor_ms = median_ms(lambda: self.spec.run_vendor(inputs))
        return self._vendor_ms

    def _sample(self, spec: KernelSpec, seed: int, kind: str, device: Any) -> list[torch.Tensor]:
        if kind == "captured":  # in the spec's layout: a repro may hold a view's values as a dense copy
            return [_in_layout(to_device(t, device), m) for t, m in zip(self.extra_inputs[seed], spec.inputs)]
        return self.family.sample_inputs(spec, seed, kind, device)

    def validate_unaligned(self, directory: Path) -> str | None:
        """Validate the winner's binaries for unaligned views (launch.ProgramRunner takes them for
        inputs off a 16-byte boundary) on the same trials, every input moved one element off;
        None if they pass, else why not."""
        runner = load_program(directory, self.spec, self.target.triton)
        record = validate(lambda inputs: runner.run_poisoned([unaligned_copy(t) for t in inputs]), self.spec,
                          self._sample, self.family.edge_kinds, device=self.device,
                          extra_trials=len(self.extra_inputs), trial_cache=self._trials,
                          reference_device=self.reference_device, resolve_ties=self.family.resolve_ties)
        return None if record.ok else record.reason

    def evaluate(self, config: Config) -> Evaluation:
        ev = self._evaluate(config)
        ev.fault = self.device == "cuda" and device_fault(ev.error)
        return ev

    def _evaluate(self, config: Config) -> Evaluation:
        try:
            _, runner = self.build(config)
        except Exception as e:
            return Evaluation(config.to_json(), False, 0.0, error=f"build failed: {_short(e)}")
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            # edge inputs (inf, NaN, huge) make the interpreter's numpy warn; validation judges them
            warnings.simplefilter("ignore", RuntimeWarning)
            record = validate(runner.run_poisoned, self.spec, self._sample, self.family.edge_kinds,
                              device=self.device, extra_trials=len(self.extra_inputs),
                              trial_cache=self._trials, reference_device=self.reference_device,
                              resolve_ties=self.family.resolve_ties)
        if not record.ok:
            return Evaluation(config.to_json(), False, 0.0, error=record.reason, validation=record.to_json())
        if not self.timed:
            return Evaluation(config.to_json(), True, 1.0, validation=record.to_json())
        inputs = self.bench_inputs()
        try:
            cand = median_ms(lambda: runner(*inputs))
        except Exception as e:
            return Evaluation(config.to_json(), False, 0.0, error=f"benchmark failed: {_short(e)}",
                              validation=record.to_json())
        vendor = self.vendor_ms()
        return Evaluation(config.to_json(), True, vendor / cand if cand > 0 else 0.0, cand, vendor,
                          validation=record.to_json(), measured=True)

    def confirm(self, config: Config, rounds: int = 3) -> tuple[float, float] | None:
        """(vendor ms, candidate ms) of a built candidate, timed alternately (benchmark.paired_ms);
        None where nothing is timed."""
        if not self.timed:
            return None
        _, runner = self.build(config)
        inputs = self.bench_inputs()
        return paired_ms(lambda: self.spec.run_vendor(inputs), lambda: runner(*inputs), rounds)


def _in_layout(t: torch.Tensor, meta: Any) -> torch.Tensor:
    """``t``'s values with ``meta``'s strides (kernels bake the spec's strides in)."""
    if tuple(t.stride()) == tuple(meta.stride) or tuple(t.shape) != tuple(meta.shape):
        return t
    out = torch.empty_strided(meta.shape, meta.stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def unaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at its strides, in memory that starts one element past a 16-byte boundary
    (as a view such as ``x[1:]`` does); elements of 16 bytes or more cannot be off it."""
    if t.element_size() >= 16 or t.numel() == 0:
        return t.clone()
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    buf = torch.empty(span + 1, dtype=t.dtype, device=t.device)  # allocations are 16-byte aligned
    out = buf.as_strided(t.shape, t.stride(), storage_offset=1)
    out.copy_(t)
    return out


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    if len(text) > 600:
        text = text[:600] + " ..."
    return text if str(e) else "".join(traceback.format_exception_only(type(e), e)).strip()
