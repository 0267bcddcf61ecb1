"""Record the Triton launches a Python launcher makes into a KernelProgram.

A generator that is not a template (a person's or an agent's candidate file, Inductor's output)
has a launcher: Python that allocates buffers and launches ``@triton.jit`` kernels. Serving must
not run that Python, so it is run once here, on real inputs of the spec, with every launch
intercepted and not executed: the kernel, its grid, constexprs, warps and stages, and each
argument as a spec input, a spec output, a temporary buffer or a literal scalar. The result is an
ordinary KernelProgram: built, validated, timed and served like a family's.

What a launcher may do while recorded: allocate tensors (``torch.empty``/``zeros``/``full`` and
their ``_like``/``new_`` forms, whole-buffer ``fill_``/``zero_`` before first use), take views,
read sizes and strides, and launch module-level ``@triton.jit`` kernels. Anything else would not
be in the program, so it is an error that says what was done: computing with torch on the host,
reading a tensor's values, switching CUDA streams (work the timer and the caller's stream would
not see), passing a tensor it neither received nor allocated (kept from an earlier call), or
returning an input or such a tensor as an output.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from types import ModuleType
from typing import Any, Callable, Sequence
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_kernelize.core.program import Buffer, KernelProgram, Launch, View
from torch_kernelize.core.spec import KernelSpec, dtype_name

aten = torch.ops.aten

# Allocation ops -> how the new buffer's initial value is read from the call (None: uninitialised)
_ALLOCATIONS: dict[Any, Callable[[tuple, dict], float | int | None]] = {
    aten.empty.memory_format: lambda a, k: None,
    aten.empty_strided.default: lambda a, k: None,
    aten.empty_like.default: lambda a, k: None,
    aten.new_empty.default: lambda a, k: None,
    aten.new_empty_strided.default: lambda a, k: None,
    aten.zeros.default: lambda a, k: 0,
    aten.zeros_like.default: lambda a, k: 0,
    aten.new_zeros.default: lambda a, k: 0,
    aten.ones.default: lambda a, k: 1,
    aten.ones_like.default: lambda a, k: 1,
    aten.new_ones.default: lambda a, k: 1,
    aten.full.default: lambda a, k: a[1],
    aten.full_like.default: lambda a, k: a[1],
    aten.new_full.default: lambda a, k: a[2],
}
_FILLS = {aten.fill_.Scalar: lambda a: a[1], aten.zero_.default: lambda a: 0}
_HARMLESS = {aten.detach.default, aten.alias.default, aten.lift_fresh.default}
# Launch options a recorded launch keeps; others would change the binary in ways not stored
_OPTIONS = ("num_warps", "num_stages")
# Stream APIs, refused while recording: a launcher must launch on the caller's current stream
_STREAM_APIS = [(torch.cuda, "torch.cuda." + n) for n in ("Stream", "ExternalStream", "stream", "set_stream",
                                                            "StreamContext")]
_STREAM_APIS += [(torch, "torch.Stream"), (getattr(torch, "accelerator", None), "torch.accelerator.set_stream")]


class RecordingError(ValueError):
    """The launcher did something a recorded program cannot hold; the message says what."""


@dataclasses.dataclass
class _Allocation:
    numel: int
    dtype: torch.dtype
    init: float | int | None
    used: bool = False  # a launch has taken it (a later fill would not be in the program)


class _Recorder(TorchDispatchMode):
    """Tracks the launcher's allocations and refuses every other host computation."""

    def __init__(self, inputs: Sequence[torch.Tensor]):
        super().__init__()
        self.inputs = list(inputs)
        self.allocations: dict[int, _Allocation] = {}  # storage address -> allocation
        self.launches: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALLOCATIONS:
            out = func(*args, **kwargs)
            init = _ALLOCATIONS[func](args, kwargs)
            self.allocations[_storage(out)] = _Allocation(out.untyped_storage().nbytes() // out.element_size(),
                                                          out.dtype, _scalar(init))
            return out
        if func in _FILLS:
            t = args[0]
            alloc = self.allocations.get(_storage(t))
            if alloc is None or alloc.used or t.storage_offset() or t.numel() != alloc.numel or t.dtype != alloc.dtype:
                raise RecordingError(f"launch() ran {func} on a tensor that is not a whole buffer it allocated "
                                     "and no kernel used yet: the recorded program initialises only new "
                                     "buffers, as a whole (torch.zeros/torch.full or fill_ right after allocating)")
            alloc.init = _scalar(_FILLS[func](args))
            return func(*args, **kwargs)
        if func.is_view or func in _HARMLESS:
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            raise RecordingError("launch() read a tensor's value on the host (.item(), a comparison in an "
                                 "if, .tolist()): the launches must depend only on shapes, strides and dtypes, "
                                 "which is all the recorded program knows")
        raise RecordingError(f"launch() ran {func} on the host: a candidate may only allocate tensors, take "
                             "views and launch Triton kernels (the recorded program keeps nothing else); "
                             "compute it in a kernel")


def recorded_once(store: dict, key: Any, record: Callable[[], KernelProgram], what: str) -> KernelProgram:
    """``record()``'s program, recorded once per ``key`` and kept in ``store`` (its
    RecordingError too: a failed recording is not repeated); ``what`` prefixes the error."""
    if key not in store:
        try:
            store[key] = record()
        except RecordingError as e:
            store[key] = e
    program = store[key]
    if isinstance(program, RecordingError):
        raise RecordingError(f"{what}: {program}")
    return program


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _scalar(v: Any) -> float | int | None:
    if v is None or isinstance(v, (int, float)):
        return v
    raise RecordingError(f"launch() filled a buffer with a {type(v).__name__}: fill with a Python number")


def _refuse_streams(name: str) -> Callable:
    def refuse(*args, **kwargs):
        raise RecordingError(f"launch() used {name}: work on a stream of its own escapes the timer and "
                             "the caller's ordering; launch every kernel on the current stream")
    return refuse


# A launch as intercepted: (the @triton.jit function, its positional args, keyword args, grid)
LaunchHook = Callable[[Callable[[Any, tuple, dict, Any], None]], contextlib.AbstractContextManager]


def record_program(launcher: Callable, inputs: Sequence[torch.Tensor], spec: KernelSpec, source: str,
                   module: ModuleType, arguments: tuple[Sequence, dict] | None = None,
                   hooks: Sequence[LaunchHook] = ()) -> KernelProgram:
    """Run ``launcher`` on the node's arguments built from ``inputs`` (tensors of the spec's
    input metas), record its launches, and return them as a KernelProgram whose source is
    ``source`` (the text of ``module``, which defines every launched kernel at its top level).

    ``arguments``: what ``launcher`` is called with instead, as (args, kwargs). ``hooks``: for
    launchers that launch kernels through something other than ``JITFunction.run`` (Inductor's
    autotuner): each is given the recording function and returns a context manager that routes
    those launches to it while the launcher runs."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    recorder = _Recorder(inputs)

    def record(fn: Any, args: tuple, kwargs: dict, grid: Any) -> None:
        recorder.launches.append((fn, args, kwargs, grid))

    def run(self, *args, grid, warmup, **kwargs):
        if warmup:
            raise RecordingError("launch() asked for a warm-up compile: only launches are recorded")
        record(self, args, kwargs, grid)

    # a region's launcher takes the region's inputs in order; an op's, the op's arguments
    args, kwargs = (arguments if arguments is not None else
                    (list(inputs), {}) if spec.graph is not None else spec.build_args(list(inputs)))
    # Class-wide while it lasts: fill_cache records on its one measuring thread, nothing launches beside it
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(JITFunction, "run", run))
        stack.enter_context(mock.patch.object(InterpretedFunction, "run", run))
        for hook in hooks:
            stack.enter_context(hook(record))
        for owner, label in _STREAM_APIS:
            name = label.rsplit(".", 1)[1]
            if owner is not None and hasattr(owner, name):
                stack.enter_context(mock.patch.object(owner, name, _refuse_streams(label)))
        stack.enter_context(recorder)
        result = launcher(*args, **kwargs)
    launches = [_launch_fields(recorder, fn, a, k, grid, module) for fn, a, k, grid in recorder.launches]
    if not launches:
        raise RecordingError("launch() launched no Triton kernel")
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    out_of = _match_outputs(recorder, outputs, spec)
    temps: dict[int, int] = {}  # storage -> temp index, in order of first use
    final = []
    views: dict[tuple, int] = {}

    def buffer_of(storage: int) -> tuple[str, int]:
        return ("out", out_of[storage]) if storage in out_of else ("tmp", temps.setdefault(storage, len(temps)))
    for fields in launches:
        final.append(Launch(**dict(fields, args=resolve_views(fields["args"], buffer_of, views))))
    temp_buffers = [None] * len(temps)
    for storage, i in temps.items():
        alloc = recorder.allocations[storage]
        temp_buffers[i] = Buffer((alloc.numel,), dtype_name(alloc.dtype), alloc.init)
    output_init = tuple(recorder.allocations[s].init for s, _ in sorted(out_of.items(), key=lambda kv: kv[1]))
    return KernelProgram(source, tuple(final), output_init, tuple(temp_buffers),
                         views=tuple(View(buffer, offset) for buffer, offset in views))


def _launch_fields(recorder: _Recorder, fn: Any, args: tuple, kwargs: dict, grid: Any,
                   module: ModuleType) -> dict[str, Any]:
    """One intercepted launch as Launch fields; buffers the launcher allocated are ("alloc",
    storage) until the outputs are known."""
    name = fn.fn.__name__
    if getattr(module, name, None) is not fn:
        raise RecordingError(f"kernel {name!r} is not a @triton.jit function defined at the top level of the "
                             "candidate file (kernels from other modules, closures and autotune/heuristics "
                             "wrappers cannot be recorded: the program names each kernel in the file)")
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    params = inspect.signature(fn.fn).parameters  # a JITFunction or, under TRITON_INTERPRET=1, an InterpretedFunction
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise RecordingError(f"kernel {name!r} launched with option(s) {unknown} that a recorded launch does "
                             f"not keep (it keeps {list(_OPTIONS)})")
    try:
        bound = inspect.signature(fn.fn).bind(*args, **kwargs)
    except TypeError as e:
        raise RecordingError(f"kernel {name!r}: {e}") from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    if callable(grid):
        grid = grid(values)
    grid = tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,)))
    constexprs, launch_args = {}, []
    for p in params.values():
        value = values[p.name]
        if p.annotation is not inspect.Parameter.empty and "constexpr" in str(p.annotation):  # as Triton reads it
            if not (value is None or isinstance(value, (bool, int, float, str))):
                raise RecordingError(f"kernel {name!r}: constexpr {p.name} = {value!r} is not a number, bool or "
                                     "string")
            constexprs[p.name] = value
        elif isinstance(value, torch.Tensor):
            launch_args.append(_tensor_arg(recorder, name, p.name, value))
        elif isinstance(value, bool) or value is None:
            raise RecordingError(f"kernel {name!r}: argument {p.name} = {value!r} must be a tl.constexpr "
                                 "(a recorded launch passes ints and floats only)")
        elif isinstance(value, int):
            launch_args.append(("i32" if -2**31 <= value < 2**31 else "i64", value))
        elif isinstance(value, float):
            launch_args.append(("fp32", value))
        else:
            raise RecordingError(f"kernel {name!r}: argument {p.name} of type {type(value).__name__} cannot be "
                                 "recorded")
    # Triton's defaults for launches that do not give them
    return {"kernel": name, "grid": grid, "args": launch_args, "constexprs": constexprs,
            "num_warps": int(options.get("num_warps", 4)), "num_stages": int(options.get("num_stages", 3))}


def _tensor_arg(recorder: _Recorder, kernel: str, param: str, t: torch.Tensor) -> tuple[str, Any]:
    storage = _storage(t)
    for i, x in enumerate(recorder.inputs):
        if isinstance(x, torch.Tensor) and _storage(x) == storage:
            if t.data_ptr() != x.data_ptr() or t.dtype != x.dtype:
                raise RecordingError(f"kernel {kernel!r}: argument {param} is a view of input {i} that starts "
                                     "elsewhere or has another dtype; pass the input itself and offset in the "
                                     "kernel (the program passes each input's own pointer)")
            return ("in", i)
    alloc = recorder.allocations.get(storage)
    if alloc is None:
        raise RecordingError(f"kernel {kernel!r}: argument {param} is a tensor that launch() neither received nor "
                             "allocated in this call (kept from import time or an earlier call): the served "
                             "program would not have it")
    if t.dtype != alloc.dtype or (t.data_ptr() - storage) % t.element_size():
        raise RecordingError(f"kernel {kernel!r}: argument {param} is a view into a buffer launch() allocated "
                             "with another dtype; pass the buffer itself")
    alloc.used = True
    if t.data_ptr() != storage:  # a kernel writing its part of a buffer (a concatenation's slice)
        return (ALLOC_AT, (storage, (t.data_ptr() - storage) // t.element_size()))
    return ("alloc", storage)


ALLOC_AT = "alloc_at"  # a recorded argument: (storage, element offset) into an allocation


def resolve_views(args: Sequence[tuple[str, Any]], buffer_of: Callable[[int], tuple[str, int]],
                  views: dict[tuple, int]) -> tuple[tuple[str, Any], ...]:
    """A launch's recorded arguments with each allocation (``("alloc", storage)``) resolved to
    ``buffer_of(storage)`` and each allocation at an offset to a program view (``("view", j)``,
    ``views``: (buffer, offset) -> j, in order of first use)."""
    out = []
    for kind, value in args:
        if kind == "alloc":
            out.append(buffer_of(value))
        elif kind == ALLOC_AT:
            storage, offset = value
            out.append(("view", views.setdefault((buffer_of(storage), offset), len(views))))
        else:
            out.append((kind, value))
    return tuple(out)


def _match_outputs(recorder: _Recorder, outputs: list, spec: KernelSpec) -> dict[int, int]:
    """storage -> output index, after checking that each output is a fresh buffer of its meta."""
    if len(outputs) != len(spec.outputs):
        raise RecordingError(f"launch() returned {len(outputs)} output(s); the op has {len(spec.outputs)}")
    found: dict[int, int] = {}
    for j, (t, meta) in enumerate(zip(outputs, spec.outputs)):
        if not isinstance(t, torch.Tensor):
            raise RecordingError(f"output {j} is a {type(t).__name__}, not a tensor")
        storage = _storage(t)
        for i, x in enumerate(recorder.inputs):
            if isinstance(x, torch.Tensor) and _storage(x) == storage:
                raise RecordingError(f"output {j} is input {i} (or a view of it): an output must be a new "
                                     "tensor that launch() allocates")
        alloc = recorder.allocations.get(storage)
        if alloc is None:
            raise RecordingError(f"output {j} is a tensor launch() did not allocate in this call (cached from "
                                 "an earlier call or import time): an output must be new on every call")
        if storage in found:
            raise RecordingError(f"outputs {found[storage]} and {j} share one buffer")
        got = (tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype))
        want = (meta.shape, meta.stride, meta.dtype)
        span = 1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride)) if meta.numel else 0
        if got != want or t.storage_offset() or alloc.numel != span:
            raise RecordingError(f"output {j} has shape, stride, dtype {got} in a buffer of {alloc.numel} "
                                 f"element(s); the op's output is {want} in {span} (allocate it with "
                                 "torch.empty_strided(shape, stride, dtype=...))")
        found[storage] = j
    return found
