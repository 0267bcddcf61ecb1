"""The entry record (entry.json) and CacheEntry, its typed, read-only view.

The record is a plain JSON dict so that a person (or any tool) can read it; CacheEntry adds types
and the parsed KernelSpec. ``normalize_record`` is strict on write (a malformed record raises
CacheError before anything touches the disk); ``check_record`` is the same check on read, where a
problem makes the entry invalid instead of raising.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import platform
import re
from pathlib import Path
from typing import Any, Mapping

from torch_kernelize.core.errors import CacheError
from torch_kernelize.core.spec import KernelSpec

from .integrity import ENTRY_FILE, MANIFEST_FILE, PROGRAM_DIR, EntryProblem, check_manifest, sha256_bytes

FORMAT = 1
WINNERS = ("triton", "vendor")
KEY_RE = re.compile(r"[0-9a-f]{8,64}")
TIMING_DEFAULTS: dict[str, Any] = {"candidate_ms": None, "vendor_ms": None, "speedup": None, "measured": False}
PROVENANCE_KEYS = ("generator", "search_id", "torch", "triton", "date", "host")


def check_key(key: Any) -> str:
    """Return ``key`` if it is a spec key (8-64 lowercase hex chars); raise CacheError otherwise.

    Keys become folder and file names, so anything else (paths, '..', upper case) is refused.
    """
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise CacheError(f"{key!r} is not a kernel cache key: expected 8 to 64 lowercase hex characters "
                         "(a KernelSpec.key)")
    return key


def is_key(name: str) -> bool:
    return bool(KEY_RE.fullmatch(name))


def _number_or_none(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))


def record_problems(r: Any) -> list[str]:
    """Everything wrong with a record (empty when it is well formed)."""
    if not isinstance(r, dict):
        return [f"the record is a {type(r).__name__}, not a JSON object"]
    problems = []
    if r.get("format") != FORMAT:
        problems.append(f"format is {r.get('format')!r}, this code reads format {FORMAT}")
    key = r.get("key")
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        problems.append(f"key {key!r} is not a spec key")
    try:
        spec = KernelSpec.from_json(r["spec"])
    except Exception as e:  # noqa: BLE001 - any malformed spec is a problem, never a crash
        problems.append(f"spec does not load: {type(e).__name__}: {e}")
    else:
        if "bucket" in r:  # a shape bucket's entry: keyed by the bucket (torch_kernelize/core/buckets.py)
            problems += _bucket_problems(r["bucket"], spec, key)
        elif isinstance(key, str) and spec.key != key:
            problems.append(f"spec key {spec.key} is not the entry key {key}")
    winner = r.get("winner")
    if winner not in WINNERS:
        problems.append(f"winner {winner!r} is not one of {WINNERS}")
    if not (r.get("family") is None or isinstance(r.get("family"), str)):
        problems.append("family must be a string or null")
    if not (r.get("config") is None or isinstance(r.get("config"), dict)):
        problems.append("config must be an object or null")
    validation = r.get("validation")
    if not isinstance(validation, dict):
        problems.append("validation must be an object (a ValidationRecord)")
    elif winner == "triton" and validation.get("ok") is not True:
        problems.append("a triton winner needs a passing validation record (validation.ok is not true)")
    timings = r.get("timings")
    if not isinstance(timings, dict):
        problems.append("timings must be an object")
    else:
        for k in ("candidate_ms", "vendor_ms", "speedup"):
            if not _number_or_none(timings.get(k)):
                problems.append(f"timings.{k} must be a finite number or null, got {timings.get(k)!r}")
        if not isinstance(timings.get("measured"), bool):
            problems.append("timings.measured must be true or false")
    if not isinstance(r.get("provenance", {}), dict):
        problems.append("provenance must be an object")
    if not isinstance(r.get("note", ""), str):
        problems.append("note must be a string")
    return problems


def _bucket_problems(bucket: Any, spec: KernelSpec, key: Any) -> list[str]:
    from torch_kernelize.core.buckets import Bucket, contains
    try:
        b = Bucket.from_json(bucket)
        bkey = b.key(spec)
    except Exception as e:  # noqa: BLE001 - a malformed bucket is a problem, never a crash
        return [f"bucket does not load: {type(e).__name__}: {e}"]
    problems = [] if bkey == key else [f"bucket key {bkey} is not the entry key {key}"]
    values = b.values(spec)
    if values is None:
        problems.append(f"the representative spec's bucket dims are no multiple of the bucket's scale {b.scale}")
    elif not contains(b.ranges, values):
        problems.append(f"the representative spec lies outside the bucket {b.ranges}")
    return problems


def check_record(r: Any, key: str) -> str | None:
    """The first reason a record read from disk cannot be trusted as the entry for ``key``, or None."""
    problems = record_problems(r)
    if not problems and r["key"] != key:
        problems.append(f"entry.json is for key {r['key']}, found under {key}")
    return "; ".join(problems) or None


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    import torch

    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    return {"torch": torch.__version__, "triton": triton}


def normalize_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A deep, JSON-clean copy of ``record`` with defaults filled in; CacheError if it is malformed.

    Fills: format, key (from the spec), family/config (null), timings fields, note, and provenance
    torch/triton versions, date (UTC ISO 8601) and host when the caller left them out.
    """
    if not isinstance(record, Mapping):
        raise CacheError(f"a cache record must be a dict, got {type(record).__name__}")
    try:
        r = json.loads(json.dumps(dict(record), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CacheError(f"a cache record must be plain JSON (no NaN/inf, tensors or objects): {e}") from None
    if "spec" not in r:
        raise CacheError("a cache record needs 'spec' (KernelSpec.to_json())")
    try:
        spec = KernelSpec.from_json(r["spec"])
    except Exception as e:  # noqa: BLE001
        raise CacheError(f"the record's spec does not load: {type(e).__name__}: {e}") from None
    r["spec"] = spec.to_json()
    r.setdefault("key", spec.key)
    r.setdefault("format", FORMAT)
    r.setdefault("family", None)
    r.setdefault("config", None)
    r.setdefault("note", "")
    r.setdefault("validation", {})
    timings = r.setdefault("timings", {})
    if isinstance(timings, dict):
        for k, v in TIMING_DEFAULTS.items():
            timings.setdefault(k, v)
    prov = r.setdefault("provenance", {})
    if isinstance(prov, dict):
        for k in ("generator", "search_id"):
            prov.setdefault(k, None)
        for k, v in _versions().items():
            prov.setdefault(k, v)
        prov.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        prov.setdefault("host", platform.node())
    problems = record_problems(r)
    if problems:
        raise CacheError(f"cache record for key {r.get('key')!r} is malformed: " + "; ".join(problems))
    return r


def better(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether ``new`` should replace ``old`` when put() is not told to replace (ties keep old)."""
    a, b = new.get("timings") or {}, old.get("timings") or {}
    new_unmeasured = new.get("winner") == "triton" and not a.get("measured")
    old_unmeasured = old.get("winner") == "triton" and not b.get("measured")
    if new_unmeasured and old.get("winner") == "vendor":
        return True
    if old_unmeasured and new.get("winner") == "vendor":
        return False
    return float(a.get("speedup") or 0.0) > float(b.get("speedup") or 0.0)


@dataclasses.dataclass(frozen=True, eq=False)
class CacheEntry:
    """A verified cache entry. Treat ``record`` and the dicts as read-only: entries are memoized."""

    key: str
    spec: KernelSpec
    winner: str
    family: str | None
    config: dict[str, Any] | None
    validation: dict[str, Any]
    timings: dict[str, Any]
    provenance: dict[str, Any]
    note: str
    path: Path
    record: dict[str, Any]

    @classmethod
    def from_record(cls, record: dict[str, Any], path: Path) -> "CacheEntry":
        """Typed view of a record that passed ``check_record``."""
        return cls(key=record["key"], spec=KernelSpec.from_json(record["spec"]), winner=record["winner"],
                   family=record.get("family"), config=record.get("config"),
                   validation=record["validation"], timings=record["timings"],
                   provenance=record.get("provenance", {}), note=record.get("note", ""),
                   path=Path(path), record=record)

    @property
    def program_dir(self) -> Path | None:
        """Where the built program's files are (kernel.py, program.json, binaries); None for vendor."""
        return self.path / PROGRAM_DIR if self.winner == "triton" else None

    @property
    def language(self) -> str | None:
        """The stored program's language: "triton", or "cuda" (CUDA C++, whose source is kernel.cu);
        None for vendor. (``winner`` says "triton" for either: the tier of generated kernels.)"""
        if self.program_dir is None:
            return None
        return "cuda" if (self.program_dir / "kernel.cu").exists() else "triton"

    @property
    def bucket(self) -> Any:
        """The shape bucket (buckets.Bucket) this entry serves, or None for an exact-shape entry."""
        if "bucket" not in self.record:
            return None
        from torch_kernelize.core.buckets import Bucket
        return Bucket.from_json(self.record["bucket"])

    @property
    def speedup(self) -> float | None:
        return self.timings.get("speedup")

    @property
    def measured(self) -> bool:
        return bool(self.timings.get("measured"))

    @functools.cached_property
    def identity(self) -> str:
        """The sha256 of the entry's manifest (which holds every file's sha256): a replaced entry
        has another, so a process that loaded the old one's kernel knows to load it again. Read
        once per verified entry (a replaced entry is verified, and memoized, anew)."""
        try:
            return sha256_bytes((self.path / MANIFEST_FILE).read_bytes())
        except OSError:
            return ""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheEntry) and (self.key, self.record) == (other.key, other.record)

    def __hash__(self) -> int:
        return hash((self.key, str(self.path)))

    def __repr__(self) -> str:
        sp = "unmeasured" if not self.measured else f"{self.speedup}x"
        return f"CacheEntry({self.key}, {self.spec.describe()}, winner={self.winner}, {sp}, path={self.path})"


def entry_from_files(files: Mapping[str, bytes], key: str, path: Path) -> CacheEntry:
    """Check a snapshot of an entry's files (manifest, record, program presence) and build its view.

    Raises EntryProblem naming the first thing wrong.
    """
    check_manifest(files)
    try:
        record = json.loads(files[ENTRY_FILE])
    except (ValueError, UnicodeDecodeError) as e:
        raise EntryProblem(f"{ENTRY_FILE} does not parse: {e}") from None
    problem = check_record(record, key)
    if problem:
        raise EntryProblem(f"{ENTRY_FILE}: {problem}")
    has_program = any(rel.startswith(PROGRAM_DIR + "/") for rel in files)
    if record["winner"] == "triton" and not has_program:
        raise EntryProblem("a triton entry without program/ files")
    if record["winner"] == "vendor" and has_program:
        raise EntryProblem("a vendor entry must not hold program/ files")
    return CacheEntry.from_record(record, path)
