"""A shape bucket's kernel in a specialization that serves every shape of its class.

A dynamic graph's specialization can be shared by many concrete shapes (compiling/shape_classes.py).
Its exact-shape kernels are then pinned to one shape, but a bucket's kernel serves all of them:
``BucketCall`` reads the bucket's variable sizes off its input tensors and runs the ``TritonCall``
of those sizes, made on first sight of them (the bucket's binaries are already loaded: the sizes
only change the launch grid and scalar arguments) and kept. Health, layout checks and the vendor
path on failure are each size's TritonCall's; the state is the bucket entry's, so a failing kernel
is disabled for the whole bucket.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Sequence

from torch_kernelize.core.buckets import Dim, metas_at
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.serving.runtime import KernelState, TritonCall


class SizedCall(TritonCall):
    """One size's call of a bucket's kernel. Its spec, which only the vendor path, a failure's
    record and layout checks read, is made when first asked for: a new size costs its launch
    plan alone."""

    def __init__(self, make_spec: Callable[[], KernelSpec], runner: Callable, state: KernelState,
                 on_failure: Callable | None, name: str):
        # (TritonCall's own __init__ would make the spec now)
        self._make_spec, self._spec = make_spec, None
        self.runner, self.state, self.on_failure = runner, state, on_failure
        self.layout_checks = ()
        self.__name__ = name

    @property
    def spec(self) -> KernelSpec:
        if self._spec is None:
            self._spec = self._make_spec()
        return self._spec


def readable(dims: Sequence[Dim]) -> bool:
    """Whether every variable of ``dims`` can be read off an input (not only an output)."""
    variables = {v for *_, v in dims}
    return variables == {v for side, _, _, v in dims if side == "in"}


class BucketCall(TritonCall):
    """The call of one bucket's kernel at whatever sizes of the bucket its inputs have."""

    def __init__(self, spec: KernelSpec, dims: Sequence[Dim], state: KernelState,
                 make: Callable[[tuple[int, ...]], TritonCall], scale: int = 1):
        """``spec``: the node's spec where the specialization was made (its name, the report's);
        ``dims``: the bucket's variable dims, every variable on an input (``readable``), each
        ``scale`` times its variable (a whole-graph bucket's token counts: core/buckets.Bucket);
        ``make(values)``: the TritonCall of the bucket's kernel at those variable sizes."""
        super().__init__(spec, None, state)  # (no runner of its own: each size's call has one)
        if not readable(dims):
            raise ValueError(f"bucket dims {list(dims)}: a variable appears on no input")
        first = {}
        for side, i, d, v in dims:
            if side == "in":
                first.setdefault(v, (i, d))
        per = f" // {int(scale)}" if scale != 1 else ""
        reads = [first[v] for v in sorted(first)]
        values = "".join(f"t[{i}].shape[{d}]{per}, " for i, d in reads)
        self._values = eval(f"lambda t: ({values})")  # built from ints only
        # the same read in a generated call, whose inputs are i0, i1, ... (direct_call.py)
        self.sizes_source = "(" + "".join(f"i{i}.shape[{d}]{per}, " for i, d in reads) + ")"
        # one generated call for every size (ProgramRunner.bucket_direct), where the caller made one
        self.generic: Callable | None = None
        self._dims = tuple(dims)
        self._make = make
        self._sized: dict[tuple[int, ...], TritonCall] = {}
        self._lock = threading.Lock()
        self.layout_inputs: tuple[int, ...] = ()  # inputs whose strides each size's call checks
        self._layouts: dict[tuple[int, ...], tuple] = {}  # sizes -> (input, strides) to check there
        self.__name__ = f"triton_{spec.short_name}_bucket_{state.key[:8]}"

    def sized(self, values: tuple[int, ...]) -> TritonCall:
        call = self._sized.get(values)
        if call is None:
            with self._lock:
                call = self._sized.get(values)
                if call is None:
                    call = self._make(values)
                    call.layout_checks = self._layout_checks(values)
                    self._sized[values] = call
        return call

    def _layout_checks(self, values: tuple[int, ...]) -> tuple:
        """(input, strides) the kernel was built for at these sizes, for the inputs whose layout is
        not certain (``checking``); made once per size, without the spec."""
        checks = self._layouts.get(values)
        if checks is None:
            metas = metas_at(self.spec, self._dims, values, "in") if self.layout_inputs else ()
            checks = self._layouts[values] = tuple((i, metas[i].stride) for i in self.layout_inputs)
        return checks

    def checking(self, inputs: Sequence[int]) -> "BucketCall":
        """This call checking that ``inputs`` (a vendor op's outputs) arrive laid out as its kernel
        reads them at their sizes. It keeps the generic call: a call whose layouts hold takes it
        (the assemblies of small buckets are mostly such calls, and the per-size path costs tens
        of microseconds of host time each); one whose do not takes its size's call, which notes
        the layout and runs the vendor op."""
        checked = copy.copy(self)
        checked.layout_inputs = tuple(inputs)
        checked._sized, checked._lock, checked._layouts = {}, threading.Lock(), {}  # (its own: they check)
        return checked

    def per_size(self, *tensors: Any):
        """The size's own runner (what a generic call hands the calls it does not cover)."""
        return self.sized(self._values(tensors)).runner(*tensors)

    def __call__(self, *tensors: Any):
        generic = self.generic
        if generic is not None and self.state.disabled is None:
            if self.layout_inputs and not self._laid_out(tensors):
                return self.sized(self._values(tensors))(*tensors)  # (on the vendor op)
            try:
                return generic(*tensors)
            except Exception as e:  # (the size's call decides: the vendor op's answer, a disabled kernel)
                return self.sized(self._values(tensors)).failed(e, tensors)
        return self.sized(self._values(tensors))(*tensors)

    def _laid_out(self, tensors: Sequence[Any]) -> bool:
        return all(tensors[i].stride() == stride for i, stride in self._layout_checks(self._values(tensors)))

    def vendor(self, *tensors: Any):
        return self.sized(self._values(tensors)).vendor(*tensors)

    def failed(self, e: Exception, tensors: Sequence[Any]):
        return self.sized(self._values(tensors)).failed(e, tensors)

    def donating(self) -> None:
        return None  # (a bucket's programs are run as allocated: no donated variant)
