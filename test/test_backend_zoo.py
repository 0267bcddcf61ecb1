"""The kernelize backend end to end on the example zoo, each model in a fresh process.

The fresh process never imports torch_kernelize: backend="kernelize" must resolve through the
torch_dynamo_backends entry point. Results must match eager; the report must show the graph.
"""
from __future__ import annotations

import json

import pytest

from conftest import last_json, run_python, write_target

ZOO_SNIPPET = """
import importlib.util, json, sys, torch
name, target = {name!r}, {target!r}
# Load the model zoo from its file, so that torch_kernelize itself is not imported here:
# `backend="kernelize"` has to come from the entry point.
spec = importlib.util.spec_from_file_location("model_zoo", {zoo_path!r})
zoo = importlib.util.module_from_spec(spec); spec.loader.exec_module(zoo)
assert "torch_kernelize" not in sys.modules
model, inputs = zoo.SMALL_MODELS[name]()
ref_model, _ = zoo.SMALL_MODELS[name]()
compiled = torch.compile(model, backend="kernelize", options={{"target": target, "report": {report!r}}})
with torch.no_grad():
    outs = [compiled(*inputs) for _ in range(2)]
    refs = [ref_model(*inputs) for _ in range(2)]
err = max((o - r).abs().max().item() for o, r in zip(outs, refs))
state_err = max(((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), ref_model.state_dict().values())), default=0.0)
print(json.dumps({{"err": err, "state_err": state_err, "loaded": "torch_kernelize" in sys.modules}}))
"""


def _zoo_path():
    import torch_kernelize.model_zoo as zoo
    return zoo.__file__


@pytest.mark.parametrize("name", ["mlp", "conv1d", "transformer", "moe", "inplace"])
@pytest.mark.parametrize("target", ["cpu", "interpreter"])
def test_zoo_matches_eager_in_fresh_process(name, target, tmp_path):
    report = tmp_path / "report.json"
    proc = run_python(ZOO_SNIPPET.format(name=name, target=target, report=str(report),
                                         zoo_path=_zoo_path()))
    res = last_json(proc)
    assert res["loaded"], "the backend did not load torch_kernelize through the entry point"
    assert res["err"] < 1e-4, res
    assert res["state_err"] == 0.0, "in-place updates of buffers differ from eager"
    doc = json.loads(report.read_text())
    assert doc["graphs"], "no graph was reported"
    for g in doc["graphs"]:
        assert g["target"]["name"] == target
        for node in g["nodes"]:
            assert {"op", "tier", "reason"} <= set(node)
            assert node["tier"] in ("decompose", "triton", "vendor", "fallback")


def _zoo_on_chip_without(tmp_path, name: str, op: str):
    """The zoo model ``name`` run on a chip without ``op`` (no Triton) beside eager, in a child:
    (its process, its coverage report); outputs within 1e-5 of eager."""
    chip = write_target(tmp_path / "chip.toml", unsupported=[op], triton="none")
    report = tmp_path / "report.json"
    proc = run_python(ZOO_SNIPPET.format(name=name, target=str(chip), report=str(report), zoo_path=_zoo_path()))
    assert last_json(proc)["err"] < 1e-5
    return proc, json.loads(report.read_text())


def test_moe_histc_goes_to_fallback_on_a_target_without_histc(tmp_path):
    proc, doc = _zoo_on_chip_without(tmp_path, "moe", "aten.histc")
    histc = [n for g in doc["graphs"] for n in g["nodes"] if n["op"] == "aten.histc.default"]
    assert histc and all(n["tier"] == "fallback" for n in histc)
    assert all("vendor" in n["rejected"] and "decompose" in n["rejected"] for n in histc)
    assert any("aten.histc.default" in g["summary"]["missing_ops"] for g in doc["graphs"])
    assert doc["fallback_time"]["aten.histc.default"]["calls"] == 2
    # one warning per op, not per call
    assert proc.stderr.count("aten.histc.default has no implementation") == 1


def test_gelu_unsupported_is_decomposed_and_still_matches(tmp_path):
    _, doc = _zoo_on_chip_without(tmp_path, "mlp", "aten.gelu")
    nodes = [n for g in doc["graphs"] for n in g["nodes"]]
    gelu = [n for n in nodes if n["op"] == "aten.gelu.default"]
    assert gelu and all(n["tier"] == "decompose" for n in gelu)
    assert "does not run aten.gelu.default" in gelu[0]["reason"] and "erf" in gelu[0]["reason"]
    assert not any(n["tier"] == "fallback" for n in nodes)
    # the decomposition's own nodes were planned: erf runs on the vendor tier
    assert any(n["op"] == "aten.erf.default" and n["tier"] == "vendor" for n in nodes)


def test_torch_compile_imports_the_serving_path_before_the_first_call():
    """Looking the backend up imports what a first call runs (lowering, both caches), as
    torch.compile(model) imports Inductor: their import is not part of the first call."""
    proc = run_python("""
import json, sys, torch
torch.compile(torch.nn.Linear(4, 4), backend="kernelize", options={"target": "cpu"})
print(json.dumps({m: m in sys.modules for m in ("torch_kernelize.compiling.lower", "torch_kernelize.warm_start.graph_cache",
                                                "torch_kernelize.warm_start.executable_cache", "torch_kernelize.compiling.planner")}))
""")
    assert all(last_json(proc).values()), last_json(proc)
