"""The builder: generate and compile candidates, in parallel worker processes on CUDA.

Compiling a Triton kernel takes about a second of CPU; measuring it takes milliseconds of GPU.
So candidates are built ahead in a process pool (spawned: the workers never touch CUDA, they
compile for the GPU target the parent names) and the runner only loads the finished binaries.
On the interpreter target there is nothing to compile and building happens inline.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

from torch_kernelize.lowering.kernels import Config, KernelFamily
from torch_kernelize.lowering.targets import Target
from torch_kernelize.spec import KernelSpec


def _build(spec_json: dict, family_name: str, config_json: dict, directory: str, backend: str,
           gpu_target: tuple | None) -> str | None:
    """Worker: generate + write (+ compile) one candidate; the error text, or None."""
    from torch_kernelize.build import write_program
    from torch_kernelize.lowering.kernels import families

    try:
        spec = KernelSpec.from_json(spec_json)
        family = next(f for f in families() if f.name == family_name)
        program = family.generate(spec, Config.from_json(config_json))
        write_program(Path(directory), spec, program, backend, gpu_target)
        return None
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        return text if len(text) < 2000 else text[:2000] + " ..."


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

    def submit(self, spec: KernelSpec, family: KernelFamily, configs: list[Config]) -> None:
        """Start building these candidates (CUDA: in the pool; interpreter: nothing to do yet)."""
        if self._pool is None:
            return
        for c in configs:
            k = (spec.key, c.key)
            if k not in self._futures:
                d = self.directory(spec, c)
                self._futures[k] = self._pool.submit(_build, spec.to_json(), family.name, c.to_json(), str(d),
                                                     self.backend, self._gpu_target)

    def build(self, spec: KernelSpec, family: KernelFamily, config: Config) -> Path:
        """The built candidate's folder; raises RuntimeError with the build error."""
        k = (spec.key, config.key)
        if k not in self._futures:
            if self._pool is None:
                error = _build(spec.to_json(), family.name, config.to_json(), str(self.directory(spec, config)),
                               self.backend, None)
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.set_result(error)
                self._futures[k] = fut
            else:
                self.submit(spec, family, [config])
        error = self._futures[k].result()
        if error is not None:
            raise RuntimeError(error)
        return self.directory(spec, config)

    def submit_unaligned(self, spec: KernelSpec, directory: Path) -> concurrent.futures.Future:
        """Compile a built program again for unaligned views (CUDA: in the pool, so that the next
        specs' searches go on meanwhile); the future's result is the error text or None."""
        if self._pool is not None:
            return self._pool.submit(_build_unaligned, spec.to_json(), str(directory), self._gpu_target)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(None)  # the interpreter runs the source: nothing to compile
        return fut

    def discard(self, spec: KernelSpec) -> None:
        shutil.rmtree(self.root / spec.key, ignore_errors=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        shutil.rmtree(self.root, ignore_errors=True)
