"""Warm a shape bucket's vendor calls at the sizes it serves, when it is bound (option ``bucket_warm_ms``).

A server with varying sequence lengths meets a new size of a filled bucket at the first call of
each new length. The bucket's program then runs as compiled, but its vendor steps (cuBLAS through
``aten.mm``, cuDNN through ``aten.convolution``) meet a shape the process has not run: the library
chooses a kernel for it (cuBLAS's heuristics) and, for a kernel not used yet in the process, loads
its module (CUDA_MODULE_LOADING=LAZY). On the H100 (benchmarks/results/2026-12-06-h100-gemm-first-
call.log, fp16 GEMMs of Llama's widths at M = 8 x length): 3-4 ms where the kernel was not loaded
yet, 0.2-0.3 ms where it was, 0.02-0.1 ms once that very shape had run before, on any thread.
Llama's first call at a new length spent 8.3 of its 11.3 ms there, where issue 41 allows 1 ms over
a repeat call.

So when lowering binds a bucket's program (once per graph and bucket in a process), each distinct
warmable step (vendor_replay.WARMABLE) of the program at each size of the bucket runs once on
zero-filled tensors of its layouts at that size, on the binding thread (cuDNN keeps its plans per
thread) and its current stream, which is then synchronized: the cost is the compile's, not a
served call's. Sizes go coarse to fine (the range's ends, its middle, its quarters, ...), so a warm
cut short by its time limit has still loaded the kernels the whole range uses; the sizes it did
not reach pay only their heuristics, once. Nothing here changes what runs or what it computes;
a replay that fails is counted and skipped.

Limits: buckets of one variable (a length; several would multiply the sizes); the devices
vendor_replay warms (CUDA, once its context exists); a step whose arguments' layouts the bucket
cannot give at a size (an input of no known layout) is not warmed.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from torch_kernelize.core.buckets import contiguous_strides
from torch_kernelize.core.encoding import decode_arg
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.targets import op_packet_name, resolve_op
from torch_kernelize.serving import vendor_replay
from torch_kernelize.serving.vendor_replay import WARMABLE, Call, NotRecordable, encode, tensor_bytes

log = logging.getLogger("torch_kernelize.serving.bucket_warm")

# per process: buckets warmed, sizes, calls run / skipped / failed, ms
stats: collections.Counter = collections.Counter()
_warmed: set[tuple] = set()  # (what identifies a bucket's program, its range, device): each once per process


def coarse_to_fine(lo: int, hi: int) -> Iterator[int]:
    """Every integer of [lo, hi] once: the ends, then the points of a grid that halves its step."""
    seen: set[int] = set()
    step = 1 << max(hi - lo, 1).bit_length()
    while step:
        for v in [*range(lo, hi + 1, step), hi]:
            if v not in seen:
                seen.add(v)
                yield v
        step //= 2


def step_records(program: KernelProgram, inputs: Sequence[Any] | None, outputs: Sequence[Any] | None,
                 device: str) -> list[dict[str, Any]]:
    """The distinct warmable vendor steps of ``program`` (a bucket's program at one size) as
    replay records (vendor_replay.Call), each tensor by the layout the step gives it at that size:
    a view's own, else its buffer's (``inputs``/``outputs``: TensorMetas of the program's inputs
    and outputs there, None where unknown; temporaries are the program's)."""
    metas = {"in": inputs, "out": outputs}
    records, seen = [], set()
    for step in program.steps:
        op = resolve_op(step.op)
        rule = WARMABLE.get(op_packet_name(op))
        if rule is None:
            continue
        try:
            call = Call(op, [_layout(a, program, metas, device) for a in step.args],
                        {k: _layout(v, program, metas, device) for k, v in step.kwargs.items()}, 0)
        except (NotRecordable, ValueError, TypeError, IndexError, KeyError) as e:
            log.debug("bucket warm: step %s not warmed: %s", step.op, e)
            continue
        call.bytes = sum(tensor_bytes(t) for t in call.tensors())
        record = call.to_record()
        ident = repr((record["op"], record["args"], sorted(record["kwargs"].items())))
        if ident not in seen and rule(call):
            seen.add(ident)
            records.append(record)
    return records


def _layout(x: Any, program: KernelProgram, metas: dict[str, Sequence[Any] | None], device: str) -> Any:
    """A step argument as a replay record's: a buffer or an empty tensor by its layout, a literal
    as the step's runner decodes it (program_steps.StepCall)."""
    if isinstance(x, dict) and "buf" in x:
        kind, i = x["buf"]
        if kind == "tmp":
            buf = program.temps[i]
            shape, stride, dtype = buf.shape, contiguous_strides(buf.shape), buf.dtype
        else:
            meta = metas[kind][i] if metas[kind] is not None and i < len(metas[kind]) else None
            if meta is None:
                raise NotRecordable(f"no layout of {kind} {i} at this size")
            shape, stride, dtype = meta.shape, meta.stride, meta.dtype
        offset = 0
        if "view" in x:
            shape, stride, offset = x["view"]
        return {"tensor": [list(shape), list(stride), int(offset), dtype, device]}
    if isinstance(x, dict) and "empty" in x:
        size, stride, dtype = x["empty"]
        return {"tensor": [list(size), list(stride), 0, dtype, device]}
    if isinstance(x, list):
        return [_layout(v, program, metas, device) for v in x]
    return encode(decode_arg(x, (), device))


def warm_bucket(name: str, identity: tuple, lo: int, hi: int,
                at_size: Callable[[int], tuple[KernelProgram, Sequence[Any] | None, Sequence[Any] | None] | None],
                device: str, budget_ms: int, replay: Callable[[dict], str] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, int] | None:
    """Replay the warmable vendor steps of a bucket's program at every size of [lo, hi], coarse
    to fine, until ``budget_ms`` is spent; ``at_size(v)``: the program, its inputs' and outputs'
    metas at size v (None: that size cannot be made). Once per process per ``identity``, on a
    device vendor_replay warms; returns what it did (None where it did nothing)."""
    key = (identity, lo, hi, device)
    if budget_ms <= 0 or key in _warmed or not vendor_replay.devices_ok([device]) or _capturing(device):
        return None
    _warmed.add(key)
    replay = replay or vendor_replay.replay
    done = collections.Counter(dict.fromkeys(("sizes", "vendor", "skipped", "failed"), 0))
    t0 = clock()
    for v in coarse_to_fine(lo, hi):
        if (clock() - t0) * 1e3 >= budget_ms:
            break
        sized = at_size(v)
        if sized is None:
            continue
        records = step_records(*sized, device)
        log.debug("bucket %s: size %d: warming %s", name, v, records)  # (benchmarks/bucket_trace.py reads these)
        for record in records:
            done[replay(record)] += 1
        done["sizes"] += 1
    _synchronize(device)
    done["ms"] = round((clock() - t0) * 1e3)
    stats.update(done)
    stats["buckets"] += 1
    log.info("bucket %s: its vendor calls warmed at %d of %d sizes (%d calls, %d skipped, %d failed) in %d ms",
             name, done["sizes"], hi - lo + 1, done["vendor"], done["skipped"], done["failed"], done["ms"])
    return dict(done)


def _capturing(device: str) -> bool:
    """Whether a CUDA graph is being captured on the device's current stream: the warm's calls
    would be captured into it (a bucket bound at its first call inside a capture stays cold)."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _synchronize(device: str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
