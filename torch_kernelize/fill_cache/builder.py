"""The builder: generate and compile candidates, in parallel worker processes on CUDA.

Compiling a Triton kernel takes about a second of CPU; measuring it takes milliseconds of GPU.
So candidates are built ahead in a process pool (spawned: the workers never touch CUDA, they
compile for the GPU target the parent names) and the runner only loads the finished binaries.
On the interpreter target there is nothing to compile and building happens inline (unless the
builder is told to isolate: then in the pool as on CUDA). A generator that a worker cannot find
by name (the candidate files of fill_cache/external.py, a bucket's) generates its program here,
in the parent, and the worker only writes and compiles it. A generator that runs code on the
device while it generates (Inductor autotunes and runs the graph it captures: on a model's index
inputs that can be a device-side assert) generates where ``generate_elsewhere`` says: the fill
hands it the measure worker, whose fault ends only the worker (measure_worker.generate_in).

A program generated before its job (Inductor's whole output: tens of kernels) compiles one kernel
per pool job, in parallel, its source written here first (``SPLIT_AT``): in one job, the compile
of Llama's whole program for unaligned views (the same work again) took 9.8 s of one core.

A worker that dies (a segfault in the compiler, the OOM killer) breaks the whole pool: every
build in flight fails with BrokenProcessPool. The pool is then started again, the candidate
asked for is built again alone, so that it alone is failed if it was the one that killed the
worker, and the others are submitted again; the run goes on.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import weakref
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable

from torch_kernelize.lowering.kernels import Config, KernelFamily
from torch_kernelize.core.errors import machine_error
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.targets import Target
from torch_kernelize.core.spec import KernelSpec


WORKER_DIED = ("the build worker died while building this candidate (killed by a signal: a segfault in "
               "code generation or the compiler, or the OOM killer)")


class ContainedFault(RuntimeError):
    """Generating a candidate faulted the device, or killed or hung the process, where it was
    generated (``Builder.generate_elsewhere``); that process was replaced, this one is unharmed."""


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which ends the run (and them) in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def family_ref(family: KernelFamily) -> tuple[str, str]:
    """What a worker process finds ``family`` by (see find_family); for several generators of
    one spec (generators.Competition), the family that judges their candidates."""
    while hasattr(family, "judge"):  # a competition's judge may be a candidate file's generator
        family = family.judge
    return family.name, type(family).__module__


def find_family(name: str, module: str) -> KernelFamily:
    """The registered family ``name``, else one defined in ``module`` (a plugin's, a test's)."""
    import importlib

    from torch_kernelize.lowering.kernels import families

    for f in families():
        if f.name == name:
            return f
    found = [v for v in vars(importlib.import_module(module)).values()
             if isinstance(v, KernelFamily) and v.name == name]
    if not found:
        raise LookupError(f"no kernel family {name!r} (registered, or in {module})")
    return found[0]


Elsewhere = Callable[[KernelSpec, tuple[str, str], Config], dict]


def _generator(spec: KernelSpec, family: KernelFamily, config: Config,
               elsewhere: Elsewhere | None = None) -> tuple[str, str] | dict:
    """What a worker builds from: the family's reference where it can find the family, else the
    program ({"source", "program"}) generated ``elsewhere`` (for a family a process can find by
    name but that generates on the device) or here; raises what generation raises."""
    ref = family_ref(family)
    try:
        found = find_family(*ref) is family
    except LookupError:
        found = False
    if found and not family.generates_in_parent:
        return ref
    if found and elsewhere is not None:
        return elsewhere(spec, ref, config)
    program = family.generate(spec, config)
    return {"source": program.source, "program": program.to_json()}


def _generates_here(family: KernelFamily, config: Config) -> bool:
    """Whether ``config``'s program is generated before its job goes to the pool (_generator)."""
    if hasattr(family, "generator_of"):
        family = family.generator_of(config)[0]
    try:
        return family.generates_in_parent or find_family(*family_ref(family)) is not family
    except LookupError:
        return True


def _build(spec_json: dict, family: tuple[str, str] | dict, config_json: dict, directory: str, backend: str,
           gpu_target: tuple | None) -> str | None:
    """Worker: generate + write (+ compile) one candidate; the error text, or None. ``family`` is
    a family_ref, or a program generated in the parent (see _generator)."""
    from torch_kernelize.building.programs import write_program

    try:
        spec = KernelSpec.from_json(spec_json)
        if isinstance(family, dict):
            program = KernelProgram.from_json(family["program"], family["source"])
        else:
            program = find_family(*family).generate(spec, Config.from_json(config_json))
        write_program(Path(directory), spec, program, backend, gpu_target)
        return None
    except Exception as e:
        if machine_error(e):  # a full disk is not the candidate's fault: the run stops (cli.py)
            raise
        return _error_text(e)


SPLIT_AT = 4  # a generated Triton program with this many distinct kernels compiles one per pool job


def kernel_groups(program_json: dict) -> list[list[int]]:
    """A generated program's launch numbers by kernel, in order of first launch (a kernel's later
    launches take the same binary from Triton's cache: one job compiles them all)."""
    groups: dict[str, list[int]] = {}
    for i, launch in enumerate(program_json.get("launches", [])):
        groups.setdefault(launch["kernel"], []).append(i)
    return list(groups.values())


def _compile_part(spec_json: dict, directory: str, launches: list[int], gpu_target: tuple | None) -> str | None:
    """Worker: compile these launches of the program written in ``directory``; the error text, or None."""
    from torch_kernelize.building.triton_compile import compile_launches
    from torch_kernelize.serving.launch import read_program

    try:
        compile_launches(Path(directory), KernelSpec.from_json(spec_json), read_program(Path(directory)),
                         gpu_target, only=launches)
        return None
    except Exception as e:
        if machine_error(e):
            raise
        return _error_text(e)


def _all_of(parts: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """One future for a program's parts: the first part's error text (None: all compiled), or the
    exception a part raised (a broken pool: the caller builds the program alone again)."""
    whole: concurrent.futures.Future = concurrent.futures.Future()
    left, lock = [len(parts)], threading.Lock()  # (a part done already calls back here, the others on the pool's thread)

    def done(_: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        failed = [p.exception() for p in parts if p.cancelled() or p.exception() is not None]
        try:
            if failed:
                whole.set_exception(failed[0] or concurrent.futures.CancelledError())
            else:
                whole.set_result(next((p.result() for p in parts if p.result() is not None), None))
        except concurrent.futures.InvalidStateError:  # discarded (cancelled) meanwhile
            pass
    for p in parts:
        p.add_done_callback(done)
    return whole


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 2000 else text[:2000] + " ..."


def _build_unaligned(spec_json: dict, directory: str, gpu_target: tuple | None) -> str | None:
    """Worker: add the binaries for unaligned views to a built program; the error text, or None
    (then no such binary is left behind: the runner sends unaligned calls to the vendor op)."""
    from torch_kernelize.building.programs import add_unaligned_binaries
    from torch_kernelize.core.program import remove_unaligned

    try:
        add_unaligned_binaries(Path(directory), KernelSpec.from_json(spec_json), gpu_target)
        return None
    except Exception as e:
        remove_unaligned(Path(directory))
        return f"{type(e).__name__}: {e}"[:2000]


class Builder:
    def __init__(self, target: Target, workers: int | None = None, isolate: bool | None = None):
        """``isolate``: build in worker processes (default: on CUDA, where compiling takes time)."""
        self.backend = target.triton
        self.root = Path(tempfile.mkdtemp(prefix="kernelize-build-"))
        # removed by close(), or else when the Builder is collected or the process exits (a
        # Measurer or test that never closes its Builder left hundreds of these in /tmp)
        self._remove_root = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self._futures: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._pools: dict[tuple[str, str], int] = {}  # which pool (by start count) each build went to
        self._jobs: dict[tuple[str, str], tuple] = {}  # the arguments of each build, to submit again
        self._pool = None
        self._gpu_target = None
        self.restarts = -1  # how often a dead worker broke the pool (the first start is not one)
        # where a generator that runs on the device generates (see _generator); None: here
        self.generate_elsewhere: Elsewhere | None = None
        # builds whose generator failed in this process (a generator run here): a device fault
        # there leaves this process's CUDA context unusable, not a worker's
        self.failed_here: set[tuple[str, str]] = set()
        self.contained: set[tuple[str, str]] = set()  # builds whose generation raised ContainedFault
        if self.backend == "cuda":
            from triton.runtime import driver
            t = driver.active.get_current_target()
            self._gpu_target = (t.backend, t.arch, t.warp_size)
        if isolate if isolate is not None else self.backend == "cuda":
            self._workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
            self._start()

    def _start(self) -> None:
        self.restarts += 1
        self._pool = concurrent.futures.ProcessPoolExecutor(
            self._workers, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_sigint)

    def contain_fault(self, spec: KernelSpec, config: Config) -> bool:
        """After a build of ``config`` faulted the device: True if that happened in a build
        worker (the pool is started afresh) or where ``generate_elsewhere`` generated it (that
        process was replaced), False if in this process (inline builds, and generators that run
        here), whose CUDA context is then unusable."""
        if (spec.key, config.key) in self.contained:
            return True
        if self._pool is None or (spec.key, config.key) in self.failed_here:
            return False
        self._restart()
        return True

    def _restart(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._start()

    def directory(self, spec: KernelSpec, config: Config) -> Path:
        return self.root / spec.key / str(abs(hash(config.key)))

    def _job(self, spec: KernelSpec, family: KernelFamily, config: Config) -> tuple:
        own = config
        if hasattr(family, "generator_of"):  # several generators: the one that made this config builds it
            family, own = family.generator_of(config)
        return (spec.to_json(), _generator(spec, family, own, self.generate_elsewhere), own.to_json(),
                str(self.directory(spec, config)), self.backend, self._gpu_target)

    def submit(self, spec: KernelSpec, family: KernelFamily, configs: list[Config], ahead: bool = False) -> None:
        """Start building these candidates (in the pool; inline builders: nothing to do yet).
        ``ahead``: for a spec searched later (the fill's lookahead), which may never be (a whole
        graph's program can cover it): only what the pool generates; a generator that runs here
        or elsewhere would make the caller wait, for nothing gained, so it waits for the search."""
        if self._pool is None:
            return
        for c in configs:
            k = (spec.key, c.key)
            if ahead and _generates_here(family, c):
                continue
            if k not in self._futures:
                try:
                    self._jobs[k] = self._job(spec, family, c)
                except Exception as e:  # a generator that runs here (or elsewhere) failed: so did the build
                    self._futures[k] = _done(_error_text(e))
                    (self.contained if isinstance(e, ContainedFault) else self.failed_here).add(k)
                    continue
                self._submit(k)

    def _submit(self, k: tuple[str, str]) -> None:
        try:
            self._futures[k] = self._submit_job(self._jobs[k])
        except BrokenProcessPool:  # broken since the last submit: a fresh pool takes it
            self._restart()
            self._futures[k] = self._submit_job(self._jobs[k])
        self._pools[k] = self.restarts

    def _submit_job(self, job: tuple) -> concurrent.futures.Future:
        """One pool job; a generated Triton program of SPLIT_AT kernels or more: its source
        written here, then one job per kernel."""
        spec_json, family, _, directory, backend, gpu_target = job
        program = family.get("program", {}) if isinstance(family, dict) else {}
        groups = kernel_groups(program) if backend == "cuda" and program.get("language", "triton") == "triton" else []
        if len(groups) < SPLIT_AT:
            return self._pool.submit(_build, *job)
        from torch_kernelize.building.programs import write_sources
        try:
            write_sources(Path(directory), KernelProgram.from_json(program, family["source"]))
        except Exception as e:
            if machine_error(e):
                raise
            return _done(_error_text(e))
        return _all_of([self._pool.submit(_compile_part, spec_json, directory, g, gpu_target) for g in groups])

    def build(self, spec: KernelSpec, family: KernelFamily, config: Config) -> Path:
        """The built candidate's folder; raises RuntimeError with the build error."""
        k = (spec.key, config.key)
        if k not in self._futures:
            if self._pool is None:
                try:
                    self._futures[k] = _done(_build(*self._job(spec, family, config)))
                except Exception as e:
                    if machine_error(e):
                        raise
                    self._futures[k] = _done(_error_text(e))
                    if isinstance(e, ContainedFault):
                        self.contained.add(k)
            else:
                self.submit(spec, family, [config])
        try:
            error = self._futures[k].result()
        except BrokenProcessPool:
            error = self._build_alone(k)
        if error is not None:
            raise RuntimeError(error)
        return self.directory(spec, config)

    def _build_alone(self, k: tuple[str, str]) -> str | None:
        """A worker died while ``k`` was in flight: build it again, alone in a fresh pool, so that
        it fails only if it kills its worker again; then submit the other lost builds again."""
        if self._pools[k] == self.restarts:  # the pool it went to is this one: start a fresh one
            self._restart()
        lost = [j for j, f in self._futures.items()
                if j != k and self._pools.get(j, self.restarts) < self.restarts and not _built(f)]
        try:
            error = self._pool.submit(_build, *self._jobs[k]).result()
        except BrokenProcessPool:
            self._restart()
            error = WORKER_DIED
        self._futures[k] = _done(error)
        self._pools.pop(k, None)
        for j in lost:
            self._submit(j)
        return error

    def submit_unaligned(self, spec: KernelSpec, directory: Path) -> concurrent.futures.Future:
        """Compile a built program again for unaligned views (CUDA: in the pool, so that the next
        specs' searches go on meanwhile); the future's result is the error text or None."""
        if self._pool is not None and self.backend == "cuda":
            try:
                return self._pool.submit(_build_unaligned, spec.to_json(), str(directory), self._gpu_target)
            except BrokenProcessPool:
                self._restart()
                return self._pool.submit(_build_unaligned, spec.to_json(), str(directory), self._gpu_target)
        return _done(None)  # the interpreter runs the source: nothing to compile

    def discard(self, spec: KernelSpec) -> None:
        """Remove the spec's built candidates and forget them: a later build of one builds it
        again (a finished build would otherwise name the folder removed here)."""
        for k in [k for k in self._futures if k[0] == spec.key]:
            self._futures.pop(k).cancel()
            self._jobs.pop(k, None)
            self._pools.pop(k, None)
        shutil.rmtree(self.root / spec.key, ignore_errors=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        self._remove_root()


def _done(result: object) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(result)
    return fut


def _built(fut: concurrent.futures.Future) -> bool:
    """Done, with a result (an error text or None), not lost with its pool."""
    return fut.done() and not fut.cancelled() and fut.exception() is None
