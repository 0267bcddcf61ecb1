"""Export and import: move validated entries between machines as one tar(.gz) file.

Archive layout (flat, no folders needed)::

    MANIFEST.json                    {"format", "namespace", "fingerprint", "entries", "files": {member: sha256}}
    fingerprint.json                 the namespace's target fingerprint (when known)
    entries/<key>/entry.json, manifest.json, program/...

Import verifies the whole archive in memory first (every member hashed and listed, safe plain
member names, each entry's own manifest and record) and only then writes, through put(), so a
bad archive leaves the cache exactly as it was.
"""
from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import time
from pathlib import Path
from typing import Iterable

from torch_kernelize.errors import CacheError

from .entry import check_key, entry_from_files, is_key, normalize_record
from .integrity import ENTRY_FILE, PROGRAM_DIR, EntryProblem, dumps, fsync_dir, sha256_bytes
from .store import ENTRIES_DIR, FINGERPRINT_FILE, KernelCache

logger = logging.getLogger("torch_kernelize.kernel_cache")

ARCHIVE_MANIFEST = "MANIFEST.json"
ARCHIVE_FORMAT = 1
MAX_ARCHIVE_BYTES = 8 << 30  # refuse to inflate more than this (a corrupt or hostile archive)


def _write_mode(archive: Path) -> str:
    name = archive.name
    if name.endswith((".tar.gz", ".tgz")):
        return "w:gz"
    if name.endswith(".tar"):
        return "w"
    raise CacheError(f"archive {archive}: name it .tar.gz, .tgz or .tar")


def export_cache(cache: KernelCache, archive: Path | str, keys: Iterable[str] | None = None) -> int:
    """Write the valid entries of ``cache`` (all, or ``keys``) to ``archive``; return how many.

    With ``keys`` given, a missing or invalid key raises CacheError (nothing is written); without,
    invalid entries are warned about and left out. The archive appears atomically.
    """
    archive = Path(archive)
    mode = _write_mode(archive)
    strict = keys is not None
    wanted = list(dict.fromkeys(check_key(k) for k in keys)) if keys is not None else cache.keys()
    members: dict[str, bytes] = {}
    fingerprint = cache.fingerprint
    if fingerprint is not None:
        members[FINGERPRINT_FILE] = dumps(fingerprint)
    exported = []
    for key in wanted:
        try:
            files = cache.snapshot(key)
        except CacheError as e:
            if strict:
                raise CacheError(f"cannot export {key}: {e}") from None
            logger.warning("kernel cache: export leaves out %s: %s", key, e)
            continue
        for rel, data in files.items():
            members[f"{ENTRIES_DIR}/{key}/{rel}"] = data
        exported.append(key)
    manifest = {
        "format": ARCHIVE_FORMAT,
        "namespace": cache.namespace,
        "fingerprint": fingerprint,
        "entries": exported,
        "files": {name: sha256_bytes(data) for name, data in sorted(members.items())},
    }
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(f".{archive.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    now = int(time.time())
    try:
        with open(tmp, "wb") as f:
            with tarfile.open(fileobj=f, mode=mode, format=tarfile.PAX_FORMAT) as tf:
                for name, data in [(ARCHIVE_MANIFEST, dumps(manifest)), *sorted(members.items())]:
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), now, 0o644
                    tf.addfile(info, io.BytesIO(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, archive)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(archive.parent)
    return len(exported)


def _check_member_name(name: str) -> None:
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or (len(parts[0]) >= 2 and parts[0][1] == ":")
            or any(p in ("", ".", "..") for p in parts)):
        raise CacheError(f"archive member {name!r} has an unsafe or non-canonical path "
                         "(absolute, '..', '.', empty or backslash parts are refused)")


def _read_members(archive: Path) -> dict[str, bytes]:
    """Every regular member of the archive, in memory; CacheError on links, unsafe names, duplicates."""
    members: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(archive, "r:*") as tf:
            for m in tf:
                _check_member_name(m.name)
                if m.isdir():
                    continue
                if not m.isreg():
                    kind = "link" if (m.issym() or m.islnk()) else "special file"
                    raise CacheError(f"archive member {m.name!r} is a {kind}; only plain files are allowed")
                if m.name in members:
                    raise CacheError(f"archive member {m.name!r} appears twice")
                total += m.size
                if total > MAX_ARCHIVE_BYTES:
                    raise CacheError(f"archive {archive} holds more than {MAX_ARCHIVE_BYTES} bytes; refused")
                f = tf.extractfile(m)
                members[m.name] = f.read() if f is not None else b""
    except CacheError:
        raise
    except FileNotFoundError:
        raise CacheError(f"archive {archive} does not exist") from None
    except (OSError, EOFError, tarfile.TarError) as e:
        raise CacheError(f"archive {archive} is not a readable tar file: {type(e).__name__}: {e}") from None
    return members


def verify_archive(archive: Path | str) -> tuple[dict, dict[str, dict[str, bytes]]]:
    """Check an archive completely, touching nothing; return (MANIFEST, {key: {relpath: bytes}}).

    CacheError names the first problem: unsafe or unlisted members, hash mismatches, bad entries.
    """
    archive = Path(archive)
    members = _read_members(archive)
    if ARCHIVE_MANIFEST not in members:
        raise CacheError(f"archive {archive} has no {ARCHIVE_MANIFEST}; it was not written by export_cache")
    try:
        manifest = json.loads(members.pop(ARCHIVE_MANIFEST))
    except (ValueError, UnicodeDecodeError) as e:
        raise CacheError(f"archive {archive}: {ARCHIVE_MANIFEST} does not parse: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT:
        raise CacheError(f"archive {archive}: {ARCHIVE_MANIFEST} is not format {ARCHIVE_FORMAT}")
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise CacheError(f"archive {archive}: {ARCHIVE_MANIFEST} has no 'files' table")
    if not isinstance(manifest.get("namespace"), str):
        raise CacheError(f"archive {archive}: {ARCHIVE_MANIFEST} names no namespace")
    for name in sorted(set(listed) - set(members)):
        raise CacheError(f"archive {archive}: member {name!r} is listed in {ARCHIVE_MANIFEST} but missing")
    for name in sorted(set(members) - set(listed)):
        raise CacheError(f"archive {archive}: member {name!r} is not listed in {ARCHIVE_MANIFEST}")
    for name, data in sorted(members.items()):
        if sha256_bytes(data) != listed[name]:
            raise CacheError(f"archive {archive}: member {name!r} fails its sha256 check (modified or corrupt)")
    entries: dict[str, dict[str, bytes]] = {}
    for name, data in members.items():
        if name == FINGERPRINT_FILE:
            continue
        parts = name.split("/", 2)
        if len(parts) != 3 or parts[0] != ENTRIES_DIR or not is_key(parts[1]):
            raise CacheError(f"archive {archive}: unexpected member {name!r} "
                             f"(expected {FINGERPRINT_FILE} or {ENTRIES_DIR}/<key>/...)")
        entries.setdefault(parts[1], {})[parts[2]] = data
    if "entries" in manifest and sorted(manifest["entries"]) != sorted(entries):
        raise CacheError(f"archive {archive}: {ARCHIVE_MANIFEST} lists entries {sorted(manifest['entries'])} "
                         f"but holds {sorted(entries)}")
    for key, files in sorted(entries.items()):
        try:
            entry_from_files(files, key, Path(f"{archive}!{ENTRIES_DIR}/{key}"))
        except EntryProblem as e:
            raise CacheError(f"archive {archive}: entry {key} is invalid: {e}") from None
    if FINGERPRINT_FILE in members:
        try:
            fp = json.loads(members[FINGERPRINT_FILE])
        except (ValueError, UnicodeDecodeError):
            fp = None
        if not isinstance(fp, dict):
            raise CacheError(f"archive {archive}: {FINGERPRINT_FILE} is not a JSON object")
        manifest["fingerprint"] = fp
    return manifest, entries


def import_cache(root: Path | str, archive: Path | str, replace: bool = False) -> list[str]:
    """Verify ``archive`` completely, then put() its entries into ``<root>/<its namespace>``.

    Returns the keys whose archived entry is now the cached one (an existing better entry is
    kept unless ``replace``). A bad archive raises CacheError and writes nothing.
    """
    manifest, entries = verify_archive(archive)
    fingerprint = manifest.get("fingerprint")
    cache = KernelCache(root, manifest["namespace"], fingerprint if isinstance(fingerprint, dict) else None)
    on_disk = cache.fingerprint_on_disk()
    if fingerprint is not None and on_disk is not None and on_disk != fingerprint:
        raise CacheError(f"archive {archive} is for fingerprint {fingerprint}, but {cache.dir} holds "
                         f"{on_disk}; refusing to mix them")
    imported = []
    for key, files in sorted(entries.items()):
        record = normalize_record(json.loads(files[ENTRY_FILE]))
        program = {rel: data for rel, data in files.items() if rel.startswith(PROGRAM_DIR + "/")}
        _, installed = cache._put(record, program, replace)
        if installed:
            imported.append(key)
        else:
            logger.info("kernel cache: import kept the existing, better entry %s", key)
    return imported
