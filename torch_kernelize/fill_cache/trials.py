"""The trials of one spec, shared by all its candidates, within a memory budget.

Each trial's inputs, float64 reference and vendor outputs are computed once (the reference on
the device where it has float64, else on the CPU) and kept for the next candidates: on the
device while they are small (a share of the spec's own size, so that what is kept stays within
the memory bound), else in host memory (moved back block by block as compared) when computing
them again would cost more than moving them back, and not at all beyond a share of the host's
free memory. What is not kept is computed again, at a cost ``seconds`` shows: inputs drawn on
the device (``sample_generator``) and references of a GEMM in float64 on an H200 take
milliseconds, less than a copy from the host. Inputs come first within the host's share.

Specs larger than ``REDUCED_TRIALS_BYTES`` are validated on one random trial (with every edge
kind) instead of ``DEFAULT_SEEDS``' three: ``trial_seeds`` says why, in the validation record.

Before a spec is searched, ``check_fits`` compares what validating one candidate needs on the
device (on a CPU target: in host memory, within the process's address-space limit) with what is
free there: a spec that cannot fit is reported "too large" and left to the vendor op, and never
ends the run; nothing of it is allocated.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.core.devices import to_device
from torch_kernelize.core.spec import KernelSpec, TensorMeta
from torch_kernelize.core.validate import CHUNK_ELEMENTS, DEFAULT_SEEDS, Trials, sync_device

log = logging.getLogger("torch_kernelize.fill_cache")

DEVICE_KEEP_BYTES = 512 << 20   # kept trials stay on the device up to this (and a quarter of the spec's size)
HOST_KEEP_SHARE = 0.25          # ... then in host memory, up to this share of what is available
HOST_COPY_BYTES_PER_S = 8e9     # a pageable copy between host and device: what a use of a host-kept trial costs
REDUCED_TRIALS_BYTES = 1 << 30  # specs with more inputs + outputs than this get one random trial


class SpecTooLarge(RuntimeError):
    """Validating this spec does not fit in the device (or host) memory that is free: the vendor op runs it."""


def free_device_memory(device: str | torch.device) -> int | None:
    """Bytes a validation may still allocate on ``device``: free memory plus what torch's caching
    allocator holds unused; on the CPU, free_host_memory(); None where there is no limit to check."""
    device = torch.device(device)
    if device.type == "cpu":
        return free_host_memory()
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class PeakMeter:
    """The peak device memory allocated since it was made, beyond what was allocated then (None
    off CUDA): what a spec's search cost in memory, to compare with ``spec_bytes``. It counts
    what torch's allocator hands out (trials, candidates' outputs, comparison blocks, cuBLAS and
    cuDNN workspaces), not what it caches unused or the CUDA context.

    The device keeps one peak for the process, and another spec's meter (a winner awaiting its
    last check keeps its Measurer) restarts it: ``start`` before each call of the Measurer, then
    ``extra``, which keeps the largest peak seen, after it."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.peak = 0
        if self.cuda:
            self.before = torch.cuda.memory_allocated(self.device)
            self.start()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def extra(self) -> int | None:
        if not self.cuda:
            return None
        self.peak = max(self.peak, int(torch.cuda.max_memory_allocated(self.device) - self.before))
        return self.peak


def _proc_bytes(path: str, field: str) -> int | None:
    """A "<field>: <n> kB" line of a /proc file, in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_memory() -> int:
    found = _proc_bytes("/proc/meminfo", "MemAvailable")
    return found if found is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def mapped_bytes() -> int:
    """The address space this process maps now (what RLIMIT_AS counts); 0 where unknown."""
    return _proc_bytes("/proc/self/status", "VmSize") or 0


def free_host_memory() -> int:
    """Bytes a validation on the CPU may still allocate: the host's available memory, and no more
    than this process's address-space limit leaves (the measure worker's, measure_worker.py)."""
    free = available_host_memory()
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, AttributeError, OSError):
        return free
    if soft == resource.RLIM_INFINITY:
        return free
    return max(0, min(free, soft - mapped_bytes()))


def has_float64(device: str | torch.device) -> bool:
    device = torch.device(device)
    if device.type in ("cpu", "cuda"):
        return True
    try:
        torch.zeros(1, dtype=torch.float64, device=device)
        return True
    except (RuntimeError, TypeError):
        return False


def _bytes(metas: Sequence[TensorMeta], element_size: int | None = None) -> int:
    return sum(m.numel * (element_size or torch.empty((), dtype=m.torch_dtype).element_size()) for m in metas)


def spec_bytes(spec: KernelSpec) -> int:
    """The spec's own inputs plus outputs, in bytes: what memory use is judged against."""
    return _bytes(spec.inputs) + _bytes(spec.outputs)


def trial_seeds(spec: KernelSpec) -> tuple[tuple[int, ...], str]:
    """The random seeds ``spec``'s candidates are validated on, and why they are fewer than
    DEFAULT_SEEDS ("" when they are not). A trial of a huge spec tests as many elements as many
    trials of a small one; its cost (a float64 reference, a comparison) grows with its size."""
    size = spec_bytes(spec)
    if size <= REDUCED_TRIALS_BYTES:
        return DEFAULT_SEEDS, ""
    return DEFAULT_SEEDS[:1], (f"1 random trial of {len(DEFAULT_SEEDS)}: the spec's inputs and outputs are "
                               f"{size / 2**30:.1f} GiB (over {REDUCED_TRIALS_BYTES / 2**30:g} GiB); "
                               "every edge kind kept")


def device_keep_bytes(spec: KernelSpec) -> int:
    """How much of a spec's trials may stay on the device: a quarter of its own size, 512 MiB at
    most (a trial's float64 reference and the vendor's output already hold ~2x the spec's outputs)."""
    return min(DEVICE_KEEP_BYTES, spec_bytes(spec) // 4)


def validation_bytes(spec: KernelSpec, reference_on_device: bool) -> int:
    """What validating one candidate on one trial holds on the device: the trials kept there, its
    inputs and the copy that shows they are left unchanged, its outputs, the vendor op's outputs,
    the comparison's float64 blocks, and, with the reference computed there, the float64 copies of
    inputs and outputs it runs on."""
    outs = _bytes(spec.outputs)
    largest = max((m.numel for m in spec.outputs), default=0)
    need = device_keep_bytes(spec) + 2 * _bytes(spec.inputs) + 2 * outs + 8 * 8 * min(largest, CHUNK_ELEMENTS)
    if reference_on_device:
        need += _bytes(spec.inputs, 8) + _bytes(spec.outputs, 8)
    return need


class TrialStore(Trials):
    """``validate.Trials`` that computes each trial once and keeps it for the spec's candidates."""

    def __init__(self, spec: KernelSpec, sample_inputs: Callable[[KernelSpec, int, str, Any], list[torch.Tensor]],
                 device: str | torch.device = "cpu", trials: int = 1):
        """``trials``: how many trials validation has, so that every one's inputs can be kept
        before any reference or vendor output is."""
        super().__init__(spec, sample_inputs, device, device if has_float64(device) else "cpu")
        self._inputs_to_come = trials * _bytes(spec.inputs)
        self._inputs: dict[tuple, list[torch.Tensor]] = {}
        self._refs: dict[tuple, tuple[torch.Tensor, ...] | None] = {}
        self._vendor: dict[tuple, tuple[tuple[torch.Tensor, ...], bool]] = {}
        self._far: dict[tuple, bool] = {}  # the vendor output's verdict, kept even where it is not
        self._on_device = 0
        self._on_host = 0
        self._device_budget = device_keep_bytes(spec)
        self._host_budget = int(available_host_memory() * HOST_KEEP_SHARE)
        self.computed = {"inputs": 0, "reference": 0, "vendor": 0}

    # --- the memory plan ------------------------------------------------------------------------
    def check_fits(self) -> None:
        """Choose where references are computed; raise SpecTooLarge if even the CPU reference
        leaves too little device memory to validate a candidate (on the CPU: host memory)."""
        free = free_device_memory(self.device)
        if free is None:
            return
        if torch.device(self.device).type == "cpu":  # inputs, outputs and float64 references: all in host memory
            need = validation_bytes(self.spec, True)
            if need > free:
                raise SpecTooLarge(f"validation needs ~{need / 2**30:.1f} GiB of host memory, "
                                   f"{free / 2**30:.1f} GiB are available")
            return
        on_device = torch.device(self.reference_device).type != "cpu"
        if on_device and validation_bytes(self.spec, True) <= free:
            return
        need = validation_bytes(self.spec, False)
        if need > free:
            raise SpecTooLarge(f"validation needs ~{need / 2**30:.1f} GiB of device memory, "
                               f"{free / 2**30:.1f} GiB are free")
        if on_device:
            log.info("%s: float64 references on the CPU (on the device they would not fit in %.1f GiB)",
                     self.spec.describe()[:90], free / 2**30)
            self.reference_device = "cpu"

    def place(self, size: int, on_device: bool, seconds: float, inputs: bool = False) -> str | None:
        """Where ``size`` bytes of a trial, computed in ``seconds``, are kept: "device" while they
        are small, else "host" unless computing them again costs less than bringing them back
        (or they are on the CPU already) and while the host's share has room; None: not kept."""
        if inputs:
            self._inputs_to_come = max(0, self._inputs_to_come - _bytes(self.spec.inputs))
        if on_device and self._on_device + size <= self._device_budget:
            self._on_device += size
            return "device"
        if on_device and seconds < size / HOST_COPY_BYTES_PER_S:
            return None
        room = self._host_budget - (0 if inputs else self._inputs_to_come)
        if self._on_host + size <= room:
            self._on_host += size
            return "host"
        return None

    def _keep(self, tensors: Sequence[torch.Tensor], seconds: float, inputs: bool = False) -> list[torch.Tensor] | None:
        """``tensors`` where ``place`` keeps them, or None: not kept."""
        size = sum(t.untyped_storage().nbytes() for t in tensors)
        where = self.place(size, any(t.device.type != "cpu" for t in tensors), seconds, inputs)
        if where == "device":
            return list(tensors)
        return [to_device(t, "cpu") for t in tensors] if where == "host" else None

    def _oom(self, what: str) -> SpecTooLarge:
        self.release()
        return SpecTooLarge(f"out of device memory while computing the trials' {what}")

    # --- Trials ---------------------------------------------------------------------------------
    def inputs(self, seed: int, kind: str) -> list[torch.Tensor]:
        kept = self._inputs.get((seed, kind))
        if kept is not None:
            return [to_device(t, self.device) for t in kept]
        t0 = time.perf_counter()
        try:
            inputs = super().inputs(seed, kind)
        except torch.OutOfMemoryError:
            raise self._oom("inputs") from None
        self.computed["inputs"] += 1
        kept = self._keep(inputs, _since(t0, self.device), inputs=True)
        if kept is not None:
            self._inputs[(seed, kind)] = kept
        return inputs

    def reference(self, seed: int, kind: str, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        if (seed, kind) in self._refs:
            return self._refs[(seed, kind)]
        t0 = time.perf_counter()
        try:
            ref = super().reference(seed, kind, inputs)
        except torch.OutOfMemoryError:
            if torch.device(self.reference_device).type == "cpu":
                raise self._oom("float64 references") from None
            torch.cuda.empty_cache()
            log.info("%s: float64 references on the CPU (out of device memory)", self.spec.describe()[:90])
            self.reference_device = "cpu"
            return self.reference(seed, kind, inputs)
        self.computed["reference"] += 1
        if ref is None:
            self._refs[(seed, kind)] = None
            return None
        kept = self._keep(ref, time.perf_counter() - t0)  # Trials.reference synchronized
        if kept is not None:
            self._refs[(seed, kind)] = tuple(kept)
        if (seed, kind) not in self._far:
            # the vendor's verdict now, while no candidate output is held: later, validation lets
            # the reference go before it needs the vendor's output
            try:
                self.vendor(seed, kind, inputs, ref)
            except torch.OutOfMemoryError:
                raise
            except Exception:  # the op rejects these inputs: validation meets it where it needs it
                pass
        return ref

    def vendor_needs_reference(self, seed: int, kind: str) -> bool:
        return (seed, kind) not in self._far

    def vendor(self, seed: int, kind: str, inputs: Sequence[torch.Tensor],
               ref: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], bool]:
        if (seed, kind) in self._vendor:
            return self._vendor[(seed, kind)]
        t0 = time.perf_counter()
        try:
            out = self.spec.run_vendor(inputs)
            ran = _since(t0, self.device)  # what computing it again costs
            far = self._far.get((seed, kind))  # computed before and not kept: the verdict stands
            if far is None:
                far = self.far_from(out, ref)
        except torch.OutOfMemoryError:
            raise self._oom("vendor outputs") from None
        finally:
            self.seconds["vendor"] += time.perf_counter() - t0
        self.computed["vendor"] += 1
        self._far[(seed, kind)] = far
        kept = self._keep(out, ran)
        if kept is not None:
            self._vendor[(seed, kind)] = (tuple(kept), far)
        return out, far

    def forget(self, seed: int, kind: str) -> None:
        """Drop one trial: a candidate wrote to its inputs, which the next candidate must not see."""
        self._inputs.pop((seed, kind), None)
        self._refs.pop((seed, kind), None)
        self._vendor.pop((seed, kind), None)
        self._far.pop((seed, kind), None)

    def release(self) -> None:
        """Drop everything kept (the spec is done, or the device ran out of memory)."""
        self._inputs.clear()
        self._refs.clear()
        self._vendor.clear()
        self._far.clear()
        self._on_device = self._on_host = 0
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()


def _since(t0: float, device: str | torch.device) -> float:
    """Seconds since ``t0``, once ``device`` has done what was queued on it."""
    sync_device(device)
    return time.perf_counter() - t0
