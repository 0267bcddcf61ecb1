"""One truth for a node's tier (issue 37): the report, the log table, the MISSING lines, strict
mode and the repro folders agree; the commands they print run as printed; every output compared
(integers exactly, complex as complex)."""
from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import pytest
import torch

from conftest import write_target
from torch_kernelize import bringup, flush_repros
from torch_kernelize.fill_cache import cli as fill_cli

GEMM_ONLY = ["aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"]
MODEL = '''
import torch
class M(torch.nn.Module):
    def forward(self, x):
        y = (x * 2).relu() + 1
        return y.sigmoid() * 3, (x * 2).exp()   # two nodes of one spec (x * 2)
def make():
    return M(), (torch.randn(4, 32),)
'''


@pytest.fixture
def model_ref(tmp_path) -> str:
    (tmp_path / "m.py").write_text(MODEL)
    return f"{tmp_path / 'm.py'}:make"


def _compile(tmp_path, chip, **options):
    from torch_kernelize.fill_cache.collect import load_model
    model, (x,) = load_model(f"{tmp_path / 'm.py'}:make")
    compiled = torch.compile(model, backend="kernelize", options={
        "target": str(chip), "cache_dir": str(tmp_path / "kc"), "repro_dir": str(tmp_path / "repros"),
        "report": str(tmp_path / "report.json"), **options})
    with torch.no_grad():
        return compiled(x), model(x)


def test_strict_mode_passes_a_model_run_whole_by_fused_regions(tmp_path, model_ref):
    # the nodes of a fused region that hit were reported "tier": "triton" and "missing": true,
    # and strict mode raised for them, naming repro folders that were never written
    chip = write_target(tmp_path / "chip.toml", supported=GEMM_ONLY)
    assert fill_cli.main(["--model", model_ref, "--target", str(chip), "--cache-dir", str(tmp_path / "kc"),
                          "--budget", "1", "--quiet"]) == 0
    got, want = _compile(tmp_path, chip, strict=True)
    torch.testing.assert_close(got, want)
    [graph] = json.loads((tmp_path / "report.json").read_text())["graphs"]
    assert graph["summary"]["fused_regions"] >= 1 and graph["summary"]["coverage_pct"] == 100.0
    assert not [n for n in graph["nodes"] if n.get("missing") or n.get("repro")]
    flush_repros()
    assert not (tmp_path / "repros").exists()


def test_log_and_report_agree_on_what_runs_on_the_host(tmp_path, model_ref, caplog):
    chip = write_target(tmp_path / "chip.toml", supported=GEMM_ONLY, triton="none")
    with caplog.at_level(logging.INFO, logger="torch_kernelize"):
        _compile(tmp_path, chip)
    flush_repros()
    table = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("kernelize:"))
    missing = [line.strip() for line in table.splitlines() if line.strip().startswith("MISSING")]
    [graph] = json.loads((tmp_path / "report.json").read_text())["graphs"]
    fallback = [n for n in graph["nodes"] if n["tier"] == "fallback"]
    # one line per op and shape: the two nodes of x * 2 share one line and one folder
    assert len(missing) == len({(n["op"], n["spec_key"]) for n in fallback}) < len(fallback)
    assert any("(2 nodes)" in line for line in missing)
    for line in missing:
        op = line.split()[1].split("(")[0]
        assert any(n["op"] == op for n in fallback), line
        folder = Path(re.search(r"repro: (\S+)", line).group(1))
        assert (folder / "repro.py").exists(), line
    s = graph["summary"]
    assert s["coverage_pct"] == round(100 * (s["nodes"] - len(fallback)) / s["nodes"], 1)


def test_the_commands_bringup_prints_run_as_printed(tmp_path, model_ref, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the printed command holds relative paths as given
    chip = write_target(tmp_path / "chip.toml", supported=GEMM_ONLY)
    args = ["--target", "chip.toml", "--model", model_ref, "--cache-dir", "kc", "--repro-dir", "repros"]
    assert bringup.main(args + ["--no-fill"]) == 1
    out = capsys.readouterr().out
    assert "missing ops across all models: aten.add.Tensor, aten.exp.default, aten.le.Scalar" in out
    command = re.search(r"fill them: (.*)\):", out).group(1)
    assert "--target chip.toml" in command
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "torch_kernelize.fill_cache"]
    flush_repros()
    assert fill_cli.main(words[3:] + ["--budget", "1", "--quiet"]) == 0
    assert bringup.main(args + ["--no-fill"]) == 0, capsys.readouterr().out
    assert chip.exists()


def test_an_op_no_generator_fills_points_to_the_candidate_route(tmp_path, model_ref):
    from torch_kernelize.compiling.report import missing_lines
    from torch_kernelize.core.decision import Decision
    from torch_kernelize.core.spec import KernelSpec
    x = torch.randn(8)
    spec = KernelSpec.from_call(torch.ops.aten.histc.default, (x,), {}, torch.histc(x))
    [line] = missing_lines([Decision("n", "aten.histc.default", "fallback", "", missing=True, spec=spec,
                                     repro="kernelize_repros/histc-x")])
    assert "no generator fills it" in line and "torch_kernelize.repros task kernelize_repros/histc-x" in line
    words = shlex.split(line.split("(", 1)[1].rstrip(")"))
    from torch_kernelize.repros import main as repros_main
    assert words[:3] == ["python", "-m", "torch_kernelize.repros"]
    assert repros_main(words[3:]) == 2  # runs as printed (the folder here is not a real one)


def test_bringup_compares_integer_outputs_exactly_and_complex_as_complex():
    f = torch.randn(6)
    ok, _ = bringup.compare_outputs((f, torch.arange(6)), (f, torch.arange(6)))
    assert ok == 0.0
    err, why = bringup.compare_outputs((f, torch.arange(6) + (torch.arange(6) == 3)), (f, torch.arange(6)))
    assert err == float("inf") and "output 1" in why and "exactly" in why
    _, why = bringup.compare_outputs(torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool))
    assert why
    c = torch.randn(5, dtype=torch.complex64)
    _, why = bringup.compare_outputs(c.conj(), c)  # same real parts: a cast to real saw no difference
    assert "max error" in why


def test_bringup_fails_on_a_wrong_integer_output(tmp_path, monkeypatch, capsys):
    (tmp_path / "ids.py").write_text(
        "import torch\nclass M(torch.nn.Module):\n    def forward(self, x):\n        return x * 2, (x > 0).long()\n"
        "def make():\n    return M(), (torch.randn(4, 8),)\n")
    real = bringup._eager
    monkeypatch.setattr(bringup, "_eager", lambda *a: (lambda o: (o[0], o[1] + 1))(real(*a)))
    code = bringup.main(["--target", "cpu", "--model", f"{tmp_path / 'ids.py'}:make", "--no-fill",
                         "--repro-dir", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 1 and "DIFFERS FROM EAGER: output 1" in out


def test_complex_outputs_are_validated_as_complex():
    from torch_kernelize.core.spec import KernelSpec
    from torch_kernelize.core.validate import compare
    x = torch.randn(4, 6, dtype=torch.complex64)
    spec = KernelSpec.from_call(torch.ops.aten.mul.Tensor, (x, x), {}, x * x)
    [ref] = spec.reference([x, x])
    assert ref.dtype == torch.complex128 and torch.allclose(ref.to(torch.complex64), x * x)
    assert compare((x * x).to(torch.complex64), ref).ok
    wrong = compare((x * x).conj(), ref)
    assert not wrong.ok and "j" in wrong.reason  # printed as complex, not a cast to real


def test_complex_trial_inputs_have_imaginary_parts():
    from torch_kernelize.core.spec import KernelSpec
    from torch_kernelize.lowering.kernels.base import sample_tensor
    x = torch.zeros(4, 6, dtype=torch.complex64)
    meta = KernelSpec.from_call(torch.ops.aten.mul.Tensor, (x, x), {}, x * x).inputs[0]
    t = sample_tensor(meta, torch.Generator().manual_seed(0))
    assert t.dtype == torch.complex64 and bool((t.imag != 0).all()) and t.real.abs().max() < 100
    assert bool((sample_tensor(meta, torch.Generator().manual_seed(0), "large").abs() > 100).any())
