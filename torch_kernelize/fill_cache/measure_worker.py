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

The same worker runs every untrusted kernel on every target (the interpreter runs a kernel's
body as Python in the process: an out-of-bounds store segfaults it): fill_cache's candidates,
and the entries that ``python -m torch_kernelize.cache verify`` and ``import --revalidate`` run
(verify.py). Each call has a time limit (``--time-limit``, else $KERNELIZE_TIME_LIMIT): a kernel
that does not finish in it is failed with "timed out after N s" and the worker is replaced. On a
CPU target the worker's address space is limited too (RLIMIT_AS: what the host had available
when it started, else $KERNELIZE_MEMORY_LIMIT GiB), so a kernel that allocates without end gets
a MemoryError instead of the OOM killer. The worker starts when first needed and is reused.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.core.errors import OptionsError
from torch_kernelize.fill_cache.builder import Builder, ContainedFault, family_ref, find_family
from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN
from torch_kernelize.fill_cache.measure import PHASES, Evaluation, Measurer, _short, device_fault
from torch_kernelize.lowering.kernels import Config, KernelFamily
from torch_kernelize.core.errors import machine_error
from torch_kernelize.core.targets import Target
from torch_kernelize.core.spec import KernelSpec


class WorkerDied(RuntimeError):
    """The measure worker process ended while it measured (a segfault, the OOM killer, a kill), or
    did not answer within its time limit (then it was killed)."""


TIME_LIMIT_ENV = "KERNELIZE_TIME_LIMIT"
MEMORY_LIMIT_ENV = "KERNELIZE_MEMORY_LIMIT"
FILL_TIME_LIMIT_S = 1800.0  # one candidate in a fill: its validation and timing (and the spec's trials, first)
ENTRY_TIME_LIMIT_S = {"cuda": 120.0}  # one cached entry's revalidation; elsewhere (the interpreter):
OTHER_ENTRY_TIME_LIMIT_S = 600.0      # its kernels run as Python, ~1000x slower


def time_limit_s(given: float | None, default: float) -> float:
    """The per-call time limit: ``given`` (a --time-limit flag), else $KERNELIZE_TIME_LIMIT, else ``default``."""
    if given is None and os.environ.get(TIME_LIMIT_ENV, "").strip():
        raw = os.environ[TIME_LIMIT_ENV].strip()
        try:
            given = float(raw)
        except ValueError:
            raise OptionsError(f"${TIME_LIMIT_ENV} must be a number of seconds, got {raw!r}") from None
    if given is not None and not given > 0:
        raise OptionsError(f"the time limit must be a positive number of seconds, got {given!r}")
    return float(given) if given is not None else default


def entry_time_limit_s(target: Target, given: float | None = None) -> float:
    """The time limit for revalidating one cached entry on ``target``."""
    return time_limit_s(given, ENTRY_TIME_LIMIT_S.get(target.device, OTHER_ENTRY_TIME_LIMIT_S))


def memory_limit_bytes(target: Target) -> int | None:
    """The worker's address-space allowance beyond what it maps at start: None on CUDA (its
    driver maps far more address space than it uses); $KERNELIZE_MEMORY_LIMIT GiB where set,
    else 0: the host's available memory, read in the worker."""
    if target.device == "cuda":
        return None
    raw = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if not raw:
        return 0
    try:
        gib = float(raw)
    except ValueError:
        raise OptionsError(f"${MEMORY_LIMIT_ENV} must be a number of GiB, got {raw!r}") from None
    return int(gib * 2**30) if gib > 0 else None


def _died_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
    else:
        how = f"exit code {exitcode}"
    return f"the measure worker died while running this kernel ({how})"


class MeasureWorker:
    """One spawned process that runs untrusted kernels; replaced when it dies, hangs or its device
    faults. Started at the first call (or ``start``); ``time_limit_s`` bounds each call, not
    counting the worker's own start."""

    POLL_S = 0.2
    START_LIMIT_S = 600.0  # its start (imports, CUDA): not counted in a call's time limit

    def __init__(self, time_limit_s: float = FILL_TIME_LIMIT_S, memory_limit: int | None = None,
                 cuda: bool = False, inductor: bool = False) -> None:
        """``memory_limit``: bytes of address space beyond the worker's own at start (0: what the
        host has available then; None: no limit); ``cuda``: the worker initializes CUDA first;
        ``inductor``: it imports Inductor then too (it will generate with Inductor: generate_in),
        while the parent still traces the models."""
        self._ctx = multiprocessing.get_context("spawn")
        self.time_limit_s, self.memory_limit, self.cuda, self.inductor = time_limit_s, memory_limit, cuda, inductor
        self.restarts = -1
        self.holds: set[str] = set()  # the keys of the specs whose Measurers the worker keeps
        self._proc: Any = None
        self._ready = False  # the worker said it has started (its start is not in a call's time)
        self._started: tuple = ()  # its _kind() when it was started

    @classmethod
    def for_target(cls, target: Target, time_limit_s: float, inductor: bool = False) -> "MeasureWorker":
        """The worker of a fill on ``target``; ``inductor``: it generates with Inductor, imported
        at its start on CUDA (elsewhere Inductor is asked for a few specs at most)."""
        cuda = target.device == "cuda"
        return cls(time_limit_s, memory_limit_bytes(target), cuda, inductor and cuda)

    def _kind(self) -> tuple:
        """What a spare worker must have been started with to serve this one (each call brings
        the environment along)."""
        return self.memory_limit, self.cuda, self.inductor, tuple(sys.path)

    def start(self) -> None:
        """Start the worker now, if it is not running (it imports torch while the caller builds):
        the spare one a closed worker of this process left, if it was started alike."""
        if self._proc is not None:
            return
        self.restarts += 1
        self._started = self._kind()
        if _SPARE:
            proc, conn, kind = _SPARE.pop()
            if kind == self._started:
                self._proc, self._conn, self._ready = proc, conn, True
                return
            proc.kill()  # started for another kind of worker: of no use any more
            conn.close()
        self._conn, child = self._ctx.Pipe()
        level = logging.getLogger("torch_kernelize").getEffectiveLevel()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.memory_limit, self.cuda, self.inductor, level),
                                       daemon=True, name="kernelize-measure")
        self._proc.start()
        child.close()

    def _wait(self, limit_s: float, late: str) -> str | None:
        """Wait for the worker's next message; None when it is there, else why not."""
        waited = 0.0
        while not self._conn.poll(self.POLL_S):
            waited += self.POLL_S
            if not self._proc.is_alive():
                self._proc.join(5)
                return _died_text(self._proc.exitcode)
            if waited >= limit_s:
                return f"timed out after {limit_s:g} s ({late})"
        return None

    def call(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` in the worker; its exception is raised here; WorkerDied if it dies or
        does not answer within the time limit (then it is ended: the next call starts a fresh one)."""
        self.start()
        try:
            text = None if self._ready else self._wait(self.START_LIMIT_S, "the measure worker did not start")
            if text is None and not self._ready:
                self._conn.recv()  # ("ready", None)
                self._ready = True
            if text is None:
                self._conn.send((fn, args, dict(os.environ)))
                text = self._wait(self.time_limit_s, "a kernel that never returns, or one that needs longer: "
                                  f"--time-limit or ${TIME_LIMIT_ENV}")
            if text is None:
                status, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._proc.join(5)
            text = _died_text(self._proc.exitcode)
        except BaseException:  # interrupted (Ctrl-C, a caller's alarm): its answer would come to the next call
            self.stop()
            raise
        if text is None:
            if status == "error":
                raise value
            return value
        self.restart()
        raise WorkerDied(text)

    def restart(self) -> None:
        """End the worker (it is dead, hangs, or its CUDA context is unusable); the next call (or
        ``start``) starts a fresh one."""
        self.stop()

    def stop(self, kill: bool = True) -> None:
        """End the worker (asked to, unless ``kill``); the next call starts a fresh one."""
        if self._proc is None:
            return
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
        self._proc, self._ready, self.holds = None, False, set()

    def close(self) -> None:
        """End the worker; a healthy one is kept (one per process) for the next MeasureWorker,
        with nothing of its specs held: a run of tests starts a handful, not one per fill."""
        if self._proc is not None and self._ready and not _SPARE and self._proc.is_alive():
            try:
                self.call(_forget_all)
            except Exception:  # it died or hangs: ended by call()
                pass
            if self._proc is not None:
                _SPARE.append((self._proc, self._conn, self._started))
                self._proc, self._ready, self.holds = None, False, set()
                return
        self.stop(kill=False)


_SPARE: list[tuple[Any, Any, tuple]] = []  # (process, connection, kind): at most one


MIN_AUTO_MEMORY = 2 << 30  # (address space: thread stacks and malloc arenas count, untouched)


def _limit_memory(allowance: int) -> None:
    """Limit this process's address space to what it maps now plus ``allowance`` bytes (0: the
    host's available memory, 2 GiB at least), where the OS has RLIMIT_AS."""
    try:
        import resource

        from torch_kernelize.fill_cache.trials import available_host_memory, mapped_bytes
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped_bytes() + (allowance or max(available_host_memory(), MIN_AUTO_MEMORY))
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, AttributeError, OSError, ValueError):  # no such limit here: run without it
        pass


def _serve(conn: Any, memory_limit: int | None = None, cuda: bool = False, inductor: bool = False,
           log_level: int = logging.WARNING) -> None:
    """The worker's loop: run each (fn, args) it is sent, send back ("ok", result) or ("error", exc).
    Its log lines go to the stderr it shares with the parent, at the parent's level (a spawned
    process starts with no logging configured)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("torch_kernelize").setLevel(log_level)
    _exit_with_parent()
    if memory_limit is not None:
        import triton.language  # noqa: F401 - mapped before the limit is measured, as torch is
        _limit_memory(memory_limit)
    if cuda and torch.cuda.is_available():
        torch.cuda.init()  # before the first candidate arrives, while the parent builds it
    if inductor:
        _warm_inductor()
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        fn, args, env = msg
        if env != os.environ:  # a spare worker serves a later run: the environment of its call
            os.environ.clear()
            os.environ.update(env)
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as e:  # sent to the parent, which raises it
            if not isinstance(e, Exception):  # a kernel's SystemExit must not end the parent
                e = RuntimeError(f"{type(e).__name__}: {e}")
            try:
                conn.send(("error", e))
            except Exception:  # an exception that does not pickle
                conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))


def _warm_inductor() -> None:
    """Import Inductor (seconds that otherwise fall inside the first graph's generation). Its
    compile workers are not started: the capture compiles in this process (inductor.COMMON_OPTIONS
    sets compile_threads 1: a kernel compiled in a subprocess comes back without its source)."""
    import torch._inductor.compile_fx  # noqa: F401


def _exit_with_parent() -> None:
    """End this worker once its parent is gone (killed with SIGKILL, say), even while a kernel
    that never returns holds it: a daemon thread watches (the interpreter's kernels release the
    GIL between Python steps)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="kernelize-parent-watch").start()


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


def _forget_all() -> None:
    """Drop every spec's Measurer: the worker becomes a spare, to serve another run alike."""
    while _HELD:
        _HELD.popitem()[1].close()


def _measurer(context: tuple) -> Measurer:
    spec_json, ref, target, captured, cache_dir, pins = context
    key = spec_json["key"]
    if key not in _HELD:
        WHOLE_GRAPH_DOMAIN.pin(key, pins)  # a whole graph's index inputs, as the parent has them
        _HELD[key] = Measurer(KernelSpec.from_json(spec_json), find_family(*ref), target, captured or [], _Built(),
                              Path(cache_dir) if cache_dir else None)
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


def _generate(spec_json: dict, ref: tuple[str, str], config_json: dict, pins: dict | None) -> dict:
    """Generate one candidate here (Builder.generate_elsewhere): its program as data."""
    WHOLE_GRAPH_DOMAIN.pin(spec_json["key"], pins)  # (Inductor runs a whole graph on its domain's inputs)
    program = find_family(*ref).generate(KernelSpec.from_json(spec_json), Config.from_json(config_json))
    return {"source": program.source, "program": program.to_json()}


# --- in the parent ------------------------------------------------------------------------------
def generate_in(worker: MeasureWorker) -> Callable[[KernelSpec, tuple[str, str], Config], dict]:
    """A Builder's ``generate_elsewhere``: generate in ``worker``. A generator that faults the
    device there (Inductor running a graph on index inputs out of range), dies or hangs raises
    ContainedFault, and the worker is replaced; what it raises otherwise is raised as it is."""
    def generate(spec: KernelSpec, ref: tuple[str, str], config: Config) -> dict:
        try:
            return worker.call(_generate, spec.to_json(), ref, config.to_json(), WHOLE_GRAPH_DOMAIN.pins.get(spec.key))
        except WorkerDied as e:
            raise ContainedFault(f"generating it ended the measure worker: {e}") from None
        except Exception as e:
            if machine_error(e) or not device_fault(f"{type(e).__name__}: {e}"):
                raise
            worker.restart()  # its CUDA context is unusable
            raise ContainedFault(f"generating it faulted the device (in the measure worker, replaced): "
                                 f"{type(e).__name__}: {e}") from None
    return generate


class IsolatedMeasurer:
    """A Measurer whose loading, validation and timing run in a MeasureWorker (same interface)."""

    contains_faults = True  # a device fault ends only the worker, not the run

    def __init__(self, spec: KernelSpec, family: KernelFamily, target: Target,
                 extra_inputs: Sequence[Sequence[torch.Tensor]], builder: Builder, worker: MeasureWorker,
                 cache_dir: Path | None = None):
        self.spec, self.family, self.target, self.builder, self.worker = spec, family, target, builder, worker
        self.cache_dir = str(cache_dir) if cache_dir is not None else None
        self._captured = [list(x) for x in extra_inputs]
        self._ref = family_ref(family)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._peak: int | None = None

    def _call(self, method: str, config: Config | None = None, directory: Path | None = None, *args: Any):
        held = self.spec.key in self.worker.holds
        context = (self.spec.to_json(), self._ref, self.target, None if held else self._captured, self.cache_dir,
                   None if held else WHOLE_GRAPH_DOMAIN.pins.get(self.spec.key))
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
        t0 = time.perf_counter()  # a generator that runs here or in the worker generates now
        try:
            self.builder.submit(self.spec, self.family, list(configs))
        finally:
            self.seconds["generate"] += time.perf_counter() - t0

    def build(self, config: Config) -> tuple[Path, None]:
        return self.builder.build(self.spec, self.family, config), None

    def check_fits(self) -> None:
        self._call("check_fits")

    def evaluate(self, config: Config) -> Evaluation:
        t0 = time.perf_counter()
        try:
            directory = self.builder.build(self.spec, self.family, config)
        except Exception as e:
            if machine_error(e):  # not the candidate's fault (measure.py)
                raise
            return self._build_failed(config, f"build failed: {_short(e)}")
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

    def _build_failed(self, config: Config, error: str) -> Evaluation:
        """A failed build's evaluation. A device fault (a device-side assert while Inductor ran
        the graph to capture it) is journaled as a fault; made in this process, it ends the
        run (search.DeviceFault: its CUDA context is unusable); made in a build worker, the
        pool is started afresh and the search goes on."""
        if (self.spec.key, config.key) in self.builder.contained:  # generated in the worker, replaced
            return Evaluation(config.to_json(), False, 0.0, error=error, fault=True, contained=True)
        if self.target.device != "cuda" or not device_fault(error):
            return Evaluation(config.to_json(), False, 0.0, error=error)
        contained = self.builder.contain_fault(self.spec, config)
        return Evaluation(config.to_json(), False, 0.0, error=error, fault=True, contained=contained)

    def confirm(self, config: Config, rounds: int = 3) -> tuple[float, float] | None:
        # built again where needed: a winner resumed from an earlier process's journal was built
        # in that process's build folder, which is gone
        return self._call("confirm", config, self.build(config)[0], rounds)

    def assemblies(self, set_aside: Sequence[str], rounds: int = 3) -> tuple[float, float] | None:
        return self._call("assemblies", None, None, list(set_aside), rounds)

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
