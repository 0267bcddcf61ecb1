"""Launching stored Triton binaries on CUDA. ``load_launch`` turns the cubin and Triton metadata
that building/triton_compile.py stored back into a launcher without compiling anything: through
torch's static CUDA launcher when it takes the kernel (no C compilation either), else through
Triton's own launcher rebuilt from the stored binary.

Pointer arguments are compiled as 16-byte aligned (Triton's ``tt.divisibility``: vector loads).
A stored kernel also gets a second binary per launch compiled without that assumption for its
inputs (``launch<i>.unaligned.cubin``, validated by fill_cache with unaligned inputs): the
runner checks its inputs' alignment before each launch and takes it for views that start off a
16-byte boundary (a slice ``t[start:end]`` of int64 with an odd ``start``), instead of sending
the call to the vendor op. Entries without it (older, or where it did not compile) fall back to
the vendor op for such calls (see launch.MisalignedInput).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from torch_kernelize.core.program import KernelProgram, Launch, launch_files
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.serving.cubin_launch import load_now

log = logging.getLogger("torch_kernelize.serving.launch")


def ast_source(fn: Any, launch: Launch, program: KernelProgram, spec: KernelSpec, aligned: bool = True):
    """ASTSource with the signature, constexprs and alignment facts of one launch (pointers
    16-byte aligned, except the inputs' where ``aligned`` is False; integer arguments by their values)."""
    from triton.compiler import ASTSource

    signature = program.signature(launch, spec)
    names = list(signature)
    attrs = {}
    runtime = iter(enumerate(launch.args))
    varying = {int(p) for p in launch.runtime_sizes.get("args", {})}  # a bucket's sizes: no divisibility
    for i, name in enumerate(names):
        if signature[name] == "constexpr":
            continue
        position, (kind, value) = next(runtime)
        # Outputs and temporaries are the runner's own allocations, aligned in both binaries:
        # only the caller's inputs can be views off a boundary. (Dropping the assumption for an
        # output costs its vector stores, and for fp16 atomics a compare-and-swap loop per element.)
        if (signature[name].startswith("*") and (_view_aligned(program, spec, value) if kind == "view"
                                                 else aligned or kind != "in")) \
                or (kind in ("i32", "i64") and value % 16 == 0 and position not in varying):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature=signature, constexprs=dict(launch.constexprs), attrs=attrs)


def _view_aligned(program: KernelProgram, spec: KernelSpec, j: int) -> bool:
    """Whether view ``j`` points 16 bytes past a multiple of 16 into its (aligned) buffer."""
    v = program.views[j]
    return v.offset * getattr(torch, program.buffer_dtype(v.buffer, spec)).itemsize % 16 == 0


def import_launcher() -> None:
    """Import torch's static launcher ahead of the first load (the backend does so when
    torch.compile looks it up); a torch or Triton without it is left to ``CudaLaunch``."""
    try:
        import torch._inductor.runtime.static_triton_launcher  # noqa: F401
    except Exception as e:  # e.g. no Triton: CudaLaunch then uses Triton's launcher, or fails there
        log.debug("torch's static launcher is not importable (%s: %s)", type(e).__name__, e)


class StoredBinary:
    """One stored binary, read as far as launching it needs: Triton's metadata, the source's
    signature and the cubin -- the fields of Triton's ``CompiledKernel`` that torch's static
    launcher reads. ``CompiledKernel`` also makes a namedtuple class, a compiler backend and packed
    metadata per binary (~0.5 ms each, and a graph's first call loads dozens); ``compiled()``
    builds it only where Triton's launcher is needed."""

    def __init__(self, src: Any, cubin: Path, meta: Path, default_hash: str):
        from triton.backends.compiler import GPUTarget

        metadata = json.loads(meta.read_text())
        target = metadata["target"]  # stored as a dict, as Triton's CompiledKernel reads it
        metadata["target"] = GPUTarget(target["backend"], target["arch"], target["warp_size"])
        self.metadata = _metadata_type(tuple(sorted(metadata)))(**metadata)
        self.src = src
        self.hash = metadata.get("hash", default_hash)
        self.name = self.metadata.name
        self.asm = {"cubin": cubin.read_bytes()}
        self._cubin_path = str(cubin)
        self._group = {cubin.name: str(cubin), meta.name: str(meta)}

    def compiled(self) -> Any:
        """Triton's ``CompiledKernel`` of this binary (no compilation: the stored files)."""
        from triton.compiler import CompiledKernel
        return CompiledKernel(self.src, self._group, self.hash)


@functools.lru_cache(maxsize=None)
def _metadata_type(fields: tuple[str, ...]) -> type:
    """Triton's ``KernelMetadata`` namedtuple for one set of fields: one class per Triton
    version's field set, where ``CompiledKernel`` makes one per binary."""
    return collections.namedtuple("KernelMetadata", fields)


class CudaLaunch:
    """One stored kernel, loaded into the driver. ``run(grid_x, grid_y, grid_z, stream, *args)``
    launches it (the runner's hot path); the arguments leave out the positions in ``dropped``
    (constexprs the static launcher does not take)."""

    def __init__(self, binary: StoredBinary, constexpr_positions: Sequence[int]):
        import torch

        self.name = binary.name
        self.dropped: frozenset[int] = frozenset()
        self._static = None
        try:
            if getattr(binary.metadata, "launch_cooperative_grid", False):
                # torch's static launcher has no cooperative launch: it would start a grid
                # barrier's programs without the driver's check that they all fit at once
                raise NotImplementedError("cooperative launch")
            from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
            static = StaticallyLaunchedCudaKernel(binary)
            static.load_kernel(torch.cuda.current_device())
            load_now(static.function)
            self._static = static
            self.run = static.run
            self.dropped = frozenset(constexpr_positions)
        except Exception as e:  # not every kernel/torch version takes the static path
            log.debug("static launcher refused %s (%s); using Triton's launcher", self.name, e)
            compiled = binary.compiled()
            launch = compiled.run  # builds Triton's launcher for the stored binary (no Triton compile)
            function, packed = compiled.function, compiled.packed_metadata
            load_now(function)
            scratch = getattr(binary.metadata, "global_scratch_size", 0) > 0

            def run(gx: int, gy: int, gz: int, stream: int, *args: Any) -> None:
                if scratch:
                    _give_triton_an_allocator()
                launch(gx, gy, gz, stream, function, packed, None, None, None, *args)
            self.run = run

    @property
    def static(self) -> bool:
        return self._static is not None


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Device memory for Triton's global scratch (a kernel that builds tensor descriptors keeps
    them there: 128 bytes per program), from torch's caching allocator: inside a CUDA-graph
    capture it comes from the graph's pool, as the rest of the call's memory does."""
    return torch.empty(size, dtype=torch.uint8, device="cuda")


@functools.lru_cache(maxsize=None)
def _allocator_slot() -> tuple[Any, type] | None:
    """Triton's allocator context variable and its default's type, looked up once (the check
    runs before each launch); None in a Triton laid out otherwise."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        return _allocator, NullAllocator
    except ImportError:
        return None


def _give_triton_an_allocator() -> None:
    """Set ``_scratch`` as Triton's allocator where none is set in this thread (Triton keeps it in
    a context variable; its default raises at the launch). One the user set is kept; a Triton
    laid out otherwise gets ours, which serves any kernel."""
    slot = _allocator_slot()
    if slot is not None and not isinstance(slot[0].get(), slot[1]):
        return
    import triton
    triton.set_allocator(_scratch)


class KernelSignature:
    """What launching a stored binary needs of its ``@triton.jit`` function -- the name and the
    parameters (Triton's launcher maps constants by name; torch's static launcher reads which are
    constexprs) -- taken from the program, so that serving does not import and decorate every
    kernel's source (a few ms each: a graph loads hundreds of kernels on its first call)."""

    def __init__(self, name: str, arg_names: Sequence[str], constexprs: Sequence[str]):
        self.__name__ = name
        self.arg_names = list(arg_names)
        self.params = [_Param(k, n, n in constexprs) for k, n in enumerate(self.arg_names)]
        self.constexprs = [p.num for p in self.params if p.is_constexpr]

    @classmethod
    def of(cls, launch: Launch, program: KernelProgram) -> "KernelSignature":
        return cls(launch.kernel, program.kernel_arg_names(launch.kernel), list(launch.constexprs))


@dataclasses.dataclass(frozen=True)
class _Param:
    num: int
    name: str
    is_constexpr: bool


def load_launch(directory: Path, i: int, fn: Any, launch: Launch, program: KernelProgram,
                spec: KernelSpec, aligned: bool = True) -> CudaLaunch:
    """The launcher of launch ``i`` from its stored cubin and metadata (no compilation); ``fn`` is
    the kernel's function or its KernelSignature."""
    if program.language == "cuda":
        from torch_kernelize.serving import cubin_launch
        return cubin_launch.load_launch(directory, i, launch)

    cubin, meta = launch_files(i, aligned)
    binary = StoredBinary(ast_source(fn, launch, program, spec, aligned), directory / cubin, directory / meta, spec.key)
    names = program.kernel_arg_names(launch.kernel)
    return CudaLaunch(binary, [k for k, n in enumerate(names) if n in launch.constexprs])
