"""KernelProgram: what a generator emits and the cache stores, for one concrete KernelSpec.

A program is a Python module of ``@triton.jit`` kernels plus an explicit launch list: which
kernel, on which grid, with which arguments (spec inputs, spec outputs, temporaries, literal
scalars), constexprs, warps and stages. Shapes are concrete (a spec is per shape), so grids and
sizes are plain numbers: nothing is computed at launch time but the pointers.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import torch

# An argument of a launch: ("in", i) | ("out", i) | ("tmp", i) | ("i32"|"i64"|"fp32", value)
Arg = tuple[str, Any]
SCALAR_KINDS = ("i32", "i64", "fp32")
BUFFER_KINDS = ("in", "out", "tmp")

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
class Launch:
    kernel: str
    grid: tuple[int, ...]
    args: tuple[Arg, ...]
    constexprs: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for kind, _ in self.args:
            if kind not in BUFFER_KINDS + SCALAR_KINDS:
                raise ValueError(f"launch {self.kernel}: unknown argument kind {kind!r}")
        if not 1 <= len(self.grid) <= 3 or any(g < 1 for g in self.grid):
            raise ValueError(f"launch {self.kernel}: bad grid {self.grid}")

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "grid": list(self.grid), "args": [list(a) for a in self.args],
                "constexprs": self.constexprs, "num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Launch":
        return cls(d["kernel"], tuple(d["grid"]), tuple((k, v) for k, v in d["args"]), dict(d["constexprs"]),
                   d["num_warps"], d["num_stages"])


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
class KernelProgram:
    source: str
    launches: tuple[Launch, ...]
    output_init: tuple[float | int | None, ...] = ()  # per spec output; () means all uninitialised
    temps: tuple[Buffer, ...] = ()
    donations: tuple[Donation, ...] = ()

    def init_of(self, i: int) -> float | int | None:
        return self.output_init[i] if i < len(self.output_init) else None

    def signature(self, launch: Launch, spec) -> dict[str, str]:
        """Triton signature (arg name -> type) of one launch, for ahead-of-time compilation."""
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
            elif kind == "tmp":
                sig[name] = POINTER_TYPES[self.temps[value].dtype]
            else:
                sig[name] = kind
        for name in launch.constexprs:
            sig[name] = "constexpr"
        return {n: sig[n] for n in names}

    def kernel_arg_names(self, kernel: str) -> list[str]:
        """Parameter names of a kernel, read from the source without importing it."""
        return list(_arg_names(self.source, kernel))

    def to_json(self) -> dict[str, Any]:
        """Everything but the source, which is stored as its own file."""
        return {"launches": [l.to_json() for l in self.launches], "output_init": list(self.output_init),
                "temps": [t.to_json() for t in self.temps], "donations": [d.to_json() for d in self.donations]}

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str) -> "KernelProgram":
        return cls(source, tuple(Launch.from_json(l) for l in d["launches"]), tuple(d.get("output_init", ())),
                   tuple(Buffer.from_json(t) for t in d.get("temps", ())),
                   tuple(Donation.from_json(x) for x in d.get("donations", ())))

    def describe(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@functools.lru_cache(maxsize=4096)
def _arg_names(source: str, kernel: str) -> tuple[str, ...]:
    """Parsed once per program (loading a graph's kernels asks for each several times)."""
    import ast
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == kernel:
            return tuple(a.arg for a in node.args.args)
    raise ValueError(f"kernel {kernel!r} is not defined in the program source")
