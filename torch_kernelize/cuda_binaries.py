"""Ahead-of-time Triton compilation for CUDA and loading of the stored binaries.

``compile_launches`` runs ``triton.compile`` once per launch (fill_cache time) and stores the
cubin and Triton's metadata. ``load_launch`` rebuilds a ``triton.compiler.CompiledKernel`` from
those files: loading a binary into the driver is not a compilation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch_kernelize.launch import import_source
from torch_kernelize.lowering.kernels.program import KernelProgram, Launch
from torch_kernelize.spec import KernelSpec


def _gpu_target():
    from triton.runtime import driver
    return driver.active.get_current_target()


def _launch_files(i: int) -> tuple[str, str]:
    return f"launch{i}.cubin", f"launch{i}.json"


def compile_launches(directory: Path, spec: KernelSpec, program: KernelProgram) -> list[str]:
    import triton
    from triton.compiler import ASTSource

    module = import_source(directory / "kernel.py", f"torch_kernelize_build.k{spec.key}_{id(program)}")
    target = _gpu_target()
    files = []
    for i, launch in enumerate(program.launches):
        fn = getattr(module, launch.kernel)
        src = ASTSource(fn, signature=program.signature(launch, spec), constexprs=dict(launch.constexprs))
        compiled = triton.compile(src, target=target,
                                  options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
        cubin, meta = _launch_files(i)
        (directory / cubin).write_bytes(compiled.asm["cubin"])
        metadata = dict(compiled.metadata._asdict())
        metadata["target"] = {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size}
        (directory / meta).write_text(json.dumps(metadata, default=str, sort_keys=True))
        files += [cubin, meta]
    return files


def load_launch(directory: Path, i: int, fn: Any, launch: Launch, program: KernelProgram,
                spec: KernelSpec):
    """A CompiledKernel for launch ``i``, from its stored cubin and metadata (no compilation)."""
    from triton.compiler import ASTSource, CompiledKernel

    cubin, meta = _launch_files(i)
    src = ASTSource(fn, signature=program.signature(launch, spec), constexprs=dict(launch.constexprs))
    group = {cubin: str(directory / cubin), meta: str(directory / meta)}
    return CompiledKernel(src, group, json.loads((directory / meta).read_text()).get("hash", spec.key))
