"""Integrity of one entry: sha256 manifests, durable writes, and checks that never raise.

An entry is only trusted when every file it holds is listed in its manifest with a matching
hash and nothing else is present. Entries are checked from an in-memory snapshot of their bytes
(``read_entry_files``), so the bytes that were hashed are the bytes that get parsed; the same
check runs on entries read from disk and on entries read out of an archive.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator, Mapping

ENTRY_FILE = "entry.json"
MANIFEST_FILE = "manifest.json"
PROGRAM_DIR = "program"
# Python may have left bytecode next to a kernel.py; it is never part of an entry, and never read:
# kernels load from their source (core/source_module.py).
IGNORED_DIRS = frozenset({"__pycache__"})
# Bytecode and native libraries: an importer or loader would run them without reading any source,
# so no entry holds one and an archive holding one is refused.
_EXECUTABLE = re.compile(r".*\.(pyc|pyo|pyd|so|dylib|dll)(\.[0-9.]*)?", re.IGNORECASE)


def executable_file(rel: str) -> bool:
    """Whether ``rel`` (a '/'-separated path) is bytecode or a native library, or lies in a
    ``__pycache__`` folder."""
    parts = rel.split("/")
    return any(p in IGNORED_DIRS for p in parts) or bool(_EXECUTABLE.fullmatch(parts[-1]))


class EntryProblem(Exception):
    """An entry cannot be trusted; the message says why (used internally, never escapes the cache)."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dumps(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no NaN/inf: strict JSON any tool can read)."""
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def read_regular(path: Path | str) -> bytes:
    """The bytes of ``path``, which must be a regular file: a FIFO or a device where a cache file
    should be would block the reader, or never end. OSError (FileNotFoundError when missing)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens without a writer
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


# --- durable writes ------------------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    """Make a rename or a new name inside ``path`` durable (a no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write and fsync a new file; the caller makes it visible by renaming its directory."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A new sibling temp file of ``path`` for the block to write (and fsync): when the block
    ends, it replaces ``path`` in one step and the folder is fsynced; when it raises, the temp
    file is removed. Readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step (``replacing``)."""
    with replacing(path) as tmp:
        write_durable(tmp, data)


def seal(magic: bytes, header: Mapping[str, Any], payload: bytes) -> bytes:
    """One self-checking file: ``magic``, a JSON header line holding the payload's sha256, the payload."""
    header = {**header, "sha256": sha256_bytes(payload)}
    return magic + json.dumps(header).encode() + b"\n" + payload


def unseal(data: bytes, magic: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, payload) of a file ``seal`` wrote; ValueError when it is not one or fails its hash."""
    if not data.startswith(magic):
        raise ValueError("not an entry of this kind (its first line is not the expected one)")
    header_line, _, payload = data[len(magic):].partition(b"\n")
    header = json.loads(header_line)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    if sha256_bytes(payload) != header.get("sha256"):
        raise ValueError("payload does not match its sha256")
    return header, payload


# --- manifests -----------------------------------------------------------------------------------

def manifest_of(files: Mapping[str, bytes]) -> dict[str, Any]:
    """The manifest for an entry's files (everything but the manifest itself)."""
    return {"files": {rel: sha256_bytes(data) for rel, data in sorted(files.items()) if rel != MANIFEST_FILE}}


def _allowed(rel: str) -> bool:
    return rel in (ENTRY_FILE, MANIFEST_FILE) or (rel.startswith(PROGRAM_DIR + "/") and len(rel) > len(PROGRAM_DIR) + 1)


def read_entry_files(entry_dir: Path) -> dict[str, bytes]:
    """Snapshot every file of an entry directory as {posix relpath: bytes}.

    Raises EntryProblem for anything that is not a plain file or directory (links included:
    an entry must not point outside itself) and OSError when the directory vanishes mid-read.
    ``__pycache__`` folders (bytecode Python leaves when kernel.py is imported) are skipped.
    """
    files: dict[str, bytes] = {}
    stack = [(entry_dir, "")]
    while stack:
        folder, prefix = stack.pop()
        with os.scandir(folder) as it:
            children = sorted(it, key=lambda e: e.name)
        for child in children:
            rel = prefix + child.name
            st = os.lstat(child.path)
            if stat.S_ISDIR(st.st_mode):
                if child.name not in IGNORED_DIRS:
                    stack.append((Path(child.path), rel + "/"))
            elif stat.S_ISREG(st.st_mode):
                with open(child.path, "rb") as f:
                    files[rel] = f.read()
            else:
                raise EntryProblem(f"{rel} is not a regular file (links are not allowed in an entry)")
    return files


def file_signature(entry_dir: Path) -> tuple:
    """Cheap identity of an entry directory and its files (inode, size, mtime, ctime), no hashing.

    Two equal signatures mean nothing was renamed, added, removed or rewritten in between
    (down to the filesystem's timestamp resolution); used to memoize verification per process.
    """
    st = os.stat(entry_dir)
    parts: list[tuple] = [("", st.st_dev, st.st_ino, st.st_ctime_ns)]
    stack = [(entry_dir, "")]
    while stack:
        folder, prefix = stack.pop()
        with os.scandir(folder) as it:
            for child in it:
                if child.name in IGNORED_DIRS:
                    continue
                s = child.stat(follow_symlinks=False)
                parts.append((prefix + child.name, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_mode))
                if stat.S_ISDIR(s.st_mode):
                    stack.append((Path(child.path), prefix + child.name + "/"))
    return tuple(sorted(parts))


def check_manifest(files: Mapping[str, bytes]) -> None:
    """Raise EntryProblem unless ``files`` match their manifest exactly (no missing, extra or changed file)."""
    if MANIFEST_FILE not in files:
        raise EntryProblem(f"{MANIFEST_FILE} is missing")
    try:
        manifest = json.loads(files[MANIFEST_FILE])
    except (ValueError, UnicodeDecodeError) as e:
        raise EntryProblem(f"{MANIFEST_FILE} does not parse: {e}") from None
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(listed, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in listed.items()):
        raise EntryProblem(f"{MANIFEST_FILE} has no {{'files': {{relpath: sha256}}}} table")
    if ENTRY_FILE not in listed:
        raise EntryProblem(f"{MANIFEST_FILE} does not cover {ENTRY_FILE}")
    for rel in sorted(set(files) | set(listed)):
        if rel == MANIFEST_FILE:
            continue
        if executable_file(rel):
            raise EntryProblem(f"{rel} is bytecode or a native library, which an entry never holds "
                               "(kernels are loaded from their source)")
        if not _allowed(rel):
            raise EntryProblem(f"unexpected file {rel!r} (an entry holds entry.json, manifest.json and program/)")
        if rel not in files:
            raise EntryProblem(f"{rel} is missing (listed in {MANIFEST_FILE})")
        if rel not in listed:
            raise EntryProblem(f"{rel} is not listed in {MANIFEST_FILE}")
        digest = sha256_bytes(files[rel])
        if digest != listed[rel]:
            raise EntryProblem(f"{rel} fails its sha256 check (manifest {listed[rel][:12]}..., file {digest[:12]}...)")
