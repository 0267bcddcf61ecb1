"""The runner: load a built KernelProgram from its files and launch it. No generation here.

On the interpreter target the kernels' Python functions run through Triton's interpreter. On
CUDA each launch is rebuilt from its stored binary (cubin + metadata): no Triton compilation on
the serving path. Outputs are allocated with the spec's exact shape, stride and dtype.
"""
from __future__ import annotations

import copy
import json
import logging
import operator
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.core.source_module import load_source_module
from torch_kernelize.core.fills import fill_
from torch_kernelize.core.errors import IndexOutOfRange
from torch_kernelize.core.program import PHASE, SOURCE_FILES, KernelProgram, Launch
from torch_kernelize.core.program_steps import StepCall
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.serving.direct_call import CallPlan, at_offset, direct_function
from torch_kernelize.serving.interpreter_compat import fix_scalar_index

PROGRAM_FILE = "program.json"

_import_lock = threading.Lock()
# Triton's interpreter is not reentrant: a run patches triton.language for the whole process and
# restores it when done, so a second thread interpreting meanwhile fails (and its kernel would be
# disabled). Interpreted launches take turns; CUDA launches need no lock.
_interpreter_lock = threading.RLock()
log = logging.getLogger("torch_kernelize.serving.launch")


class MisalignedInput(RuntimeError):
    """A CUDA kernel was compiled for 16-byte aligned pointers, got an unaligned view and has no
    binary for unaligned pointers: the caller runs the vendor op for this one call (the kernel
    stays enabled)."""


def import_source(path: Path, module_name: str):
    """Import a kernel source file as a module, from its text: never from bytecode beside it
    (core/source_module.py says why); Triton's @jit reads the same text back."""
    with _import_lock:
        return load_source_module(path, module_name)


INTERPRETER_TWINS = "INTERPRETER_TWINS"


def use_interpreter_twins(module: Any) -> None:
    """Swap a kernel module's inline-PTX helpers (and ``libdevice``) for their interpreter twins.

    The interpreter runs no PTX. A source whose helpers use ``tl.inline_asm_elementwise`` names,
    in a module-level dict ``INTERPRETER_TWINS = {"helper": "helper_twin"}``, a ``@triton.jit``
    twin of each that computes the same result in plain Triton; the kernels resolve helpers
    through the module's globals, so the interpreted kernels call the twins. (CPU tests thus
    check everything but the PTX itself, which fill_cache validates on the GPU.)
    """
    for name, twin in getattr(module, INTERPRETER_TWINS, {}).items():
        if not hasattr(module, twin):
            raise ValueError(f"{module.__name__}: interpreter twin {twin!r} of {name!r} is not defined")
        setattr(module, name, getattr(module, twin))
    libdevice = getattr(module, "libdevice", None)
    if getattr(libdevice, "__name__", "").startswith("triton.language.extra"):
        module.libdevice = _InterpreterLibdevice()


class _InterpreterLibdevice:
    """``libdevice`` as the interpreter can run it (it runs no extern library, Inductor's kernels
    call ``libdevice.exp`` and kin): each function is ``triton.language.math``'s of the same name,
    looked up at call time, when the interpreter has patched that module."""

    def __getattr__(self, name: str) -> Any:
        import triton.language as tl
        fn = getattr(tl.math, name, None)
        if fn is None:
            raise AttributeError(f"libdevice.{name} has no triton.language.math equivalent that the Triton "
                                 "interpreter runs (the kernel runs on the cuda target only)")
        return fn


def _interpreted(fn: Any):
    from triton.runtime.interpreter import InterpretedFunction
    _interpret_nested_jit_calls()
    fix_scalar_index()
    return fn if isinstance(fn, InterpretedFunction) else InterpretedFunction(fn.fn)


def _interpret_nested_jit_calls() -> None:
    """Let interpreted kernels call @triton.jit helpers (tl.sum, tl.max, tl.sigmoid, own helpers).

    Unless TRITON_INTERPRET=1 was set when triton was imported, those helpers are JITFunctions,
    whose ``__call__`` only raises ("outside of the scope of a kernel"); a compiled kernel never
    calls it (the code generator inlines them). Installed once: such calls run interpreted.
    """
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang
    from triton.runtime.jit import JITFunction
    if getattr(JITFunction.__call__, "_interprets", False):
        return
    cache: dict[int, tuple[Any, Any]] = {}

    def call(self, *args, **kwargs):
        hit = cache.get(id(self))
        if hit is None or hit[0] is not self:
            hit = cache[id(self)] = (self, InterpretedFunction(self.fn))
        # like InterpretedFunction.__call__, but undo the language patching afterwards, so that a
        # later triton.compile in this process sees the real triton.language again
        scope = _patch_lang(self.fn)
        try:
            return hit[1].rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    call._interprets = True
    JITFunction.__call__ = call


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a cheap call, where torch has it


def _raw_stream(device: torch.device) -> int:
    """The current CUDA stream's handle."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


# Inductor's output code allocates through these: no Python argument parsing, no device object.
_GUARDS = getattr(torch._C, "_dynamo", None) and getattr(torch._C._dynamo, "guards", None)
_EMPTY_STRIDED_CPU = getattr(_GUARDS, "_empty_strided_cpu", None)
_EMPTY_STRIDED_CUDA = getattr(_GUARDS, "_empty_strided_cuda", None)  # on the current device
_CUDA_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _empty_strided(device: torch.device) -> Callable[[tuple, tuple, torch.dtype], torch.Tensor]:
    """``(shape, stride, dtype) -> tensor`` allocating on ``device``, the cheapest way there is."""
    if device.type == "cpu" and _EMPTY_STRIDED_CPU is not None:
        return _EMPTY_STRIDED_CPU
    if (device.type == "cuda" and _EMPTY_STRIDED_CUDA is not None and _CUDA_DEVICE is not None
            and device.index in (None, _CUDA_DEVICE())):
        return _EMPTY_STRIDED_CUDA
    return lambda shape, stride, dtype: torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _getter(positions: Sequence[int]) -> Callable[[tuple], tuple]:
    """pool -> the tuple of the pool's items at ``positions`` (itemgetter, always a tuple)."""
    if len(positions) == 1:
        only = positions[0]
        return lambda pool: (pool[only],)
    return operator.itemgetter(*positions) if positions else (lambda pool: ())


class ProgramRunner:
    """A loaded program for one spec: call it with the spec's input tensors."""

    def __init__(self, spec: KernelSpec, program: KernelProgram, kernels: Sequence[Any], backend: str,
                 unaligned: Callable[[], Sequence[Any]] | None = None):
        """``unaligned`` loads (once, on the first unaligned input) the launchers compiled without
        the 16-byte alignment assumption (CUDA)."""
        self.spec = spec
        self.program = program
        self.backend = backend
        self._kernels = list(kernels)  # one launchable per launch
        self._out_metas = spec.outputs
        self._tuple = spec.tuple_output
        self._names = names = [program.kernel_arg_names(l.kernel) for l in program.launches]
        # Pre-resolve each launch's argument list into (kind, value) pairs plus constexpr order.
        self._plans = [self._plan(l, n) for l, n in zip(program.launches, names)]
        # The hot path's view of the same: outputs to allocate, and (for CUDA) each launch's
        # arguments as positions in one pool (inputs, outputs, temps, state, constants) with the
        # constants its launcher does not take already dropped.
        tmp = len(spec.inputs) + len(spec.outputs)
        state = tmp + len(program.temps)
        self._pool_base = {"in": 0, "out": len(spec.inputs), "tmp": tmp, "state": state,
                           "view": state + len(program.state)}
        self._views = [(v.buffer[0], v.buffer[1], v.offset) for v in program.views]
        self._consts: tuple = ()
        # vendor steps (program_steps.py) by the launch they run before; what they return is not allocated
        self._steps: dict[int, list[StepCall]] = {}
        for step in program.steps:
            self._steps.setdefault(step.at, []).append(StepCall(step))
        made_out, made_tmp = program.produced_outputs, program.produced_temps
        self._out_allocs = [(m.shape, m.stride, m.torch_dtype, program.init_of(i)) if i not in made_out else None
                            for i, m in enumerate(spec.outputs)]
        self._temp_allocs = [(b.shape, getattr(torch, b.dtype), b.init) if i not in made_tmp else None
                             for i, b in enumerate(program.temps)]
        # state buffers (grid-barrier semaphores), zeroed once per (device, stream) and kept: calls
        # on one stream run one after another, so they take turns on one set
        self._state_allocs = [(b.shape, getattr(torch, b.dtype)) for b in program.state]
        self._states: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._keep = list(range(len(program.launches)))  # the launches a call runs
        self._donated: dict[int, int] = {}  # output -> the input it is written into (donating())
        if backend == "cuda":
            self._cuda_plans = self._cuda_plans_for(self._kernels)
        self._checks = [(c.temp, c.message) for c in program.checks]
        # inputs the spec holds on the host (a dynamic graph's tensorified floats: 0-d float64 CPU
        # tensors) that a CUDA program reads on the device, where the fill validated it: passed
        # as CPU pointers, the launcher's pointer check failed ("CUDA driver error: invalid argument")
        self._host_inputs = tuple(i for i, m in enumerate(spec.inputs)
                                  if m.device == "cpu" and not m.shape) if backend == "cuda" else ()
        self._load_unaligned = unaligned
        self._unaligned_tried = False
        self._unaligned_plans: list | None = None
        self._unaligned_lock = threading.Lock()
        self.direct = self._direct_call()

    def for_spec(self, spec: KernelSpec, program: KernelProgram) -> "ProgramRunner":
        """A runner of ``spec`` by this one's kernels with ``program`` (a shape bucket's at one of
        its sizes, core/buckets.instantiate): nothing loaded, parsed or compiled."""
        return ProgramRunner(spec, program, self._kernels, self.backend, self._load_unaligned)

    def resized(self, program: KernelProgram, outputs: Sequence[Any]) -> "ProgramRunner":
        """This runner with ``program`` (its own, with other launch sizes: a shape bucket's at one
        size, core/buckets.instantiate) and outputs of the sizes ``outputs`` (TensorMetas): the
        same kernels, nothing loaded, parsed or generated, no direct function."""
        runner = copy.copy(self)
        runner.program = program
        runner._out_metas = tuple(outputs)
        runner._plans = [self._plan(l, n) for l, n in zip(program.launches, self._names)]
        made_out = program.produced_outputs
        runner._out_allocs = [(m.shape, m.stride, m.torch_dtype, program.init_of(i)) if i not in made_out else None
                              for i, m in enumerate(outputs)]
        if program.steps or program.views:  # a graph bucket's program: its steps' views and buffers resize too
            runner._views = [(v.buffer[0], v.buffer[1], v.offset) for v in program.views]
            runner._steps = {}
            resolved = {id(c.step): c for calls in self._steps.values() for c in calls}  # (steps no size changed)
            for step in program.steps:
                runner._steps.setdefault(step.at, []).append(resolved.get(id(step)) or StepCall(step))
            made_temps = program.produced_temps
            runner._temp_allocs = [(b.shape, getattr(torch, b.dtype), b.init) if i not in made_temps
                                   else None for i, b in enumerate(program.temps)]
        if self.backend == "cuda":
            runner._consts = ()
            runner._cuda_plans = runner._cuda_plans_for(self._kernels)
        runner._unaligned_tried, runner._unaligned_plans = False, None
        runner._unaligned_lock = threading.Lock()
        runner.direct = None
        return runner

    def donating(self) -> "ProgramRunner | None":
        """This program writing its donated outputs into the caller's inputs and leaving out the
        launches that only copied them (see Donation); the caller guarantees that nothing reads
        those inputs afterwards. None if the program declares no donation."""
        donations = self.program.donations
        if not donations:
            return None
        runner = copy.copy(self)
        skip = {i for d in donations for i in d.skip}
        runner._keep = [i for i in self._keep if i not in skip]
        runner._donated = {d.out: d.input for d in donations}
        runner._out_allocs = [None if i in runner._donated else a for i, a in enumerate(self._out_allocs)]
        if self.backend == "cuda":
            runner._cuda_plans = runner._cuda_plans_for(self._kernels)
        runner._unaligned_tried, runner._unaligned_plans = False, None
        runner._unaligned_lock = threading.Lock()
        runner.direct = None  # (the generated call knows no donation)
        return runner

    def _cuda_plans_for(self, kernels: Sequence[Any]) -> list:
        """Per kept launch: (its launcher's run, a getter of its arguments from the pool, grid)."""
        plans, consts = [], list(self._consts)
        first_const = self._pool_base["view"] + len(self._views)
        for i in self._keep:
            k, (_, order, grid) = kernels[i], self._plans[i]
            where = []
            for j, (kind, value) in enumerate(order):
                if j in k.dropped:
                    continue
                if kind in self._pool_base:
                    where.append(self._pool_base[kind] + value)
                else:
                    where.append(first_const + len(consts))
                    consts.append(value)
            plans.append((k.run, _getter(where), *grid))
        self._consts = tuple(consts)
        return plans

    def bucket_direct(self, program: KernelProgram, outputs: Sequence[Any], sizes: str,
                      general: Callable) -> Callable | None:
        """One generated call serving every size of a shape bucket: ``program`` (this runner's,
        sized_programs.Resizer.symbolic) and ``outputs`` (TensorMetas) hold SizeSources of the
        sizes ``v``, which ``sizes`` reads off the inputs; ``general`` takes the calls the
        generated one does not (an unaligned input, another device). A new size then costs
        nothing to make, and every call runs straight-line. None where the general path is the
        only one (as ``direct``)."""
        return self.resized(program, outputs)._direct_call(sizes, general)

    def _direct_call(self, sizes: str | None = None, general: Callable | None = None) -> Callable | None:
        """The CUDA hot path of this program as one generated function of its inputs
        (direct_call.py); None where the general path is the only one (not CUDA, donated
        outputs, state buffers, no input on the device)."""
        if (self.backend != "cuda" or self._donated or self._state_allocs
                or len(self._host_inputs) == len(self.spec.inputs)  # (no inputs, or none on the device)
                or None in (_RAW_STREAM, _CUDA_DEVICE, _EMPTY_STRIDED_CUDA)):
            return None
        plan = CallPlan(self.spec.key, len(self.spec.inputs), general or self.__call__, self._out_allocs,
                        self._temp_allocs, self._views, self._steps,
                        [(i, self._kernels[i], self._plans[i]) for i in self._keep],
                        len(self.program.launches), self._tuple, self._host_inputs, self._checks, flag_checks)
        return direct_function(plan, _EMPTY_STRIDED_CUDA, _RAW_STREAM, _CUDA_DEVICE, sizes)

    def _plans_for_unaligned(self) -> list:
        if self._unaligned_plans is not None:
            return self._unaligned_plans
        with self._unaligned_lock:  # loaded once, whichever thread meets an unaligned input first
            if self._unaligned_plans is None:
                if self._load_unaligned is None or self._unaligned_tried:
                    raise MisalignedInput(f"an input of {self.spec.describe()} is not 16-byte aligned")
                self._unaligned_tried = True
                try:
                    self._unaligned_plans = self._cuda_plans_for(self._load_unaligned())
                except Exception as e:  # e.g. the entry was replaced meanwhile: the vendor op, per call
                    log.warning("%s: the binary for unaligned inputs did not load (%s: %s)",
                                self.spec.describe(), type(e).__name__, e)
                    raise MisalignedInput(f"an input of {self.spec.describe()} is not 16-byte aligned") from e
            return self._unaligned_plans

    def _plan(self, launch: Launch, names: list[str]):
        runtime = [n for n in names if n not in launch.constexprs]
        by_name = dict(zip(runtime, launch.args))
        # Full parameter order (CUDA launchers take constexprs in place); interpreter takes kwargs.
        order = [("const", launch.constexprs[n]) if n in launch.constexprs else by_name[n] for n in names]
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        return launch, order, grid

    def allocate(self, device: torch.device, poison: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        outs = []
        empty = _empty_strided(device)
        for alloc in self._out_allocs:
            if alloc is None:  # donated: the caller's input (see donating()), or a vendor step's result
                outs.append(None)
                continue
            shape, stride, dtype, init = alloc
            t = empty(shape, stride, dtype)
            if init is not None:
                t.fill_(init)
            elif poison:
                fill_(t)  # validation: the current run's fill (core/fills.py)
            outs.append(t)
        temps = []
        for alloc in self._temp_allocs:
            if alloc is None:  # a vendor step's result
                temps.append(None)
                continue
            shape, dtype, init = alloc
            t = torch.empty(shape, dtype=dtype, device=device)
            if init is not None:
                t.fill_(init)
            elif poison:
                fill_(t)  # validation: the current run's fill (core/fills.py)
            temps.append(t)
        return outs, temps

    def _view_tensors(self, outs: list, temps: list) -> list:
        """The program's views (``KernelProgram.views``) into this call's buffers; None for one
        into a buffer a vendor step has not returned yet (made when it does)."""
        bufs = {"out": outs, "tmp": temps}
        return [at_offset(bufs[kind][j], offset) if bufs[kind][j] is not None else None
                for kind, j, offset in self._views]

    def state(self, device: torch.device, stream: int = 0) -> tuple[torch.Tensor, ...]:
        """The state buffers of calls on ``stream`` of ``device``: zeroed when first asked for."""
        key = (device.index if device.index is not None else -1, stream)
        bufs = self._states.get(key)
        if bufs is None:  # two threads meeting here keep the first set (dict.setdefault is atomic)
            bufs = self._states.setdefault(key, tuple(torch.zeros(shape, dtype=dtype, device=device)
                                                      for shape, dtype in self._state_allocs))
        return bufs

    def launch(self, inputs: Sequence[torch.Tensor], outs: list[torch.Tensor], temps: list[torch.Tensor]) -> None:
        if self._steps:
            return self._launch_with_steps(inputs, outs, temps)
        if self.backend == "cuda":  # the serving path: no per-call dicts or argument lists
            plans = self._cuda_plans
            for t in inputs:
                if t.data_ptr() % 16:
                    plans = self._plans_for_unaligned()
                    break
            device = inputs[0].device if inputs else torch.device("cuda")
            stream = _raw_stream(device)
            state = self.state(device, stream) if self._state_allocs else ()
            views = self._view_tensors(outs, temps) if self._views else ()
            pool = (*inputs, *outs, *temps, *state, *views, *self._consts)
            for run, args, gx, gy, gz in plans:
                run(gx, gy, gz, stream, *args(pool))
            return
        with _interpreter_lock:
            self._interpret(inputs, outs, temps)

    def _launch_with_steps(self, inputs: Sequence[torch.Tensor], outs: list, temps: list) -> None:
        """Launches and vendor steps in program order (a compiler's whole output): a step may
        return a buffer that later launches read; it is put into the launches' pool in place.
        (No donations or state buffers in such a program.)"""
        device = inputs[0].device if inputs else torch.device("cuda" if self.backend == "cuda" else "cpu")
        bufs = {"in": list(inputs), "out": outs, "tmp": temps}
        n = len(self.program.launches)
        if self.backend == "cuda":
            plans = self._cuda_plans
            if any(t.data_ptr() % 16 for t in inputs):
                plans = self._plans_for_unaligned()
            stream = _raw_stream(device)
            views = self._view_tensors(outs, temps) if self._views else []
            pool, base = [*inputs, *outs, *temps, *views, *self._consts], self._pool_base
            for i in range(n + 1):
                for step in self._steps.get(i, ()):
                    step(bufs, device.type)
                    for kind, j in step.results:
                        pool[base[kind] + j] = bufs[kind][j]
                        for v, (vkind, vj, offset) in enumerate(self._views):  # a view into what it returned
                            if (vkind, vj) == (kind, j):
                                pool[base["view"] + v] = at_offset(bufs[kind][j], offset)
                if i == n:
                    break
                run, args, gx, gy, gz = plans[i]
                run(gx, gy, gz, stream, *args(pool))
            return
        with _interpreter_lock:
            for i in range(n + 1):
                for step in self._steps.get(i, ()):
                    step(bufs, device.type)
                    if self._views:
                        bufs["view"] = self._view_tensors(outs, temps)
                if i < n:
                    if self._views and "view" not in bufs:
                        bufs["view"] = self._view_tensors(outs, temps)
                    self._interpret_launch(i, bufs)

    def _interpret(self, inputs: Sequence[torch.Tensor], outs: list[torch.Tensor], temps: list[torch.Tensor]) -> None:
        device = inputs[0].device if inputs else torch.device("cpu")
        bufs = {"in": inputs, "out": outs, "tmp": temps, "state": self.state(device) if self._state_allocs else (),
                "view": self._view_tensors(outs, temps) if self._views else ()}
        for i in self._keep:
            self._interpret_launch(i, bufs)

    def _interpret_launch(self, i: int, bufs: dict[str, Sequence]) -> None:
        kernel, (launch, order, grid) = self._kernels[i], self._plans[i]
        args = [bufs[k][v] if k in bufs else v for k, v in order]
        if not launch.synchronized:
            kernel[grid](*args, num_warps=launch.num_warps, num_stages=launch.num_stages)
            return
        # The interpreter runs the programs one after another, so a grid barrier would wait
        # forever: one launch per phase instead (a launch's end is a grid barrier).
        at = self.program.kernel_arg_names(launch.kernel).index(PHASE)
        for phase in range(1, launch.phases + 1):
            args[at] = phase
            kernel[grid](*args, num_warps=launch.num_warps, num_stages=launch.num_stages)

    def __call__(self, *inputs: torch.Tensor):
        if self._host_inputs:
            inputs = self._moved_to_device(inputs)
        device = inputs[0].device if inputs else torch.device("cuda" if self.backend == "cuda" else "cpu")
        outs, temps = self.allocate(device)
        for out, given in self._donated.items():
            if self.backend == "cuda" and inputs[given].data_ptr() % 16:  # outputs are compiled aligned
                raise MisalignedInput(f"the buffer donated to {self.spec.describe()} is not 16-byte aligned")
            outs[out] = inputs[given]
        self.launch(inputs, outs, temps)
        if self._checks:
            self._raise_flagged(temps)
        return tuple(outs) if self._tuple else outs[0]

    def _moved_to_device(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``inputs`` with the host-held ones on the device of the others (a small copy per call)."""
        device = next((t.device for i, t in enumerate(inputs) if i not in self._host_inputs),
                      torch.device("cuda"))
        moved = list(inputs)
        for i in self._host_inputs:
            if moved[i].device != device:
                moved[i] = moved[i].to(device, non_blocking=True)
        return moved

    def _raise_flagged(self, temps: list[torch.Tensor]) -> None:
        """Raise the error of a check whose flag the kernels set. On a GPU a read is a sync: within
        a lowered graph's call (``deferred_checks``) the flags are read once, at its end; never
        while a CUDA graph is captured, where they cannot be read."""
        flag_checks([(temps[i], message) for i, message in self._checks])

    def run_poisoned(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Validation: outputs and uninitialised temporaries filled before the launch (with the
        current validation run's fill, core/fills.py), always returned as a tuple."""
        device = inputs[0].device if inputs else torch.device("cpu")
        outs, temps = self.allocate(device, poison=True)
        self.launch(inputs, outs, temps)
        if self._checks:
            self._raise_flagged(temps)
        return tuple(outs)


_deferred = threading.local()  # a GPU graph call's flags, read once at its end (deferred_checks)


def flag_checks(flags: list[tuple[torch.Tensor, str]]) -> None:
    """A program call's check flags (ProgramRunner._raise_flagged, and the generated call's):
    on a GPU, left to the lowered graph's call that is running (deferred_checks) or, while a CUDA
    graph is captured, unread; else read now."""
    if flags and flags[0][0].is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return
        pending = getattr(_deferred, "flags", None)
        if pending is not None:
            pending.extend(flags)
            return
    raise_flagged(flags)


def raise_flagged(flags: Sequence[tuple[torch.Tensor, str]]) -> None:
    """IndexOutOfRange with the message of the first flag a kernel set."""
    if flags and bool(torch.stack([t.reshape(-1)[0] for t, _ in flags]).any()):
        raise IndexOutOfRange(next(m for t, m in flags if bool(t.any())))


def deferred_checks(call: Callable[[Any], Any], args: Any) -> Any:
    """``call(args)`` with the checks of the GPU kernels it runs read once, after it (one sync
    per call instead of one per kernel); a nested call leaves them to the outer one."""
    outer = getattr(_deferred, "flags", None)
    _deferred.flags = flags = []
    try:
        out = call(args)
    finally:
        _deferred.flags = outer
    if flags:
        if outer is not None:
            outer.extend(flags)
        else:
            raise_flagged(flags)
    return out


def read_program(directory: Path) -> KernelProgram:
    """A built program's launch list and source (whichever language it is written in)."""
    meta = json.loads((Path(directory) / PROGRAM_FILE).read_text())
    source = (Path(directory) / SOURCE_FILES[meta.get("language", "triton")]).read_text()
    return KernelProgram.from_json(meta, source)


def load_program(directory: Path, spec: KernelSpec, backend: str, module_name: str | None = None) -> ProgramRunner:
    """Load a built program from ``directory`` (kernel.py or kernel.cu, program.json, launch
    binaries); ``module_name`` names the imported source (interpreter)."""
    directory = Path(directory)
    program = read_program(directory)
    if program.language != "triton" and backend != "cuda":
        raise ValueError(f"{spec.describe()}: a {program.language} program runs on the cuda target only, "
                         f"not on {backend!r}")
    if backend == "interpreter":
        module = import_source(directory / program.source_file, module_name or f"torch_kernelize_kernels.k{spec.key}")
        use_interpreter_twins(module)
        return ProgramRunner(spec, program, [_interpreted(getattr(module, l.kernel)) for l in program.launches],
                             backend)
    if backend == "cuda":  # the stored binaries; the source is not imported (KernelSignature)
        from torch_kernelize.core.program import has_unaligned
        from torch_kernelize.serving.triton_binaries import KernelSignature, load_launch

        def launchers(aligned: bool = True) -> list:
            return [load_launch(directory, i, KernelSignature.of(l, program), l, program, spec, aligned)
                    for i, l in enumerate(program.launches)]
        unaligned = (lambda: launchers(False)) if has_unaligned(directory, len(program.launches)) else None
        return ProgramRunner(spec, program, launchers(), backend, unaligned)
    raise ValueError(f"no Triton runner for backend {backend!r}")
