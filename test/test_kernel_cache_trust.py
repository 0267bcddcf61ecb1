"""Trust: an archive's kernels are stored only when its signer is trusted or each entry passes
re-validation here; no archive code runs before that; verify quarantines failing entries.

The archives hold real entries (fill_cache on the interpreter target: a fused row-wise region and
histc), so that a changed kernel computes a wrong histogram, as in the probe that filed the issue.
"""
from __future__ import annotations

import importlib.util
import io
import json
import os
import py_compile
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import run_python
from test_kernel_cache_cli import cli  # noqa: F401 - the fixture: torch_kernelize.cache
from torch_kernelize.core.errors import CacheError
from torch_kernelize.kernel_cache import KernelCache, clear_memo, export_cache, import_cache, signing
from torch_kernelize.kernel_cache.integrity import dumps, manifest_of, sha256_bytes
from torch_kernelize.kernel_cache.source_check import source_problems
from torch_kernelize.core.targets import get_target
from torch_kernelize.lowering.kernels import family_for

MODELS = "torch_kernelize.model_zoo"


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Path:
    """An interpreter-target cache with two validated entries (a fused region and histc)."""
    root = tmp_path_factory.mktemp("filled")
    proc = subprocess.run([sys.executable, "-m", "torch_kernelize.fill_cache", "--quiet", "--model",
                           f"{MODELS}:make_small", "--target", "interpreter", "--cache-dir", str(root),
                           "--budget", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


@pytest.fixture
def cache(filled, tmp_path) -> KernelCache:
    clear_memo()
    shutil.copytree(filled, tmp_path / "src")
    kc = KernelCache.for_target(tmp_path / "src", get_target("interpreter"))
    assert len(kc.keys()) == 2
    yield kc
    clear_memo()


def histc_key(cache: KernelCache) -> str:
    return next(e.key for e in cache.entries() if e.spec.op == "aten.histc.default")


def other_key(cache: KernelCache) -> str:
    return next(e.key for e in cache.entries() if e.spec.op != "aten.histc.default")


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isreg()}


def write_tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def tamper(archive: Path, key: str, edit, out: Path, keep_signature: bool = True) -> Path:
    """Edit one entry's kernel.py, then recompute every hash (the entry's manifest and the
    archive's MANIFEST), as someone changing an archive would; the signature is kept or dropped."""
    m = members(archive)
    prefix = f"entries/{key}/"
    name = prefix + "program/kernel.py"
    m[name] = edit(m[name].decode()).encode()
    entry = {n[len(prefix):]: d for n, d in m.items() if n.startswith(prefix)}
    m[prefix + "manifest.json"] = dumps(manifest_of(entry))
    manifest = json.loads(m["MANIFEST.json"])
    manifest["files"] = {n: sha256_bytes(d) for n, d in sorted(m.items()) if n not in ("MANIFEST.json", "SIGNATURE.json")}
    m["MANIFEST.json"] = dumps(manifest)
    if not keep_signature:
        m.pop("SIGNATURE.json")
    return write_tar(out, m)


def wrong_bins(src: str) -> str:
    """A histc kernel that still runs but counts every value one bin too high."""
    old = "pos = tl.minimum(tl.maximum(pos, 0), 7)"
    assert old in src
    return src.replace(old, "pos = tl.minimum(tl.maximum(pos + 1, 0), 7)")


def planting(marker: Path):
    """Python that would leave ``marker`` if any of it ran: at import, and in a kernel body."""
    def edit(src: str) -> str:
        src = src.replace("import triton.language as tl\n",
                          f"import triton.language as tl\nopen({str(marker)!r}, 'w').write('imported')\n", 1)
        return src.replace("    pid = tl.program_id(0)\n",
                           f"    pid = tl.program_id(0)\n    open({str(marker) + '.body'!r}, 'w')\n", 1)
    return edit


def tree(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*")) if "__pycache__" not in p.parts} if root.exists() else {}


def use_config(monkeypatch, folder: Path) -> None:
    monkeypatch.setenv(signing.CONFIG_ENV, str(folder))


# --- signatures ------------------------------------------------------------------------------------

def test_export_signs_and_a_trusted_signer_imports(cache, tmp_path, monkeypatch):
    use_config(monkeypatch, tmp_path / "alice")
    archive = tmp_path / "a.tar.gz"
    assert export_cache(cache, archive) == 2
    alice = signing.own_public_key(create=False)
    key_file = tmp_path / "alice" / signing.KEY_FILE
    assert alice and key_file.stat().st_mode & 0o777 == 0o600
    assert json.loads(members(archive)["SIGNATURE.json"])["public_key"] == alice

    use_config(monkeypatch, tmp_path / "bob")  # another user: alice's key is not his
    target = tmp_path / "bob-cache"
    with pytest.raises(CacheError, match="a key you do not trust") as refused:
        import_cache(target, archive)
    assert f"trust add {alice}" in str(refused.value) and "--revalidate" in str(refused.value)
    assert not target.exists()
    assert signing.trust_add(alice, "alice")
    result = import_cache(target, archive)
    assert result.imported == sorted(cache.keys()) and alice in result.accepted_by
    assert KernelCache(target, cache.namespace).check_integrity() == []


def test_unsigned_archive_is_refused_naming_both_ways(cache, tmp_path):
    archive = tmp_path / "a.tar.gz"
    export_cache(cache, archive)
    m = members(archive)
    m.pop("SIGNATURE.json")
    unsigned = write_tar(tmp_path / "unsigned.tar.gz", m)
    with pytest.raises(CacheError, match="it is not signed") as refused:
        import_cache(tmp_path / "t", unsigned)
    assert "trust add" in str(refused.value) and "--revalidate --target" in str(refused.value)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("keep_signature, match", [(True, "does not verify"), (False, "not signed")])
def test_tampered_rehashed_archive_is_refused_and_replaces_nothing(cache, tmp_path, keep_signature, match):
    archive = tmp_path / "a.tar.gz"
    export_cache(cache, archive)  # signed by this user's own key, which is trusted
    marker = tmp_path / "ran"
    bad = tamper(archive, histc_key(cache), lambda s: planting(marker)(wrong_bins(s)), tmp_path / "bad.tar.gz",
                 keep_signature)
    target = tmp_path / "target"
    import_cache(target, archive)  # good entries are there first
    before = tree(target)
    for replace in (False, True):
        with pytest.raises(CacheError, match=match):
            import_cache(target, bad, replace=replace)
    assert tree(target) == before
    assert not marker.exists() and not Path(f"{marker}.body").exists()


# --- revalidation ----------------------------------------------------------------------------------

def test_revalidate_stores_the_good_entries_and_rejects_the_wrong_one(cache, tmp_path, cli, capsys):
    archive = tmp_path / "a.tar.gz"
    export_cache(cache, archive)
    bad_key, good_key = histc_key(cache), other_key(cache)
    bad = tamper(archive, bad_key, wrong_bins, tmp_path / "bad.tar.gz", keep_signature=False)
    target = tmp_path / "target"
    args = ["import", str(bad), "--cache-dir", str(target), "--revalidate", "--target", "interpreter"]
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert "imported 1 entries" in out and "revalidation" in out and f"  {good_key}" in out
    assert f"rejected 1 entry (not stored):\n  {bad_key}: trial 1" in out and "out of tolerance" in out
    clear_memo()
    stored = KernelCache.for_target(target, get_target("interpreter"))
    assert stored.keys() == [good_key] and stored.check_integrity() == []


def test_revalidate_never_puts_a_failing_entry_over_a_good_one(cache, tmp_path, cli, capsys):
    archive = tmp_path / "a.tar.gz"
    export_cache(cache, archive)
    bad = tamper(archive, histc_key(cache), wrong_bins, tmp_path / "bad.tar.gz", keep_signature=False)
    target = tmp_path / "target"
    import_cache(target, archive)
    before = tree(target)
    args = ["import", str(bad), "--cache-dir", str(target), "--revalidate", "--target", "interpreter"]
    assert cli.main(args) == 1  # without --replace, the passing entry is already there: kept
    assert "kept the existing entry of 1 key(s)" in capsys.readouterr().out
    assert tree(target) == before
    assert cli.main([*args, "--replace"]) == 1
    clear_memo()
    after = KernelCache.for_target(target, get_target("interpreter"))
    assert after.get(histc_key(cache)).record == cache.get(histc_key(cache)).record
    assert (after.entry_dir(histc_key(cache)) / "program" / "kernel.py").read_bytes() == \
        (cache.entry_dir(histc_key(cache)) / "program" / "kernel.py").read_bytes()


def test_no_archive_code_runs_before_it_is_accepted(cache, tmp_path, cli, capsys):
    archive = tmp_path / "a.tar.gz"
    export_cache(cache, archive)
    marker = tmp_path / "ran"
    bad_key = histc_key(cache)
    bad = tamper(archive, bad_key, planting(marker), tmp_path / "bad.tar.gz", keep_signature=False)
    target = tmp_path / "target"
    assert cli.main(["import", str(bad), "--cache-dir", str(target)]) == 2
    assert "not signed" in capsys.readouterr().err
    assert cli.main(["import", str(bad), "--cache-dir", str(target), "--revalidate", "--target", "interpreter"]) == 1
    out = capsys.readouterr().out
    assert f"{bad_key}: its source is not a kernel file, so it was not run" in out
    assert "a top-level Expr statement" in out and "the name 'open'" in out
    assert not marker.exists() and not Path(f"{marker}.body").exists()
    clear_memo()
    assert KernelCache.for_target(target, get_target("interpreter")).keys() == [other_key(cache)]


def test_revalidate_refuses_an_archive_for_another_target(cache, tmp_path, cli, capsys):
    archive = tmp_path / "a.tar.gz"
    export_cache(cache, archive)
    assert cli.main(["import", str(archive), "--cache-dir", str(tmp_path / "t"), "--revalidate",
                     "--target", "cpu"]) == 2
    assert "revalidate it where it can run" in capsys.readouterr().err
    assert cli.main(["import", str(archive), "--cache-dir", str(tmp_path / "t"), "--revalidate"]) == 2
    assert "needs --target" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


# --- bytecode ----------------------------------------------------------------------------------------

def bytecode_of(source: str, marker: Path, cfile: Path) -> bytes:
    """``source`` plus a line that leaves ``marker``, compiled as Python would cache it, with an
    unchecked hash: a loader that prefers bytecode runs it without reading the source."""
    src = cfile.parent / "planted_src.py"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(source + f"\nopen({str(marker)!r}, 'w').write('bytecode ran')\n")
    py_compile.compile(str(src), cfile=str(cfile), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
                       doraise=True)
    src.unlink()
    return cfile.read_bytes()


@pytest.mark.parametrize("member", [f"program/__pycache__/kernel.{sys.implementation.cache_tag}.pyc",
                                    "program/kernel.so"])
def test_an_archive_holding_bytecode_is_refused_even_when_signed(cache, tmp_path, cli, capsys, member):
    archive = tmp_path / "a.tar.gz"
    export_cache(cache, archive)
    key = histc_key(cache)
    marker = tmp_path / "ran"
    m = members(archive)
    prefix = f"entries/{key}/"
    m[prefix + member] = bytecode_of(m[prefix + "program/kernel.py"].decode(), marker, tmp_path / "b" / "k.pyc")
    entry = {n[len(prefix):]: d for n, d in m.items() if n.startswith(prefix)}
    m[prefix + "manifest.json"] = dumps(manifest_of(entry))  # every hash recomputed, and signed again
    manifest = json.loads(m["MANIFEST.json"])
    manifest["files"] = {n: sha256_bytes(d) for n, d in sorted(m.items()) if n not in ("MANIFEST.json", "SIGNATURE.json")}
    m["MANIFEST.json"] = dumps(manifest)
    m["SIGNATURE.json"] = dumps({"format": 1, **signing.sign(m["MANIFEST.json"])})
    bad = write_tar(tmp_path / "bad.tar.gz", m)
    target = tmp_path / "target"
    for extra in ([], ["--revalidate", "--target", "interpreter"]):
        assert cli.main(["import", str(bad), "--cache-dir", str(target), *extra]) == 2
        err = capsys.readouterr().err
        assert f"archive member '{prefix + member}' is bytecode or a native library" in err, err
    assert not target.exists() and not marker.exists()


def test_bytecode_beside_a_cached_kernel_never_runs(cache, tmp_path, cli, capsys):
    """As another user of a shared cache (or a crafted copy) could leave it: loading the kernel
    to serve it, and verify, run the source."""
    from torch_kernelize.serving.launch import load_program
    entry = cache.get(histc_key(cache))
    source = entry.program_dir / "kernel.py"
    marker = tmp_path / "ran"
    bytecode_of(source.read_text(), marker, Path(importlib.util.cache_from_source(str(source))))
    assert cache.check_integrity() == []  # __pycache__ is not part of an entry
    runner = load_program(entry.program_dir, entry.spec, "interpreter", module_name="tk_trust_planted")
    runner(*family_for(entry.spec).sample_inputs(entry.spec, 0))
    assert not marker.exists()
    assert cli.main(["verify", "--cache-dir", str(cache.root), "--target", "interpreter"]) == 0
    assert "2/2 entries verified" in capsys.readouterr().out and not marker.exists()


def spinning(src: str) -> str:
    """A kernel body that never returns (it still passes the static source check)."""
    old = "    pid = tl.program_id(0)\n"
    assert old in src
    return src.replace(old, old + "    spin = 0\n    while spin >= 0:\n        spin = spin + 1\n", 1)


def test_revalidate_rejects_a_kernel_that_never_returns_within_its_limit(cache, tmp_path, cli, capsys, monkeypatch):
    archive = tmp_path / "a.tar.gz"
    export_cache(cache, archive)
    bad_key, good_key = histc_key(cache), other_key(cache)
    bad = tamper(archive, bad_key, spinning, tmp_path / "spin.tar.gz", keep_signature=False)
    assert source_problems(members(bad)[f"entries/{bad_key}/program/kernel.py"]) == []
    staging = tmp_path / "tmp"  # where the staging folder (kernelize-revalidate-*) goes
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    target = tmp_path / "target"
    started = time.monotonic()
    assert cli.main(["import", str(bad), "--cache-dir", str(target), "--revalidate", "--target", "interpreter",
                     "--time-limit", "6"]) == 1  # wall time: the good entry needs it too
    assert time.monotonic() - started < 60
    out = capsys.readouterr().out
    assert f"rejected 1 entry (not stored):\n  {bad_key}: timed out after 6 s" in out, out
    assert "imported 1 entries" in out and f"  {good_key}" in out
    assert list(staging.iterdir()) == []
    clear_memo()
    assert KernelCache.for_target(target, get_target("interpreter")).keys() == [good_key]


# --- quarantine ------------------------------------------------------------------------------------

def test_verify_quarantines_a_failing_entry(cache, tmp_path, cli, capsys):
    key = histc_key(cache)
    entry = cache.get(key)
    work = tmp_path / "wrong"
    shutil.copytree(entry.program_dir, work)
    (work / "kernel.py").write_text(wrong_bins((work / "kernel.py").read_text()))
    cache.put(dict(entry.record), work, replace=True)  # valid hashes, wrong results
    assert cli.main(["verify", "--cache-dir", str(cache.root), "--target", "interpreter"]) == 1
    out = capsys.readouterr().out
    assert "1/2 entries verified" in out and "FAILED" in out
    moved = list((cache.dir / "quarantine").iterdir())
    folder = next(p for p in moved if p.is_dir())
    assert f"quarantined {key}: {folder}" in out and "never served" in out
    assert folder.name.startswith(key) and (folder / "program" / "kernel.py").exists()
    note = json.loads(Path(f"{folder}.json").read_text())
    assert note["key"] == key and "verify" in note["reason"] and note["restore"].startswith("mv ")
    clear_memo()
    assert cache.lookup(key)[0] == "miss" and cache.keys() == [other_key(cache)]
    assert cache.check_integrity() == []
    assert cli.main(["verify", "--cache-dir", str(cache.root), "--target", "interpreter"]) == 0
    assert cli.main(["list", "--cache-dir", str(cache.root)]) == 0
    assert f"1 entry out of service in {cache.dir / 'quarantine'}" in capsys.readouterr().out


# --- the pieces -----------------------------------------------------------------------------------

def _family_cases():
    aten, x = torch.ops.aten, torch.randn(8, 32)
    return {
        "pointwise": (aten.relu.default, [x], {}),
        "reduction": (aten.sum.dim_IntList, [x, [1]], {}),
        "softmax": (aten._softmax.default, [x, 1, False], {}),
        "histc": (aten.histc.default, [x], {"bins": 8, "min": -2.0, "max": 2.0}),
        "layernorm": (aten.native_layer_norm.default, [x, [32], torch.randn(32), torch.randn(32), 1e-5], {}),
        "indexing": (aten.index_select.default, [x, 0, torch.tensor([0, 3, 5])], {}),
        "scan": (aten.cumsum.default, [x, 1], {}),
        "topk": (aten.topk.default, [x, 4], {}),
        "mm": (aten.mm.default, [x, torch.randn(32, 16)], {}),
        "bmm": (aten.bmm.default, [torch.randn(2, 8, 32), torch.randn(2, 32, 16)], {}),
        "conv1d": (aten.convolution.default, [torch.randn(2, 4, 16), torch.randn(8, 4, 3), None, [1], [1], [1],
                                              False, [0], 1], {}),
    }


@pytest.mark.parametrize("name", sorted(_family_cases()))
def test_source_check_admits_what_the_generators_write(name):
    """--revalidate must not refuse our own kernels: every family's seed programs pass."""
    from torch_kernelize.lowering.kernels import family_for
    from torch_kernelize.core.spec import KernelSpec
    op, args, kwargs = _family_cases()[name]
    spec = KernelSpec.from_call(op, args, kwargs, op(*args, **kwargs))
    family = family_for(spec)
    assert family is not None
    programs = [family.generate(spec, config) for config in family.seed_configs(spec)[:3]]
    sources = [p.source for p in programs if p.language == "triton"]
    assert sources
    for source in sources:
        assert source_problems(source) == []


def test_source_check_admits_stored_kernels(cache):
    for entry in cache.entries():  # a fused region's and histc's, as fill_cache stored them
        assert source_problems((entry.program_dir / "kernel.py").read_text()) == [], entry


@pytest.mark.parametrize("snippet, problem", [
    ("import os\n", "import of os"),
    ("from triton.runtime import driver\n", "import from triton.runtime"),
    ("X = print('hi')\n", "a top-level assignment"),
    ("try:\n    pass\nexcept Exception:\n    pass\n", "a top-level Try"),
    ("@triton.jit\ndef k(x, n=open('f')):\n    pass\n", "default argument that is not a literal"),
    ("def k(x):\n    pass\n", "not a @triton.jit function"),
    ("@print\ndef k(x):\n    pass\n", "a decorator other than @triton.jit"),
    ("@triton.jit\ndef k(x):\n    getattr(x, 'handle')\n", "the name 'getattr'"),
    ("@triton.jit\ndef k(x):\n    x.handle.tofile('f')\n", "the attribute .handle"),
    ("@triton.jit\ndef k(x):\n    y = x.__class__\n", "private attribute .__class__"),
    ("@triton.jit\ndef k(x):\n    tl.core.builtins.open('f')\n", "the module builtins"),
    ("@triton.jit\ndef k(x):\n    triton.runtime\n", "triton.runtime"),
    ("@triton.jit\ndef k(x):\n    import os\n", "holds a Import"),
])
def test_source_check_refuses_what_a_kernel_file_does_not_hold(snippet, problem):
    problems = source_problems("import triton\nimport triton.language as tl\n" + snippet)
    assert any(problem in p for p in problems), problems


def test_keys_and_trusted_file_are_guarded(tmp_path, monkeypatch):
    monkeypatch.delenv(signing.CONFIG_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert signing.config_dir() == tmp_path / "xdg" / "torch_kernelize"
    use_config(monkeypatch, tmp_path / "cfg")
    assert signing.own_public_key(create=False) is None and signing.trusted_keys() == {}
    mine = signing.own_public_key()
    assert signing.own_public_key() == mine  # made once
    assert signing.trusted_keys() == {mine: "your own key"}
    key_file = tmp_path / "cfg" / signing.KEY_FILE
    key_file.chmod(0o644)
    with pytest.raises(CacheError, match="can be read by other users"):
        signing.sign(b"x")
    key_file.chmod(0o600)
    with pytest.raises(CacheError, match="not a public key"):
        signing.trust_add("ed25519:notbase64!!")
    other = "ed25519:" + "A" * 43 + "="
    assert signing.trust_add(other, "someone") and not signing.trust_add(other, "someone")
    assert signing.trusted_keys()[other] == "someone"
    (tmp_path / "cfg" / signing.TRUSTED_FILE).chmod(0o666)
    with pytest.raises(CacheError, match="can be changed by other users"):
        signing.trusted_keys()
    (tmp_path / "cfg" / signing.TRUSTED_FILE).chmod(0o644)
    assert signing.trust_remove(other) and not signing.trust_remove(other)
    doc = signing.sign(b"manifest")
    assert signing.signature_verifies(b"manifest", doc) and not signing.signature_verifies(b"manifest!", doc)


def owned_by_someone_else(monkeypatch, path: Path) -> None:
    """Make ``path`` another user's: chown it where this runs as root, else pretend to be another uid."""
    if os.geteuid() == 0:
        os.chown(path, 12345, 12345)
    else:
        monkeypatch.setattr(signing.os, "geteuid", lambda: path.stat().st_uid + 1)


@pytest.mark.parametrize("what, name, match", [
    ("file", signing.TRUSTED_FILE, "the trusted keys file .* belongs to uid"),
    ("file", signing.KEY_FILE, "the signing key .* belongs to uid"),
    ("folder", None, "the config folder .* belongs to uid"),
    ("writable folder", None, "the config folder .* can be changed by other users"),
])
def test_trust_files_of_another_user_are_refused(tmp_path, monkeypatch, what, name, match):
    use_config(monkeypatch, tmp_path / "cfg")
    signing.own_public_key()
    other = "ed25519:" + "A" * 43 + "="
    signing.trust_add(other, "someone")
    path = tmp_path / "cfg" / name if name else tmp_path / "cfg"
    if what == "writable folder":
        path.chmod(0o777)
    else:
        owned_by_someone_else(monkeypatch, path)
    with pytest.raises(CacheError, match=match):
        signing.trusted_keys()
    if name != signing.TRUSTED_FILE:  # signing reads the key and the folder, not the trusted file
        with pytest.raises(CacheError, match=match):
            signing.sign(b"x")


def test_serving_path_never_imports_cryptography():
    proc = run_python("""
        import sys, torch, torch_kernelize.backend, torch_kernelize.kernel_cache
        print("cryptography" in sys.modules)
    """)
    assert proc.stdout.strip().splitlines()[-1] == "False"
