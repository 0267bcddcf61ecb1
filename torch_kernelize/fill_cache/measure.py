"""Builder and runner for candidates: generate -> build -> load -> validate -> benchmark.

One ``Measurer`` per spec (``CandidateMeasurer``: what the fill driver asks of one; a worker's
IsolatedMeasurer and a shape bucket's BucketMeasurer are others). ``evaluate(config)`` never raises for a bad candidate: a candidate
that fails to generate, compile, run or validate scores 0 with the error recorded (a spec whose
validation cannot fit in device memory raises trials.SpecTooLarge: no candidate is at fault).
Its trials (inputs, float64 references, vendor outputs) are computed once, in a TrialStore, and
``seconds`` splits its time into build, reference, validation and timing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from torch_kernelize.compiling.whole_graph import is_whole_graph
from torch_kernelize.core.program_steps import refused_ops
from torch_kernelize.fill_cache.builder import Builder
from torch_kernelize.fill_cache.graph_candidates import assembly_runner
from torch_kernelize.fill_cache.benchmark import (Timer, median_ms, paired_ms, queued_ms, timing_available,
                                                  with_split_copies)
from torch_kernelize.fill_cache.trials import PeakMeter, TrialStore, spec_bytes, trial_seeds
from torch_kernelize.serving.launch import load_program
from torch_kernelize.lowering.kernels import Config, KernelFamily
from torch_kernelize.core.devices import to_device
from torch_kernelize.core.errors import machine_error
from torch_kernelize.core.targets import Target
from torch_kernelize.core.spec import GRAPHED, KernelSpec
from torch_kernelize.core.validate import validate

# "generate": candidates made before their build (Inductor's capture, in the measure worker on CUDA);
# "build": their compile, in the build pool
PHASES = ("generate", "build", "reference", "validation", "timing")
# A spec this small is validated on the host with one intra-op thread: its float64 references and
# comparisons are too small to share, and waking a second thread on a busy host cost more than
# the work (an f64 mm of 19x16x32: 13 ms on 2 threads of a loaded 2-core host, 0.09 ms on one;
# make_hf_llama's fill on the interpreter: "reference" 20 s -> 1 s)
ONE_THREAD_BYTES = 16 << 20


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
    fault: bool = False  # the candidate faulted the device (or killed its process): never run again
    contained: bool = False  # ... in a measure worker, which was replaced: the run goes on

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# CUDA errors that leave the context unusable (every later call fails): the candidate that raised
# one is journaled as a fault, and the measure worker that ran it is replaced (in this process,
# the run must end: search.DeviceFault). A device-side assert (an index out of range) is one.
_FAULTS = ("illegal memory access", "misaligned address", "unspecified launch failure",
           "illegal instruction", "hardware stack error", "device-side assert triggered")


def device_fault(error: str) -> bool:
    return any(f in error for f in _FAULTS)


class CandidateMeasurer(Protocol):
    """What the fill driver (fill_run.FillRun) asks of the measurer of one spec's candidates."""

    spec: KernelSpec
    family: KernelFamily
    builder: Builder       # where its candidates are built (the driver discards them when the spec is done)
    contains_faults: bool  # a device fault leaves only a worker's CUDA context unusable, not this process's

    @property
    def seconds(self) -> dict[str, float]:
        """Time spent so far by phase (PHASES)."""

    def check_fits(self) -> None:
        """Raise trials.SpecTooLarge if validating a candidate cannot fit in free memory."""

    def prepare(self, configs: Sequence[Config]) -> None:
        """Start building the candidates the search evaluates next."""

    def build(self, config: Config) -> tuple[Path, Any]:
        """The built candidate's folder (and its loaded runner, where this process loads it)."""

    def evaluate(self, config: Config) -> Evaluation:
        """Build, validate and time one candidate; a bad candidate scores 0, never raises."""

    def confirm(self, config: Config, rounds: int = 3) -> tuple[float, float] | None:
        """(baseline ms, candidate ms), timed alternately; None where nothing is timed."""

    def assemblies(self, set_aside: Sequence[str], rounds: int = 3) -> tuple[float, float] | None:
        """A whole graph's assembly as the cache gives it and with ``set_aside`` taken as "vendor
        wins": (ms, ms), timed alternately; None where nothing is timed."""

    def validate_unaligned(self, directory: Path) -> str | None:
        """Why the built program's binaries for unaligned views fail (None: they pass)."""

    def peak_extra_bytes(self) -> int | None: ...

    def close(self) -> None:
        """The spec is done: its trials are released."""


class Measurer:
    contains_faults = False  # a device fault here leaves this process's CUDA context unusable

    def __init__(self, spec: KernelSpec, family: KernelFamily, target: Target,
                 extra_inputs: Sequence[Sequence[torch.Tensor]] = (), builder: Builder | None = None,
                 cache_dir: Path | None = None, baseline: Callable | None = None):
        """``cache_dir``: the root of the cache being filled (a session's cache_dir, above the
        target's namespace), whose kernels a whole graph's own assembly runs (the baseline its
        candidates are timed against: graph_candidates.py). ``baseline``: that
        function where the caller has its own (a dynamic graph's bucket: whole_buckets.py)."""
        self.spec = spec
        self.cache_dir = cache_dir
        self._baseline: Any = baseline
        self.family = family
        self.target = target
        self.builder = builder or Builder(target)
        self.device = "cuda" if target.device == "cuda" else "cpu"
        self.timed = timing_available(target)
        self.extra_inputs = [list(x) for x in extra_inputs]
        self._vendor_ms: float | None = None  # the vendor kernel is timed once per spec
        self.seeds, self.trials_note = trial_seeds(spec)  # fewer random trials for a huge spec
        self.trials = TrialStore(spec, self._sample, self.device,  # shared by all candidates
                                 len(self.seeds) + len(family.edge_kinds) + len(self.extra_inputs))
        self._seconds = dict.fromkeys(PHASES, 0.0)  # "reference" is the trial store's
        self.peak_meter = PeakMeter(self.device)
        self._one_thread = self.device == "cpu" and spec_bytes(spec) <= ONE_THREAD_BYTES

    @property
    def seconds(self) -> dict[str, float]:
        """Time spent so far by phase; reference: drawing inputs, float64 references, vendor outputs."""
        return dict(self._seconds, reference=sum(self.trials.seconds.values()))

    @property
    def reference_device(self) -> str:
        return self.trials.reference_device

    def check_fits(self) -> None:
        """Raise trials.SpecTooLarge if validating a candidate cannot fit in free device memory."""
        self.trials.check_fits()

    def close(self) -> None:
        self.trials.release()

    def peak_extra_bytes(self) -> int | None:
        """Peak device memory allocated since this Measurer began, beyond what was allocated then."""
        return self.peak_meter.extra()

    # --- builder --------------------------------------------------------------------------------
    def prepare(self, configs: Sequence[Config]) -> None:
        """Start building candidates the search will evaluate next (in parallel on CUDA); a
        generator that runs in this process generates now (generate time)."""
        t0 = time.perf_counter()
        try:
            self.builder.submit(self.spec, self.family, list(configs))
        finally:
            self._seconds["generate"] += time.perf_counter() - t0

    def build(self, config: Config) -> tuple[Path, Any]:
        """The built candidate's folder and its loaded runner."""
        t0 = time.perf_counter()
        try:
            directory = self.builder.build(self.spec, self.family, config)
            return directory, load_program(directory, self.spec, self.target.triton,
                                           module_name=f"torch_kernelize_candidates.k{self.spec.key}_{abs(hash(config.key))}")
        finally:
            self._seconds["build"] += time.perf_counter() - t0

    # --- runner ---------------------------------------------------------------------------------
    def bench_inputs(self) -> list[torch.Tensor]:
        """The first validation trial's inputs (from the trial store: kept there, or drawn again)."""
        return self.trials.inputs(self.seeds[0], "random")

    def baseline(self) -> Any:
        """What candidates are timed against, a function of the inputs: the vendor op; for a whole
        graph, the graph as kernelize assembles it from the cache (graph_candidates.py); for a
        GRAPHED spec, the vendor op as a split graph serves it, what it made copied into the next
        stretch's inputs (benchmark.with_split_copies)."""
        if self._baseline is None:
            self._baseline = self.spec.run_vendor
            if is_whole_graph(self.spec) and self.cache_dir is not None:
                self._baseline = assembly_runner(self.spec, self.target, self.cache_dir)
            elif self.spec.condition == GRAPHED:
                self._baseline = with_split_copies(self.spec.run_vendor)
        return self._baseline

    def vendor_ms(self) -> float | None:
        if self.timed and self._vendor_ms is None:
            inputs = self.bench_inputs()
            baseline = self.baseline()
            self._vendor_ms = self._time(lambda: self._timer(False)(lambda: baseline(inputs)))
        return self._vendor_ms

    def _timer(self, candidate: bool) -> Timer:
        """How the vendor op or a candidate is timed: alone (median_ms); a GRAPHED spec's as a
        captured model serves it, behind queued work, a candidate captured and replayed
        (benchmark.queued_ms; the vendor op syncs, so it runs as it is)."""
        if self.spec.condition == GRAPHED:
            return lambda fn: queued_ms(fn, graphed=candidate)
        return lambda fn: median_ms(fn)  # (looked up when called: tests replace it)

    def _time(self, fn):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self._seconds["timing"] += time.perf_counter() - t0

    def validate_runner(self, run: Any) -> Any:
        """validate() of ``run`` (inputs -> outputs) on the shared trials: a core.validate record.
        Its time, less what the trials computed, is validation's. (A bucket validates its winner's
        binaries at other sizes with it: buckets.BucketMeasurer.)"""
        before = sum(self.trials.seconds.values())
        t0 = time.perf_counter()
        try:
            threads = 1 if self._one_thread else None
            with warnings.catch_warnings(), np.errstate(all="ignore"), _host_threads(threads):
                # edge inputs (inf, NaN, huge) make the interpreter's numpy warn; validation judges them
                warnings.simplefilter("ignore", RuntimeWarning)
                record = validate(run, self.spec, self._sample, self.family.edge_kinds, self.seeds,
                                  device=self.device, extra_trials=len(self.extra_inputs), trials=self.trials,
                                  resolve_ties=self.family.resolve_ties, elementwise_bar=True,
                                  magnitudes=self.family.term_magnitudes)
                record.trials_note = self.trials_note
                return record
        finally:
            spent = sum(self.trials.seconds.values()) - before
            self._seconds["validation"] += time.perf_counter() - t0 - spent

    def _sample(self, spec: KernelSpec, seed: int, kind: str, device: Any) -> list[torch.Tensor]:
        if kind == "captured":  # in the spec's layout: a repro may hold a view's values as a dense copy
            return [_in_layout(to_device(t, device), m) for t, m in zip(self.extra_inputs[seed], spec.inputs)]
        return self.family.sample_inputs(spec, seed, kind, device)

    def validate_unaligned(self, directory: Path) -> str | None:
        """Validate the winner's binaries for unaligned views (launch.ProgramRunner takes them for
        inputs off a 16-byte boundary) on the same trials, every input moved one element off;
        None if they pass, else why not."""
        runner = load_program(directory, self.spec, self.target.triton)
        record = self.validate_runner(lambda inputs: runner.run_poisoned([unaligned_copy(t) for t in inputs]))
        return None if record.ok else record.reason

    def evaluate(self, config: Config) -> Evaluation:
        ev = self._evaluate(config)
        ev.fault = self.device == "cuda" and device_fault(ev.error)
        return ev

    def _evaluate(self, config: Config) -> Evaluation:
        try:
            _, runner = self.build(config)
        except Exception as e:
            if machine_error(e):  # not the candidate's fault, and not journaled: the run stops (cli.py)
                raise
            return Evaluation(config.to_json(), False, 0.0, error=f"build failed: {_short(e)}")
        refused = refused_ops(getattr(getattr(runner, "program", None), "steps", ()), self.target)
        if refused:  # a bring-up chip: the program's vendor calls would not run where it is served
            return Evaluation(config.to_json(), False, 0.0, error=f"its program calls {', '.join(refused)}, which "
                              f"target {self.target.name!r} does not run")
        record = self.validate_runner(runner.run_poisoned)
        if not record.ok:
            return Evaluation(config.to_json(), False, 0.0, error=record.reason, validation=record.to_json())
        if not self.timed:
            return Evaluation(config.to_json(), True, 1.0, validation=record.to_json())
        inputs = self.bench_inputs()
        try:
            cand = self._time(lambda: self._timer(True)(lambda: runner(*inputs)))
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
        baseline = self.baseline()
        timers = ({"time_vendor": self._timer(False), "time_candidate": self._timer(True)}
                  if self.spec.condition == GRAPHED else {})
        return self._time(lambda: paired_ms(lambda: baseline(inputs), lambda: runner(*inputs), rounds, **timers))

    def assemblies(self, set_aside: Sequence[str], rounds: int = 3) -> tuple[float, float] | None:
        """(ms of the whole graph's assembly as the cache gives it, ms with the entries of
        ``set_aside`` taken as "vendor wins"), timed alternately; None where nothing is timed."""
        if not self.timed or self.cache_dir is None:
            return None
        inputs = self.bench_inputs()
        given = self.baseline()  # (a whole graph's: its assembly from the cache as it is now)
        without = assembly_runner(self.spec, self.target, self.cache_dir, frozenset(set_aside))
        return self._time(lambda: paired_ms(lambda: given(inputs), lambda: without(inputs), rounds))


@contextlib.contextmanager
def _host_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` (None: left as they are) for the block, then back."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None:
            torch.set_num_threads(before)


def _in_layout(t: torch.Tensor, meta: Any) -> torch.Tensor:
    """``t``'s values with ``meta``'s strides (kernels bake the spec's strides in)."""
    if tuple(t.stride()) == tuple(meta.stride) or tuple(t.shape) != tuple(meta.shape):
        return t
    # a broadcast input (stride 0, e.g. an expand a region reads) is captured dense: its values
    # repeat along those dims, so one slice of each is stored and expanded again
    broadcast = [d for d, (n, st) in enumerate(zip(meta.shape, meta.stride)) if st == 0 and n > 1]
    for d in broadcast:
        t = t.narrow(d, 0, 1)
    out = torch.empty_strided(t.shape, meta.stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out.expand(meta.shape) if broadcast else out


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


def phase_totals(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Seconds per phase (build, reference, validation, timing) over the summary rows of a run."""
    return {p: round(sum((r.get("time") or {}).get(p, 0.0) for r in rows), 2) for p in PHASES}
