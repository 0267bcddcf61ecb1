"""Generators as plugins (fill_cache/generators.py): a generator found through the entry-point
group competes in the same harness as the spec's family, wins or loses, and names itself in the
entry and the journal (resume too). And the Inductor generator (fill_cache/inductor.py) on CPU:
Inductor's Triton output captured with its launch order, run on the interpreter target against
the float64 reference, stored, and served by a warm process that compiles nothing."""
from __future__ import annotations

import importlib.metadata
import json
import logging
import textwrap

import pytest
import torch

from conftest import COUNT_COMPILES, REPO, last_json, run_python
from kernel_testing import spec_of
from torch_kernelize.fill_cache import generators
from torch_kernelize.fill_cache.cli import FillRun
from torch_kernelize.fill_cache.collect import UsageError, Work
from torch_kernelize.fill_cache.inductor import InductorGenerator
from torch_kernelize.fill_cache.journal import Journal
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.kernel_cache import KernelCache
from torch_kernelize.lowering.kernels import Config, KernelFamily, family_for
from torch_kernelize.lowering.kernels.elementwise import FAMILY as ELEMENTWISE
from torch_kernelize.core.targets import get_target

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
aten = torch.ops.aten
TARGET = get_target("interpreter")


class SigmoidPlugin(KernelFamily):
    """A generator from outside the families: sigmoid kernels, or (``wrong``) tanh's."""

    def __init__(self, name: str, wrong: bool = False):
        self.name, self.wrong = name, wrong

    def supports(self, spec):
        return None if spec.op == "aten.sigmoid.default" else "sigmoid only"

    def seed_configs(self, spec):
        return [Config.of(variant="tanh" if self.wrong else "sigmoid")]

    def evaluations(self, spec, budget):
        return 1

    def generate(self, spec, config):
        if config["variant"] == "tanh":
            spec = spec_of(aten.tanh.default, [torch.zeros(spec.inputs[0].shape)])
        return ELEMENTWISE.generate(spec, ELEMENTWISE.seed_configs(spec)[0])


GOOD = SigmoidPlugin("good-plugin")
BAD = SigmoidPlugin("bad-plugin", wrong=True)


@pytest.fixture
def plugins(monkeypatch):
    """Entry points as an installed package would declare them (one that does not import)."""
    eps = [importlib.metadata.EntryPoint(name, value, generators.ENTRY_POINT_GROUP)
           for name, value in (("good", "test_generators:GOOD"), ("bad", "test_generators:BAD"),
                               ("broken", "a_package_that_is_not_installed:GENERATOR"))]
    monkeypatch.setattr(generators, "entry_points", lambda: eps)


def sigmoid_work() -> Work:
    return Work(spec_of(aten.sigmoid.default, [torch.randn(8, 32)]), "test")


def fill(tmp_path, work: Work, names: str, resume: bool = False, force: bool = False):
    cache = KernelCache.for_target(tmp_path / "cache", TARGET)
    run = FillRun(TARGET, cache, budget=1, resume=resume, force=force, min_speedup=1.03,
                  generators=generators.chosen_generators(names, TARGET))
    try:
        row = run.process(work)
    finally:
        run.close()
    return row, cache


def test_plugins_are_found_through_the_entry_point_group(plugins, caplog):
    with caplog.at_level(logging.WARNING):
        found = generators.available_generators()
    assert found["good-plugin"] is GOOD and found["bad-plugin"] is BAD and "inductor" in found
    assert found[ELEMENTWISE.name] is ELEMENTWISE  # the families are generators of the same registry
    assert "a_package_that_is_not_installed" in caplog.text and "skipped" in caplog.text
    with pytest.raises(UsageError, match="no generator named nope; there are bad-plugin, good-plugin, inductor"):
        generators.chosen_generators("nope", TARGET)
    default = generators.chosen_generators(None, TARGET)
    assert GOOD in default and all(g.name != "inductor" for g in default)  # inductor: opt in off CUDA
    from types import SimpleNamespace
    assert "inductor" in [g.name for g in generators.chosen_generators(None, SimpleNamespace(triton="cuda"))]


def test_a_plugin_candidate_competes_and_wins_with_its_provenance(plugins, tmp_path):
    work = sigmoid_work()
    row, cache = fill(tmp_path, work, "good-plugin")
    assert row["status"] == "stored" and row["evaluated"] == 2, row  # the plugin's candidate and the family's
    status, entry, _ = cache.lookup(work.spec.key)
    assert status == "hit" and entry.family == "good-plugin"  # equal on the interpreter: the first correct wins
    record = json.loads(next((tmp_path / "cache").glob(f"*/entries/{work.spec.key}/entry.json")).read_text())
    assert record["provenance"]["generator"] == "good-plugin" and record["config"] == {
        "generator": "good-plugin", "variant": "sigmoid"}
    journal = Journal(cache.journal_path(work.spec.key)).records()
    assert [r["config"].get("generator") for r in journal] == ["good-plugin", None]


def test_a_wrong_plugin_candidate_loses_to_the_family(plugins, tmp_path):
    work = sigmoid_work()
    row, cache = fill(tmp_path, work, "bad-plugin")
    assert row["status"] == "stored", row
    status, entry, _ = cache.lookup(work.spec.key)
    assert status == "hit" and entry.family == ELEMENTWISE.name
    bad, own = Journal(cache.journal_path(work.spec.key)).records()
    assert bad["config"]["generator"] == "bad-plugin" and not bad["correct"] and "trial" in bad["error"]
    assert own["correct"] and "generator" not in own["config"]


def test_resume_takes_each_generators_evaluations_and_needs_the_generator_again(plugins, tmp_path):
    work = sigmoid_work()
    fill(tmp_path, work, "good-plugin")
    row, _ = fill(tmp_path, work, "good-plugin", resume=True, force=True)
    assert row["status"] == "stored" and row["resumed"] == 2 and row["evaluated"] == 2, row
    with pytest.raises(UsageError, match="journal names generator 'good-plugin'.*--generators good-plugin"):
        fill(tmp_path, work, "none", resume=True, force=True)


def test_a_spec_no_family_generates_is_searched_when_another_generator_supports_it(plugins, tmp_path, monkeypatch):
    from torch_kernelize.fill_cache import fill_run
    monkeypatch.setattr(fill_run, "family_for", lambda spec: None)
    work = sigmoid_work()
    row, cache = fill(tmp_path, work, "good-plugin")
    assert row["status"] == "stored" and cache.lookup(work.spec.key)[1].family == "good-plugin", row
    row, _ = fill(tmp_path / "fresh", sigmoid_work(), "none")
    assert row["status"] == "no generator"


# --- the Inductor generator, on CPU ---------------------------------------------------------------

def test_inductor_capture_keeps_its_kernels_launch_order_and_temporaries():
    spec = spec_of(aten.sum.default, [torch.randn(32768)])  # a split reduction: partial sums, then theirs
    program = InductorGenerator().generate(spec, Config.of(mode="default"))
    first, second = program.launches
    assert first.kernel.startswith("triton_red_fused_sum") and second.kernel.startswith("triton_per_fused_sum")
    assert first.args[:2] == (("in", 0), ("tmp", 0)) and second.args[:2] == (("tmp", 0), ("out", 0))
    assert first.grid[0] == program.temps[0].shape[0] > 1 and second.grid == (1, 1, 1)
    assert "R0_BLOCK" in first.constexprs and "XBLOCK" in second.constexprs
    assert "triton_heuristics" not in program.source and program.source.count("@triton.jit") == 2


def test_inductor_output_with_an_extern_call_gives_no_candidate_and_says_why(monkeypatch):
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    spec = spec_of(aten.mm.default, [a, b])
    with pytest.raises(ValueError, match="no Inductor candidate \\(default\\).*no Triton kernel.*extern"):
        InductorGenerator().generate(spec, Config.of(mode="default"))
    # a graph of an extern GEMM and a Triton epilogue: the GEMM cannot be in a program
    from torch_kernelize.core.spec import KernelSpec
    monkeypatch.setattr(KernelSpec, "run_vendor", lambda self, ts: (torch.relu(ts[0] @ ts[1]),))
    with pytest.raises(ValueError, match="not only Triton launches.*aten.mm.out on the host"):
        InductorGenerator().generate(spec, Config.of(mode="default"))


def rmsnorm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def test_inductor_candidate_of_a_region_is_validated_on_the_interpreter():
    from test_kernels_fused import one_region
    spec = one_region(rmsnorm, torch.randn(4, 32, dtype=torch.float16), torch.randn(32, dtype=torch.float16))
    measurer = Measurer(spec, generators.Competition(family_for(spec), [InductorGenerator()]), TARGET)
    try:
        ev = measurer.evaluate(Config.of(generator="inductor", mode="default"))
    finally:
        measurer.builder.close()
    assert ev.correct, ev.error
    assert ev.validation["kinds"][-1] == "special"


def test_an_inductor_winner_is_served_by_a_warm_process_that_compiles_nothing(tmp_path, monkeypatch):
    from torch_kernelize.fill_cache import fill_run
    monkeypatch.setattr(fill_run, "family_for", lambda spec: None)  # Inductor's candidate is the only one
    x = torch.randn(4, 16)
    work = Work(spec_of(aten._softmax.default, [x, -1, False]), "test")
    row, cache = fill(tmp_path, work, "inductor")
    assert row["status"] == "stored" and row["winner"] == "inductor generator=inductor mode=default", row
    record = json.loads(next((tmp_path / "cache").glob(f"*/entries/{work.spec.key}/entry.json")).read_text())
    origin = record["provenance"]
    assert origin["generator"] == "inductor" and origin["inductor"]["mode"] == "default"
    assert origin["inductor"]["torch"] == torch.__version__
    from torch_kernelize.fill_cache.verify import verify_entries
    verdict, = verify_entries(cache, TARGET, [work.spec.key])  # tools/cache.py verify: no family, the default domain
    assert verdict.ok, verdict.detail
    proc = run_python(COUNT_COMPILES + textwrap.dedent(f"""
        torch._dynamo.utils.counters.clear()
        f = lambda x: torch.softmax(x, -1)
        compiled = torch.compile(f, backend="kernelize", options={{"target": "interpreter",
                                 "cache_dir": {str(tmp_path / "cache")!r}, "repro_dir": "off",
                                 "report": {str(tmp_path / "report.json")!r}}})
        x = torch.randn(4, 16)
        with torch.no_grad():
            for _ in range(3):
                err = (compiled(x) - f(x)).abs().max().item()
        doc = json.load(open({str(tmp_path / "report.json")!r}))
        nodes = [(n["op"], n["tier"], n.get("family")) for g in doc["graphs"] for n in g["nodes"]]
        inductor_counters = sum(torch._dynamo.utils.counters["inductor"].values())
        print(json.dumps(dict(counts, err=err, nodes=nodes, inductor_counters=inductor_counters)))
    """))
    res = last_json(proc)
    assert ["aten._softmax.default", "triton", "inductor"] in res["nodes"], res
    assert res["err"] < 1e-5, res
    assert res["triton_compile"] == 0 and res["jit_run"] == 0, res
    assert res["inductor_compile"] == 0 and res["inductor_counters"] == 0, res


def test_an_unknown_generator_on_the_command_line_exits_2_with_the_names_there_are(plugins, tmp_path, capsys):
    from torch_kernelize.fill_cache.cli import main
    assert main(["--model", "torch_kernelize.model_zoo:make_small", "--target", "interpreter", "--cache-dir",
                 str(tmp_path / "cache"), "--generators", "inductor,nope"]) == 2
    err = capsys.readouterr().err
    assert "--generators: no generator named nope; there are bad-plugin, good-plugin, inductor" in err
