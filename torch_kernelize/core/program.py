"""KernelProgram: what a generator emits and the cache stores, for one concrete KernelSpec.

A program is a Python module of ``@triton.jit`` kernels plus an explicit launch list: which
kernel, on which grid, with which arguments (spec inputs, spec outputs, temporaries, literal
scalars), constexprs, warps and stages. Shapes are concrete (a spec is per shape), so grids and
sizes are plain numbers: nothing is computed at launch time but the pointers.

A program may instead be CUDA C++ (``language="cuda"``), for a kernel that needs what Triton does
not express (shared-memory addresses of its own, bulk copies): its kernels are ``extern "C"
__global__`` functions, a launch's constexprs are the ``-D`` macros it is compiled with, its block
is ``32 * num_warps`` threads and ``shared`` bytes of dynamic shared memory. Such a program runs
on the cuda target only (building/nvcc.py builds it, serving/cubin_launch.py launches it); the interpreter cannot run it.

A launch may be grid-synchronized (``phases`` > 1): its kernel takes a constexpr ``PHASE`` and
runs its phases one after another, every program waiting at a grid barrier between them (e.g. a
reduction whose result all programs need, then a pass that uses it, in one launch). On CUDA it is
compiled once with PHASE=0 (all phases, barriers between) and launched cooperatively, so the driver
refuses a grid whose programs cannot all be resident at once instead of letting the barrier hang.
The interpreter runs programs one after another, where a barrier would wait forever: it launches
the kernel once per phase with PHASE=1..phases instead, and the end of a launch is a grid barrier.
The barrier's semaphore lives in a ``state`` buffer: zeroed once, then kept from call to call
(a barrier leaves its semaphore ready for the next), one per device and stream.

A program may also hold vendor steps (``steps``, core/program_steps.py): ATen op calls between
its launches, on its buffers or views of them. That is how a compiler's whole output (Triton
kernels and cuBLAS/cuDNN calls, in order) is one program. A launch argument may be a view
(``views``): a pointer some elements into an output or temporary, for a kernel that writes its
part of a buffer (a compiler's concatenation); programs of one size only.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import torch

from torch_kernelize.core.program_steps import VendorStep, check_steps, produced

# An argument of a launch: ("in", i) | ("out", i) | ("tmp", i) | ("state", i) | ("view", j) |
# ("i32"|"i64"|"fp32", value)
Arg = tuple[str, Any]
SCALAR_KINDS = ("i32", "i64", "fp32")
BUFFER_KINDS = ("in", "out", "tmp", "state", "view")
VIEW_BASES = ("out", "tmp")  # what a view points into
PHASE = "PHASE"  # the constexpr of a grid-synchronized launch: 0 = every phase, k = phase k alone
LANGUAGES = ("triton", "cuda")
SOURCE_FILES = {"triton": "kernel.py", "cuda": "kernel.cu"}  # the source's file name in a built program

# Triton signature type of a tensor pointer, by torch dtype name.
POINTER_TYPES = {
    "float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "float64": "*fp64",
    "int64": "*i64", "int32": "*i32", "int16": "*i16", "int8": "*i8", "uint8": "*u8", "bool": "*i1",
}


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A temporary buffer, or how an output is initialised before the kernels run."""
    shape: tuple[int, ...]
    dtype: str
    init: float | int | None = None  # None: left uninitialised (poisoned under validation)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "init": self.init}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Buffer":
        return cls(tuple(d["shape"]), d["dtype"], d.get("init"))


@dataclasses.dataclass(frozen=True)
class View:
    """A pointer into a program buffer ``offset`` elements past its start: the argument of a
    kernel that writes its part of a buffer (Inductor's concatenations: each input's kernel
    writes its slice). Its dtype is the buffer's."""
    buffer: tuple[str, int]   # ("out", i) | ("tmp", i)
    offset: int

    def to_json(self) -> list:
        return [*self.buffer, self.offset]

    @classmethod
    def from_json(cls, d: list) -> "View":
        return cls((d[0], int(d[1])), int(d[2]))


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, ...]
    args: tuple[Arg, ...]
    constexprs: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    phases: int = 1  # > 1: grid-synchronized (see the module docstring); constexprs hold PHASE=0
    shared: int = 0  # dynamic shared memory in bytes (CUDA C++ launches; Triton sizes its own)
    # a bucketed program's (buckets.py): {"grid": [SizeExpr per entry], "args": {"position": SizeExpr}},
    # the grid and the scalar arguments that are functions of the bucket's sizes
    runtime_sizes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for kind, _ in self.args:
            if kind not in BUFFER_KINDS + SCALAR_KINDS:
                raise ValueError(f"launch {self.kernel}: unknown argument kind {kind!r}")
        if not 1 <= len(self.grid) <= 3 or any(g < 1 for g in self.grid):
            raise ValueError(f"launch {self.kernel}: bad grid {self.grid}")
        if self.phases < 1 or (self.phases > 1) != (PHASE in self.constexprs):
            raise ValueError(f"launch {self.kernel}: {self.phases} phase(s) needs the constexpr {PHASE} "
                             "exactly when there are several")
        if self.phases > 1 and self.constexprs[PHASE] != 0:
            raise ValueError(f"launch {self.kernel}: {PHASE} must be 0 (all phases) in the launch")
        if self.shared < 0:
            raise ValueError(f"launch {self.kernel}: negative shared memory {self.shared}")

    @property
    def synchronized(self) -> bool:
        return self.phases > 1

    def to_json(self) -> dict[str, Any]:
        d = {"kernel": self.kernel, "grid": list(self.grid), "args": [list(a) for a in self.args],
             "constexprs": self.constexprs, "num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.phases > 1:
            d["phases"] = self.phases
        if self.shared:
            d["shared"] = self.shared
        if self.runtime_sizes:
            d["runtime_sizes"] = self.runtime_sizes
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Launch":
        return cls(d["kernel"], tuple(d["grid"]), tuple((k, v) for k, v in d["args"]), dict(d["constexprs"]),
                   d["num_warps"], d["num_stages"], d.get("phases", 1), d.get("shared", 0),
                   dict(d.get("runtime_sizes", {})))


@dataclasses.dataclass(frozen=True)
class Donation:
    """Output ``out`` may be the caller's input ``input`` itself (same shape, strides and dtype),
    written in place, when nothing reads that buffer after this call: the launches in ``skip``
    only copied the input into the output and are left out then. That is how a functional
    accumulation (out = self.clone(); out[idx] += src) runs in place (see reinplace.py)."""
    out: int
    input: int
    skip: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"out": self.out, "input": self.input, "skip": list(self.skip)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Donation":
        return cls(d["out"], d["input"], tuple(d["skip"]))


@dataclasses.dataclass(frozen=True)
class Check:
    """A flag the program's kernels set when the call's inputs are invalid for the op (an index
    out of range): temporary ``temp`` (zero-initialised); any nonzero element after the launches
    makes the call raise ``IndexOutOfRange(message)``, as eager raises, instead of returning what
    the kernels computed (they never access memory out of bounds)."""
    temp: int
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"temp": self.temp, "message": self.message}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Check":
        return cls(int(d["temp"]), str(d["message"]))


@dataclasses.dataclass(frozen=True)
class KernelProgram:
    source: str
    launches: tuple[Launch, ...]
    output_init: tuple[float | int | None, ...] = ()  # per spec output; () means all uninitialised
    temps: tuple[Buffer, ...] = ()
    donations: tuple[Donation, ...] = ()
    state: tuple[Buffer, ...] = ()  # kept across calls, zeroed once (grid-barrier semaphores)
    language: str = "triton"  # or "cuda": CUDA C++ (see the module docstring)
    steps: tuple[VendorStep, ...] = ()  # vendor calls between the launches (see the module docstring)
    checks: tuple[Check, ...] = ()  # flags of invalid inputs, checked after the launches
    views: tuple[View, ...] = ()  # pointers into outputs and temporaries at an offset ("view" args)
    # a graph bucket's program (core/buckets.py): each integer of to_json() outside the launches
    # that is a function of the bucket's sizes (buffer sizes, vendor steps' views), as (its path
    # in to_json(), a SizeExpr); the launches name theirs in runtime_sizes
    sized: tuple[tuple[tuple[Any, ...], Any], ...] = ()

    def __post_init__(self):
        if self.language not in LANGUAGES:
            raise ValueError(f"unknown kernel language {self.language!r}; expected one of {LANGUAGES}")
        if self.language == "cuda" and any(l.synchronized for l in self.launches):
            raise ValueError("grid-synchronized launches are Triton programs only")
        for b in self.state:
            if b.init not in (None, 0):
                raise ValueError(f"state buffers start at zero, not {b.init!r}")
        for c in self.checks:
            if not 0 <= c.temp < len(self.temps) or self.temps[c.temp].init != 0:
                raise ValueError(f"check {c.message!r}: temp {c.temp} is not a zero-initialised buffer")
        for launch in self.launches:
            for kind, i in launch.args:
                pool = {"tmp": self.temps, "state": self.state, "view": self.views}.get(kind)
                if pool is not None and not 0 <= i < len(pool):
                    raise ValueError(f"launch {launch.kernel}: no {kind} buffer {i}")
        for v in self.views:
            kind, i = v.buffer
            if kind not in VIEW_BASES or v.offset <= 0 or (kind == "tmp" and not 0 <= i < len(self.temps)):
                raise ValueError(f"view {v.to_json()}: a view points past the start of an output or temporary")
            if kind == "tmp" and v.offset >= math.prod(self.temps[i].shape):
                raise ValueError(f"view {v.to_json()}: past the end of temporary {i}")
        # (a graph bucket's program names its views' sizes and offsets in ``sized`` or has none that vary)
        if self.views and (self.donations or self.language != "triton"
                           or (any(l.runtime_sizes for l in self.launches) and not (self.sized or self.steps))):
            raise ValueError("views into buffers are for Triton programs of one size without donations "
                             "(a bucket's buffers change size, and with them the views' offsets)")
        if self.steps:
            if self.language != "triton" or self.donations or self.state:
                raise ValueError("vendor steps are for Triton programs without donations or state buffers")
            check_steps(self.steps, len(self.launches), len(self.temps))

    @property
    def produced_outputs(self) -> frozenset[int]:
        """Outputs that a vendor step returns (not allocated before the call)."""
        return produced(self.steps, "out")

    @property
    def produced_temps(self) -> frozenset[int]:
        return produced(self.steps, "tmp")

    def init_of(self, i: int) -> float | int | None:
        return self.output_init[i] if i < len(self.output_init) else None

    @property
    def source_file(self) -> str:
        return SOURCE_FILES[self.language]

    @property
    def aligned_only(self) -> bool:
        """Whether the kernels need 16-byte aligned pointers whatever they were compiled for: CUDA
        C++ kernels (16-byte vectors) and Triton kernels that build tensor descriptors (TMA reads
        from aligned bases only). No binary for unaligned views is built for them; the runner sends
        such calls to the vendor op (serving/launch.MisalignedInput)."""
        return self.language == "cuda" or "tl.make_tensor_descriptor(" in self.source

    def signature(self, launch: Launch, spec) -> dict[str, str]:
        """Triton signature (arg name -> type) of one launch, for ahead-of-time compilation."""
        if self.language != "triton":
            raise ValueError(f"a {self.language} program has no Triton signature")
        names = self.kernel_arg_names(launch.kernel)
        runtime_names = [n for n in names if n not in launch.constexprs]
        if len(runtime_names) != len(launch.args):
            raise ValueError(f"{launch.kernel}: {len(launch.args)} args for parameters {runtime_names}")
        sig: dict[str, str] = {}
        for name, (kind, value) in zip(runtime_names, launch.args):
            if kind == "in":
                sig[name] = POINTER_TYPES[spec.inputs[value].dtype]
            elif kind == "out":
                sig[name] = POINTER_TYPES[spec.outputs[value].dtype]
            elif kind in ("tmp", "state"):
                sig[name] = POINTER_TYPES[(self.temps if kind == "tmp" else self.state)[value].dtype]
            elif kind == "view":
                sig[name] = POINTER_TYPES[self.buffer_dtype(self.views[value].buffer, spec)]
            else:
                sig[name] = kind
        for name in launch.constexprs:
            sig[name] = "constexpr"
        return {n: sig[n] for n in names}

    def buffer_dtype(self, buffer: tuple[str, int], spec) -> str:
        """The dtype name of an output's or a temporary's buffer."""
        kind, i = buffer
        return spec.outputs[i].dtype if kind == "out" else self.temps[i].dtype

    def kernel_arg_names(self, kernel: str) -> list[str]:
        """Parameter names of a kernel, read from the source without importing it."""
        if self.language == "cuda":
            return list(_cuda_arg_names(self.source, kernel))
        return list(_arg_names(self.source, kernel))

    def to_json(self) -> dict[str, Any]:
        """Everything but the source, which is stored as its own file."""
        d = {"launches": [l.to_json() for l in self.launches], "output_init": list(self.output_init),
             "temps": [t.to_json() for t in self.temps], "donations": [d.to_json() for d in self.donations]}
        if self.state:
            d["state"] = [b.to_json() for b in self.state]
        if self.language != "triton":
            d["language"] = self.language
        if self.steps:
            d["steps"] = [x.to_json() for x in self.steps]
        if self.checks:
            d["checks"] = [c.to_json() for c in self.checks]
        if self.views:
            d["views"] = [v.to_json() for v in self.views]
        if self.sized:
            d["sized"] = [[list(path), expr] for path, expr in self.sized]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str) -> "KernelProgram":
        return cls(source, tuple(Launch.from_json(l) for l in d["launches"]), tuple(d.get("output_init", ())),
                   tuple(Buffer.from_json(t) for t in d.get("temps", ())),
                   tuple(Donation.from_json(x) for x in d.get("donations", ())),
                   tuple(Buffer.from_json(b) for b in d.get("state", ())), d.get("language", "triton"),
                   tuple(VendorStep.from_json(x) for x in d.get("steps", ())),
                   tuple(Check.from_json(c) for c in d.get("checks", ())),
                   tuple(View.from_json(v) for v in d.get("views", ())),
                   tuple((tuple(path), expr) for path, expr in d.get("sized", ())))

    def describe(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@functools.lru_cache(maxsize=4096)
def _arg_names(source: str, kernel: str) -> tuple[str, ...]:
    """Parsed once per program (loading a graph's kernels asks for each several times). Only the
    kernel's signature is parsed when it can be cut out: a whole program's ``ast.parse`` is
    ~0.25 ms, paid for every kernel a warm process loads."""
    import ast
    header = _signature_source(source, kernel)
    if header is not None:
        try:
            return tuple(a.arg for a in ast.parse(header).body[0].args.args)
        except SyntaxError:
            pass
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == kernel:
            return tuple(a.arg for a in node.args.args)
    raise ValueError(f"kernel {kernel!r} is not defined in the program source")


def _signature_source(source: str, kernel: str) -> str | None:
    """``def kernel(...): pass`` with the parameters of the source's ``def kernel(`` line(s), or
    None when they cannot be cut out by matching brackets (left to the whole parse)."""
    import re
    m = re.search(r"^def\s+" + re.escape(kernel) + r"\s*\(", source, re.MULTILINE)
    if m is None:
        return None
    depth, i = 1, m.end()
    while i < len(source) and depth:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(source[i], 0)
        if source[i] in "#'\"":  # a comment or string could hold brackets
            return None
        i += 1
    return f"def {kernel}({source[m.end():i - 1]}): pass" if depth == 0 else None


@functools.lru_cache(maxsize=256)
def _cuda_arg_names(source: str, kernel: str) -> tuple[str, ...]:
    """Parameter names of an ``extern "C" __global__`` kernel in CUDA C++ source."""
    import re
    m = re.search(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?" + re.escape(kernel) + r"\s*\(([^)]*)\)",
                  source)
    if m is None:
        raise ValueError(f"kernel {kernel!r} is not defined in the program source")
    params = [p.strip() for p in m.group(1).split(",") if p.strip()]
    return tuple(re.search(r"(\w+)\s*$", p).group(1) for p in params)


# --- the binaries in a program folder ------------------------------------------------------------

def launch_files(i: int, aligned: bool = True) -> tuple[str, str]:
    """The names of launch ``i``'s stored binary and metadata in a program folder."""
    tag = "" if aligned else ".unaligned"
    return f"launch{i}{tag}.cubin", f"launch{i}{tag}.json"


def has_unaligned(directory: Path, launches: int) -> bool:
    return all((Path(directory) / launch_files(i, False)[0]).exists() for i in range(launches))


def remove_unaligned(directory: Path) -> None:
    """Drop the binaries for unaligned views (a failed or partial set): such calls go to the vendor op."""
    for f in Path(directory).glob("launch*.unaligned.*"):
        f.unlink(missing_ok=True)
