"""Vendor calls replayed on zeros: which may be, and how.

A vendor library's first call at an op and layout pays for what the library sets up there: its
handle and workspace, the choice of a kernel for the shape (cuBLAS's heuristics, cuDNN's plans)
and the lazy loading of that kernel's module (CUDA_MODULE_LOADING=LAZY). Running the same call
once ahead, on zero-filled tensors of the same layouts, moves that cost out of a served call
without changing what runs: prewarm.py replays the calls a program made last time while Dynamo
traces, bucket_warm.py a shape bucket's calls at every size it serves.

A call is a JSON record (``Call.to_record``): the op, its arguments with each tensor described by
``{"tensor": [size, stride, storage_offset, dtype, device]}``, and its tensors' bytes. Only ops in
``WARMABLE`` are replayed, and only where their rule says zeros are safe: no random numbers drawn
(a replay would shift the program's), no index that could fall outside a tensor (a device-side
assert would end the process's CUDA context). A record may come from a file anyone with the
cache can edit, so a replay checks it again (its op, its devices, its bytes) and never raises.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torch_kernelize.core.spec import dtype_from_name, dtype_name
from torch_kernelize.core.targets import op_name, op_packet_name, resolve_op

log = logging.getLogger("torch_kernelize.serving.vendor_replay")

MAX_CALL_BYTES = 1 << 30      # a replayed call's tensors, inputs and outputs together
WARM_DEVICES = frozenset({"cuda"})  # where a first call loads modules; tests widen it to CPU
TRACE_MODES = (torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FUNCTIONAL)  # a replay is never traced


class Call:
    """One recorded vendor call: the op, its arguments with tensors described by
    ``{"tensor": [size, stride, storage_offset, dtype, device]}``, and its tensors' bytes (inputs
    and outputs)."""

    def __init__(self, op: torch._ops.OpOverload, args: list, kwargs: dict, nbytes: int):
        self.op, self.args, self.kwargs, self.bytes = op, args, kwargs, nbytes

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "Call":
        return cls(resolve_op(record["op"]), list(record["args"]), dict(record["kwargs"]), int(record["bytes"]))

    def to_record(self) -> dict[str, Any]:
        return {"op": op_name(self.op), "args": self.args, "kwargs": self.kwargs, "bytes": self.bytes}

    def arg(self, name: str, default: Any = None) -> Any:
        """An argument by its schema name."""
        if name in self.kwargs:
            return self.kwargs[name]
        for i, a in enumerate(self.op._schema.arguments):
            if a.name == name:
                return self.args[i] if i < len(self.args) else default
        return default

    def tensors(self) -> list[list]:
        return [t["tensor"] for t in leaves([self.args, list(self.kwargs.values())])
                if isinstance(t, dict) and "tensor" in t]

    def run(self) -> Any:
        """The op on zero-filled tensors of the recorded layouts (under whatever dispatch mode is
        current: ``replay`` leaves a trace's fake mode first)."""
        return self.op(*decode(self.args), **{k: decode(v) for k, v in self.kwargs.items()})


def _always(call: Call) -> bool:
    return True


def _no_dropout(call: Call) -> bool:
    """Dropout draws from the generator: a replay would shift the program's random numbers."""
    return not call.arg("dropout_p", 0.0)


def _nonempty(call: Call) -> bool:
    """Zero indices address element 0 of each indexed dimension, which exists when no tensor is empty."""
    return all(math.prod(t[0]) > 0 for t in call.tensors())


# op packet -> when a call on zero-filled tensors is safe. The ops whose first use costs most
# (library set-up, large modules); any op left out simply runs cold.
WARMABLE: dict[str, Callable[[Call], bool]] = {
    "aten.mm": _always, "aten.addmm": _always, "aten.bmm": _always, "aten.baddbmm": _always,
    "aten.convolution": _always,
    "aten._scaled_dot_product_cudnn_attention": _no_dropout,
    "aten._scaled_dot_product_flash_attention": _no_dropout,
    "aten._scaled_dot_product_efficient_attention": _no_dropout,
    "aten._softmax": _always, "aten._log_softmax": _always,
    "aten.sort": _always, "aten.topk": _always, "aten.cumsum": _always, "aten.histc": _always,
    "aten.div": _always,  # integer division by zero does not trap on CUDA (and raises on CPU)
    "aten.index": _nonempty, "aten.index_select": _nonempty, "aten.gather": _nonempty,
    "aten.embedding": _nonempty, "aten.index_add": _nonempty, "aten.scatter_add": _nonempty,
}


def leaves(x: Any) -> Iterable[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from leaves(y)
    else:
        yield x


def storage_numel(size: list[int], stride: list[int], offset: int) -> int:
    if math.prod(size) == 0:
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(size, stride))


def tensor_bytes(t: list) -> int:
    size, stride, offset, dtype, _ = t
    return storage_numel(size, stride, offset) * dtype_from_name(dtype).itemsize


class NotRecordable(Exception):
    pass


def encode(a: Any) -> Any:
    """An argument of a bound node as JSON, tensors by their fake value's layout."""
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
        if not isinstance(a, torch.Tensor):
            raise NotRecordable("an argument without a tensor value")
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided or any(not isinstance(s, int) for s in (*a.shape, *a.stride())):
            raise NotRecordable("a tensor that is not strided with static sizes")
        return {"tensor": [list(a.shape), list(a.stride()), int(a.storage_offset()),
                           dtype_name(a.dtype), str(a.device)]}
    if isinstance(a, (list, tuple)):
        return [encode(x) for x in a]
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    raise NotRecordable(f"an argument of type {type(a).__name__}")


def decode(a: Any) -> Any:
    """Zero-filled tensors with the recorded layouts; other values as recorded."""
    if isinstance(a, list):
        return [decode(x) for x in a]
    if isinstance(a, dict) and "tensor" in a:
        size, stride, offset, dtype, device = a["tensor"]
        base = torch.zeros(storage_numel(size, stride, offset), dtype=dtype_from_name(dtype), device=device)
        return base.as_strided(size, stride, offset)
    if isinstance(a, dict) and "dtype" in a:
        return dtype_from_name(a["dtype"])
    if isinstance(a, dict):
        raise ValueError(f"not a recorded argument: {a!r}")
    return a


def ready(device_type: str) -> bool:
    """Whether this process may run work on ``device_type`` now (CUDA: only once it made a context)."""
    return torch.cuda.is_initialized() if device_type == "cuda" else True


def devices_ok(devices: Iterable[str]) -> bool:
    for d in devices:
        dev = torch.device(d)
        if dev.type not in WARM_DEVICES or not ready(dev.type):
            return False
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            return False
    return True


def replay(record: Mapping[str, Any]) -> str:
    """Run ``record``'s call on zeros: "vendor" if it ran, "skipped" where it may not (an op
    WARMABLE leaves out or its rule refuses, a device not ready, more than MAX_CALL_BYTES),
    "failed" where it raised (logged at debug level; never raised)."""
    try:
        call = Call.from_record(record)
        rule = WARMABLE.get(op_packet_name(call.op))
        tensors = call.tensors()
        nbytes = max(call.bytes, sum(tensor_bytes(t) for t in tensors))  # (a record's bytes are not trusted)
        if (rule is None or not tensors or not devices_ok(t[4] for t in tensors)
                or nbytes > MAX_CALL_BYTES or not rule(call)):
            return "skipped"
        # bucket_warm replays while Dynamo compiles, inside its FakeTensorMode: there the zeros
        # would be fake and no call would reach the library (the H100 traces of issue 41 warmed
        # 3360 fake GEMMs in 13 s, and every first call still paid cuBLAS's first use)
        with unset_fake_temporarily():
            if any(torch._C._get_dispatch_mode(k) is not None for k in TRACE_MODES):
                log.debug("replay of %s skipped: inside a trace (the call would be traced, not run)", record.get("op"))
                return "skipped"
            call.run()
        return "vendor"
    except Exception as e:
        log.debug("replay of %s failed: %s: %s", record.get("op"), type(e).__name__, e)
        return "failed"
