"""CUDA C++ kernels, built: nvcc compiles each launch of a program to a cubin (fill_cache time);
serving/cubin_launch.py launches the stored cubins through the CUDA driver API.

A family emits CUDA C++ (``KernelProgram.language == "cuda"``, see program.py) where Triton cannot
express the kernel it needs: shared-memory addresses of its own, the copy engine's bulk copies.
Building needs nvcc, the CUDA toolkit's compiler, and only where the cache is filled: it is found
through ``TORCH_KERNELIZE_NVCC``, then ``PATH``, then ``CUDA_HOME``/``CUDA_PATH``, then
/usr/local/cuda. Serving needs only the driver that torch has loaded already: no compiler runs.

Such kernels assume 16-byte aligned pointers (they move 16-byte vectors), and have no second
binary for unaligned views: the runner sends those calls to the vendor op (launch.MisalignedInput).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from torch_kernelize.core.program import KernelProgram, Launch, launch_files

NVCC_ENV = "TORCH_KERNELIZE_NVCC"
MIN_CAPABILITY = (9, 0)  # the kernels use sm_90's bulk copies and transaction-count barriers


def nvcc() -> str | None:
    """The nvcc to build with, or None where there is none."""
    given = os.environ.get(NVCC_ENV)
    if given:
        return given if Path(given).is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def available() -> bool:
    """Whether this process can build and run CUDA C++ candidates: nvcc is found, and the current
    CUDA device has compute capability MIN_CAPABILITY or above."""
    import torch
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() >= MIN_CAPABILITY
            and nvcc() is not None)


def _define(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    raise ValueError(f"a CUDA C++ constant must be an int or bool, not {value!r}")


def defines(launch: Launch) -> list[str]:
    """A launch's constants as nvcc's -D options."""
    return [f"-D{k}={_define(v)}" for k, v in sorted(launch.constexprs.items())]


def nvcc_command(source: Path, out: Path, launch: Launch, arch: int, tool: str = "nvcc") -> list[str]:
    """The nvcc command that compiles ``launch``'s kernel for sm_<arch> into ``out`` (a cubin)."""
    return [tool, "-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3", "-std=c++17", "-Xptxas", "-v",
            *defines(launch), str(source), "-o", str(out)]


def compile_launches(directory: Path, program: KernelProgram, gpu_target: tuple) -> list[str]:
    """Compile every launch of a CUDA C++ program (written in ``directory``) with nvcc for the
    GPU of ``gpu_target`` (backend, arch, warp size); store each cubin with its metadata (kernel
    name, threads, shared memory, ptxas's register and spill report). Returns the file names."""
    tool = nvcc()
    if tool is None:
        raise RuntimeError(f"building a CUDA C++ kernel needs nvcc: put the CUDA toolkit's nvcc on PATH "
                           f"or name it in {NVCC_ENV}")
    backend, arch = gpu_target[0], int(gpu_target[1])
    if backend != "cuda":
        raise RuntimeError(f"CUDA C++ kernels build for NVIDIA GPUs, not for {backend!r}")
    directory = Path(directory)
    files = []
    for i, launch in enumerate(program.launches):
        cubin, meta = launch_files(i)
        cmd = nvcc_command(directory / program.source_file, directory / cubin, launch, arch, tool)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"nvcc failed on {launch.kernel} ({' '.join(defines(launch))}):\n{done.stderr[-3000:]}")
        report = " ".join(l.split(":", 1)[-1].strip() for l in done.stderr.splitlines() if "registers" in l or "spill" in l)
        metadata = {"name": launch.kernel, "language": "cuda", "threads": 32 * launch.num_warps,
                    "shared": launch.shared, "ptxas": report,
                    "target": {"backend": backend, "arch": arch, "warp_size": int(gpu_target[2])}}
        (directory / meta).write_text(json.dumps(metadata, sort_keys=True))
        files += [cubin, meta]
    return files
