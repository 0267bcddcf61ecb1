"""Options and target files: every mistake gives an error that names the problem."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import write_target
from torch_kernelize.core.errors import OptionsError, TargetError
from torch_kernelize.core.targets import BUILTIN_TARGETS, get_target, load_target_file
from torch_kernelize.core.options import Options


def test_explicit_options_win_over_environment_over_defaults(tmp_path):
    env = {"KERNELIZE_TARGET": "interpreter", "KERNELIZE_STRICT": "1", "KERNELIZE_CACHE_DIR": str(tmp_path)}
    o = Options.resolve({"target": "cpu"}, env=env)
    assert o.target == "cpu" and o.strict is True and o.cache_dir == tmp_path
    d = Options.resolve({}, env={})
    assert d.target is None and d.strict is False and d.report is None
    assert d.cache_dir.name == "torch_kernelize" and d.repro_dir == Path("kernelize_repros")
    assert Options.resolve({"repro_dir": "off"}, env={}).repro_dir is None
    assert Options.resolve(None, mode="reduce-overhead", env={}).cudagraphs is True


def test_unknown_option_names_the_option_and_lists_valid_ones():
    with pytest.raises(OptionsError, match=r"unknown kernelize option\(s\) \['targte'\].*valid options are"):
        Options.resolve({"targte": "cpu"}, env={})


@pytest.mark.parametrize("options,env,match", [
    ({"strict": "maybe"}, {}, "option 'strict' must be a boolean"),
    ({}, {"KERNELIZE_CHECK": "sometimes"}, r"check \(from \$KERNELIZE_CHECK\)"),
    ({"cache_dir": ""}, {}, "option 'cache_dir' must be a path"),
    ({"target": 3}, {}, "option 'target' must be a target name"),
])
def test_malformed_option_values(options, env, match):
    with pytest.raises(OptionsError, match=match):
        Options.resolve(options, env=env)


@pytest.mark.parametrize("options,env,match", [
    ({}, {"KERNELIZE_GRAPH_CACHE": "nonsense"}, r"graph_cache \(from \$KERNELIZE_GRAPH_CACHE\)' is 'nonsense'.*'\./nonsense'"),
    ({"graph_cache": "true"}, {}, "graph_cache' must be a path, got 'true', which reads as a yes/no"),
    ({}, {"KERNELIZE_REPRO_DIR": "disabled"}, "not one of 'off' and not an existing folder"),
    ({"cache_dir": "yes"}, {}, "reads as a yes/no"),
    ({"report": "1"}, {}, "option 'report' must be a path, got '1'"),
])
def test_values_that_cannot_be_what_was_meant_are_errors(options, env, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OptionsError, match=match):
        Options.resolve(options, env=env)
    assert list(tmp_path.iterdir()) == [], "nothing may be created for a rejected value"


def test_folder_options_take_existing_folders_and_explicit_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "graphs").mkdir()
    assert Options.resolve({}, env={"KERNELIZE_GRAPH_CACHE": "graphs"}).graph_cache_dir == Path("graphs")
    assert Options.resolve({"graph_cache": "./new"}, env={}).graph_cache_dir == Path("new")
    assert Options.resolve({"repro_dir": str(tmp_path / "r")}, env={}).repro_dir == tmp_path / "r"
    assert Options.resolve({"report": "report.json"}, env={}).report == Path("report.json")


def test_unknown_mode():
    with pytest.raises(OptionsError, match="mode"):
        Options.resolve(None, mode="max-autotune", env={})


def test_option_error_reaches_the_user_through_torch_compile():
    f = torch.compile(lambda x: x + 1, backend="kernelize", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown kernelize option"):
        f(torch.randn(3))


def test_target_file_round_trip(tmp_path):
    t = load_target_file(write_target(tmp_path / "c.toml", unsupported=["aten.gelu", "aten.histc.default"]))
    assert (t.name, t.device, t.triton) == ("chip", "cpu", "interpreter")
    assert not t.vendor_runs(torch.ops.aten.gelu.default)
    assert not t.vendor_runs(torch.ops.aten.gelu.default) and not t.vendor_runs(torch.ops.aten.histc.default)
    assert t.vendor_runs(torch.ops.aten.mul.Tensor)
    allow = load_target_file(write_target(tmp_path / "a.toml", supported=["aten.mul"]))
    assert allow.vendor_runs(torch.ops.aten.mul.Tensor) and not allow.vendor_runs(torch.ops.aten.add.Tensor)


@pytest.mark.parametrize("text,match", [
    ('name = "x"\ndevice = "tpu"\ntriton = "none"\n', "device must be one of"),
    ('name = "x"\ndevice = "cpu"\ntriton = "rocm"\n', "triton must be one of"),
    ('name = "x"\ndevice = "cpu"\ntriton = "cuda"\n', "triton = 'cuda' needs device = 'cuda'"),
    ('device = "cpu"\ntriton = "none"\n', "'name' is required"),
    ('name = "x"\ndevice = "cpu"\ntriton = "none"\ncolour = 1\n', r"unknown key\(s\) \['colour'\]"),
    ('name = "x"\ndevice = "cpu"\ntriton = "none"\n[ops]\nunsupported = ["aten.gelux"]\n',
     "'aten.gelux' is not a registered PyTorch operator"),
    ('name = "x"\ndevice = "cpu"\ntriton = "none"\n[ops]\nunsupported = ["gelu"]\n', "is not an op name"),
    ('name = "x"\ndevice = "cpu"\ntriton = "none"\n[ops]\nunsupported = []\nsupported = []\n', "not both"),
    ('name = "x"\ndevice = "cpu"\ntriton = "none"\n[ops]\nunsupported = "aten.gelu"\n', "must be a list"),
    ('name = "x" device', "is not valid TOML"),
])
def test_malformed_target_files(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(TargetError, match=match) as info:
        load_target_file(path)
    assert str(path) in str(info.value) or "target" in str(info.value)


def test_target_names_and_defaults(tmp_path):
    assert get_target(None, "cpu") is BUILTIN_TARGETS["cpu"]
    assert get_target(None, "cuda") is BUILTIN_TARGETS["cuda"]
    assert get_target("interpreter").triton == "interpreter"
    with pytest.raises(TargetError, match="unknown target 'tpu'"):
        get_target("tpu")
    with pytest.raises(TargetError, match="does not exist"):
        get_target(str(tmp_path / "missing.toml"))


def test_cuda_target_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    f = torch.compile(lambda x: x + 1, backend="kernelize", options={"target": "cuda"})
    with pytest.raises(Exception, match="needs CUDA"):
        f(torch.randn(3))


def test_fingerprint_names_versions_and_device():
    fp = BUILTIN_TARGETS["interpreter"].fingerprint()
    assert set(fp) == {"triton_backend", "device", "torch", "triton"}
    assert BUILTIN_TARGETS["interpreter"].fingerprint_id().startswith("interpreter-")
