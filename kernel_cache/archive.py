"""Export and import: move validated entries between machines as one tar(.gz) file.

Archive layout (flat, no folders needed)::

    MANIFEST.json                    {"format", "namespace", "fingerprint", "entries", "files": {member: sha256}}
    SIGNATURE.json                   the exporter's ed25519 signature of MANIFEST.json's bytes
    fingerprint.json                 the namespace's target fingerprint (when known)
    entries/<key>/entry.json, manifest.json, program/...

Hashes only prove that an archive agrees with itself; anyone can recompute them. What makes an
archive's code fit to serve is either its signature, by a key the importing user trusts (the
manifest it signs hashes every other member), or ``revalidate``: each entry's program passes the
static source check (parsed, never imported) and then its validation, run on this machine
against its reference. Import checks the whole archive in memory first (safe plain member names,
hashes, records, signature), imports no code before an entry is accepted, and writes through
put() only what was accepted, so a refused archive leaves the cache exactly as it was.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from torch_kernelize.core.errors import CacheError

from .entry import check_key, entry_from_files, is_key, normalize_record
from . import signing
from .integrity import ENTRY_FILE, PROGRAM_DIR, EntryProblem, dumps, executable_file, replacing, sha256_bytes
from .source_check import source_problems
from .store import ENTRIES_DIR, FINGERPRINT_FILE, KernelCache

logger = logging.getLogger("torch_kernelize.kernel_cache")

ARCHIVE_MANIFEST = "MANIFEST.json"
ARCHIVE_SIGNATURE = "SIGNATURE.json"
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
    """Write the valid entries of ``cache`` (all, or ``keys``) to ``archive``, signed with this
    user's key (made on first use: kernel_cache.signing); return how many.

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
    manifest_bytes = dumps(manifest)
    signature = dumps({"format": ARCHIVE_FORMAT, **signing.sign(manifest_bytes)})
    archive.parent.mkdir(parents=True, exist_ok=True)
    now = int(time.time())
    with replacing(archive) as tmp, open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode=mode, format=tarfile.PAX_FORMAT) as tf:
            for name, data in [(ARCHIVE_MANIFEST, manifest_bytes), (ARCHIVE_SIGNATURE, signature),
                               *sorted(members.items())]:
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), now, 0o644
                tf.addfile(info, io.BytesIO(data))
        f.flush()
        os.fsync(f.fileno())
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
                if executable_file(m.name):
                    raise CacheError(f"archive member {m.name!r} is bytecode or a native library, which an "
                                     "archive never holds (kernels are loaded from their source); refused")
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


@dataclasses.dataclass
class CheckedArchive:
    """An archive that agrees with itself (verify_archive): its MANIFEST, as parsed and as the
    bytes the signature covers, its signature document (None: unsigned), and its entries' files."""

    path: Path
    manifest: dict[str, Any]
    manifest_bytes: bytes
    signature: dict[str, Any] | None
    entries: dict[str, dict[str, bytes]]


def verify_archive(archive: Path | str) -> CheckedArchive:
    """Check an archive's structure completely, touching nothing and running none of it.

    CacheError names the first problem: unsafe or unlisted members, hash mismatches, bad entries.
    Whether its signer is trusted is a separate question (``import_cache`` asks it).
    """
    archive = Path(archive)
    members = _read_members(archive)
    if ARCHIVE_MANIFEST not in members:
        raise CacheError(f"archive {archive} has no {ARCHIVE_MANIFEST}; it was not written by export_cache")
    signature = None
    if ARCHIVE_SIGNATURE in members:
        try:
            signature = json.loads(members.pop(ARCHIVE_SIGNATURE))
        except (ValueError, UnicodeDecodeError):
            signature = None
        if not isinstance(signature, dict):
            raise CacheError(f"archive {archive}: {ARCHIVE_SIGNATURE} is not a JSON object")
    manifest_bytes = members.pop(ARCHIVE_MANIFEST)
    try:
        manifest = json.loads(manifest_bytes)
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
    return CheckedArchive(archive, manifest, manifest_bytes, signature, entries)


# A revalidation: given a cache holding the entries to check (a staging copy) and their keys,
# {key: None when the entry passed, else why it failed}. torch_kernelize/cache.py makes one
# from fill_cache.verify (the layer that knows how to run kernels); kernel_cache only stores.
Revalidator = Callable[[KernelCache, list[str]], Mapping[str, "str | None"]]


@dataclasses.dataclass
class ImportResult:
    namespace: str
    accepted_by: str                                        # the trusted signer, or "revalidation"
    imported: list[str] = dataclasses.field(default_factory=list)  # the archived entry is now the cached one
    kept: list[str] = dataclasses.field(default_factory=list)      # accepted; an existing entry was kept
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)  # failed revalidation: why
    failed: tuple[str, str] | None = None  # (key, why): storing it failed (a full disk); later ones were not tried


def trusted_signer(checked: CheckedArchive) -> tuple[str | None, str]:
    """(who signed it, "") when its signature verifies against a trusted key, else (None, why not)."""
    sig = checked.signature
    if sig is None:
        return None, "it is not signed"
    key = sig.get("public_key")
    if not signing.signature_verifies(checked.manifest_bytes, sig):
        return None, (f"its signature does not verify against the key it names ({key!r}): it was changed "
                      "after it was signed, or not signed by that key")
    trusted = signing.trusted_keys()
    if key not in trusted:
        return None, f"it is signed by {key} (key id {signing.key_id(key)}), a key you do not trust"
    return f"{trusted[key] or 'a trusted key'} ({key})", ""


def _refusal(archive: Path, root: Path, why: str, signed_by: str | None) -> str:
    tool = "python -m torch_kernelize.cache"
    trust = (f"trust its signer, if you know {signed_by} is theirs: {tool} trust add {signed_by}"
             if signed_by else "ask whoever made it for an archive signed by a key you trust "
             f"({tool} export signs), and trust that key: {tool} trust add KEY")
    return (f"archive {archive} was refused: {why}. Its hashes only show that it agrees with itself; its "
            f"kernels could compute anything. Either {trust}; or re-validate every entry on this machine "
            f"and store only what passes: {tool} import {archive} --cache-dir {root} --revalidate "
            "--target TARGET")


def _program(files: Mapping[str, bytes]) -> dict[str, bytes]:
    return {rel: data for rel, data in files.items() if rel.startswith(PROGRAM_DIR + "/")}


def _revalidate(checked: CheckedArchive, revalidate: Revalidator) -> dict[str, str]:
    """{key: why} of the entries that fail: first the static source check of their Python files
    (parsed, never imported), then, for the rest, ``revalidate`` on a staging copy."""
    rejected: dict[str, str] = {}
    runnable = []
    for key, files in sorted(checked.entries.items()):
        problems = [p for rel, data in sorted(_program(files).items()) if rel.endswith(".py")
                    for p in source_problems(data, rel)]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            rejected[key] = "its source is not a kernel file, so it was not run: " + "; ".join(problems[:3]) + more
        else:
            runnable.append(key)
    if not runnable:
        return rejected
    fingerprint = checked.manifest.get("fingerprint")
    with tempfile.TemporaryDirectory(prefix="kernelize-revalidate-") as tmp:
        staging = KernelCache(tmp, checked.manifest["namespace"], fingerprint if isinstance(fingerprint, dict) else None)
        for key in runnable:
            files = checked.entries[key]
            staging.put_files(normalize_record(json.loads(files[ENTRY_FILE])), _program(files), replace=True)
        verdicts = revalidate(staging, list(runnable))
    for key in runnable:
        problem = verdicts.get(key, "the revalidation gave no verdict")
        if problem is not None:
            rejected[key] = problem
    return rejected


def import_cache(root: Path | str, archive: Path | str, replace: bool = False,
                 revalidate: Revalidator | None = None) -> ImportResult:
    """Check ``archive``, then put() the entries it is trusted with into ``<root>/<its namespace>``.

    Without ``revalidate``, every entry is stored if the archive's signature verifies against a
    key the user trusts (kernel_cache.signing), and CacheError refuses it otherwise, saying how to
    proceed. With ``revalidate``, each entry is stored only if its source passes the static check
    and ``revalidate`` passes it on this machine; an entry that is already cached is then kept
    unless ``replace`` (its speed was claimed elsewhere, only its correctness was checked here).
    Otherwise an existing better entry is kept unless ``replace``. No archive code runs before
    its entry is accepted, and a refused archive writes nothing.
    """
    checked = verify_archive(archive)
    fingerprint = checked.manifest.get("fingerprint")
    cache = KernelCache(root, checked.manifest["namespace"], fingerprint if isinstance(fingerprint, dict) else None)
    on_disk = cache.fingerprint_on_disk()
    if fingerprint is not None and on_disk is not None and on_disk != fingerprint:
        raise CacheError(f"archive {archive} is for fingerprint {fingerprint}, but {cache.dir} holds "
                         f"{on_disk}; refusing to mix them")
    if revalidate is None:
        signer, why = trusted_signer(checked)
        if signer is None:
            key = (checked.signature or {}).get("public_key")
            named = key if isinstance(key, str) and "does not verify" not in why else None
            raise CacheError(_refusal(Path(archive), cache.root, why, named))
        result = ImportResult(cache.namespace, f"signed by {signer}")
    else:
        result = ImportResult(cache.namespace, "revalidation on this machine",
                              rejected=_revalidate(checked, revalidate))
    for key, files in sorted(checked.entries.items()):
        if key in result.rejected:
            continue
        if revalidate is not None and not replace and cache.get(key) is not None:
            result.kept.append(key)
            continue
        record = normalize_record(json.loads(files[ENTRY_FILE]))
        try:
            _, installed = cache.put_files(record, _program(files), replace)
        except OSError as e:  # put() leaves nothing half-written; what was stored before stays
            result.failed = (key, f"{e.strerror or e}: {e.filename or cache.entry_dir(key)}")
            break
        if installed:
            result.imported.append(key)
        else:
            result.kept.append(key)
            logger.info("kernel cache: import kept the existing, better entry %s", key)
    return result
