"""The on-disk kernel cache: round trips, integrity, concurrency, crash safety, export/import."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import filelock
import pytest
import torch

from torch_kernelize.core.errors import CacheError
from torch_kernelize.kernel_cache import CacheEntry, KernelCache, clear_memo, export_cache, import_cache
from torch_kernelize.kernel_cache import store as store_mod
from torch_kernelize.core.spec import KernelSpec

NS = "testns-cpu-0123456789ab"
FP = {"triton_backend": "interpreter", "device": "test cpu", "torch": "2.x", "triton": "3.x"}
LOGGER = "torch_kernelize.kernel_cache"


# --- helpers -------------------------------------------------------------------------------------

def make_spec(rows: int = 4, cols: int = 8) -> KernelSpec:
    x = torch.randn(rows, cols)
    return KernelSpec.from_call(torch.ops.aten.relu.default, [x], {}, torch.relu(x))


def make_record(spec: KernelSpec, winner: str = "triton", speedup: float | None = 1.5,
                measured: bool = True, note: str = "") -> dict:
    return {
        "format": 1, "key": spec.key, "spec": spec.to_json(), "winner": winner,
        "family": "pointwise" if winner == "triton" else None,
        "config": {"BLOCK": 128} if winner == "triton" else None,
        "validation": {"ok": winner == "triton", "seeds": [0, 1, 2], "kinds": ["random"] * 3, "trials": 3,
                       "max_abs_err": 0.0, "max_rel_err": 0.0, "tolerance": {"float32": [1e-5, 1e-5]},
                       "reason": ""},
        "timings": {"candidate_ms": 0.01, "vendor_ms": 0.015, "speedup": speedup, "measured": measured},
        "provenance": {"generator": "test", "search_id": "s1", "torch": "2.x", "triton": "3.x",
                       "date": "2026-01-01T00:00:00+00:00", "host": "testhost"},
        "note": note,
    }


def make_program(folder: Path, tag: str = "v1") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.py").write_text(f"# kernel {tag}\nimport triton\n")
    (folder / "program.json").write_text(json.dumps({"launches": [], "tag": tag}))
    (folder / "launch0.cubin").write_bytes(bytes(range(256)) + tag.encode())
    return folder


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with file contents (None for folders): a snapshot to compare."""
    if not root.exists():
        return {}
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def hidden_dirs(cache: KernelCache) -> list[str]:
    return sorted(n for n in os.listdir(cache.entries_dir) if n.startswith("."))


@pytest.fixture(autouse=True)
def _fresh_memo():
    clear_memo()
    yield
    clear_memo()


@pytest.fixture
def spec() -> KernelSpec:
    return make_spec()


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "cache", NS, FP)


@pytest.fixture
def prog(tmp_path) -> Path:
    return make_program(tmp_path / "built")


# --- basics --------------------------------------------------------------------------------------

def test_put_get_round_trip(cache, spec, prog):
    record = make_record(spec)
    put = cache.put(record, prog)
    assert isinstance(put, CacheEntry)
    clear_memo()  # read it back from disk, not from the writer's memo
    got = cache.get(spec.key)
    assert got is not None and got.record == put.record
    assert got.key == spec.key and got.spec == spec and got.winner == "triton"
    assert got.family == "pointwise" and got.config == {"BLOCK": 128}
    assert got.validation["ok"] is True and got.timings["speedup"] == 1.5 and got.speedup == 1.5
    assert got.provenance["search_id"] == "s1" and got.note == ""
    assert got.path == cache.dir / "entries" / spec.key
    umask = os.umask(0)
    os.umask(umask)
    assert got.path.stat().st_mode & 0o777 == 0o777 & ~umask, "entries must stay readable by other users"
    assert got.program_dir == got.path / "program"
    for name in ("kernel.py", "program.json", "launch0.cubin"):
        assert (got.program_dir / name).read_bytes() == (prog / name).read_bytes()
    manifest = json.loads((got.path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["entry.json", "program/kernel.py", "program/launch0.cubin",
                                         "program/program.json"]
    assert json.loads((cache.dir / "fingerprint.json").read_text()) == FP
    assert cache.keys() == [spec.key]
    assert [e.key for e in cache.entries()] == [spec.key]
    assert cache.check_integrity() == []
    assert hidden_dirs(cache) == []
    # a second cache object on the same folder reads the same entry
    assert KernelCache(cache.root, NS).get(spec.key).record == put.record


def test_put_fills_defaults_and_provenance(cache, spec, prog):
    entry = cache.put({"spec": spec.to_json(), "winner": "triton", "validation": {"ok": True},
                       "timings": {"speedup": 2.0, "measured": True}}, prog)
    assert entry.key == spec.key and entry.record["format"] == 1
    assert entry.timings == {"candidate_ms": None, "vendor_ms": None, "speedup": 2.0, "measured": True}
    assert entry.family is None and entry.config is None and entry.note == ""
    prov = entry.provenance
    assert prov["torch"] == torch.__version__ and prov["date"].startswith("20") and prov["host"] is not None


def test_get_is_memoized(cache, spec, prog, monkeypatch):
    cache.put(make_record(spec), prog)
    clear_memo()
    calls = []
    real = store_mod.read_entry_files
    monkeypatch.setattr(store_mod, "read_entry_files", lambda p: calls.append(p) or real(p))
    first = cache.get(spec.key)
    second = KernelCache(cache.root, NS).get(spec.key)
    assert first is second and len(calls) == 1


def test_lookup_statuses(cache, prog):
    hit, vendor, missing = make_spec(2, 3), make_spec(5, 7), make_spec(9, 9)
    cache.put(make_record(hit, speedup=1.8), prog)
    cache.put(make_record(vendor, winner="vendor", speedup=0.7, note="candidates were slower"), None)
    status, entry, reason = cache.lookup(hit.key)
    assert (status, entry.key) == ("hit", hit.key) and "1.8" in reason
    status, entry, reason = cache.lookup(vendor.key)
    assert status == "vendor" and entry.winner == "vendor" and "0.7" in reason and "speedup" in reason
    assert cache.lookup(missing.key) == ("miss", None, f"no cache entry for key {missing.key} in {cache.dir}")
    (cache.entry_dir(hit.key) / "program" / "kernel.py").write_text("# tampered\n")
    status, entry, reason = cache.lookup(hit.key)
    assert status == "invalid" and entry is None and "kernel.py" in reason and "sha256" in reason


def test_vendor_entries(cache, spec, prog):
    entry = cache.put(make_record(spec, winner="vendor", speedup=0.8), None)
    assert entry.winner == "vendor" and entry.program_dir is None
    assert not (entry.path / "program").exists()
    clear_memo()
    assert cache.get(spec.key).winner == "vendor"
    with pytest.raises(CacheError, match="vendor winner stores no program"):
        cache.put(make_record(spec, winner="vendor"), prog, replace=True)


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.update(winner="cuda"), "winner"),
    (lambda r: r["validation"].update(ok=False), "passing validation"),
    (lambda r: r.update(key="0" * 24), "spec key"),
    (lambda r: r["timings"].update(speedup=float("nan")), "plain JSON"),
    (lambda r: r.pop("spec"), "spec"),
])
def test_put_rejects_malformed_records(cache, spec, prog, mutate, match):
    record = make_record(spec)
    mutate(record)
    with pytest.raises(CacheError, match=match):
        cache.put(record, prog)
    assert cache.keys() == []


def test_put_needs_program_for_triton(cache, spec, tmp_path):
    with pytest.raises(CacheError, match="needs program_dir"):
        cache.put(make_record(spec), None)
    with pytest.raises(CacheError, match="not a folder"):
        cache.put(make_record(spec), tmp_path / "nope")


@pytest.mark.parametrize("bad", ["../etc", "ABCDEF0123", "abc", "g" * 24, "a" * 65, "", "0123456789/ab"])
def test_bad_keys_rejected(cache, bad):
    for call in (cache.get, cache.lookup, cache.remove, cache.lock, cache.journal_path):
        with pytest.raises(CacheError, match="not a kernel cache key"):
            call(bad)


def test_bad_namespace_rejected(tmp_path):
    for bad in ("../up", "a/b", "", ".hidden"):
        with pytest.raises(CacheError, match="namespace"):
            KernelCache(tmp_path, bad)


def test_pycache_in_program_is_ignored(cache, spec, prog):
    """Importing kernel.py leaves __pycache__ next to it; that must not invalidate the entry."""
    (prog / "__pycache__").mkdir()
    (prog / "__pycache__" / "kernel.cpython-311.pyc").write_bytes(b"junk")
    entry = cache.put(make_record(spec), prog)
    assert not (entry.program_dir / "__pycache__").exists()
    (entry.program_dir / "__pycache__").mkdir()
    (entry.program_dir / "__pycache__" / "kernel.cpython-311.pyc").write_bytes(b"junk")
    clear_memo()
    assert cache.get(spec.key) is not None and cache.check_integrity() == []


def test_bytecode_and_native_libraries_are_never_part_of_an_entry(cache, spec, prog):
    (prog / "helper.so").write_bytes(b"\x7fELF")
    with pytest.raises(CacheError, match="helper.so is bytecode or a native library"):
        cache.put(make_record(spec), prog)
    (prog / "helper.so").unlink()
    d = cache.entry_dir(cache.put(make_record(spec), prog).key)
    (d / "program" / "kernel.pyc").write_bytes(b"junk")  # listed with its hash, as a crafted entry would
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["program/kernel.pyc"] = hashlib.sha256(b"junk").hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))
    clear_memo()
    assert cache.get(spec.key) is None
    assert "program/kernel.pyc is bytecode or a native library" in cache.check_integrity()[0][1]


# --- which entry wins ----------------------------------------------------------------------------

def test_better_speedup_wins_and_replace(cache, spec, tmp_path):
    p1, p2, p3, p4 = (make_program(tmp_path / f"p{i}", f"v{i}") for i in range(1, 5))
    cache.put(make_record(spec, speedup=1.5), p1)
    kept = cache.put(make_record(spec, speedup=1.2), p2)
    assert kept.speedup == 1.5 and b"v1" in (kept.program_dir / "kernel.py").read_bytes()
    better = cache.put(make_record(spec, speedup=2.0), p3)
    assert better.speedup == 2.0
    forced = cache.put(make_record(spec, speedup=1.1), p4, replace=True)
    assert forced.speedup == 1.1
    clear_memo()
    got = cache.get(spec.key)
    assert got.speedup == 1.1 and (got.program_dir / "kernel.py").read_text().startswith("# kernel v4")
    assert hidden_dirs(cache) == [] and cache.check_integrity() == []


def test_unmeasured_triton_beats_vendor(cache, spec, prog):
    cache.put(make_record(spec, winner="vendor", speedup=0.9), None)
    entry = cache.put(make_record(spec, speedup=None, measured=False), prog)
    assert entry.winner == "triton"
    kept = cache.put(make_record(spec, winner="vendor", speedup=0.95), None)
    assert kept.winner == "triton"
    assert cache.lookup(spec.key)[0] == "hit"
    # None counts as 0: a measured speedup beats an unmeasured kernel
    assert cache.put(make_record(spec, speedup=1.3), prog).speedup == 1.3


def test_invalid_existing_entry_is_replaced(cache, spec, prog, caplog):
    cache.put(make_record(spec, speedup=5.0), prog)
    (cache.entry_dir(spec.key) / "entry.json").write_text("{")
    entry = cache.put(make_record(spec, speedup=1.0), prog)
    assert entry.speedup == 1.0
    clear_memo()
    assert cache.get(spec.key).speedup == 1.0


# --- corruption ------------------------------------------------------------------------------------

def _flip_kernel_byte(d: Path):
    path = d / "program" / "kernel.py"
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate_entry(d: Path):
    path = d / "entry.json"
    path.write_bytes(path.read_bytes()[:40])


@pytest.mark.parametrize("corrupt, reason", [
    (_flip_kernel_byte, "program/kernel.py fails its sha256"),
    (_truncate_entry, "entry.json fails its sha256"),
    (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    (lambda d: (d / "program" / "launch0.cubin").unlink(), "program/launch0.cubin is missing"),
    (lambda d: (d / "program" / "extra.bin").write_bytes(b"x"), "program/extra.bin is not listed"),
    (lambda d: (d / "manifest.json").write_text("not json"), "manifest.json does not parse"),
    (lambda d: os.symlink("/etc/passwd", d / "program" / "link"), "not a regular file"),
], ids=["flip-kernel-byte", "truncate-entry", "delete-manifest", "delete-program-file", "extra-file",
        "bad-manifest", "symlink"])
def test_corrupt_entry_is_skipped_with_one_warning(cache, spec, prog, caplog, corrupt, reason):
    cache.put(make_record(spec), prog)
    assert cache.get(spec.key) is not None  # memoized as valid before the damage
    corrupt(cache.entry_dir(spec.key))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cache.get(spec.key) is None
        assert cache.get(spec.key) is None
        assert list(cache.entries()) == []
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert spec.key in warnings[0] and reason in warnings[0] and str(cache.entry_dir(spec.key)) in warnings[0]
    problems = cache.check_integrity()
    assert len(problems) == 1 and problems[0][0] == spec.key and reason in problems[0][1]
    assert cache.lookup(spec.key)[0] == "invalid"


def test_entry_json_that_hashes_but_does_not_load(cache, spec, prog):
    """A record rewritten with a matching manifest is still checked (e.g. an unknown format)."""
    entry = cache.put(make_record(spec), prog)
    record = dict(entry.record, format=99)
    (entry.path / "entry.json").write_text(json.dumps(record))
    files = json.loads((entry.path / "manifest.json").read_text())
    from torch_kernelize.kernel_cache.integrity import sha256_file
    files["files"]["entry.json"] = sha256_file(entry.path / "entry.json")
    (entry.path / "manifest.json").write_text(json.dumps(files))
    assert cache.get(spec.key) is None
    assert "format" in cache.check_integrity()[0][1]


def test_check_integrity_reports_stray_folders_and_never_raises(cache, spec, prog):
    cache.put(make_record(spec), prog)
    (cache.entries_dir / "not-a-key").mkdir()
    (cache.entries_dir / "0123456789abcdef").mkdir()  # a key-named folder with nothing in it
    problems = dict(cache.check_integrity())
    assert "not-a-key" in problems and "manifest.json is missing" in problems["0123456789abcdef"]
    assert spec.key not in problems
    assert KernelCache(cache.root / "nowhere", NS).check_integrity() == []


# --- remove, gc, locks, journals -----------------------------------------------------------------

def test_remove(cache, spec, prog):
    cache.put(make_record(spec), prog)
    cache.remove(spec.key)
    assert cache.get(spec.key) is None and cache.keys() == [] and hidden_dirs(cache) == []
    cache.remove(spec.key)  # absent: no error
    KernelCache(cache.root / "empty", NS).remove(spec.key)


def test_quarantine_takes_an_entry_out_of_service(cache, spec, prog, tmp_path):
    other = make_spec(5, 5)
    cache.put(make_record(spec), prog)
    cache.put(make_record(other), make_program(tmp_path / "o", "o"))
    assert cache.get(spec.key) is not None  # memoized as a hit: the move must end that too
    dest = cache.quarantine(spec.key, "verify: wrong results")
    assert dest.parent == cache.dir / "quarantine" and dest.name.startswith(spec.key + "-")
    assert (dest / "program" / "kernel.py").read_bytes() == (prog / "kernel.py").read_bytes()
    note = json.loads(dest.with_name(dest.name + ".json").read_text())
    assert note["reason"] == "verify: wrong results" and note["restore"] == f"mv {dest} {cache.entry_dir(spec.key)}"
    assert cache.lookup(spec.key)[0] == "miss" and cache.keys() == [other.key]
    assert cache.check_integrity() == [] and cache.gc(max_age_s=0) == 0 and dest.is_dir()
    assert cache.quarantine(spec.key, "again") is None  # nothing left to move
    os.rename(dest, cache.entry_dir(spec.key))  # what the note says: back in service
    clear_memo()
    assert cache.get(spec.key) is not None


def test_gc_removes_only_stale_temp_dirs(cache, spec, prog):
    cache.put(make_record(spec), prog)
    stale = cache.entries_dir / f".tmp-{spec.key}-dead"
    fresh = cache.entries_dir / f".tmp-{spec.key}-busy"
    for d in (stale, fresh):
        (d / "program").mkdir(parents=True)
        (d / "entry.json").write_text("{}")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert cache.keys() == [spec.key]  # temp folders are never entries
    assert cache.gc(max_age_s=600) == 1
    assert not stale.exists() and fresh.exists()
    assert cache.gc(max_age_s=0) == 1 and hidden_dirs(cache) == []
    assert cache.get(spec.key) is not None
    assert KernelCache(cache.root / "none", NS).gc() == 0


def test_journal_path_and_lock(cache, spec, prog):
    path = cache.journal_path(spec.key)
    assert path == cache.dir / "journals" / f"{spec.key}.jsonl" and path.parent.is_dir()
    lock = cache.lock(spec.key)
    assert isinstance(lock, filelock.BaseFileLock)
    assert Path(lock.lock_file) == cache.dir / "locks" / f"{spec.key}.lock"
    probe = ("import filelock, sys\n"
             "try:\n    filelock.FileLock(sys.argv[1]).acquire(timeout=0.2)\nexcept filelock.Timeout:\n"
             "    sys.exit(3)\nsys.exit(0)\n")
    with lock:
        with cache.lock(spec.key):  # re-entrant within a thread
            cache.put(make_record(spec), prog)  # put does not deadlock under the search lock
        rc = subprocess.run([sys.executable, "-c", probe, lock.lock_file]).returncode
        assert rc == 3, "another process could take the lock while we held it"
    assert subprocess.run([sys.executable, "-c", probe, lock.lock_file]).returncode == 0
    assert cache.get(spec.key) is not None


# --- crashes -----------------------------------------------------------------------------------------

class SimulatedCrash(Exception):
    pass


@pytest.mark.parametrize("fail_from_call, only_once", [(1, False), (2, False), (2, True)])
def test_failing_rename_mid_put_keeps_old_entry(cache, spec, tmp_path, monkeypatch, fail_from_call, only_once):
    """rename raises from its Nth call on: before the swap (1) or after the old entry went aside (2).

    only_once: just that call fails, so put's own rollback can move the old entry straight back.
    """
    old = cache.put(make_record(spec, speedup=1.5), make_program(tmp_path / "old", "old"))
    calls = []
    real = store_mod._rename

    def flaky(src, dst):
        calls.append((src, dst))
        if len(calls) == fail_from_call or (len(calls) > fail_from_call and not only_once):
            raise SimulatedCrash(f"rename #{len(calls)}")
        real(src, dst)

    monkeypatch.setattr(store_mod, "_rename", flaky)
    with pytest.raises(SimulatedCrash):
        cache.put(make_record(spec, speedup=3.0), make_program(tmp_path / "new", "new"))
    assert len(calls) >= fail_from_call
    clear_memo()
    got = cache.get(spec.key)
    assert got is not None and got.speedup == 1.5 and got.record == old.record
    assert (got.program_dir / "kernel.py").read_text().startswith("# kernel old")
    assert cache.keys() == [spec.key] and cache.check_integrity() == []
    if only_once:  # rolled back in place: the entry is at its own folder again, nothing left over
        assert got.path == cache.entry_dir(spec.key) and hidden_dirs(cache) == []
    monkeypatch.setattr(store_mod, "_rename", real)
    cache.gc(max_age_s=0)
    assert hidden_dirs(cache) == []
    assert cache.get(spec.key).path == cache.entry_dir(spec.key)
    assert cache.put(make_record(spec, speedup=3.0), make_program(tmp_path / "new2", "new")).speedup == 3.0


def _crash_worker(root: str, record: dict, prog: str, crash_at: str) -> None:
    """Put ``record`` and die with os._exit(17) at one step of the swap (a kill, not an exception)."""
    from torch_kernelize.kernel_cache import KernelCache as KC
    from torch_kernelize.kernel_cache import store

    real_rename, real_rmtree = store._rename, store._rmtree
    n = [0]

    def rename(src, dst):
        n[0] += 1
        if crash_at == f"rename{n[0]}":
            os._exit(17)
        real_rename(src, dst)

    def rmtree(path):
        if crash_at == "rmtree-old" and Path(path).name.startswith(".old-"):
            os._exit(17)
        real_rmtree(path)

    store._rename, store._rmtree = rename, rmtree
    KC(root, NS, FP).put(record, Path(prog))
    os._exit(0)


@pytest.mark.parametrize("crash_at", ["rename1", "rename2", "rmtree-old"])
def test_killed_mid_put_leaves_a_valid_entry(cache, spec, tmp_path, crash_at):
    cache.put(make_record(spec, speedup=1.5), make_program(tmp_path / "old", "old"))
    new_prog = make_program(tmp_path / "new", "new")
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_crash_worker, args=(str(cache.root), make_record(spec, speedup=3.0), str(new_prog),
                                                crash_at))
    p.start()
    p.join(120)
    assert p.exitcode == 17, "the worker did not die where the test meant it to"
    clear_memo()
    got = cache.get(spec.key)
    assert got is not None, "a killed put left no readable entry"
    expected = 3.0 if crash_at == "rmtree-old" else 1.5
    assert got.speedup == expected
    assert cache.check_integrity() == [] and cache.keys() == [spec.key]
    cache.gc(max_age_s=0)
    assert hidden_dirs(cache) == []
    clear_memo()
    got = cache.get(spec.key)
    assert got is not None and got.speedup == expected and got.path == cache.entry_dir(spec.key)


# --- concurrency -------------------------------------------------------------------------------------

def _concurrent_writer(root: str, shared: dict, own: dict, prog: str, worker: int, rounds: int) -> None:
    import random

    from torch_kernelize.kernel_cache import KernelCache as KC

    cache = KC(root, NS, FP)
    rng = random.Random(worker)
    for i in range(rounds):
        record = json.loads(json.dumps(shared))
        record["timings"]["speedup"] = round(rng.uniform(1.0, 3.0), 3)
        record["note"] = f"worker {worker} round {i}"
        cache.put(record, Path(prog), replace=(i % 3 != 0))
        cache.put(own, Path(prog))


def _concurrent_reader(root: str, key: str, stop, reads, bad) -> None:
    """Look the shared key up as fast as possible while writers swap it; count anything but a hit."""
    from torch_kernelize.kernel_cache import KernelCache as KC
    from torch_kernelize.kernel_cache import clear_memo as forget

    cache = KC(root, NS)
    while not stop.is_set():
        forget()  # a full re-read every time, racing the writers' renames
        status, entry, reason = cache.lookup(key)
        with reads.get_lock():
            reads.value += 1
        if status != "hit":
            with bad.get_lock():
                bad.value += 1
            print(f"reader saw {status}: {reason}", file=sys.stderr)


def test_concurrent_puts_from_processes(cache, spec, prog):
    n = 4
    own_specs = [make_spec(3, 10 + i) for i in range(n)]
    cache.put(make_record(spec), prog)
    ctx = multiprocessing.get_context("spawn")
    stop, reads, bad = ctx.Event(), ctx.Value("i", 0), ctx.Value("i", 0)
    reader = ctx.Process(target=_concurrent_reader, args=(str(cache.root), spec.key, stop, reads, bad))
    reader.start()
    writers = [ctx.Process(target=_concurrent_writer,
                           args=(str(cache.root), make_record(spec), make_record(s, speedup=1.0 + i), str(prog), i, 30))
               for i, s in enumerate(own_specs)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(300)
    stop.set()
    reader.join(60)
    assert [p.exitcode for p in writers] == [0] * n and reader.exitcode == 0
    assert reads.value > 20, "the reader barely ran; the race was not exercised"
    assert bad.value == 0, f"{bad.value} of {reads.value} concurrent lookups were not hits"
    clear_memo()
    assert cache.keys() == sorted([spec.key] + [s.key for s in own_specs])
    assert cache.check_integrity() == []
    assert hidden_dirs(cache) == [], "temp/aside folders left behind"
    for key in cache.keys():
        entry = cache.get(key)
        assert entry is not None and entry.key == key
    assert cache.get(spec.key).note.startswith("worker ")


# --- export / import ---------------------------------------------------------------------------------

@pytest.fixture
def filled(cache, tmp_path):
    specs = [make_spec(2, 2), make_spec(3, 3), make_spec(4, 4)]
    cache.put(make_record(specs[0], speedup=1.2), make_program(tmp_path / "a", "a"))
    cache.put(make_record(specs[1], speedup=2.5), make_program(tmp_path / "b", "b"))
    cache.put(make_record(specs[2], winner="vendor", speedup=0.5), None)
    return cache, specs


def test_export_import_round_trip(filled, tmp_path):
    cache, specs = filled
    archive = tmp_path / "out" / "cache.tar.gz"
    assert export_cache(cache, archive) == 3
    imported = import_cache(tmp_path / "fresh", archive).imported
    assert imported == sorted(s.key for s in specs)
    other = KernelCache(tmp_path / "fresh", NS)
    assert json.loads((other.dir / "fingerprint.json").read_text()) == FP
    assert other.check_integrity() == []
    for s in specs:
        a, b = cache.get(s.key), other.get(s.key)
        assert a.record == b.record
        if a.program_dir is not None:
            assert tree(a.program_dir) == tree(b.program_dir)
    # importing again keeps the equal existing entries; replace=True installs them anyway
    assert import_cache(tmp_path / "fresh", archive).imported == []
    assert import_cache(tmp_path / "fresh", archive, replace=True).imported == sorted(s.key for s in specs)
    # a plain .tar and a subset of keys
    plain = tmp_path / "sub.tar"
    assert export_cache(cache, plain, [specs[1].key]) == 1
    assert import_cache(tmp_path / "sub", plain).imported == [specs[1].key]
    assert KernelCache(tmp_path / "sub", NS).keys() == [specs[1].key]


def test_export_missing_or_invalid_keys(filled, tmp_path, caplog):
    cache, specs = filled
    with pytest.raises(CacheError, match="no cache entry"):
        export_cache(cache, tmp_path / "x.tar.gz", ["0123456789abcdef01234567"])
    (cache.entry_dir(specs[0].key) / "program" / "kernel.py").write_text("changed")
    with pytest.raises(CacheError, match="kernel.py fails its sha256"):
        export_cache(cache, tmp_path / "x.tar.gz", [specs[0].key])
    assert not (tmp_path / "x.tar.gz").exists()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert export_cache(cache, tmp_path / "y.tar.gz") == 2
    assert any(specs[0].key in r.getMessage() for r in caplog.records)
    with pytest.raises(CacheError, match=".tar.gz"):
        export_cache(cache, tmp_path / "y.zip")


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isreg()}


def _write_tar(path: Path, members: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for info in extra:
            tf.addfile(info)
    return path


def _rehash(members: dict[str, bytes]) -> dict[str, bytes]:
    """Make MANIFEST.json consistent with the members again (so only the deeper check can catch it)."""
    import hashlib
    manifest = json.loads(members["MANIFEST.json"])
    manifest["files"] = {n: hashlib.sha256(d).hexdigest() for n, d in members.items()
                         if n not in ("MANIFEST.json", "SIGNATURE.json")}
    return dict(members, **{"MANIFEST.json": json.dumps(manifest).encode()})


def _tamper_member(m, key):
    m[f"entries/{key}/program/kernel.py"] += b"\nimport os  # injected\n"
    return m, []


def _traversal(m, key):
    m["../evil.py"] = b"print('pwned')"
    return _rehash(m), []


def _absolute(m, key):
    m["/tmp/evil.py"] = b"x"
    return _rehash(m), []


def _nested_traversal(m, key):
    m[f"entries/{key}/program/../../../../evil.py"] = b"x"
    return _rehash(m), []


def _symlink(m, key):
    info = tarfile.TarInfo(f"entries/{key}/program/link")
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return m, [info]


def _unlisted(m, key):
    m[f"entries/{key}/program/extra.py"] = b"x"
    return m, []


def _entry_manifest_wrong(m, key):
    m[f"entries/{key}/program/kernel.py"] = b"# rewritten\n"
    return _rehash(m), []  # archive MANIFEST agrees; the entry's own manifest does not


def _no_manifest(m, key):
    m.pop("MANIFEST.json")
    return m, []


@pytest.mark.parametrize("tamper, match", [
    (_tamper_member, "fails its sha256"),
    (_traversal, "unsafe"),
    (_absolute, "unsafe"),
    (_nested_traversal, "unsafe"),
    (_symlink, "link"),
    (_unlisted, "not listed"),
    (_entry_manifest_wrong, "is invalid: program/kernel.py fails its sha256"),
    (_no_manifest, "MANIFEST.json"),
], ids=lambda x: getattr(x, "__name__", str(x)).strip("_") if callable(x) else None)
def test_tampered_archive_rejected_and_cache_untouched(filled, tmp_path, tamper, match):
    cache, specs = filled
    good = tmp_path / "good.tar.gz"
    export_cache(cache, good)
    members, extra = tamper(_members(good), specs[1].key)
    bad = _write_tar(tmp_path / "bad.tar.gz", members, extra)
    # a target that already holds an entry of its own, and one that does not exist yet
    target = tmp_path / "target"
    KernelCache(target, NS, FP).put(make_record(specs[0], speedup=9.0), make_program(tmp_path / "t", "t"))
    before = tree(target)
    with pytest.raises(CacheError, match=match):
        import_cache(target, bad)
    assert tree(target) == before
    with pytest.raises(CacheError, match=match):
        import_cache(tmp_path / "virgin", bad)
    assert not (tmp_path / "virgin").exists()


def test_import_rejects_garbage_file(tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"this is not a tar file at all" * 10)
    with pytest.raises(CacheError, match="not a readable tar"):
        import_cache(tmp_path / "t", junk)
    with pytest.raises(CacheError, match="does not exist"):
        import_cache(tmp_path / "t", tmp_path / "missing.tar.gz")
    assert not (tmp_path / "t").exists()


def test_import_refuses_other_fingerprint(filled, tmp_path):
    cache, specs = filled
    archive = tmp_path / "c.tar.gz"
    export_cache(cache, archive)
    other = KernelCache(tmp_path / "t", NS, dict(FP, device="another gpu"))
    other.put(make_record(specs[0]), make_program(tmp_path / "p", "p"))
    before = tree(tmp_path / "t")
    with pytest.raises(CacheError, match="fingerprint"):
        import_cache(tmp_path / "t", archive)
    assert tree(tmp_path / "t") == before


def test_for_target_namespace():
    from torch_kernelize.core.targets import BUILTIN_TARGETS
    target = BUILTIN_TARGETS["interpreter"]
    cache = KernelCache.for_target("/nonexistent/root", target)
    assert cache.namespace == target.fingerprint_id()
    assert cache.dir == Path("/nonexistent/root") / target.fingerprint_id()
    assert cache.fingerprint == target.fingerprint()
    assert not Path("/nonexistent/root").exists()  # constructing never writes
