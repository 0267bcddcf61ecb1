"""fill_cache over several processes launched by torchrun (one per GPU, on one or many nodes).

    torchrun --nproc-per-node 8 -m torch_kernelize.fill_cache --model m.py:make --cache-dir /shared/cache

Every rank collects the same work (a model's trace and reproducers are deterministic; spec keys
are content hashes); rank 0 deals it out, largest spec first, to the least loaded rank, and
publishes the deal; each rank searches its share into the one shared cache directory (per-spec
file locks and atomic writes make that safe); rank 0 collects every rank's summary rows and
writes one summary for the run.

Ranks talk only through torchrun's TCPStore (torch.distributed.rendezvous). Rank 0 waits for
each rank's result for as long as that rank is alive, however long its share takes: a daemon
thread in every rank bumps a heartbeat counter, and a rank whose counter stops moving for
``dead_after`` seconds (killed, or its node lost) is reported as not answering instead of
being waited for forever. A fixed collective timeout could not tell such a rank from one that
is still searching. A dead rank's evaluations are journaled and its winners stored as they
were found, so a rerun with --resume finishes the rest.

Nodes without a shared filesystem (--gather-to-rank0): every rank but 0 fills a cache of its own
(``<cache-dir>/rank-<N>``), then sends its entries to rank 0 as a signed archive through the
store; rank 0 imports it into ``--cache-dir`` on the trust model's terms: signed by a key it
trusts (its own, where the ranks share a home directory), else each entry re-validated there.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from torch_kernelize.fill_cache.collect import UsageError, Work

if TYPE_CHECKING:
    from torch_kernelize.core.targets import Target
    from torch_kernelize.kernel_cache.archive import ImportResult
    from torch_kernelize.kernel_cache.interfaces import Cache

log = logging.getLogger("torch_kernelize.fill_cache")

HEARTBEAT_S = 5.0     # how often each rank bumps its heartbeat
DEAD_AFTER_S = 120.0  # a rank whose heartbeat has not moved for this long is reported dead
POLL_S = 0.5
# How bad a rank's exit code is, least first: bad input (2) is the one to fix before anything
# else, then the machine (4: a full disk, a permission); interrupted (130), a device fault or a
# rank lost (3) are resumed with --resume.
SEVERITY = (0, 1, 3, 130, 4, 2)


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its variables)."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def worst(codes: Sequence[int]) -> int:
    return max(codes, key=lambda c: SEVERITY.index(c) if c in SEVERITY else len(SEVERITY), default=0)


def pin_device(local_rank: int) -> None:
    """Show this process only its own GPU (the ``local_rank``-th visible one), before CUDA starts:
    the measure worker and the build pool are spawned processes and inherit the environment, so
    all of them time and compile on this rank's GPU as ``cuda:0``."""
    import torch

    if torch.cuda.is_initialized():  # too late to narrow; it can only happen when embedded
        torch.cuda.set_device(local_rank)
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in visible.split(",") if d.strip()] if visible is not None else None
    if devices is not None and local_rank >= len(devices):
        raise UsageError(f"local rank {local_rank} has no GPU of its own: CUDA_VISIBLE_DEVICES={visible!r} "
                         f"names {len(devices)}; start at most that many processes per node (--nproc-per-node)")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[local_rank] if devices is not None else str(local_rank)


def deal(work: Sequence[Work], ranks: int, weight: Callable[[Work], int],
         to_rank0: Callable[[Work], bool] = lambda w: False) -> list[list[Work]]:
    """Each rank's share, every spec in exactly one. Specs go out largest ``weight`` first, each to
    the rank with the least weight so far (then the fewest specs), except those ``to_rank0`` (with
    --gather-to-rank0, the specs rank 0's cache serves already). A spec inside a fused region
    (``covered_by``) goes with its region, so that its own search is skipped there once the region
    has a kernel. Each share keeps the order of ``work`` (regions before their nodes)."""
    by_key = {w.spec.key: w for w in work}
    owner: dict[str, int] = {}
    load = [0] * ranks
    count = [0] * ranks

    def give(w: Work, rank: int) -> int:
        owner[w.spec.key] = rank
        load[rank] += weight(w)
        count[rank] += 1
        return rank

    free = [w for w in work if not any(k in by_key for k in w.covered_by)]
    for w in sorted(free, key=lambda w: (-weight(w), w.spec.key)):
        give(w, 0 if to_rank0(w) else min(range(ranks), key=lambda r: (load[r], count[r], r)))

    def owner_of(w: Work, seen: frozenset = frozenset()) -> int:
        if w.spec.key in owner:
            return owner[w.spec.key]
        region = next(by_key[k] for k in w.covered_by if k in by_key)
        if region.spec.key in seen:  # a cycle cannot come from a trace; deal it as a free spec
            return give(w, min(range(ranks), key=lambda r: (load[r], count[r], r)))
        return give(w, owner_of(region, seen | {w.spec.key}))

    for w in work:
        owner_of(w)
    return [[w for w in work if owner[w.spec.key] == r] for r in range(ranks)]


class RankGroup:
    """This process's place in a torchrun job, and the few messages fill_cache's ranks exchange."""

    def __init__(self, store: Any, rank: int, world: int, local_rank: int = 0, dead_after: float = DEAD_AFTER_S):
        self.store, self.rank, self.world, self.local_rank = store, rank, world, local_rank
        self.dead_after = dead_after
        self.search_id: str | None = None
        self._dealt = False
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="fill_cache-heartbeat", daemon=True)

    @classmethod
    def from_env(cls, timeout_s: float = 1800.0) -> "RankGroup":
        """Join the job torchrun started: its TCPStore (served by torchrun's agent, else by rank 0)."""
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)))
        # keys of this run only (torchrun's store outlives a restarted attempt)
        prefix = (f"torch_kernelize.fill_cache/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
        return cls(dist.PrefixStore(prefix, store), rank, world, local_rank)

    def start(self) -> None:
        """Start the heartbeat, and stop on torchrun's SIGTERM as on Ctrl-C: when one rank fails,
        torchrun terminates the others, and they keep the winners they found (fill_cache's
        KeyboardInterrupt path) instead of dying mid-write."""
        self._beat.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _interrupt)

    def close(self) -> None:
        self._stop.set()

    def _heartbeat(self) -> None:
        while True:
            try:
                self.store.add(f"alive/{self.rank}", 1)
            except Exception:  # the store is gone: rank 0 ended, nothing to tell it any more
                return
            if self._stop.wait(HEARTBEAT_S):
                return

    # --- the deal -------------------------------------------------------------------------------
    def share(self, work: list[Work], weight: Callable[[Work], int], search_id: str,
              to_rank0: Callable[[Work], bool] = lambda w: False) -> tuple[list[Work], str]:
        """This rank's share of ``work`` and the run's search id (rank 0's): rank 0 deals
        (``deal``) and publishes the deal (spec keys per rank); the others wait for it."""
        if self.rank == 0:
            shares = deal(work, self.world, weight, to_rank0)
            self._publish({"search_id": search_id, "shares": [[w.spec.key for w in s] for s in shares]})
            self.search_id = search_id
            return shares[0], search_id
        if not self._await("deal", 0):
            raise UsageError("rank 0 stopped answering before it dealt out the work; see its log")
        msg = json.loads(self.store.get("deal"))
        if "error" in msg:
            raise UsageError(f"rank 0 could not collect the work: {msg['error']}")
        mine = {w.spec.key: w for w in work}
        dealt = {k for s in msg["shares"] for k in s}
        if dealt != set(mine):
            raise UsageError(f"this rank collected other specs than rank 0 ({len(set(mine) - dealt)} not on rank 0, "
                             f"{len(dealt - set(mine))} only on rank 0): the ranks must see the same --model, "
                             "--repros and --candidate files and the same cache directory")
        self.search_id = msg["search_id"]
        return [mine[k] for k in msg["shares"][self.rank]], self.search_id

    def _publish(self, msg: dict[str, Any]) -> None:
        self.store.set("deal", json.dumps(msg))
        self._dealt = True

    # --- the results ----------------------------------------------------------------------------
    def finish(self, result: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[int]] | None:
        """Hand this rank's ``result`` (JSON-able: its code, rows, error) to rank 0. On rank 0:
        every rank's result by rank, and the ranks that stopped answering; None elsewhere."""
        try:
            if self.rank != 0:
                self.store.set(f"result/{self.rank}", json.dumps(result, default=str))
                return None
            if not self._dealt:  # rank 0 failed before dealing: the others must not wait for it
                self._publish({"error": result.get("error") or "it stopped"})
            results, missing = {0: result}, []
            for r in range(1, self.world):
                if self._await(f"result/{r}", r):
                    results[r] = json.loads(self.store.get(f"result/{r}"))
                else:
                    missing.append(r)
            return results, missing
        finally:
            self.close()

    def send_archive(self, data: bytes) -> None:
        """Before ``finish``: this rank's entries, for rank 0 to import (--gather-to-rank0)."""
        self.store.set(f"archive/{self.rank}", data)

    def received_archive(self, rank: int) -> bytes | None:
        """On rank 0, after ``finish``: what ``rank`` sent with ``send_archive``, if anything."""
        key = f"archive/{rank}"
        return self.store.get(key) if self.store.check([key]) else None

    def _await(self, key: str, rank: int) -> bool:
        """Wait for ``key`` while ``rank`` is alive; False once its heartbeat stood still for
        ``dead_after`` seconds."""
        last, moved = None, time.monotonic()
        while not self.store.check([key]):
            beats = self.store.add(f"alive/{rank}", 0)
            if beats != last:
                last, moved = beats, time.monotonic()
            elif time.monotonic() - moved > self.dead_after:
                log.error("rank %d has not answered for %.0fs: taken for dead", rank, self.dead_after)
                return False
            time.sleep(POLL_S)
        return True


def export_bytes(cache: Cache, keys: Sequence[str]) -> bytes | None:
    """The valid entries of ``keys`` in ``cache`` as a signed archive, or None if there are none."""
    from torch_kernelize.kernel_cache.archive import export_cache

    keys = [k for k in keys if cache.lookup(k)[0] in ("hit", "vendor")]
    if not keys:
        return None
    with tempfile.TemporaryDirectory(prefix="kernelize-gather-") as tmp:
        path = Path(tmp) / "entries.tar.gz"
        export_cache(cache, path, keys)
        return path.read_bytes()


def import_bytes(root: Path, data: bytes, target: Target) -> ImportResult:
    """Import an archive a rank sent into the cache under ``root``: on its signature where it is
    signed by a key this user trusts, else by re-validating every entry on this machine (the
    store that carried it authenticates nobody)."""
    from torch_kernelize.core.errors import CacheError
    from torch_kernelize.fill_cache.verify import verify_entries
    from torch_kernelize.kernel_cache.archive import import_cache, trusted_signer, verify_archive

    def revalidate(staging: Any, keys: list[str]) -> dict[str, str | None]:
        if staging.namespace != target.fingerprint_id():
            raise CacheError(f"the entries are for namespace {staging.namespace}, but rank 0's target is "
                             f"{target.fingerprint_id()}: the ranks must have the same kind of device")
        return {v.key: None if v.ok else v.detail for v in verify_entries(staging, target, keys)}

    with tempfile.TemporaryDirectory(prefix="kernelize-gather-") as tmp:
        path = Path(tmp) / "entries.tar.gz"
        path.write_bytes(data)
        signer, _ = trusted_signer(verify_archive(path))
        return import_cache(root, path, revalidate=None if signer else revalidate)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
