"""python -m torch_kernelize.cache (and tools/cache.py, the same command from a checkout): list, show,
check, export, import, trust, gc on a small real cache; exit codes."""
from __future__ import annotations

import importlib
import json
import runpy
import subprocess
import sys

import pytest

from conftest import REPO, console_scripts
from test_kernel_cache import FP, NS, make_program, make_record, make_spec
from torch_kernelize.kernel_cache import KernelCache, clear_memo


@pytest.fixture(scope="module")
def cli():
    import torch_kernelize.cache
    return torch_kernelize.cache


@pytest.fixture
def filled(tmp_path):
    clear_memo()
    cache = KernelCache(tmp_path / "c", NS, FP)
    hit, vendor = make_spec(2, 5), make_spec(6, 7)
    cache.put(make_record(hit, speedup=1.75), make_program(tmp_path / "p"))
    cache.put(make_record(vendor, winner="vendor", speedup=0.5), None)
    yield cache, hit, vendor
    clear_memo()


def test_list_and_show(cli, filled, capsys):
    cache, hit, vendor = filled
    assert cli.main(["list", "--cache-dir", str(cache.root)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("#")}
    assert "aten.relu.default" in lines[hit.key] and "f32[2x5]" in lines[hit.key]
    assert "triton" in lines[hit.key] and "1.75x" in lines[hit.key] and "yes" in lines[hit.key]
    assert "vendor" in lines[vendor.key] and "0.5x" in lines[vendor.key]
    assert cli.main(["show", hit.key, "--cache-dir", str(cache.root), "--namespace", NS]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hit:") and '"winner": "triton"' in out and "kernel.py" in out


def test_check_exit_codes(cli, filled, capsys):
    cache, hit, vendor = filled
    assert cli.main(["check", "--cache-dir", str(cache.root)]) == 0
    (cache.entry_dir(hit.key) / "program" / "kernel.py").write_text("# broken\n")
    assert cli.main(["check", "--cache-dir", str(cache.root)]) == 1
    out = capsys.readouterr().out
    assert hit.key in out and "sha256" in out
    assert cli.main(["list", "--cache-dir", str(cache.root)]) == 0
    assert "INVALID" in capsys.readouterr().out


def test_export_import_gc(cli, filled, tmp_path, capsys):
    cache, hit, vendor = filled
    archive = tmp_path / "x.tar.gz"
    assert cli.main(["export", str(archive), "--cache-dir", str(cache.root), "--keys", hit.key]) == 0
    assert cli.main(["import", str(archive), "--cache-dir", str(tmp_path / "new")]) == 0
    assert hit.key in capsys.readouterr().out
    assert KernelCache(tmp_path / "new", NS).keys() == [hit.key]
    assert cli.main(["export", str(archive), "--cache-dir", str(cache.root), "--keys", "0" * 24]) == 2
    assert "no cache entry" in capsys.readouterr().err
    (cache.entries_dir / ".tmp-leftover").mkdir()
    graphs = cache.root / "graphs"  # a graph or executable cache writer killed mid-write
    graphs.mkdir()
    (graphs / ".k.exe.tmp-123-abcd").write_bytes(b"half")
    (graphs / "k.exe").write_bytes(b"an entry")
    assert cli.main(["gc", "--cache-dir", str(cache.root), "--max-age-minutes", "0"]) == 0
    out = capsys.readouterr().out
    assert f"{cache.dir}: removed 1" in out and not (cache.entries_dir / ".tmp-leftover").exists()
    assert f"{graphs}: removed 1" in out and [p.name for p in graphs.iterdir()] == ["k.exe"]
    # prewarm's program indexes: one whose executables are all gone, one that lists k.exe, a temp file
    prewarm = cache.root / "prewarm"
    prewarm.mkdir()
    index = {"format": 1, "executables": [{"path": str(graphs / "gone.exe"), "vendor": []}]}
    (prewarm / "a.json").write_text(json.dumps(index))
    (prewarm / "a.json.lock").write_text("")
    index["executables"].append({"path": str(graphs / "k.exe"), "vendor": []})
    (prewarm / "b.json").write_text(json.dumps(index))
    (prewarm / ".b.json.tmp-1-ab").write_text("half")
    assert cli.main(["gc", "--cache-dir", str(cache.root), "--max-age-minutes", "0"]) == 0
    assert f"{prewarm}: removed 2" in capsys.readouterr().out
    assert sorted(p.name for p in prewarm.iterdir()) == ["b.json"]


def test_an_import_that_stops_partway_lists_what_was_stored_and_exits_1(cli, filled, tmp_path, capsys,
                                                                        monkeypatch):
    import errno

    from torch_kernelize.kernel_cache import store
    cache, hit, vendor = filled
    archive = tmp_path / "x.tar.gz"
    assert cli.main(["export", str(archive), "--cache-dir", str(cache.root)]) == 0
    first, second = sorted([hit.key, vendor.key])
    real = store.write_durable

    def full_disk(path, data):  # the disk fills up while the second entry is written
        if second in path.parent.name or second in path.parent.parent.name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)
    monkeypatch.setattr(store, "write_durable", full_disk)
    capsys.readouterr()
    assert cli.main(["import", str(archive), "--cache-dir", str(tmp_path / "new")]) == 1
    out, err = capsys.readouterr()
    assert f"imported 1 entries" in out and f"  {first}" in out and second not in out
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: import stopped at entry {second} (No space left on device: ") and \
        str(tmp_path / "new") in line and "were stored" in line
    clear_memo()
    new = KernelCache(tmp_path / "new", NS)
    assert new.keys() == [first] and new.check_integrity() == []
    assert not [p for p in new.entries_dir.iterdir() if p.name != first]  # nothing half-written


def test_runs_as_python_dash_m(filled):
    """The installed command: python -m torch_kernelize.cache, in a fresh interpreter."""
    cache, hit, vendor = filled
    r = subprocess.run([sys.executable, "-m", "torch_kernelize.cache", "list", "--cache-dir", str(cache.root)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert hit.key in r.stdout and vendor.key in r.stdout


def test_the_checkout_script_and_the_console_script_run_the_same_command(cli, filled, monkeypatch, capsys):
    """tools/cache.py run as a script, and pyproject's kernelize-cache, call the package's main."""
    cache, hit, vendor = filled
    monkeypatch.setattr(sys, "argv", ["tools/cache.py", "check", "--cache-dir", str(cache.root)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(REPO / "tools" / "cache.py"), run_name="__main__")
    assert exited.value.code == 0 and "0 problem(s)" in capsys.readouterr().out
    module, _, name = console_scripts()["kernelize-cache"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main


@pytest.mark.parametrize("args, says", [(["import"], "required: --cache-dir, archive"), (["bogus"], "invalid choice"),
                                        (["verify", "--cache-dir", "x"], "required: --target")])
def test_argument_errors_are_one_line_exit_2(cli, capsys, args, says):
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and says in line and line.endswith("(see --help)"), line


@pytest.mark.parametrize("command", [["list"], ["check"], ["verify", "--target", "interpreter"]])
def test_missing_folder_or_empty_namespace_is_an_error(cli, tmp_path, capsys, command):
    missing = tmp_path / "typo"
    assert cli.main([*command, "--cache-dir", str(missing)]) == 2
    assert f"no kernel cache at {missing}: the folder does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([*command, "--cache-dir", str(empty)]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and ("no kernel cache namespace" in err or "no cache entries" in err)
    KernelCache(empty, NS, FP)._ensure_dirs()  # a namespace folder without entries
    args = [*command, "--cache-dir", str(empty)] + ([] if "verify" in command else ["--namespace", NS])
    assert cli.main(args) == 2
    assert "no cache entries in" in capsys.readouterr().err


def test_trust_commands(cli, tmp_path, capsys):
    assert cli.main(["trust", "list"]) == 0
    assert capsys.readouterr().out == ""
    assert cli.main(["trust", "key"]) == 0
    mine = capsys.readouterr().out.strip()
    assert mine.startswith("ed25519:")
    other = "ed25519:" + "B" * 43 + "="
    assert cli.main(["trust", "add", other, "--name", "ci runner"]) == 0
    assert "now trusting" in capsys.readouterr().out
    assert cli.main(["trust", "list"]) == 0
    listed = capsys.readouterr().out
    assert f"{mine}  your own key" in listed and f"{other}  ci runner" in listed
    assert cli.main(["trust", "remove", other]) == 0
    assert cli.main(["trust", "remove", other]) == 2
    assert cli.main(["trust", "add", "not-a-key"]) == 2
    assert "is not a public key" in capsys.readouterr().err


def test_help_documents_exit_codes(cli, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "  2  nothing was done" in out and "KERNELIZE_CONFIG_DIR" in out
    assert out.startswith("usage: python -m torch_kernelize.cache ")
