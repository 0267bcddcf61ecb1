"""The builder: turn a generated KernelProgram into the files the cache stores and the runner loads.

Files: kernel.py (the Triton source; kernel.cu for CUDA C++), program.json (launch list), and on CUDA one compiled
binary per launch (launch<i>.cubin + launch<i>.json metadata), compiled ahead of time here so
that serving never compiles; the kernel that fill_cache stores also gets the binaries for
unaligned views (``add_unaligned_binaries``; candidates are not compiled twice). ``gpu_target``
(backend, arch, warp size) lets a process without CUDA (a build worker) compile for the GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

from torch_kernelize.serving.launch import PROGRAM_FILE, read_program
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.spec import KernelSpec


def write_program(directory: Path, spec: KernelSpec, program: KernelProgram, backend: str,
                  gpu_target: tuple | None = None) -> list[str]:
    """Write a program's files into ``directory``; return their names (relative)."""
    files = write_sources(directory, program)
    if backend == "cuda":
        from torch_kernelize.building.triton_compile import compile_launches
        files += compile_launches(directory, spec, program, gpu_target)
    return files


def write_sources(directory: Path, program: KernelProgram) -> list[str]:
    """Write a program's source and its ``program.json`` (no binaries) into ``directory``; return
    their names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / program.source_file).write_text(program.source)
    (directory / PROGRAM_FILE).write_text(json.dumps(program.to_json(), indent=1, sort_keys=True))
    return [program.source_file, PROGRAM_FILE]


def add_unaligned_binaries(directory: Path, spec: KernelSpec, gpu_target: tuple | None = None) -> list[str]:
    """Compile the program in ``directory`` again without assuming 16-byte aligned pointers (the
    runner's path for unaligned views); return the new files."""
    from torch_kernelize.building.triton_compile import compile_launches

    return compile_launches(Path(directory), spec, read_program(directory), gpu_target, aligned=False)
