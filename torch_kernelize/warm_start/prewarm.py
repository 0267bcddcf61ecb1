"""Overlap the vendor libraries' first use with Dynamo's tracing (option ``prewarm``).

A warm process's first call is Dynamo's tracing (Python, ~0.5 s for the benchmark models), the
backend (an executable-cache hit), then the graph's first run, which pays the first use of each
vendor library and op: cuBLAS's set-up and the lazy loading (CUDA_MODULE_LOADING=LAZY) of each
ATen CUDA op's module. On the H200 the first fp16 mm takes ~90 ms, the first cuDNN attention
~67 ms, the first softmax, argsort or floor division 11-32 ms. None of it needs the graph, only
the ops and their argument layouts, which an executable-cache entry records in its header.

So when Dynamo starts compiling a process's first frame, a background thread replays the vendor
calls of the executables the same program (same command line, same working directory) ran last
time: once per distinct op and argument layout, on zero-filled tensors, and only the ops whose
rule in ``serving/vendor_replay.WARMABLE`` says zeros are safe (no random numbers drawn, no index
that could fall outside a tensor: a device-side assert would end the process's CUDA context).
The set-up and the module loading run in C++ without the GIL, beside the tracing. Nothing here
changes what runs: a replay that fails is logged and skipped.

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
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.fx as fx

from torch_kernelize.core.targets import op_packet_name
from torch_kernelize.serving import vendor_replay
from torch_kernelize.serving.vendor_replay import WARMABLE, Call, NotRecordable, encode, ready, replay, tensor_bytes

if TYPE_CHECKING:
    from torch_kernelize.serving.runtime import Specialization

log = logging.getLogger("torch_kernelize.warm_start.prewarm")

FORMAT = 1
MAX_EXECUTABLES = 8           # a program's index keeps its most recently used executables

stats: collections.Counter = collections.Counter()  # runs / vendor / skipped / failed / ms, per process


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
            call = Call(op, encode(list(node.args)), {k: encode(v) for k, v in node.kwargs.items()}, 0)
            out = node.meta.get("val")
            outs = [encode(o)["tensor"] for o in (out if isinstance(out, (list, tuple)) else [out])
                    if isinstance(o, torch.Tensor)]
        except NotRecordable:
            continue
        call.bytes = sum(tensor_bytes(t) for t in call.tensors() + outs)
        record = call.to_record()
        ident = _identity(record)
        if ident not in seen and call.bytes <= vendor_replay.MAX_CALL_BYTES and rule(call):
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
    if not any(ready(d) for d in vendor_replay.WARM_DEVICES):
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


def _replay(record: Mapping[str, Any]) -> None:
    stats[replay(record)] += 1
