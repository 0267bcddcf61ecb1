"""The builder: turn a generated KernelProgram into the files the cache stores and the runner loads.

Files: kernel.py (the Triton source), program.json (launch list), and on CUDA one compiled
binary per launch (launch<i>.cubin + launch<i>.json metadata), compiled ahead of time here so
that serving never compiles; the kernel that fill_cache stores also gets the binaries for
unaligned views (``add_unaligned_binaries``; candidates are not compiled twice). ``gpu_target``
(backend, arch, warp size) lets a process without CUDA (a build worker) compile for the GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

from torch_kernelize.launch import PROGRAM_FILE, SOURCE_FILE
from torch_kernelize.lowering.kernels.program import KernelProgram
from torch_kernelize.spec import KernelSpec


def write_program(directory: Path, spec: KernelSpec, program: KernelProgram, backend: str,
                  gpu_target: tuple | None = None) -> list[str]:
    """Write a program's files into ``directory``; return their names (relative)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SOURCE_FILE).write_text(program.source)
    (directory / PROGRAM_FILE).write_text(json.dumps(program.to_json(), indent=1, sort_keys=True))
    files = [SOURCE_FILE, PROGRAM_FILE]
    if backend == "cuda":
        from torch_kernelize.cuda_binaries import compile_launches
        files += compile_launches(directory, spec, program, gpu_target)
    return files


def add_unaligned_binaries(directory: Path, spec: KernelSpec, gpu_target: tuple | None = None) -> list[str]:
    """Compile the program in ``directory`` again without assuming 16-byte aligned pointers (the
    runner's path for unaligned views); return the new files."""
    from torch_kernelize.cuda_binaries import compile_launches

    directory = Path(directory)
    source = (directory / SOURCE_FILE).read_text()
    program = KernelProgram.from_json(json.loads((directory / PROGRAM_FILE).read_text()), source)
    return compile_launches(directory, spec, program, gpu_target, aligned=False)
