"""CUDA C++ kernels, served: a stored cubin (built by building/nvcc.py) loaded into the CUDA driver
that torch has loaded already, and launched through its API. No compiler runs.

Such kernels assume 16-byte aligned pointers (they move 16-byte vectors), and have no second
binary for unaligned views: the runner sends those calls to the vendor op (launch.MisalignedInput).
"""
from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

from torch_kernelize.core.program import Launch, launch_files

_C_SCALARS = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float}


def load_now(function: Any) -> bool:
    """Have the driver load a kernel's code (a CUfunction) now, not at its first launch: under
    CUDA's lazy module loading (torch's default) the first launch of each kernel loads it, and a
    Mixtral server's first call of a new shape bucket launched its bucket's kernels for the first
    time (9 loads, ~40 ms on an H100: issue 41). Programs are loaded when lowering binds them, so
    their code is loaded there too. False where the driver has no cuFuncLoad (before CUDA 12.4)
    or refused: the kernel then loads at its first launch, as it would have."""
    fn = getattr(_Driver.lib(), "cuFuncLoad", None)
    value = function.value if isinstance(function, ctypes.c_void_p) else function
    return fn is not None and bool(value) and fn(ctypes.c_void_p(value)) == 0


class _Driver:
    """The few CUDA driver entry points the launcher calls (libcuda, loaded by torch already)."""

    _lib: ctypes.CDLL | None = None

    @classmethod
    def lib(cls) -> ctypes.CDLL:
        if cls._lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 6, ctypes.c_uint, ctypes.c_void_p,
                                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            cls._lib = lib
        return cls._lib

    @classmethod
    def check(cls, rc: int, what: str) -> None:
        if rc:
            msg = ctypes.c_char_p()
            cls.lib().cuGetErrorString(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise RuntimeError(f"CUDA driver error {rc} ({text}) in {what}")


class CubinLaunch:
    """One stored CUDA C++ kernel, loaded into the driver per device on first use.
    ``run(grid_x, grid_y, grid_z, stream, *args)`` launches it: the runner's hot path."""

    dropped: frozenset[int] = frozenset()  # every parameter is a runtime argument
    static = False

    def __init__(self, cubin: bytes, metadata: dict[str, Any], launch: Launch):
        self.name = metadata["name"]
        self.threads = int(metadata["threads"])
        self.shared = int(metadata["shared"])
        self._cubin = cubin
        self._kinds = [_C_SCALARS.get(kind) for kind, _ in launch.args]  # None: a pointer
        self._functions: dict[int, ctypes.c_void_p] = {}

    def _function(self, device: int) -> ctypes.c_void_p:
        fn = self._functions.get(device)
        if fn is None:
            import torch
            lib = _Driver.lib()
            with torch.cuda.device(device):
                torch.cuda.init()
                torch.empty(0, device=f"cuda:{device}")  # the device's primary context, current here
                module, fn = ctypes.c_void_p(), ctypes.c_void_p()
                _Driver.check(lib.cuModuleLoadData(ctypes.byref(module), self._cubin), f"loading {self.name}")
                _Driver.check(lib.cuModuleGetFunction(ctypes.byref(fn), module, self.name.encode()),
                              f"finding {self.name}")
                if self.shared > 48 * 1024:  # above the default, a kernel must ask for it
                    _Driver.check(lib.cuFuncSetAttribute(fn, 8, self.shared),  # MAX_DYNAMIC_SHARED_SIZE_BYTES
                                  f"reserving {self.shared} B of shared memory for {self.name}")
            self._functions[device] = fn
        return fn

    def run(self, gx: int, gy: int, gz: int, stream: int, *args: Any) -> None:
        import torch
        fn = self._function(torch.cuda.current_device())
        values = [ctypes.c_void_p(a.data_ptr()) if kind is None else kind(a) for kind, a in zip(self._kinds, args)]
        argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        _Driver.check(_Driver.lib().cuLaunchKernel(fn, gx, gy, gz, self.threads, 1, 1, self.shared, stream, argv, None),
                      f"launching {self.name}")


def load_launch(directory: Path, i: int, launch: Launch) -> CubinLaunch:
    """The launcher of launch ``i`` of a built CUDA C++ program (no compilation)."""
    cubin, meta = launch_files(i)
    return CubinLaunch((Path(directory) / cubin).read_bytes(), json.loads((Path(directory) / meta).read_text()), launch)
