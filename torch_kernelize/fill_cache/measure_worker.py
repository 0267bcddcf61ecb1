"""Measurement in a worker process: a candidate that kills it fails alone, and the run goes on.

A candidate that segfaults, or faults the GPU (an illegal memory access leaves the process's CUDA
context unusable), takes down the process that ran it. Run in fill_cache's own process, that
ended the run (exit 3, then ``--resume``); run here, in one spawned worker that owns the device
for measurement, only the worker goes: the candidate is journaled as failed with the reason
(``fault``: never evaluated again), a fresh worker is started, and the search goes on.

The worker keeps a spec's Measurer until the parent closes it, so its trials (inputs, float64
references, vendor outputs) are computed once for all of the spec's candidates and the winner's
last checks; a fresh worker computes them again.
Candidates are still built by the parent's Builder (its own pool); the worker loads them.
"""
from __future__ import annotations

import multiprocessing
import signal
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.fill_cache.builder import Builder, family_ref, find_family
from torch_kernelize.fill_cache.measure import Evaluation, Measurer, _short
from torch_kernelize.lowering.kernels import Config, KernelFamily
from torch_kernelize.core.targets import Target
from torch_kernelize.core.spec import KernelSpec


class WorkerDied(RuntimeError):
    """The measure worker process ended while it measured (a segfault, the OOM killer, a kill)."""


def _died_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exit code {exitcode}"
    return f"the measure worker died while measuring this candidate ({how})"


class MeasureWorker:
    """One spawned process that measures candidates; restarted when it dies or its device faults."""

    POLL_S = 0.2
    TIMEOUT_S = 1800.0  # one call (a candidate's validation and timing): beyond it, a hung kernel

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self.restarts = -1
        self.holds: set[str] = set()  # the keys of the specs whose Measurers the worker keeps
        self._start()

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child,), daemon=True, name="kernelize-measure")
        self._proc.start()
        child.close()
        self.holds = set()
        self.restarts += 1

    def call(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` in the worker; its exception is raised here; WorkerDied if it dies (then
        a fresh worker is already started)."""
        text = None
        try:
            self._conn.send((fn, args))
            waited = 0.0
            while not self._conn.poll(self.POLL_S):
                waited += self.POLL_S
                if not self._proc.is_alive():
                    break
                if waited > self.TIMEOUT_S:
                    text = f"the measure worker did not answer in {self.TIMEOUT_S:.0f} s (a kernel that hangs?)"
                    break
            if text is None and self._conn.poll(0):
                status, value = self._conn.recv()
                if status == "error":
                    raise value
                return value
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass
        except KeyboardInterrupt:  # its answer would come to the next call: end it, the parent stops
            self.restart()
            raise
        if text is None:
            self._proc.join(5)
            text = _died_text(self._proc.exitcode)
        self.restart()
        raise WorkerDied(text)

    def restart(self) -> None:
        """End the worker (it is dead, or its CUDA context is) and start a fresh one."""
        self._stop(kill=True)
        self._start()

    def _stop(self, kill: bool) -> None:
        if self._proc.is_alive() and not kill:
            try:
                self._conn.send(None)
                self._proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()

    def close(self) -> None:
        self._stop(kill=False)


def _serve(conn: Any) -> None:
    """The worker's loop: run each (fn, args) it is sent, send back ("ok", result) or ("error", exc)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if torch.cuda.is_available():
        torch.cuda.init()  # before the first candidate arrives, while the parent builds it
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        fn, args = msg
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as e:  # sent to the parent, which raises it
            try:
                conn.send(("error", e))
            except Exception:  # an exception that does not pickle
                conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))


# --- in the worker ------------------------------------------------------------------------------
_HELD: dict[str, Measurer] = {}


class _Built:
    """The worker's builder: the parent built the candidate and names its folder."""

    def __init__(self) -> None:
        self.dirs: dict[str, Path] = {}

    def build(self, spec: KernelSpec, family: KernelFamily, config: Config) -> Path:
        return self.dirs[config.key]

    def submit(self, *args: Any) -> None:
        pass


def _measurer(context: tuple) -> Measurer:
    spec_json, ref, target, captured = context
    key = spec_json["key"]
    if key not in _HELD:
        _HELD[key] = Measurer(KernelSpec.from_json(spec_json), find_family(*ref), target, captured or [], _Built())
    return _HELD[key]


def _run(context: tuple, method: str, config_json: dict | None, directory: str | None, *args: Any):
    """Measurer.<method> on the worker's Measurer of the spec; returns (result, seconds, peak bytes)."""
    m = _measurer(context)
    if method == "close":
        _HELD.pop(m.spec.key).close()
        return None, {}, None
    before = dict(m.seconds)
    m.peak_meter.start()
    if config_json is not None and directory is not None:
        m.builder.dirs[Config.from_json(config_json).key] = Path(directory)
    call = getattr(m, method)
    if method == "validate_unaligned":
        result = call(Path(directory))
    elif config_json is not None:
        result = call(Config.from_json(config_json), *args)
    else:
        result = call(*args)
    return result, {k: m.seconds[k] - before[k] for k in m.seconds}, m.peak_extra_bytes()


# --- in the parent ------------------------------------------------------------------------------
class IsolatedMeasurer:
    """A Measurer whose loading, validation and timing run in a MeasureWorker (same interface)."""

    contains_faults = True  # a device fault ends only the worker, not the run

    def __init__(self, spec: KernelSpec, family: KernelFamily, target: Target,
                 extra_inputs: Sequence[Sequence[torch.Tensor]], builder: Builder, worker: MeasureWorker):
        self.spec, self.family, self.target, self.builder, self.worker = spec, family, target, builder, worker
        self._captured = [list(x) for x in extra_inputs]
        self._ref = family_ref(family)
        self.seconds = dict.fromkeys(("build", "reference", "validation", "timing"), 0.0)
        self._peak: int | None = None

    def _call(self, method: str, config: Config | None = None, directory: Path | None = None, *args: Any):
        held = self.spec.key in self.worker.holds
        context = (self.spec.to_json(), self._ref, self.target, None if held else self._captured)
        result, seconds, peak = self.worker.call(_run, context, method, config.to_json() if config else None,
                                                 str(directory) if directory else None, *args)
        if method == "close":
            self.worker.holds.discard(self.spec.key)
        else:
            self.worker.holds.add(self.spec.key)
        for k, v in seconds.items():
            self.seconds[k] += v
        if peak is not None:
            self._peak = max(self._peak or 0, peak)
        return result

    def prepare(self, configs: Sequence[Config]) -> None:
        self.builder.submit(self.spec, self.family, list(configs))

    def build(self, config: Config) -> tuple[Path, None]:
        return self.builder.build(self.spec, self.family, config), None

    def check_fits(self) -> None:
        self._call("check_fits")

    def evaluate(self, config: Config) -> Evaluation:
        import time
        t0 = time.perf_counter()
        try:
            directory = self.builder.build(self.spec, self.family, config)
        except Exception as e:
            return Evaluation(config.to_json(), False, 0.0, error=f"build failed: {_short(e)}")
        finally:
            self.seconds["build"] += time.perf_counter() - t0
        try:
            ev = self._call("evaluate", config, directory)
        except WorkerDied as e:  # journaled as a fault: no later run evaluates it again
            return Evaluation(config.to_json(), False, 0.0, error=str(e), fault=True, contained=True)
        if ev.fault:  # the worker's CUDA context is unusable: a fresh worker for the next candidate
            self.worker.restart()
            ev.contained = True
        return ev

    def confirm(self, config: Config, rounds: int = 3) -> tuple[float, float] | None:
        return self._call("confirm", config, self.builder.directory(self.spec, config), rounds)

    def validate_unaligned(self, directory: Path) -> str | None:
        try:
            return self._call("validate_unaligned", None, directory)
        except WorkerDied as e:
            return str(e)

    def peak_extra_bytes(self) -> int | None:
        return self._peak

    def close(self) -> None:
        """The spec is done: the worker drops its trials (device memory) now."""
        if self.spec.key in self.worker.holds:
            try:
                self._call("close")
            except WorkerDied:  # gone with its trials: a fresh worker is running
                pass
