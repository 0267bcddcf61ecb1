"""Vendor steps: the calls of a program that are not Triton launches (an ATen op on the target's
own library: cuBLAS through ``aten.mm.out``, cuDNN through ``aten.convolution``, SDPA, any ATen
fallback a compiler's output code makes), in order between its launches.

A compiler's whole output (fill_cache/inductor_program.py records Inductor's) is Triton kernels
and such calls; a KernelProgram holds both: its ``launches`` as always, and ``steps``, each
running after the first ``at`` launches. A step's arguments are the program's buffers (spec
inputs, outputs, temporaries), whole or as a view (size, stride, offset into the buffer: what
Inductor's ``reinterpret_tensor`` makes), an empty tensor by its metadata (``{"empty": [size,
stride, dtype]}``: it has no memory to share), and literals encoded as in a KernelSpec. An op that
writes a buffer (``out=``, an in-place op) names it among its arguments; one that returns new
tensors (``aten.convolution``) names, per returned tensor, the buffer it becomes (``results``:
a temporary or an output the runner then does not allocate). Nothing here is generated or
compiled: serving calls the op overloads directly.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.core.encoding import decode_arg, dtype_from_name
from torch_kernelize.core.targets import Target, resolve_op

STEP_BUFFERS = ("in", "out", "tmp")  # what a step's argument or result may name


@dataclasses.dataclass(frozen=True)
class VendorStep:
    op: str                     # the overload, e.g. "aten.addmm.out"
    args: Any                   # encoded; a buffer is {"buf": [kind, i]} or {"buf": [kind, i], "view": [size, stride, offset]}
    kwargs: Any
    at: int                     # runs after launches[0:at]
    results: tuple[tuple[str, int] | None, ...] = ()  # per tensor the op returns: the buffer it becomes (None: unused)

    def to_json(self) -> dict[str, Any]:
        d = {"op": self.op, "args": self.args, "kwargs": self.kwargs, "at": self.at}
        if self.results:
            d["results"] = [list(r) if r is not None else None for r in self.results]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "VendorStep":
        return cls(d["op"], d["args"], dict(d["kwargs"]), int(d["at"]),
                   tuple(tuple(r) if r is not None else None for r in d.get("results", ())))

    def buffers(self) -> list[tuple[str, int]]:
        """Every buffer the step names, as argument or result."""
        found: list[tuple[str, int]] = [r for r in self.results if r is not None]
        stack = [self.args, self.kwargs]
        while stack:
            x = stack.pop()
            if isinstance(x, dict) and "buf" in x:
                found.append((x["buf"][0], int(x["buf"][1])))
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, list):
                stack.extend(x)
        return found


def check_steps(steps: Sequence[VendorStep], launches: int, temps: int) -> None:
    """Raise ValueError where ``steps`` cannot run in a program of that many launches and
    temporaries (inputs and outputs are the spec's: checked where the program meets it)."""
    last = 0
    for s in steps:
        if not s.op.startswith("aten."):  # (a cache or an archive names ops by string: nothing else is called)
            raise ValueError(f"vendor step {s.op}: a step calls an ATen op (aten.*) only")
        if not last <= s.at <= launches:
            raise ValueError(f"vendor step {s.op} at {s.at}: steps run in order, between 0 and {launches} launches")
        last = s.at
        for kind, i in s.buffers():
            if kind not in STEP_BUFFERS:
                raise ValueError(f"vendor step {s.op}: unknown buffer kind {kind!r}; expected one of {STEP_BUFFERS}")
            if kind == "tmp" and not 0 <= i < temps:
                raise ValueError(f"vendor step {s.op}: no {kind} buffer {i}")
        for r in s.results:
            if r is not None and r[0] == "in":
                raise ValueError(f"vendor step {s.op}: a result cannot become an input")


def produced(steps: Sequence[VendorStep], kind: str) -> frozenset[int]:
    """The buffers of ``kind`` that steps' results are (the runner allocates none of them)."""
    return frozenset(r[1] for s in steps for r in s.results if r is not None and r[0] == kind)


def step_ops(steps: Sequence[VendorStep]) -> list[str]:
    return sorted({s.op for s in steps})


def refused_ops(steps: Sequence[VendorStep], target: Target) -> list[str]:
    """The steps' ops that ``target``'s vendor does not run: a program calling any of them is no
    candidate there (a bring-up chip without cuBLAS runs no captured ``mm.out``)."""
    return [op for op in step_ops(steps) if not target.vendor_runs(resolve_op(op))]


# The ops Inductor's output code calls through torch's generated Python bindings (its extern
# kernels, torch/_inductor/select_algorithm.py), called the same way here. A binding parses its
# arguments in C++ and dispatches unboxed; an OpOverload's entry boxes them: on a CPU core, 7 us
# more per convolution (ResNet-50 makes 53 a call) and 0.5 us per mm. Each binding is the same
# native function with the overload's schema: ``out=`` picks the .out overload. (A graph node's
# op gets its binding checked on its traced types, serving/op_bindings.py; a step has no node,
# and these are the ops Inductor itself trusts to their bindings.)
BINDINGS = {op: name for name in ("mm", "addmm", "bmm", "baddbmm")
            for op in (f"aten.{name}.default", f"aten.{name}.out")}
BINDINGS["aten.convolution.default"] = "convolution"


def step_callable(name: str, op: torch._ops.OpOverload) -> Callable:
    """What serving calls for op ``name``: its binding where BINDINGS names one, else the
    overload's C++ entry (no Python frame of its own)."""
    binding = BINDINGS.get(name)
    fn = getattr(torch._C._VariableFunctions, binding, None) if binding else None
    return fn if fn is not None else getattr(op, "_op", op)


class StepCall:
    """One step, resolved once: the op overload and what calls it (step_callable), and per
    argument either its decoded constant or a reader of the buffers (the serving path decodes
    nothing per call: a step's literals, a convolution's strides and paddings, are built when
    the program loads)."""

    def __init__(self, step: VendorStep):
        self.step = step
        self.op = resolve_op(step.op)
        self.call = step_callable(step.op, self.op)
        self._args = [_reader(a) for a in step.args]
        self._kwargs = [(k, _reader(v)) for k, v in step.kwargs.items()]
        self._results = [(i, r[0], r[1]) for i, r in enumerate(step.results) if r is not None]
        self.results = tuple((kind, j) for _, kind, j in self._results)  # the buffers its results become

    def __call__(self, bufs: dict[str, list], device: str) -> None:
        """Run the op on ``bufs`` (kind -> list of tensors; results are stored into it)."""
        out = self.call(*[read(bufs, device) for read in self._args],
                        **{k: read(bufs, device) for k, read in self._kwargs})
        if not self._results:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, kind, j in self._results:
            bufs[kind][j] = outs[i]


Reader = Callable[[dict, str], Any]


def _reader(x: Any) -> Reader:
    """A function of (buffers, device) to the argument ``x`` encodes (see _decode)."""
    if isinstance(x, dict) and "buf" in x:
        kind, i = x["buf"]
        if "view" not in x:
            return lambda bufs, device: bufs[kind][i]
        size, stride, offset = x["view"]
        return lambda bufs, device: _view(bufs[kind][i], size, stride, offset)
    if isinstance(x, dict) and "empty" in x:  # made anew per call (on the call's device)
        return lambda bufs, device: _decode(x, bufs, device)
    if isinstance(x, list):
        items = [_reader(v) for v in x]
        if any(isinstance(v, dict) and ("buf" in v or "empty" in v) for v in _leaves(x)):
            return lambda bufs, device: [read(bufs, device) for read in items]
    per_device: dict[str, Any] = {}  # a literal: decoded once per device (a device argument is the call's)

    def constant(bufs: dict, device: str) -> Any:
        if device not in per_device:
            per_device[device] = _decode(x, bufs, device)
        return per_device[device]
    return constant


def literal(x: Any, device: str) -> Any:
    """A step argument that names no buffer, decoded for ``device`` (a device type)."""
    return _decode(x, {}, device)


def _leaves(x: Any) -> list:
    return [y for v in x for y in (_leaves(v) if isinstance(v, list) else [v])]


def _view(t: torch.Tensor, size: Any, stride: Any, offset: int) -> torch.Tensor:
    return t.as_strided(size, stride, t.storage_offset() + offset)


def _decode(x: Any, bufs: dict[str, list], device: str) -> Any:
    if isinstance(x, dict) and "buf" in x:
        kind, i = x["buf"]
        t = bufs[kind][i]
        if "view" not in x:
            return t
        return _view(t, *x["view"])
    if isinstance(x, dict) and "empty" in x:  # an empty tensor: no memory, only its metadata
        size, stride, dtype = x["empty"]
        return torch.empty_strided(size, stride, dtype=dtype_from_name(dtype), device=device)
    if isinstance(x, list):
        return [_decode(v, bufs, device) for v in x]
    return decode_arg(x, (), device)  # a literal (a device: the one the program runs on)
