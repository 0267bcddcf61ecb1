"""Overlap the vendor libraries' first use with Dynamo's tracing (option ``prewarm``).

A warm process's first call is Dynamo's tracing (Python, ~0.5 s for the benchmark models), the
backend (an executable-cache hit), then the graph's first run, which pays the first use of each
vendor library and op: cuBLAS's set-up and the lazy loading (CUDA_MODULE_LOADING=LAZY) of each
ATen CUDA op's module. On the H200 the first fp16 mm takes ~90 ms, the first cuDNN attention
~67 ms, the first softmax, argsort or floor division 11-32 ms. None of it needs the graph, only
the ops and their argument layouts, which an executable-cache entry records in its header.

So when Dynamo starts compiling a process's first frame, a background thread replays the vendor
calls of the executables the same program (same command line, same working directory) ran last
time: once per distinct op and argument layout, on zero-filled tensors, and only the ops in
``WARMABLE`` whose rule says zeros are safe (no random numbers drawn, no index that could fall
outside a tensor: a device-side assert would end the process's CUDA context). The set-up and the
module loading run in C++ without the GIL, beside the tracing. Nothing here changes what runs:
a replay that fails is logged and skipped.

Not warmed: the cached kernels' binaries. Also loading them in the thread made the first call
slower on the H200 (MoE +0.06 s, Llama +0.2 s against the vendor calls alone): most of that
loading is Python under the GIL, which the tracing needs too.

Limits:

- The thread starts before Dynamo hands the backend its options, so it reads the option from the
  environment (``KERNELIZE_PREWARM``), and each program's index of executables lives under the
  environment's (or the default) cache dir, ``<cache_dir>/prewarm/<program>.json``, whatever cache
  dir ``options`` name. ``options={"prewarm": False}`` drops the program's executables from the
  index: it takes effect from the next process.
- CUDA executables only, and only in a process that has initialized CUDA already: the warm-up
  never creates a context. (On CPU there is no module loading to hide, and the cores are Dynamo's.)
- cuDNN keeps its attention graphs per thread: the main thread's first attention call still
  builds its own graph (~50-75 ms on the H200 once the thread has loaded cuDNN, ~70-93 ms cold).
- The thread's own cuBLAS and cuDNN handles keep their workspaces, and its attention graphs stay
  cached, for the life of the process.
"""
from __future__ import annotations

import atexit
import collections
import hashlib
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch
import torch.fx as fx

from torch_kernelize.core.targets import op_name, op_packet_name, resolve_op
from torch_kernelize.core.spec import dtype_from_name, dtype_name

if TYPE_CHECKING:
    from torch_kernelize.serving.runtime import Specialization

log = logging.getLogger("torch_kernelize.warm_start.prewarm")

FORMAT = 1
MAX_EXECUTABLES = 8           # a program's index keeps its most recently used executables
MAX_CALL_BYTES = 1 << 30      # a replayed call's tensors, inputs and outputs together
WARM_DEVICES = frozenset({"cuda"})

stats: collections.Counter = collections.Counter()  # runs / vendor / skipped / failed / ms, per process


# --- which vendor calls may be replayed on zeros -------------------------------------------------

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
        return [t["tensor"] for t in _leaves([self.args, list(self.kwargs.values())])
                if isinstance(t, dict) and "tensor" in t]

    def run(self) -> Any:
        """The op on zero-filled tensors of the recorded layouts."""
        return self.op(*_decode(self.args), **{k: _decode(v) for k, v in self.kwargs.items()})


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


def _leaves(x: Any) -> Iterable[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


def _storage_numel(size: list[int], stride: list[int], offset: int) -> int:
    if math.prod(size) == 0:
        return offset
    return offset + 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _tensor_bytes(t: list) -> int:
    size, stride, offset, dtype, _ = t
    return _storage_numel(size, stride, offset) * dtype_from_name(dtype).itemsize


class _NotRecordable(Exception):
    pass


def _encode(a: Any) -> Any:
    """An argument of a bound node as JSON, tensors by their fake value's layout."""
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
        if not isinstance(a, torch.Tensor):
            raise _NotRecordable("an argument without a tensor value")
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided or any(not isinstance(s, int) for s in (*a.shape, *a.stride())):
            raise _NotRecordable("a tensor that is not strided with static sizes")
        return {"tensor": [list(a.shape), list(a.stride()), int(a.storage_offset()),
                           dtype_name(a.dtype), str(a.device)]}
    if isinstance(a, (list, tuple)):
        return [_encode(x) for x in a]
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    raise _NotRecordable(f"an argument of type {type(a).__name__}")


def _decode(a: Any) -> Any:
    """Zero-filled tensors with the recorded layouts; other values as recorded."""
    if isinstance(a, list):
        return [_decode(x) for x in a]
    if isinstance(a, dict) and "tensor" in a:
        size, stride, offset, dtype, device = a["tensor"]
        base = torch.zeros(_storage_numel(size, stride, offset), dtype=dtype_from_name(dtype), device=device)
        return base.as_strided(size, stride, offset)
    if isinstance(a, dict) and "dtype" in a:
        return dtype_from_name(a["dtype"])
    if isinstance(a, dict):
        raise ValueError(f"not a recorded argument: {a!r}")
    return a


def vendor_calls(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """The distinct warmable vendor calls of a bound graph, in the order the graph makes them."""
    calls, seen = [], set()
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        rule = WARMABLE.get(op_packet_name(op))
        if rule is None:
            continue
        try:
            call = Call(op, _encode(list(node.args)), {k: _encode(v) for k, v in node.kwargs.items()}, 0)
            out = node.meta.get("val")
            outs = [_encode(o)["tensor"] for o in (out if isinstance(out, (list, tuple)) else [out])
                    if isinstance(o, torch.Tensor)]
        except _NotRecordable:
            continue
        call.bytes = sum(_tensor_bytes(t) for t in call.tensors() + outs)
        record = call.to_record()
        ident = _identity(record)
        if ident not in seen and call.bytes <= MAX_CALL_BYTES and rule(call):
            seen.add(ident)
            calls.append(record)
    return calls


def _identity(record: Mapping[str, Any]) -> str:
    return json.dumps([record.get("op"), record.get("args"), record.get("kwargs")], sort_keys=True)


def section(first: "Specialization") -> dict[str, Any] | None:
    """What a stored executable's header keeps for the warm-up: its vendor calls (None if they
    cannot be listed: the executable is stored without)."""
    try:
        return {"format": FORMAT, "vendor": vendor_calls(first.gm)}
    except Exception as e:
        log.warning("prewarm: the executable's vendor calls could not be listed: %s: %s", type(e).__name__, e)
        return None


# --- the program's index of executables ---------------------------------------------------------

def program_key() -> str:
    """This program: its working directory and full command line (``python -c`` code included)."""
    material = json.dumps([os.getcwd(), list(getattr(sys, "orig_argv", sys.argv))])
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def index_path(cache_dir: Path | None = None) -> Path:
    if cache_dir is None:
        from torch_kernelize.core.options import Options
        cache_dir = Options.resolve().cache_dir
    return Path(cache_dir) / "prewarm" / f"{program_key()}.json"


def read_index(path: Path) -> list[dict[str, Any]]:
    """The program's executables, most recently added first, each ``{"path": its entry, "vendor":
    its vendor calls}``; [] when there is no readable index."""
    from torch_kernelize.kernel_cache.integrity import read_regular
    try:
        data = json.loads(read_regular(path))  # (a FIFO there would hang the compile that notes an executable)
        if data.get("format") == FORMAT and isinstance(data.get("executables"), list):
            return [e for e in data["executables"] if isinstance(e, dict) and isinstance(e.get("path"), str)]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError) as e:
        log.debug("prewarm index %s ignored: %s", path, e)
    return []


_noted: set[str] = set()


def note(executable: Path, section: Mapping[str, Any] | None, wanted: bool = True) -> None:
    """Note that this program ran the executable stored at ``executable``, whose header holds
    ``section``: listed in the program's index with its vendor calls when ``wanted`` (the option
    is on), dropped from it when not (so ``options={"prewarm": False}`` takes effect from the next
    process). The index is rewritten only when that changes it: a program that runs the same
    executables writes nothing."""
    executable = str(executable)
    wanted = wanted and bool(section) and section.get("format") == FORMAT
    if executable in _noted:
        return
    _noted.add(executable)
    try:
        path = index_path()
        if any(e["path"] == executable for e in read_index(path)) == wanted:
            return
        from filelock import FileLock

        from torch_kernelize.kernel_cache.integrity import write_file_atomic
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=5):
            known = [e for e in read_index(path) if e["path"] != executable and os.path.exists(e["path"])]
            mine = [{"path": executable, "vendor": section["vendor"]}] if wanted else []
            data = {"format": FORMAT, "program": list(getattr(sys, "orig_argv", sys.argv))[:8],
                    "cwd": os.getcwd(), "executables": mine + known[:MAX_EXECUTABLES - len(mine)]}
            write_file_atomic(path, json.dumps(data).encode())
    except Exception as e:  # a hint: never the compile's failure
        log.debug("prewarm: could not update the index for %s: %s: %s", executable, type(e).__name__, e)


def gc(cache_dir: Path, max_age_s: float) -> int:
    """Remove the program indexes under ``cache_dir`` none of whose executables exist any more
    (with their lock files), and the temp files of writers killed mid-write older than
    ``max_age_s``; returns how many indexes and temp files."""
    count, now = 0, time.time()
    folder = Path(cache_dir) / "prewarm"
    for path in sorted(folder.glob("*.json")) + sorted(folder.glob(".*.tmp-*")):
        try:
            if path.name.startswith("."):
                if now - path.lstat().st_mtime < max_age_s:
                    continue
            elif any(os.path.exists(e["path"]) for e in read_index(path)):
                continue
            path.unlink()
            Path(f"{path}.lock").unlink(missing_ok=True)
            count += 1
        except OSError as e:
            log.warning("prewarm: gc could not remove %s: %s", path, e)
    return count


# --- the warm-up ----------------------------------------------------------------------------------

_triggered = False
_thread: threading.Thread | None = None


def install() -> None:
    """Start the warm-up when Dynamo starts compiling a process's first frame (idempotent). The
    backend module calls it when torch.compile looks the backend up; ``torch._dynamo.reset()``
    removes it again."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without compile callbacks: no warm-up
        return
    if _on_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_compile_start)


def _on_compile_start(*_: Any) -> None:
    global _triggered
    if _triggered:
        return
    _triggered = True
    try:  # Dynamo's compile must never fail here
        start()
    except Exception as e:
        log.debug("prewarm not started: %s: %s", type(e).__name__, e)


def start() -> threading.Thread | None:
    """Replay, in a background thread, the vendor calls of this program's recorded executables;
    the thread, or None when there is nothing to do (option off, no index, CUDA not initialized)."""
    global _thread
    from torch_kernelize.core.options import Options
    options = Options.resolve()
    if not options.prewarm:
        return None
    if not any(_ready(d) for d in WARM_DEVICES):
        return None
    executables = read_index(index_path(options.cache_dir))
    if not executables:
        return None
    _thread = threading.Thread(target=_warm, args=(executables,), name="kernelize-prewarm", daemon=True)
    _thread.start()
    atexit.register(wait)
    return _thread


def wait(timeout: float | None = 30.0) -> None:
    """Wait for the warm-up to end (tests; and at exit, so no CUDA call runs during teardown)."""
    if _thread is not None:
        _thread.join(timeout)


def _warm(executables: list[dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    stats["runs"] += 1
    seen: set[str] = set()
    malformed = 0
    with torch.no_grad():
        for e in executables:
            if not os.path.exists(e["path"]):  # the cache was cleared since
                continue
            records = e.get("vendor") or []
            for record in records if isinstance(records, list) else [records]:
                if not isinstance(record, dict):  # the index is a file anyone with the cache can edit
                    malformed += 1
                    continue
                ident = _identity(record)
                if ident not in seen:
                    seen.add(ident)
                    _replay(record)
    if malformed:
        stats["skipped"] += malformed
        log.warning("prewarm: %d vendor call record(s) of the index are not JSON objects; skipped", malformed)
    stats["ms"] += round(1e3 * (time.perf_counter() - t0))
    log.info("prewarm: %d vendor calls of %d executables replayed in %d ms (%d skipped, %d failed)",
             stats["vendor"], len(executables), stats["ms"], stats["skipped"], stats["failed"])


def _ready(device_type: str) -> bool:
    """Whether this process may run work on ``device_type`` now (CUDA: only once it made a context)."""
    return torch.cuda.is_initialized() if device_type == "cuda" else True


def _devices_ok(devices: Iterable[str]) -> bool:
    for d in devices:
        dev = torch.device(d)
        if dev.type not in WARM_DEVICES or not _ready(dev.type):
            return False
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            return False
    return True


def _replay(record: Mapping[str, Any]) -> None:
    try:
        call = Call.from_record(record)
        rule = WARMABLE.get(op_packet_name(call.op))
        tensors = call.tensors()
        nbytes = max(call.bytes, sum(_tensor_bytes(t) for t in tensors))  # (the header is not hashed)
        if (rule is None or not tensors or not _devices_ok(t[4] for t in tensors)
                or nbytes > MAX_CALL_BYTES or not rule(call)):
            stats["skipped"] += 1
            return
        call.run()
        stats["vendor"] += 1
    except Exception as e:
        stats["failed"] += 1
        log.debug("prewarm: %s failed: %s: %s", record.get("op"), type(e).__name__, e)
