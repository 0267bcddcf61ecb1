"""The CUDA hot path of a loaded program as one generated function of its inputs.

A program's general path (launch.ProgramRunner.__call__) walks per-call pools and, for a
compiler's whole output, a loop over launches and vendor steps with a Python frame per step.
For a graph of a hundred launches that is tens of microseconds of host time per launch, where
Inductor's output code spends a few: it is straight-line Python. This module writes the same
for a program: outputs and temporaries allocated, each launch made with its arguments written
out, each vendor step (program_steps.py) an op call whose arguments are the buffers' names, a
re-strided view or a constant decoded here, once; a step's result bound to the buffer's name
and the kernel-pointer views into it (program.View) made right after.

A call with an input off a 16-byte boundary, or on another device than the current one, takes
the general path. Programs with donated outputs, state buffers or checks have none.

A shape bucket's program (a node's, a region's or a whole graph's) gets one such function for
every size of its bucket (``sizes``): its sized integers are SizeSources
(core/sized_programs.py), written into the source as expressions of the sizes ``v`` the function
reads off its inputs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from torch_kernelize.core.encoding import dtype_from_name
from torch_kernelize.core.program_steps import literal
from torch_kernelize.core.sized_programs import SizeSource, cdiv, source_strides
from torch_kernelize.serving.view_folding import reinterpret_tensor

_PREFIX = {"in": "i", "out": "o", "tmp": "t"}


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """What a loaded program's call does, as its runner (launch.ProgramRunner) resolved it."""
    key: str                          # the spec's key (names the generated code)
    inputs: int                       # how many input tensors
    general: Callable                 # the runner's own call: unaligned inputs, another device
    outputs: Sequence[Any]            # per output (shape, stride, dtype, init), None where a step returns it
    temps: Sequence[Any]              # per temporary (shape, dtype, init), None where a step returns it
    views: Sequence[tuple[str, int, int]]  # per program view: (buffer kind, index, offset)
    steps: dict[int, list]            # launch index -> the StepCalls that run before it
    launches: Sequence[tuple[int, Any, tuple]]  # (launch index, launcher, (launch, argument order, grid))
    n_launches: int
    tuple_output: bool
    host_inputs: tuple[int, ...] = ()  # 0-d host inputs the program reads on the device (moved there first)
    checks: Sequence[tuple[int, str]] = ()  # (temporary, message): flags of invalid inputs, read after the launches
    flag_checks: Callable | None = None     # reads them, [(flag tensor, message)] (launch.flag_checks)


class _Source:
    """Lines of the function and the globals they name."""

    def __init__(self, names: dict[str, Any]):
        self.names = names
        self.lines: list[str] = []

    def ref(self, value: Any) -> str:
        """A literal int or finite float as itself, a SizeSource (a bucket's size, computed in
        the call) as its source, a tuple holding one as a tuple of those, anything else as a global."""
        if type(value) is int or (type(value) is float and value == value and abs(value) != float("inf")):
            return repr(value)
        if isinstance(value, SizeSource):
            return f"({value})"
        if type(value) is tuple and any(isinstance(x, SizeSource) for x in value):
            return "(" + "".join(f"{self.ref(x)}, " for x in value) + ")"
        name = f"c{len(self.names)}"
        self.names[name] = value
        return name

    def add(self, line: str) -> None:
        self.lines.append(line)


def direct_function(plan: CallPlan, empty: Callable, stream_of: Callable, current_device: Callable,
                    sizes: str | None = None) -> Callable:
    """The calls of ``plan`` as one function (``fn.source`` holds its text). ``empty(shape, stride,
    dtype)`` allocates on the current device; ``stream_of(device index)`` is the current stream's
    handle; ``current_device()`` the current device's index. ``sizes``: a shape bucket's call for
    every size of the bucket, whose plan holds SizeSources of ``v``: the source of ``v`` from the
    inputs ``i0, i1, ...`` (a tuple)."""
    src = _Source({"general": plan.general, "empty": empty, "stream_of": stream_of, "cdiv": cdiv,
                   "current_device": current_device, "reinterpret": reinterpret_tensor, "at": at_offset})
    n_in = plan.inputs
    ins = ", ".join(f"i{k}" for k in range(n_in))
    on_device = [k for k in range(n_in) if k not in plan.host_inputs]
    src.add(f"if {' or '.join(f'i{k}.data_ptr() % 16' for k in on_device)}:")
    src.add(f"    return general({ins})")
    src.add(f"device = i{on_device[0]}.get_device()")
    src.add("if device != current_device():")
    src.add(f"    return general({ins})")
    for k in plan.host_inputs:  # (a 0-d tensor a dynamic graph took as an input: a norm's eps)
        src.add(f"i{k} = i{k}.to(i{on_device[0]}.device, non_blocking=True)")
    if sizes is not None:
        src.add(f"v = {sizes}")
    views = _views_by_buffer(plan)
    for k, a in enumerate(plan.outputs):
        if a is not None:
            _allocate(src, f"o{k}", a[0], a[1], a[2], a[3])
            _make_views(src, views, ("out", k))
    src.add("stream = stream_of(device)")
    events = _events(plan)
    first, last = _temp_lifetimes(plan, events)
    flags = {k for k, _ in plan.checks}  # (they live to the end, where they are read)
    for e, (what, item) in enumerate(events):
        for k in first.get(e, ()):
            a = plan.temps[k]
            if a is not None:  # (else a step returns it)
                _allocate(src, f"t{k}", a[0], source_strides(a[0]), a[1], a[2])
                _make_views(src, views, ("tmp", k))
        if what == "step":
            _step(src, item, views)
        else:
            j, kernel, order, grid = item
            src.names[f"run{j}"] = kernel.run
            args = [_arg(kind, value, src) for a, (kind, value) in enumerate(order) if a not in kernel.dropped]
            src.add(f"run{j}({', '.join(src.ref(g) for g in grid)}, stream, {', '.join(args)})")
        dead = [name for k in last.get(e, ()) if k not in flags
                for name in (f"t{k}", *(f"v{v}" for v, _ in views.get(("tmp", k), ())))]
        if dead:  # (its memory goes back to the caching allocator, as Inductor's `del buf` does)
            src.add(f"del {', '.join(dead)}")
    if plan.checks:
        src.names["flag_checks"] = plan.flag_checks
        src.add(f"flag_checks([{', '.join(f'(t{k}, {src.ref(message)})' for k, message in plan.checks)}])")
    outs = [f"o{k}" for k in range(len(plan.outputs))]
    src.add(f"return ({', '.join(outs)},)" if plan.tuple_output else f"return {outs[0]}")
    source = f"def direct({ins}):\n" + "".join(f"    {line}\n" for line in src.lines)
    exec(compile(source, f"<kernelize launch {plan.key}>", "exec"), src.names)
    direct = src.names["direct"]
    direct.source = source
    return direct


def at_offset(t: Any, offset: int) -> Any:
    """The rest of ``t``'s storage from ``offset`` elements past ``t``'s start, flat: what a
    kernel given a pointer into the buffer may address (program.View)."""
    start = t.storage_offset() + offset
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size() - start,), (1,), start)


def _allocate(src: _Source, name: str, shape: Any, stride: Any, dtype: Any, init: Any) -> None:
    src.add(f"{name} = empty({src.ref(tuple(shape))}, {src.ref(tuple(stride))}, {src.ref(dtype)})")
    if init is not None:
        src.add(f"{name}.fill_({src.ref(init)})")


def _events(plan: CallPlan) -> list[tuple[str, Any]]:
    """The call's work in program order: ("step", StepCall) and ("launch", (number, launcher,
    argument order, grid))."""
    events: list[tuple[str, Any]] = []
    for j, (i, kernel, (_, order, grid)) in enumerate(plan.launches):
        events += [("step", step) for step in plan.steps.get(i, ())]
        events.append(("launch", (j, kernel, order, grid)))
    return events + [("step", step) for step in plan.steps.get(plan.n_launches, ())]


def _temp_lifetimes(plan: CallPlan, events: list[tuple[str, Any]]) -> tuple[dict[int, list], dict[int, list]]:
    """Per event, the temporaries it names first and those it names last (directly, or through
    a pointer view into them): a temporary lives from its first use to its last, as in
    Inductor's own code, so the call holds no more memory than its live buffers."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for e, (what, item) in enumerate(events):
        if what == "step":
            named = [j for kind, j in item.step.buffers() if kind == "tmp"]
        else:
            named = []
            for kind, value in item[2]:
                if kind == "view" and plan.views[value][0] == "tmp":
                    named.append(plan.views[value][1])
                elif kind == "tmp":
                    named.append(value)
        for k in named:
            first.setdefault(k, e)
            last[k] = e
    by_first: dict[int, list] = {}
    by_last: dict[int, list] = {}
    for k in sorted(first):
        by_first.setdefault(first[k], []).append(k)
        by_last.setdefault(last[k], []).append(k)
    return by_first, by_last


def _views_by_buffer(plan: CallPlan) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """buffer -> [(view number, offset)] of the program's kernel-pointer views into it."""
    views: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for v, (kind, j, offset) in enumerate(plan.views):
        views.setdefault((kind, j), []).append((v, offset))
    return views


def _make_views(src: _Source, views: dict, buffer: tuple[str, int]) -> None:
    name = f"{_PREFIX[buffer[0]]}{buffer[1]}"
    for v, offset in views.get(buffer, ()):
        src.add(f"v{v} = at({name}, {offset})")


def _arg(kind: str, value: Any, src: _Source) -> str:
    if kind in _PREFIX:
        return f"{_PREFIX[kind]}{value}"
    if kind == "view":
        return f"v{value}"
    return src.ref(value)


def _step(src: _Source, step: Any, views: dict) -> None:
    """One vendor step: the op's binding or C++ entry (program_steps.step_callable, no Python
    frame of its own) on its arguments written out, its results bound to their buffers' names."""
    op = src.ref(step.call)
    args = [_step_arg(a, src) for a in step.step.args]
    args += [f"{k}={_step_arg(v, src)}" for k, v in step.step.kwargs.items()]
    call = f"{op}({', '.join(args)})"
    results = [(i, r) for i, r in enumerate(step.step.results) if r is not None]
    if not results:
        src.add(call)
        return
    returns = step.op._schema.returns
    single = len(returns) == 1 and not str(returns[0].type).endswith("[]")
    src.add(f"r = {call}")
    for i, (kind, j) in results:
        src.add(f"{_PREFIX[kind]}{j} = r" if single else f"{_PREFIX[kind]}{j} = r[{i}]")
        _make_views(src, views, (kind, j))
    src.add("del r")  # (its buffers' names hold them now, each dropped after its last use)


def _step_arg(x: Any, src: _Source) -> str:
    if isinstance(x, dict) and "buf" in x:
        name = f"{_PREFIX[x['buf'][0]]}{int(x['buf'][1])}"
        if "view" not in x:
            return name
        size, stride, offset = x["view"]
        return f"reinterpret({name}, {src.ref(tuple(size))}, {src.ref(tuple(stride))}, {src.ref(offset)})"
    if isinstance(x, dict) and "empty" in x:  # made anew per call
        size, stride, dtype = x["empty"]
        return f"empty({src.ref(tuple(size))}, {src.ref(tuple(stride))}, {src.ref(dtype_from_name(dtype))})"
    if isinstance(x, list) and (_has_buffers(x) or any(isinstance(v, SizeSource) for v in x)):
        return "[" + ", ".join(_step_arg(v, src) for v in x) + "]"
    if isinstance(x, SizeSource):
        return src.ref(x)
    if _has_size_source(x):  # (a size inside an encoded literal: the per-size calls serve it)
        raise ValueError(f"a step argument {x!r} holds a size this call cannot write")
    return src.ref(literal(x, "cuda"))


def _has_size_source(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return any(_has_size_source(v) for v in x)
    if isinstance(x, dict):
        return any(_has_size_source(v) for v in x.values())
    return isinstance(x, SizeSource)


def _has_buffers(x: Any) -> bool:
    if isinstance(x, list):
        return any(_has_buffers(v) for v in x)
    return isinstance(x, dict) and ("buf" in x or "empty" in x)
