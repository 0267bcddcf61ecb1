"""Inductor's whole output as one KernelProgram: its Triton kernels AND every other call its
output code makes (``extern_kernels.mm``/``addmm``/``bmm`` through ATen's ``.out`` overloads,
cuDNN convolution, SDPA, ATen fallbacks), in order, on its buffers and views of them.

fill_cache only, for whole-graph specs (compiling/whole_graph.py). Inductor compiles the graph
(``torch._inductor.compile``, through fill_cache/inductor.py's ``capture``); its output module's
``call`` then runs once under two recorders:
  * the launch hook of inductor.py: each ``CachingAutotuner.run`` becomes a Launch of the
    autotuner's ``@triton.jit`` function with the config it chose (recorded, not run);
  * a TorchDispatchMode: every ATen op the output code executes becomes a VendorStep
    (core/program_steps.py), its tensors mapped to program buffers by storage identity (spec
    inputs, buffers the code allocated with ``empty_strided``, tensors a step returned), each as
    a view (size, stride, offset) where it is not the whole buffer; allocations become temporaries
    or outputs; views and aliasing (Inductor's ``buf1 = buf0  # reuse``) need no step.
Recording the execution, rather than reading the output code, keeps Inductor's own decisions
(which extern kernel, which layout, which buffer reuse) without re-implementing its wrapper
codegen, and what runs at serving time is plain ATen overloads and stored Triton binaries:
nothing loads or executes Inductor's code there (docs/design.md says why this beats loading a
saved CompiledArtifact). Output code that calls what neither recorder sees (a C++ kernel of
Inductor's CPU backend, a custom op bound from C++) is refused; validation would catch it too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import types
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_kernelize.core.encoding import dtype_name, encode_arg
from torch_kernelize.core.program import Buffer, KernelProgram, Launch, View
from torch_kernelize.core.program_steps import VendorStep
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import op_name
from torch_kernelize.fill_cache.inductor_output import (_autotuner_launches, _autotuners, dispatching_helpers,
                                                       kernels_namespace, program_source)
# the launch recorder's tables and its argument mapping: a launch here is recorded as it is there
from torch_kernelize.lowering.kernels.recording import (_ALLOCATIONS, _HARMLESS, RecordingError, _Allocation,
                                                         _launch_fields, _scalar, _storage, resolve_views)

aten = torch.ops.aten
# Code that runs without the dispatcher (Inductor's C++ CPU kernels, AOT-compiled extensions)
_UNSEEN = ("async_compile.cpp", "cpp_pybinding", "load_pybinding", "CppWrapper")


@dataclasses.dataclass
class _Base:
    tensor: torch.Tensor        # the buffer as first seen (kept: its address is not reused meanwhile)
    ref: tuple[str, Any]        # ("in", i) | ("alloc", storage): an allocation or a step's result
    produced: bool = False      # returned by a step (not allocated by the program)


class _WholeRecorder(TorchDispatchMode):
    """Records Inductor's output code: launches (through ``launch``) and ATen ops, in order."""

    def __init__(self, inputs: list[torch.Tensor], module: types.ModuleType):
        super().__init__()
        self.inputs = inputs
        self.module = module  # the kernels' namespace (launch fields check each kernel is there)
        self.allocations: dict[int, _Allocation] = {}   # storage -> allocation (read by _launch_fields)
        self.bases: dict[int, _Base] = {}
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor):  # (a dynamic graph's size symbols are ints)
                self.bases.setdefault(_storage(t), _Base(t, ("in", i)))
        self.entries: list[tuple[str, Any]] = []          # ("launch", fields) | ("step", VendorStep)
        self.launches = 0

    def launch(self, fn: Any, args: tuple, kwargs: dict, grid: Any) -> None:
        self.entries.append(("launch", _launch_fields(self, fn, args, kwargs, grid, self.module)))
        self.launches += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALLOCATIONS:
            out = func(*args, **kwargs)
            self._new_buffer(out, _scalar(_ALLOCATIONS[func](args, kwargs)), produced=False)
            return out
        if func.is_view or func in _HARMLESS:
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            raise RecordingError("the output code reads a tensor's value on the host (.item(), a data-dependent "
                                 "size): a program's steps depend only on shapes")
        enc_args, enc_kwargs = self._encode(list(args)), {k: self._encode(v) for k, v in sorted(kwargs.items())}
        out = func(*args, **kwargs)
        results = []
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() and _storage(t) not in self.bases:
                results.append(self._new_buffer(t, None, produced=True))
            else:
                results.append(None)
        steps_results = tuple(results) if any(r is not None for r in results) else ()
        self.entries.append(("step", VendorStep(op_name(func), enc_args, enc_kwargs, self.launches, steps_results)))
        return out

    def _new_buffer(self, t: torch.Tensor, init: Any, produced: bool) -> tuple[str, int]:
        storage = _storage(t)
        if produced and (t.data_ptr() != storage or t.storage_offset()):
            raise RecordingError(f"a vendor op returned a view into a storage of its own ({tuple(t.shape)}): a "
                                 "program buffer starts at its storage")
        self.allocations[storage] = _Allocation(t.untyped_storage().nbytes() // t.element_size(), t.dtype, init)
        self.bases[storage] = _Base(t, ("alloc", storage), produced)
        return ("alloc", storage)

    def _encode(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self._tensor(x)
        if isinstance(x, (list, tuple)):
            return [self._encode(v) for v in x]
        try:
            return encode_arg(x)
        except TypeError as e:
            raise RecordingError(f"a vendor call's argument cannot be stored: {e}") from None

    def _tensor(self, t: torch.Tensor) -> dict[str, Any]:
        if not t.numel():  # no memory (empty tensors share the null address): made anew at run time
            return {"empty": [list(t.shape), list(t.stride()), dtype_name(t.dtype)]}
        base = self.bases.get(_storage(t))
        if base is None:
            raise RecordingError(f"a vendor call reads a tensor {tuple(t.shape)} that is neither an input nor a "
                                 "buffer of this call (a constant kept by the output code): the program would "
                                 "not have it")
        if t.dtype != base.tensor.dtype:
            raise RecordingError(f"a vendor call reads a buffer as {t.dtype}, allocated as {base.tensor.dtype}")
        offset = (t.data_ptr() - base.tensor.data_ptr()) // t.element_size()
        if offset < 0:
            raise RecordingError("a vendor call reads a view that starts before its buffer")
        whole = (base.ref[0] == "in" and offset == 0 and t.shape == base.tensor.shape
                 and t.stride() == base.tensor.stride())
        ref = {"buf": list(base.ref)}
        # a temporary is stored flat: every use of an allocation names its sizes and strides
        return ref if whole else {**ref, "view": [list(t.shape), list(t.stride()), offset]}


def record_whole(compiled: Callable, module: types.ModuleType, spec: KernelSpec, inputs: list,
                 config_of: Callable[[Any], Any] | None = None) -> KernelProgram:
    """One call of ``compiled`` (whose output code is ``module``) recorded as a KernelProgram of
    launches and vendor steps, each kernel with ``config_of(autotuner)`` where given (else the
    config Inductor chose); RecordingError (with the reason) where it cannot be."""
    code = Path(module.__file__).read_text()
    unseen = [u for u in _UNSEEN if u in code]
    if unseen:
        raise RecordingError(f"Inductor's output code calls code that bypasses the dispatcher ({unseen[0]}): "
                             "its calls cannot be recorded")
    kernels = _autotuners(module)
    source = program_source(code, kernels)
    recorder = _WholeRecorder(list(inputs), kernels_namespace(kernels))
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(module.__dict__, dispatching_helpers(module)))
        stack.enter_context(torch.no_grad())
        stack.enter_context(_autotuner_launches(recorder.launch, config_of))
        stack.enter_context(recorder)
        result = compiled(*inputs)
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    return _program(recorder, _match_outputs(recorder, outputs, spec), source, len(spec.outputs))


def _match_outputs(recorder: _WholeRecorder, outputs: list, spec: KernelSpec) -> dict[int, int]:
    """storage -> output index, for the outputs that are a whole buffer of this call in their
    traced layout (the runner allocates them, or a step returns them). Any other output (a view
    into a temporary or into another output's buffer: Inductor returns ``reinterpret_tensor``s)
    is made by a last step, an alias of that view (appended to ``recorder.entries``); so is an
    output that is an input or a view of one (Mixtral's stretches pass the router's tensors on)."""
    if len(outputs) != len(spec.outputs):
        raise RecordingError(f"Inductor's code returned {len(outputs)} output(s); the graph has {len(spec.outputs)}")
    found: dict[int, int] = {}
    views, copies = [], []
    for j, (t, meta) in enumerate(zip(outputs, spec.outputs)):
        base = recorder.bases.get(_storage(t)) if isinstance(t, torch.Tensor) and t.numel() else None
        if base is None:
            raise RecordingError(f"output {j} is not a buffer of this call: an output must be a buffer the "
                                 "program makes, or a view of one or of an input")
        got = (tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype))
        if got[0] != meta.shape or got[2] != meta.dtype:
            raise RecordingError(f"output {j} is {got}, not the graph's {(meta.shape, meta.stride, meta.dtype)}")
        if got[1] != meta.stride:  # Inductor chose another layout: copied into the traced one at the end
            copies.append((j, t))
            continue
        if base.ref[0] == "in":  # an input passed through, or a view of one (a stretch's): an alias, as eager's
            views.append((j, t))
            continue
        span = 1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride))
        whole = (_storage(t) not in found and t.data_ptr() == base.tensor.data_ptr()
                 and recorder.allocations[_storage(t)].numel == span
                 and (not base.produced or (t.shape == base.tensor.shape and t.stride() == base.tensor.stride())))
        if whole:
            found[_storage(t)] = j
        else:
            views.append((j, t))
    for j, t in views:  # after every launch and step: the buffer holds its final values
        recorder.entries.append(("step", VendorStep("aten.alias.default", [recorder._tensor(t)], {},
                                                    recorder.launches, (("out", j),))))
    for j, t in copies:  # into output j as the runner allocates it (the traced strides)
        recorder.entries.append(("step", VendorStep("aten.copy_.default", [{"buf": ["out", j]}, recorder._tensor(t)],
                                                    {}, recorder.launches)))
    return found


def _program(recorder: _WholeRecorder, out_of: dict[int, int], source: str, outputs: int) -> KernelProgram:
    """The recorded entries with every ("alloc", storage) resolved to an output or a temporary."""
    temps: dict[int, int] = {}

    def resolve(ref: Any) -> Any:
        if isinstance(ref, (tuple, list)) and len(ref) == 2 and ref[0] == "alloc":
            storage = ref[1]
            return ("out", out_of[storage]) if storage in out_of else ("tmp", temps.setdefault(storage, len(temps)))
        return tuple(ref) if isinstance(ref, list) else ref

    def resolve_encoded(x: Any) -> Any:
        if isinstance(x, dict) and "buf" in x:
            return {**x, "buf": list(resolve(x["buf"]))}
        if isinstance(x, dict):
            return {k: resolve_encoded(v) for k, v in x.items()}
        return [resolve_encoded(v) for v in x] if isinstance(x, list) else x

    launches, steps, views = [], [], {}
    for kind, entry in recorder.entries:
        if kind == "launch":
            launches.append(Launch(**dict(entry, args=resolve_views(entry["args"], lambda s: resolve(("alloc", s)),
                                                                    views))))
        else:
            steps.append(dataclasses.replace(entry, args=resolve_encoded(entry.args),
                                             kwargs=resolve_encoded(entry.kwargs),
                                             results=tuple(resolve(r) if r is not None else None
                                                           for r in entry.results)))
    temp_buffers = [None] * len(temps)
    for storage, i in temps.items():
        alloc = recorder.allocations[storage]
        temp_buffers[i] = Buffer((alloc.numel,), dtype_name(alloc.dtype), alloc.init)
    inits = {j: recorder.allocations[s].init for s, j in out_of.items()}
    output_init = tuple(inits.get(j) for j in range(outputs))
    if not launches and not steps:
        raise RecordingError("Inductor's output code neither launches a kernel nor calls an op")
    return KernelProgram(source, tuple(launches), output_init, tuple(temp_buffers), steps=tuple(steps),
                         views=tuple(View(buffer, offset) for buffer, offset in views))
