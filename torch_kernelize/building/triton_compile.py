"""Ahead-of-time Triton compilation for CUDA (fill_cache time): ``compile_launches`` runs
``triton.compile`` once per launch of a program and stores the cubin and Triton's metadata,
which serving/triton_binaries.py loads without compiling. CUDA C++ programs go to nvcc.py.
Also the SASS of a stored binary, for tests and experiments that check what a kernel compiled to.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from torch_kernelize.building import nvcc
from torch_kernelize.core.program import KernelProgram, Launch, launch_files
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.serving.launch import import_source
from torch_kernelize.serving.triton_binaries import ast_source


def current_gpu_target():
    """Triton's target for the current GPU."""
    from triton.runtime import driver
    return driver.active.get_current_target()


def sass(cubin: Path) -> str:
    """The SASS of a stored binary, disassembled by Triton's bundled cuobjdump (no GPU needed):
    what tests and experiments inspect to check what a kernel compiled to."""
    import subprocess

    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


SASS_OPCODES = ("LDS", "STS", "LDSM", "STSM", "LDG", "STG", "LDGSTS", "LDL", "STL", "HGMMA", "HMMA", "SHFL")


def sass_counts(cubin: bytes, opcodes: tuple[str, ...] = SASS_OPCODES, suffixes: bool = True) -> dict[str, int]:
    """How often each instruction of ``opcodes`` occurs in a binary's SASS: by full name
    (``LDS.U16`` apart from ``LDS.128``), or summed per opcode when ``suffixes`` is False."""
    import collections
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        text = sass(path)
    names = re.findall(rf"\b((?:{'|'.join(opcodes)})(?:\.[\w.]*)?)\b", text)
    return dict(sorted(collections.Counter(n if suffixes else n.split(".")[0] for n in names).items()))


def compile_options(launch: Launch) -> dict[str, Any]:
    """Triton's compile options for a launch."""
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    if launch.synchronized:  # a grid barrier: the driver must place every program at once
        options["launch_cooperative_grid"] = True
    return options


def compile_launches(directory: Path, spec: KernelSpec, program: KernelProgram,
                     gpu_target: tuple | None = None, aligned: bool = True,
                     only: Sequence[int] | None = None) -> list[str]:
    """Compile every launch of ``program`` (written in ``directory``), or those numbered in
    ``only`` (a part of a program compiled in several processes), and store each binary and its
    metadata there; return the file names. CUDA C++ programs build with nvcc (nvcc.py) and
    have no binaries for unaligned views."""
    if not aligned and program.aligned_only:
        raise ValueError("these kernels take 16-byte aligned pointers only (CUDA C++, or tensor descriptors); "
                         "unaligned views run the vendor op")
    if program.language == "cuda":
        if gpu_target is None:
            t = current_gpu_target()
            gpu_target = (t.backend, t.arch, t.warp_size)
        return nvcc.compile_launches(directory, program, gpu_target)
    import triton
    from triton.backends.compiler import GPUTarget

    module = import_source(directory / program.source_file, f"torch_kernelize_build.k{spec.key}_{id(program)}")
    target = GPUTarget(*gpu_target) if gpu_target is not None else current_gpu_target()
    files = []
    for i, launch in enumerate(program.launches):
        if only is not None and i not in only:
            continue
        src = ast_source(getattr(module, launch.kernel), launch, program, spec, aligned)
        compiled = triton.compile(src, target=target, options=compile_options(launch))
        cubin, meta = launch_files(i, aligned)
        (directory / cubin).write_bytes(compiled.asm["cubin"])
        metadata = dict(compiled.metadata._asdict())
        metadata["target"] = {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size}
        (directory / meta).write_text(json.dumps(metadata, default=str, sort_keys=True))
        files += [cubin, meta]
    return files
