"""KernelCache: the on-disk store of one target namespace, shared by concurrent, killable processes.

Layout under ``<root>/<namespace>/``::

    fingerprint.json                 the target fingerprint (written once)
    entries/<key>/entry.json         the record
    entries/<key>/manifest.json      sha256 of entry.json and every program/ file
    entries/<key>/program/...        the built program (triton winners only)
    entries/.tmp-<key>-*/            an entry being written (ignored by readers, removed by gc)
    entries/.old-<key>/              the previous entry while a replace swaps it out
    entries/.del-<key>-*/            an entry being removed
    quarantine/<key>-<time>-<id>/    an entry that failed verification, moved out of service
    quarantine/<key>-<time>-<id>.json  why, and when
    journals/<key>.jsonl             fill_cache's search journal
    locks/<key>.lock                 fill_cache's per-spec search lock
    locks/<key>.put.lock             the short lock put/remove/gc hold while they swap folders

Writers build a complete entry in a temp folder next to the others, fsync it, and rename it into
place under the put lock, so a reader sees a whole entry or none. Replacing renames the old entry
to ``.old-<key>`` first; if the writer dies between the two renames, readers fall back to
``.old-<key>`` and the next put/remove/gc renames it back. Readers never lock: they check the
entry's hashes, and re-read when the folder changed while they read it (a concurrent swap).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import filelock

from torch_kernelize.core.errors import CacheError
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target

from .entry import CacheEntry, better, check_key, entry_from_files, is_key, normalize_record
from .integrity import (ENTRY_FILE, IGNORED_DIRS, MANIFEST_FILE, PROGRAM_DIR, EntryProblem, dumps,
                        executable_file, file_signature, fsync_dir, manifest_of, read_entry_files, write_durable,
                        write_file_atomic)

logger = logging.getLogger("torch_kernelize.kernel_cache")

ENTRIES_DIR = "entries"
JOURNALS_DIR = "journals"
LOCKS_DIR = "locks"
QUARANTINE_DIR = "quarantine"
FINGERPRINT_FILE = "fingerprint.json"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
DEL_PREFIX = ".del-"
PUT_LOCK_TIMEOUT_S = 300.0
GC_MAX_AGE_S = 30 * 60.0
_READ_ATTEMPTS = 10
NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")

# Per-process memo of verified entries: (namespace dir, key) -> (where, file signature, entry, problem).
_MEMO: dict[tuple[str, str], tuple[str, tuple, CacheEntry | None, str | None]] = {}
_WARNED: set[tuple[str, str]] = set()
_warn_lock = threading.Lock()


def _rename(src: Path, dst: Path) -> None:
    """os.rename, through one function so tests can simulate a crash at each step of a put."""
    os.rename(src, dst)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def clear_memo() -> None:
    """Forget every verified entry and every warning of this process (tests, long-lived tools)."""
    _MEMO.clear()
    with _warn_lock:
        _WARNED.clear()


def read_program_dir(program_dir: Path | str) -> dict[str, bytes]:
    """The files of a built program folder as {"program/<relpath>": bytes}, ``__pycache__`` skipped."""
    program_dir = Path(program_dir)
    if not program_dir.is_dir():
        raise CacheError(f"program_dir {program_dir} is not a folder")
    files: dict[str, bytes] = {}
    for folder, dirs, names in os.walk(program_dir):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS)
        for name in sorted(names):
            path = Path(folder, name)
            if not path.is_file():
                raise CacheError(f"{path} is not a regular file; a program folder holds plain files only")
            rel = path.relative_to(program_dir).as_posix()
            if executable_file(rel):
                raise CacheError(f"{path} is bytecode or a native library, which an entry never holds "
                                 "(kernels are loaded from their source)")
            files[f"{PROGRAM_DIR}/{rel}"] = path.read_bytes()
    return files


class KernelCache:
    """The cache of one target namespace under ``root``. Cheap to construct; creates folders only on write."""

    def __init__(self, root: Path | str, namespace: str, fingerprint: Mapping[str, Any] | None = None):
        if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace) or ".." in namespace:
            raise CacheError(f"{namespace!r} is not a cache namespace: use a single folder name of letters, "
                             "digits, '.', '_', '+' or '-' (normally Target.fingerprint_id())")
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        self.namespace = namespace
        self.dir = self.root / namespace
        self._fingerprint = dict(fingerprint) if fingerprint is not None else None

    @classmethod
    def for_target(cls, root: Path | str, target: Target) -> "KernelCache":
        """The cache of ``target``: namespaced by its fingerprint."""
        return cls(root, target.fingerprint_id(), target.fingerprint())

    def __repr__(self) -> str:
        return f"KernelCache({str(self.dir)!r})"

    # --- paths ----------------------------------------------------------------------------------
    @property
    def entries_dir(self) -> Path:
        return self.dir / ENTRIES_DIR

    def entry_dir(self, key: str) -> Path:
        return self.entries_dir / check_key(key)

    def _aside_dir(self, key: str) -> Path:
        return self.entries_dir / f"{OLD_PREFIX}{key}"

    @property
    def fingerprint(self) -> dict[str, Any] | None:
        """The fingerprint given at construction, else the one stored in fingerprint.json (or None)."""
        return self._fingerprint if self._fingerprint is not None else self.fingerprint_on_disk()

    def _ensure_dirs(self) -> None:
        self.entries_dir.mkdir(parents=True, exist_ok=True)
        if self._fingerprint is None:
            return
        path = self.dir / FINGERPRINT_FILE
        if not path.exists():
            write_file_atomic(path, dumps(self._fingerprint))
        elif self.fingerprint_on_disk() != self._fingerprint:
            self._warn_once("fingerprint", f"{path} does not match this cache's fingerprint "
                            f"{self._fingerprint}; kept the one on disk")

    def unusable(self) -> str | None:
        """Why lookups in this cache cannot work (its root, namespace or entries folder is not a
        readable folder), or None. A root that does not exist yet is an empty cache, not a fault."""
        for path in (self.root, self.dir, self.entries_dir):
            try:
                st = path.stat()
            except FileNotFoundError:
                return None
            except OSError as e:
                return f"{path} cannot be read: {e.strerror or e}"
            if not stat.S_ISDIR(st.st_mode):
                return f"{path} is not a folder"
            if not os.access(path, os.R_OK | os.X_OK):
                return f"{path} is a folder this user cannot read"
        return None

    def warn_if_unusable(self) -> None:
        """One warning per process when every lookup would silently miss (the serving path asks)."""
        problem = self.unusable()
        if problem is not None:
            self._warn_once("unusable", f"cache_dir {self.root} cannot be used, so every kernel lookup misses: "
                                f"{problem}; point cache_dir (or $KERNELIZE_CACHE_DIR) at a folder")

    def fingerprint_on_disk(self) -> dict[str, Any] | None:
        try:
            fp = json.loads((self.dir / FINGERPRINT_FILE).read_text())
        except (OSError, ValueError):
            return None
        return fp if isinstance(fp, dict) else None

    def lock(self, key: str) -> filelock.FileLock:
        """The per-key lock fill_cache holds while it searches a spec (re-entrant within a thread).

        put() does not take it (it uses its own short lock), so put may be called while holding it.
        """
        path = self.dir / LOCKS_DIR / f"{check_key(key)}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return filelock.FileLock(str(path), is_singleton=True)
        except TypeError:  # filelock without singletons
            return filelock.FileLock(str(path))

    def _put_lock(self, key: str) -> filelock.FileLock:
        path = self.dir / LOCKS_DIR / f"{key}.put.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        return filelock.FileLock(str(path), timeout=PUT_LOCK_TIMEOUT_S)

    def journal_path(self, key: str) -> Path:
        """Where fill_cache keeps the search journal of ``key`` (its folder is created)."""
        path = self.dir / JOURNALS_DIR / f"{check_key(key)}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    # --- reading (no locks: the serving path) ----------------------------------------------------
    def _locate(self, key: str) -> Path | None:
        """The folder holding ``key``'s entry: its own, else ``.old-<key>`` (a replace in flight or
        killed mid-swap), else None.

        A swap can complete between the two checks (own folder not there yet, .old- already
        removed), so "neither" is only believed when two rounds in a row see it.
        """
        final, aside = self.entries_dir / key, self._aside_dir(key)
        for _ in range(2):
            if final.is_dir():
                return final
            if aside.is_dir():
                return aside
        return None

    @staticmethod
    def _verify(where: Path, key: str) -> tuple[CacheEntry | None, str | None, dict[str, bytes] | None]:
        """Hash and parse the entry at ``where``: (entry, problem, the files' bytes)."""
        try:
            files = read_entry_files(where)
            return entry_from_files(files, key, where), None, files
        except EntryProblem as e:
            return None, str(e), None
        except OSError as e:
            return None, f"cannot read the entry: {e}", None

    def _read(self, key: str, use_memo: bool = True
              ) -> tuple[CacheEntry | None, str | None, Path | None, dict[str, bytes] | None]:
        """(entry, problem, where, files): where is None for a miss; entry None when problem says why.

        files is None when the memo answered. A read that overlapped a concurrent swap (the
        folder's signature changed) is retried, so readers never report a half-swapped entry.
        """
        check_key(key)
        memo_key = (str(self.dir), key)
        where: Path | None = None
        for attempt in range(_READ_ATTEMPTS):
            if attempt >= 2:
                time.sleep(0.002 * attempt)  # let a busy writer finish its swap
            where = self._locate(key)
            if where is None:
                return None, None, None, None
            try:
                sig = file_signature(where)
            except OSError:
                continue  # renamed or removed under us: look again
            cached = _MEMO.get(memo_key)
            if use_memo and cached is not None and cached[:2] == (str(where), sig):
                return cached[2], cached[3], where, None
            entry, problem, files = self._verify(where, key)
            try:
                unchanged = file_signature(where) == sig
            except OSError:
                unchanged = False
            if not unchanged:
                continue  # a writer swapped the entry while we read it: read the new one
            if problem is not None and self._locate(key) != where:
                continue  # we read a replaced entry's leftover (.old-<key>) while it was being deleted
            _MEMO[memo_key] = (str(where), sig, entry, problem)
            return entry, problem, where, files
        return None, "the entry kept changing while it was read", where, None

    def _load(self, key: str, use_memo: bool = True) -> tuple[CacheEntry | None, str | None, Path | None]:
        return self._read(key, use_memo)[:3]

    def snapshot(self, key: str) -> dict[str, bytes]:
        """A consistent, freshly verified copy of an entry's files {relpath: bytes} (export uses it).

        CacheError when the key has no entry or its entry is invalid.
        """
        entry, problem, where, files = self._read(key, use_memo=False)
        if where is None:
            raise CacheError(f"no cache entry for key {key} in {self.dir}")
        if entry is None or files is None:
            raise CacheError(f"the entry at {where} is invalid: {problem}")
        return files

    def _warn_once(self, key: str, message: str) -> None:
        with _warn_lock:
            if (str(self.dir), key) in _WARNED:
                return
            _WARNED.add((str(self.dir), key))
        logger.warning("kernel cache: %s", message)

    def get(self, key: str) -> CacheEntry | None:
        """The verified entry for ``key``, or None (absent, or invalid: then one warning per key per process).

        Verification (sha256 of every file) is memoized per process against the files' stat
        signature, so repeated gets cost a few stat calls.
        """
        entry, problem, where = self._load(key)
        if problem is not None:
            self._warn_once(key, f"skipping invalid entry {key} at {where}: {problem}")
        return entry

    def lookup(self, key: str) -> tuple[str, CacheEntry | None, str]:
        """(status, entry, reason): status is "hit", "vendor", "miss" or "invalid"."""
        entry, problem, where = self._load(key)
        return self._status(key, entry, problem, where)

    def lookup_node(self, node: Any, spec: KernelSpec) -> tuple[str, CacheEntry | None, str]:
        """A node's entry (interfaces.Lookups): a plain cache knows no shape buckets, so its spec's key."""
        return self.lookup(spec.key)

    def lookup_region(self, region: Any, spec: KernelSpec) -> tuple[str, CacheEntry | None, str]:
        """A fused region's entry (interfaces.Lookups): its spec's key."""
        return self.lookup(spec.key)

    def _status(self, key: str, entry: CacheEntry | None, problem: str | None, where: Path | None
                ) -> tuple[str, CacheEntry | None, str]:
        if where is None:
            return "miss", None, f"no cache entry for key {key} in {self.dir}"
        if entry is None:
            self._warn_once(key, f"skipping invalid entry {key} at {where}: {problem}")
            return "invalid", None, f"cache entry {key} at {where} is invalid and was skipped: {problem}"
        if entry.winner == "vendor":
            if entry.speedup is None:
                why = "no candidate speedup recorded"
            else:
                why = f"best candidate speedup {entry.speedup:.3g}x"
            note = f" ({entry.note})" if entry.note else ""
            return "vendor", entry, f"vendor wins for {key}: {why}{note}"
        measured = entry.measured and entry.speedup is not None
        speed = f"speedup {entry.speedup:.3g}x" if measured else "speed not measured"
        kind = "CUDA C++" if entry.language == "cuda" else "triton"
        return "hit", entry, f"{kind} kernel {entry.family or '(unnamed family)'} for {key}, {speed}"

    # --- witnesses: one process's lookups, re-checked by another without hashing -----------------
    def witness(self, key: str, status: str) -> dict[str, Any] | None:
        """What lets a later process trust this process's lookup of ``key`` (which answered
        ``status``) without hashing the entry again: the verified entry's folder, file signature
        and record; or, for a miss, that the lookup found no entry. None when it cannot be
        witnessed (an invalid entry, or one re-read since the lookup)."""
        if status == "miss":
            return {"absent": True}
        cached = _MEMO.get((str(self.dir), key))
        if cached is None or cached[2] is None or status not in ("hit", "vendor"):
            return None
        where, sig, entry, _ = cached
        # the record as entry.json holds it (one put in this process may hold str subclasses)
        return {"where": Path(where).name, "signature": sig, "record": json.loads(json.dumps(entry.record))}

    def recall(self, key: str, witness: Mapping[str, Any]) -> tuple[str, CacheEntry | None, str] | None:
        """``lookup(key)`` as an earlier process saw it, if the entry is still exactly what that
        process verified (the same folder and file signature: inode, size, mtime and ctime of
        every file, as the per-process memo checks) or is still absent; None when it changed.
        A recalled entry is not hashed again, just as a memoized one is not."""
        where = self._locate(key)
        if witness.get("absent"):
            return self._status(key, None, None, None) if where is None else None
        if where is None or where.name != witness.get("where"):
            return None
        try:
            sig = file_signature(where)
        except OSError:
            return None
        if sig != witness.get("signature"):
            return None
        entry = CacheEntry.from_record(witness["record"], where)
        _MEMO[(str(self.dir), key)] = (str(where), sig, entry, None)
        return self._status(key, entry, None, where)

    def keys(self) -> list[str]:
        """Keys with an entry folder (valid or not); temp and removal folders are not entries."""
        try:
            names = os.listdir(self.entries_dir)
        except FileNotFoundError:
            return []
        keys = {n for n in names if is_key(n) and (self.entries_dir / n).is_dir()}
        keys |= {n[len(OLD_PREFIX):] for n in names if n.startswith(OLD_PREFIX) and is_key(n[len(OLD_PREFIX):])}
        return sorted(keys)

    def entries(self) -> Iterator[CacheEntry]:
        """Every valid entry, by key; invalid ones are warned about (once) and skipped."""
        for key in self.keys():
            entry = self.get(key)
            if entry is not None:
                yield entry

    def check_integrity(self) -> list[tuple[str, str]]:
        """(key, problem) for every bad entry, re-hashing everything (no memo); never raises."""
        problems: list[tuple[str, str]] = []
        try:
            if (self.dir / FINGERPRINT_FILE).exists():
                on_disk = self.fingerprint_on_disk()
                if on_disk is None:
                    problems.append((FINGERPRINT_FILE, "does not parse as a JSON object"))
                elif self._fingerprint is not None and on_disk != self._fingerprint:
                    problems.append((FINGERPRINT_FILE,
                                     f"{on_disk} is not this cache's fingerprint {self._fingerprint}"))
            try:
                names = sorted(os.listdir(self.entries_dir))
            except FileNotFoundError:
                names = []
            for name in names:
                if not name.startswith(".") and not (is_key(name) and (self.entries_dir / name).is_dir()):
                    problems.append((name, f"{self.entries_dir / name} is not an entry folder named by a key"))
            for key in self.keys():
                try:
                    entry, problem, where = self._load(key, use_memo=False)
                except Exception as e:  # noqa: BLE001 - report, never raise
                    problems.append((key, f"{type(e).__name__}: {e}"))
                    continue
                # (a valid entry left at .old-<key> by a killed replace is fine: gc() moves it back)
                if problem is not None:
                    problems.append((key, f"{problem} ({where})"))
        except Exception as e:  # noqa: BLE001
            problems.append(("", f"cannot read the cache at {self.dir}: {type(e).__name__}: {e}"))
        return problems

    # --- writing (locked, atomic) ------------------------------------------------------------------
    def put(self, record: Mapping[str, Any], program_dir: Path | str | None = None,
            replace: bool = False) -> CacheEntry:
        """Store ``record`` (+ the files of ``program_dir`` for a triton winner); return the entry now cached.

        If a valid entry for the key exists, the better of the two is kept (see entry.better)
        unless ``replace``. Atomic and safe against concurrent writers and crashes.
        """
        r = normalize_record(record)
        files = read_program_dir(program_dir) if program_dir is not None else {}
        return self.put_files(r, files, replace)[0]

    def _check_program(self, r: Mapping[str, Any], files: Mapping[str, bytes]) -> None:
        if r["winner"] == "triton" and not files:
            raise CacheError(f"cache record {r['key']}: a triton winner needs program_dir with the built program")
        if r["winner"] == "vendor" and files:
            raise CacheError(f"cache record {r['key']}: a vendor winner stores no program; pass program_dir=None")

    def put_files(self, r: dict[str, Any], program_files: Mapping[str, bytes],
                  replace: bool) -> tuple[CacheEntry, bool]:
        """put() of a normalized record and its program files (an archive's, already read);
        also says whether the new one was installed."""
        key = check_key(r["key"])
        self._check_program(r, program_files)
        self._ensure_dirs()
        files = {ENTRY_FILE: dumps(r), **program_files}
        files[MANIFEST_FILE] = dumps(manifest_of(files))
        # os.mkdir, not mkdtemp: the entry keeps the umask's permissions (mkdtemp's 0700 would hide
        # it from the other users of a shared cache once renamed into place).
        tmp: Path | None = self.entries_dir / f"{TMP_PREFIX}{key}-{os.getpid()}-{os.urandom(6).hex()}"
        os.mkdir(tmp)
        try:
            self._write_tree(tmp, files)
            with self._put_lock(key):
                self._recover(key)
                final = self.entries_dir / key
                if final.is_dir():
                    old = self._verify(final, key)[0]
                    if old is not None and not replace and not better(r, old.record):
                        logger.info("kernel cache: kept the existing entry %s (speedup %s) over the new one (%s)",
                                    key, old.speedup, r["timings"].get("speedup"))
                        self._remember(key, final, old)
                        return old, False
                    aside = self._aside_dir(key)
                    try:
                        _rename(final, aside)
                        fsync_dir(self.entries_dir)
                        _rename(tmp, final)
                        tmp = None
                        fsync_dir(self.entries_dir)
                    except BaseException:
                        self._try_recover(key)
                        raise
                    _rmtree(aside)
                else:
                    _rename(tmp, final)
                    tmp = None
                    fsync_dir(self.entries_dir)
                entry = CacheEntry.from_record(r, final)
                self._remember(key, final, entry)
                return entry, True
        except filelock.Timeout:
            raise CacheError(f"kernel cache: timed out waiting for the write lock of {key} in {self.dir}") from None
        finally:
            if tmp is not None:
                _rmtree(tmp)

    @staticmethod
    def _write_tree(tmp: Path, files: Mapping[str, bytes]) -> None:
        folders = {tmp}
        for rel, data in files.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            folders.add(path.parent)
            write_durable(path, data)
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(folder)

    def _remember(self, key: str, where: Path, entry: CacheEntry) -> None:
        try:
            _MEMO[(str(self.dir), key)] = (str(where), file_signature(where), entry, None)
        except OSError:
            _MEMO.pop((str(self.dir), key), None)

    def _recover(self, key: str) -> bool:
        """Finish a replace that was killed between its renames (caller holds the put lock).

        Returns whether a leftover ``.old-<key>`` folder was removed.
        """
        final, aside = self.entries_dir / key, self._aside_dir(key)
        if not aside.exists():
            return False
        if final.exists():  # the swap completed; only the removal of the old entry was lost
            _rmtree(aside)
            return True
        _rename(aside, final)  # the new entry never arrived: put the old one back
        fsync_dir(self.entries_dir)
        return False

    def _try_recover(self, key: str) -> None:
        try:
            self._recover(key)
        except BaseException as e:  # noqa: BLE001 - readers still find .old-<key>; the next writer retries
            logger.warning("kernel cache: could not restore entry %s after a failed put: %s", key, e)

    def remove(self, key: str) -> None:
        """Delete the entry of ``key`` (no error if there is none)."""
        check_key(key)
        if not self.entries_dir.is_dir():
            return
        try:
            with self._put_lock(key):
                self._recover(key)
                final = self.entries_dir / key
                if final.exists():
                    trash = self.entries_dir / f"{DEL_PREFIX}{key}-{os.getpid()}-{os.urandom(4).hex()}"
                    _rename(final, trash)
                    fsync_dir(self.entries_dir)
                    _rmtree(trash)
        except filelock.Timeout:
            raise CacheError(f"kernel cache: timed out waiting for the write lock of {key} in {self.dir}") from None
        _MEMO.pop((str(self.dir), key), None)

    def quarantine(self, key: str, reason: str) -> Path | None:
        """Move ``key``'s entry out of service, to ``quarantine/<key>-<UTC time>-<id>/`` with the
        reason beside it (``<that folder>.json``); return that folder, or None when there is no entry.

        One rename under the put lock: readers see the whole entry or a miss, and no lookup looks
        in quarantine/. The files stay as they were, for a person to inspect or move back.
        """
        check_key(key)
        if not self.entries_dir.is_dir():
            return None
        folder = self.dir / QUARANTINE_DIR
        final = self.entries_dir / key
        try:
            with self._put_lock(key):
                self._recover(key)
                if not final.is_dir():
                    return None
                folder.mkdir(exist_ok=True)
                stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
                dest = folder / f"{key}-{stamp}-{os.urandom(3).hex()}"
                _rename(final, dest)
                fsync_dir(self.entries_dir)
                fsync_dir(folder)
        except filelock.Timeout:
            raise CacheError(f"kernel cache: timed out waiting for the write lock of {key} in {self.dir}") from None
        finally:
            _MEMO.pop((str(self.dir), key), None)
        note = {"key": key, "reason": reason, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "restore": f"mv {dest} {final}"}
        try:
            write_file_atomic(dest.with_name(dest.name + ".json"), dumps(note))
        except OSError as e:  # the entry is out of service all the same
            logger.warning("kernel cache: quarantined %s to %s but could not write why: %s", key, dest, e)
        return dest

    def gc(self, max_age_s: float = GC_MAX_AGE_S) -> int:
        """Remove leftovers of killed writers: temp folders older than ``max_age_s``, removal folders,
        and finished-but-not-cleaned replaces (restoring an entry whose replace was cut short).

        Returns how many leftover folders/files were removed.
        """
        count = 0
        now = time.time()
        try:
            names = sorted(os.listdir(self.entries_dir))
        except FileNotFoundError:
            return 0
        for name in names:
            path = self.entries_dir / name
            try:
                if name.startswith(TMP_PREFIX):
                    if now - path.lstat().st_mtime >= max_age_s:
                        _rmtree(path)
                        count += 1
                elif name.startswith(DEL_PREFIX):
                    _rmtree(path)
                    count += 1
                elif name.startswith(OLD_PREFIX) and is_key(name[len(OLD_PREFIX):]):
                    key = name[len(OLD_PREFIX):]
                    with self._put_lock(key):
                        count += self._recover(key)
            except (OSError, filelock.Timeout) as e:
                logger.warning("kernel cache: gc could not clean %s: %s", path, e)
        for path in self.dir.glob(f".{FINGERPRINT_FILE}.tmp-*"):
            try:
                if now - path.lstat().st_mtime >= max_age_s:
                    path.unlink()
                    count += 1
            except OSError:
                pass
        return count


class LookupLog:
    """A KernelCache whose lookups are remembered with their witnesses, taken at the moment of
    each lookup (the executable cache stores them: KernelCache.witness)."""

    def __init__(self, cache: KernelCache):
        self.cache = cache
        self.witnesses: dict[str, dict[str, Any] | None] = {}

    def lookup(self, key: str) -> tuple[str, CacheEntry | None, str]:
        result = self.cache.lookup(key)
        self.witnesses[key] = self.cache.witness(key, result[0])
        return result

    def lookup_node(self, node: Any, spec: KernelSpec) -> tuple[str, CacheEntry | None, str]:
        """A node's entry (interfaces.Lookups): a static graph's sizes are exact, so its spec's key."""
        return self.lookup(spec.key)

    def lookup_region(self, region: Any, spec: KernelSpec) -> tuple[str, CacheEntry | None, str]:
        """A fused region's entry (interfaces.Lookups): its spec's key."""
        return self.lookup(spec.key)
