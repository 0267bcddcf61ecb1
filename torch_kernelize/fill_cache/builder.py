"""The builder: generate and compile candidates, in parallel worker processes on CUDA.

Compiling a Triton kernel takes about a second of CPU; measuring it takes milliseconds of GPU.
So candidates are built ahead in a process pool (spawned: the workers never touch CUDA, they
compile for the GPU target the parent names) and the runner only loads the finished binaries.
On the interpreter target there is nothing to compile and building happens inline.
A generator outside the registry of families (the candidate files of fill_cache/external.py)
generates its program here, in the parent, and the worker only writes and compiles it.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

from torch_kernelize.lowering.kernels import Config, KernelFamily, KernelProgram, families
from torch_kernelize.lowering.targets import Target
from torch_kernelize.spec import KernelSpec


def _build(spec_json: dict, family_name: str | tuple[str, dict], config_json: dict, directory: str,
           backend: str, gpu_target: tuple | None) -> str | None:
    """Worker: generate + write (+ compile) one candidate; the error text, or None.
    ``family_name`` names a registered family, or is a generated program as (source, JSON)."""
    from torch_kernelize.build import write_program
    from torch_kernelize.lowering.kernels import families

    try:
        spec = KernelSpec.from_json(spec_json)
        if isinstance(family_name, str):
            family = next(f for f in families() if f.name == family_name)
            program = family.generate(spec, Config.from_json(config_json))
        else:
            program = KernelProgram.from_json(family_name[1], family_name[0])
        write_program(Path(directory), spec, program, backend, gpu_target)
        return None
    except Exception as e:
        return _error_text(e)


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 2000 else text[:2000] + " ..."


def _done(result: str | None) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(result)
    return fut


def _build_unaligned(spec_json: dict, directory: str, gpu_target: tuple | None) -> str | None:
    """Worker: add the binaries for unaligned views to a built program; the error text, or None
    (then no such binary is left behind: the runner sends unaligned calls to the vendor op)."""
    from torch_kernelize.build import add_unaligned_binaries
    from torch_kernelize.cuda_binaries import remove_unaligned

    try:
        add_unaligned_binaries(Path(directory), KernelSpec.from_json(spec_json), gpu_target)
        return None
    except Exception as e:
        remove_unaligned(Path(directory))
        return f"{type(e).__name__}: {e}"[:2000]


class Builder:
    def __init__(self, target: Target, workers: int | None = None):
        self.backend = target.triton
        self.root = Path(tempfile.mkdtemp(prefix="kernelize-build-"))
        self._futures: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._pool = None
        self._gpu_target = None
        if self.backend == "cuda":
            from triton.runtime import driver
            t = driver.active.get_current_target()
            self._gpu_target = (t.backend, t.arch, t.warp_size)
            n = workers or max(1, min(16, (os.cpu_count() or 2) - 1))
            self._pool = concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))

    def directory(self, spec: KernelSpec, config: Config) -> Path:
        return self.root / spec.key / str(abs(hash(config.key)))

    def _start(self, spec: KernelSpec, family: KernelFamily, config: Config) -> concurrent.futures.Future:
        """The build of one candidate: in the pool (CUDA) or done here; its result is the error
        text or None. A registered family generates in the worker; any other generator here, and
        the worker gets the program."""
        generator: str | tuple[str, dict] = family.name
        if not any(f is family for f in families()):
            try:
                program = family.generate(spec, config)
                generator = (program.source, program.to_json())
            except Exception as e:
                return _done(_error_text(e))
        args = (spec.to_json(), generator, config.to_json(), str(self.directory(spec, config)), self.backend)
        if self._pool is None:
            return _done(_build(*args, None))
        return self._pool.submit(_build, *args, self._gpu_target)

    def submit(self, spec: KernelSpec, family: KernelFamily, configs: list[Config]) -> None:
        """Start building these candidates (CUDA: in the pool; interpreter: nothing to do yet)."""
        if self._pool is None:
            return
        for c in configs:
            if (spec.key, c.key) not in self._futures:
                self._futures[(spec.key, c.key)] = self._start(spec, family, c)

    def build(self, spec: KernelSpec, family: KernelFamily, config: Config) -> Path:
        """The built candidate's folder; raises RuntimeError with the build error."""
        k = (spec.key, config.key)
        if k not in self._futures:
            self._futures[k] = self._start(spec, family, config)
        error = self._futures[k].result()
        if error is not None:
            raise RuntimeError(error)
        return self.directory(spec, config)

    def submit_unaligned(self, spec: KernelSpec, directory: Path) -> concurrent.futures.Future:
        """Compile a built program again for unaligned views (CUDA: in the pool, so that the next
        specs' searches go on meanwhile); the future's result is the error text or None."""
        if self._pool is not None:
            return self._pool.submit(_build_unaligned, spec.to_json(), str(directory), self._gpu_target)
        return _done(None)  # the interpreter runs the source: nothing to compile

    def discard(self, spec: KernelSpec) -> None:
        shutil.rmtree(self.root / spec.key, ignore_errors=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        shutil.rmtree(self.root, ignore_errors=True)
