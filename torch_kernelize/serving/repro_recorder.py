"""Record misses as reproducers without stalling the model: deduplicated, capped, in the background.

A server sees a new shape on almost every request, and each new shape can miss the cache. The
calling thread only decides (under a lock, from the spec alone) whether a miss is recorded and,
if so, takes copies of the node's inputs during its first call (on their device, in the graph's
generated code: compiling/lower.py). Everything else a reproducer costs (the copies to the host,
the FX repro script, the content-addressed input store, the float64 reference, the files) runs
on one background thread fed by a bounded queue, each write once the model has been quiet for
``QUIET_S`` (or after ``MAX_DEFER_S``): its Python holds the interpreter lock, which a busy
model's calls would otherwise wait for.

A miss is recorded once per process per *record key* (its spec key; in a dynamic graph its node's
with the shape bucket of each size symbol: one shape of each bucket is recorded), not at all
where the folder already exists, and only while the process is under ``repro_max`` recorded
misses and ``repro_max_bytes`` of captured inputs. Every miss that is not recorded is counted
with its reason in the report (``repro_counts``). At interpreter exit the queue is flushed,
waiting at most ``EXIT_WAIT_S``; what is still queued then is dropped (and said so).
"""
from __future__ import annotations

import atexit
import collections
import logging
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

from torch_kernelize.core.spec import KernelSpec, dtype_from_name
from torch_kernelize.serving.runtime import calls

log = logging.getLogger("torch_kernelize.repro")

EXIT_WAIT_S = 30.0   # the most an exiting interpreter waits for the reproducers still queued
# A write (its graph's code, hashes, files: much of it Python, under the interpreter lock) starts
# once the model has started no call for QUIET_S, or after MAX_DEFER_S: written beside a busy
# model, Mixtral's reproducers doubled calls of a served trace (12 ms against 6) for seconds.
QUIET_S = 0.05
MAX_DEFER_S = 5.0
# Reproducers waiting to be written; beyond it a miss is not recorded. What they hold is bounded
# by repro_max_bytes (their captured inputs); this bounds a process that raises repro_max.
QUEUE_SIZE = 1024

NEW, DUPLICATE, COUNT_CAP, BYTES_CAP, QUEUE_FULL = "new", "duplicate", "count_cap", "bytes_cap", "queue_full"
SAME_BUCKET = "same_bucket"  # another shape of the miss's shape bucket was recorded (bucket_lookup.py)


class ReproCounts:
    """How this process's misses became reproducers: written, failed, or suppressed and why
    (the repro writer counts, the report shows)."""

    SUPPRESSED = ("duplicate", "same_bucket", "count_cap", "bytes_cap", "queue_full")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def add(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def clear(self) -> None:
        """Count afresh (a test is a process of its own)."""
        with self._lock:
            self._counts.clear()

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            c = dict(self._counts)
        suppressed = {why: c.get(why, 0) for why in self.SUPPRESSED}
        # claimed: misses taken for recording when their call ran (less those given back), written or not yet
        return {"written": c.get("written", 0), "failed": c.get("failed", 0),
                "claimed": c.get("claimed", 0) - c.get("released", 0),
                "suppressed": sum(suppressed.values()), "suppressed_by_reason": suppressed}


repro_counts = ReproCounts()


def captured_bytes(spec: KernelSpec) -> int:
    """What the CPU copies of ``spec``'s inputs take (known before they are taken)."""
    return sum(math.prod(m.shape) * dtype_from_name(m.dtype).itemsize for m in spec.inputs)


class MissBudget:
    """The process's record of which misses were taken and how much they hold (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: dict[tuple[str, str], str] = {}   # (repro root, record key) -> the spec key taken
        self.count = 0
        self.bytes = 0
        # what became of the taken misses, for the cap's warning: settled (written or not), written
        self.settled = self.written = self.written_bytes = 0
        self.cap: tuple[int, int] | None = None  # (repro_max, repro_max_bytes) once a miss met a cap
        self.said_capped = False  # whether the log has said that the process reached a cap

    def verdict(self, root: Path, key: str, folder: Path, nbytes: int, max_count: int, max_bytes: int,
                take: bool, spec_key: str | None = None) -> str:
        """NEW (taken now when ``take``), DUPLICATE, SAME_BUCKET (the record key, a bucket's, was
        taken by another spec), COUNT_CAP or BYTES_CAP. The caps are checked before the disk: a
        process past its cap looks nothing up there."""
        taken = (str(root), key)
        spec_key = spec_key or key
        with self._lock:
            if taken in self._taken:
                return DUPLICATE if self._taken[taken] == spec_key else SAME_BUCKET
            if self.count >= max_count:
                return COUNT_CAP
            if self.bytes + nbytes > max_bytes:
                return BYTES_CAP
            if _exists(folder / "spec.json"):  # recorded by an earlier process
                if take:
                    self._taken[taken] = spec_key
                return DUPLICATE
            if take:
                self._taken[taken] = spec_key
                self.count += 1
                self.bytes += nbytes
            return NEW

    def give_back(self, root: Path, key: str, nbytes: int) -> None:
        """A taken miss that will not be written after all (the queue was full)."""
        with self._lock:
            if (str(root), key) in self._taken:
                del self._taken[(str(root), key)]
                self.count -= 1
                self.bytes -= nbytes

    def note_cap(self, max_count: int, max_bytes: int) -> None:
        """A miss met a cap. The warning waits until the misses taken so far are written (say_capped),
        so that it counts what was written; at the latest it is said at exit."""
        with self._lock:
            if self.cap is not None:
                return
            self.cap = (max_count, max_bytes)
        _at_exit(self._say_at_exit)

    def _say_at_exit(self) -> None:
        writer.close()  # (its own exit hook may come after this one; a second close returns at once)
        self.say_capped(final=True)

    def settle(self, written_bytes: int | None) -> None:
        """A taken miss's write ended: written (its inputs' bytes), or not (None)."""
        with self._lock:
            self.settled += 1
            if written_bytes is not None:
                self.written += 1
                self.written_bytes += written_bytes

    def say_capped(self, final: bool = False) -> None:
        """Log once that a cap was met, with what was written: once every taken miss is settled
        (``final``: now, as at a flush or the exit)."""
        with self._lock:
            if self.cap is None or self.said_capped or (not final and self.settled < self.count):
                return
            self.said_capped = True
            written, nbytes = self.written, self.written_bytes
        log.warning("kernelize: this process wrote %d miss reproducer(s) (%d bytes of inputs) and met its cap "
                    "(repro_max=%d, repro_max_bytes=%d): other misses are only counted, in the report's 'repros'",
                    written, nbytes, *self.cap)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # an unreadable repro dir: the write will fail, and say so once
        return False


class BackgroundWriter:
    """One daemon thread that runs queued writes in order; a failing write is logged, never raised.

    At exit it gets ``EXIT_WAIT_S`` to finish; then the writes still queued are dropped and the one
    running is waited for. The wait is registered with ``threading``'s exit hooks, which run before
    ``concurrent.futures`` refuses new work (the repro string's generation uses it) and before the
    interpreter is finalized: a daemon thread still inside torch at finalization aborts the process.
    """

    def __init__(self, size: int = QUEUE_SIZE) -> None:
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue(size)
        self._idle = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._warned = False
        self._stopping = False
        self._hooked = False
        self._hurry = 0  # callers waiting in flush

    def submit(self, write: Callable[[], None]) -> bool:
        """Queue ``write``; False (nothing queued) when the queue is full."""
        with self._idle:
            try:
                self._queue.put_nowait(write)
            except queue.Full:
                return False
            self._pending += 1
            if not self._hooked:
                self._hooked = _at_exit(self.close)
            if self._thread is None or not self._thread.is_alive():  # (none yet, or a forked child)
                self._thread = threading.Thread(target=self._run, name="kernelize-repro-writer", daemon=True)
                self._thread.start()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (none waits for the model to be quiet now);
        False if ``timeout`` seconds passed first."""
        with self._idle:
            self._hurry += 1
        try:
            with self._idle:
                return self._idle.wait_for(lambda: self._pending == 0, timeout)
        finally:
            with self._idle:
                self._hurry -= 1

    def _wait_for_quiet(self) -> None:
        """Before a write: until the model has been quiet for QUIET_S, at most MAX_DEFER_S, or
        someone waits for the writes (flush, exit)."""
        deadline = time.monotonic() + MAX_DEFER_S
        while not self._hurry and not self._stopping and time.monotonic() < deadline:
            quiet = calls.quiet_s()
            if quiet >= QUIET_S:
                return
            time.sleep(QUIET_S - quiet)

    @property
    def pending(self) -> int:
        return self._pending

    def close(self, timeout: float | None = None) -> None:
        """The exit: wait ``timeout`` s (``EXIT_WAIT_S``) for the queue; then drop what is queued and
        finish the running write."""
        timeout = EXIT_WAIT_S if timeout is None else timeout
        if not self._pending or self.flush(timeout):
            return
        with self._idle:
            self._stopping = True
            dropped = self._pending - 1  # the running write finishes
        log.warning("kernelize: %d reproducer(s) not written: the interpreter exited after waiting %.0f s "
                    "for them (nothing half-written is left in place)", dropped, timeout)
        self.flush()

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            try:
                self._wait_for_quiet()
                if self._stopping:
                    repro_counts.add("failed")
                    continue
                write()
            except Exception as e:
                repro_counts.add("failed")
                self._warn(e)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _warn(self, e: Exception) -> None:
        if self._warned:
            log.debug("could not write a reproducer", exc_info=e)
            return
        self._warned = True
        log.warning("kernelize: could not write a reproducer (%s: %s); the model runs on without it, and "
                    "later failures are logged at DEBUG only: point the repro_dir option (or "
                    "$KERNELIZE_REPRO_DIR) at a writable folder, or set it to 'off'", type(e).__name__, e)
        log.debug("the failed write", exc_info=e)


budget = MissBudget()
writer = BackgroundWriter()


def flush(timeout: float | None = None) -> bool:
    """Wait until the reproducers of this process's misses are on disk (all of them: True)."""
    done = writer.flush(timeout)
    budget.say_capped(final=done)
    return done


def _at_exit(hook: Callable[[], None]) -> bool:
    """Run ``hook`` when the main thread is done, before concurrent.futures shuts down (threading's
    exit hooks run last-registered first, and it registers when imported); atexit where the private
    hook is missing. False once the interpreter is already exiting."""
    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(hook)
    except RuntimeError:  # "can't register atexit after shutdown"
        return False
    return True
