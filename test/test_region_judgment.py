"""A fused region that serving tries before the stretches it overlaps (an MoE's gated experts:
compiling/glu_regions.py) is judged in the graph where both serve (fill_cache/region_judgment.py):
its unit is the region with those stretches, whose assembly finds the same stretches (and keys)
again; the unit's assembly is lowered with the region as stored and set aside
(compiling/set_aside.py); a region that does not make its unit faster is stored as "vendor
wins", and serving then runs its parts. On the interpreter, with injected times."""
from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from torch_kernelize.compiling.glu_regions import KIND
from torch_kernelize.compiling.regions import region_spec
from torch_kernelize.compiling.whole_graph import BROKEN, WHOLE
from torch_kernelize.core.region_graph import region_graph
from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache import measure
from torch_kernelize.fill_cache.collect import specs_from_model
from torch_kernelize.fill_cache.fill_run import FillRun
from torch_kernelize.fill_cache.region_judgment import PARTS_WIN
from torch_kernelize.kernel_cache import KernelCache

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
TARGET = get_target("interpreter")

# transformers' experts (a grouped GEMM the model passes through as its own op, its product cut in
# gate and up), then more work: the stretch after the op holds the gated activation too
MODEL = """
import torch
from test_kernels_grouped_mm import _op

class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 40, 24, generator=g) / 24 ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(20, 8, generator=g) / 20 ** 0.5)

    def forward(self, x, offs):
        gate, up = _op()(x, self.w.transpose(1, 2), offs).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ self.w2
        return (y.relu() + x[:, :8].sin()).sum(1), y.exp()

def make():
    torch.manual_seed(0)
    return Experts().eval(), (torch.randn(40, 24), torch.tensor([8, 8, 21, 33], dtype=torch.int32))
"""


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """(model reference, model, its inputs, the region's Work, every Work)."""
    folder = tmp_path_factory.mktemp("experts")
    (folder / "experts.py").write_text(MODEL)
    ref = f"{folder / 'experts.py'}:make"
    spec = importlib.util.spec_from_file_location("experts", folder / "experts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, inputs = module.make()
    works = specs_from_model(ref, TARGET, folder / "cache", supported=lambda s: True)
    glu = next(w for w in works if w.spec.graph and region_graph(w.spec)["kind"] == KIND)
    return ref, model, inputs, glu, works


def _kinds(spec):
    return [n["op"] for n in region_graph(spec)["nodes"]]


def test_the_region_is_judged_with_the_stretch_it_overlaps(experts):
    _, _, inputs, glu, works = experts
    unit = glu.judged_in
    assert unit is not None and region_graph(unit)["kind"] == WHOLE
    stretch = next(w for w in works if w.spec.graph and region_graph(w.spec)["kind"] == WHOLE)
    # the unit: the stretch's nodes and the one node of the region outside it, the grouped GEMM
    gemm = _kinds(glu.spec)[0]
    assert Counter(_kinds(unit)) - Counter(_kinds(stretch.spec)) == Counter({gemm: 1}), gemm
    assert not Counter(_kinds(stretch.spec)) - Counter(_kinds(unit))
    # the router's offsets, as the model's call gave them: the GEMM's groups are timed as served
    (pinned,) = [v for v in glu.judged_pins.values()]
    assert pinned.tolist() == inputs[1].tolist()
    # lowered for its assembly, the unit finds the region first, then the same stretch (same key)
    from torch_kernelize.compiling.lower import LoweredGraph, Session
    from torch_kernelize.core.options import Options
    from torch_kernelize.core.region_graph import region_graph_module
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    gm = region_graph_module(unit)
    examples = [m.empty("cpu") for m in unit.inputs]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) for t in examples])
    lowered = LoweredGraph(gm, examples, Session(Options.for_fill("/nonexistent-kernelize-cache"), TARGET),
                           "inference", whole=False)
    first, second = lowered.regions[:2]
    assert first.kind == KIND and second.kind == WHOLE and second.stretch == BROKEN
    assert [region_spec(r, {}).key for r in (first, second)] == [glu.spec.key, stretch.spec.key]


def _filled(tmp_path, glu):
    """A cache holding a kernel of the region (the interpreter's: validated, not timed)."""
    cache = KernelCache.for_target(tmp_path / "cache", TARGET)
    run = FillRun(TARGET, cache, budget=1, resume=False, force=True, min_speedup=1.03, isolate=False)
    row = run.process(glu)
    assert row["status"] == "stored", row
    run.rows = [row]
    return cache, run


@pytest.mark.parametrize("faster", ["region", "parts"])
def test_a_region_that_does_not_make_its_unit_faster_is_set_aside_and_serving_runs_its_parts(
        experts, tmp_path, monkeypatch, faster):
    ref, model, inputs, glu, _ = experts
    cache, run = _filled(tmp_path, glu)
    lowered = []  # per assembly lowered: the keys set aside, the region's tier in it
    real = measure.assembly_runner

    def runner(spec, target, cache_dir, set_aside=frozenset()):
        run_it = real(spec, target, cache_dir, set_aside)
        tiers = {d.spec_key: d.tier for d in run_it.lowered.report.regions}
        lowered.append((set(set_aside), tiers[glu.spec.key]))
        return run_it
    monkeypatch.setattr(measure, "assembly_runner", runner)
    monkeypatch.setattr(measure, "timing_available", lambda t: True)
    times = (1.0, 2.0) if faster == "region" else (2.0, 2.0)  # (with it, without it): a tie sets it aside
    outputs = []
    monkeypatch.setattr(measure, "paired_ms", lambda a, b, rounds: outputs.append((a(), b())) or times)
    try:
        run.judge_regions([glu])
    finally:
        run.close()
    assert lowered == [(set(), "triton"), ({glu.spec.key}, "vendor")]
    (with_it, without_it), = outputs  # both assemblies ran, on the same inputs, to the same values
    for a, b in zip(with_it, without_it):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    entry = cache.lookup(glu.spec.key)[1]
    if faster == "region":
        assert entry.winner == "triton" and run.rows[0]["status"] == "stored"
        return
    assert entry.winner == "vendor" and entry.note.startswith(PARTS_WIN), entry.note
    assert entry.record["judgment"] == {"unit": glu.judged_in.key, "with_ms": 2.0, "without_ms": 2.0}
    assert run.rows[0]["status"] == PARTS_WIN
    # served: the region's nodes go to the stretch and nodes after it, with the same outputs
    report = tmp_path / "report.json"
    compiled = torch.compile(model, backend="kernelize", options={
        "target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": "off", "report": str(report)})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    (graph,) = json.loads(report.read_text())["graphs"]
    region = next(r for r in graph["regions"] if r["spec_key"] == glu.spec.key)
    assert region["tier"] == "vendor" and PARTS_WIN in region["reason"], region


def test_set_aside_lookups_answer_vendor_for_their_keys_only():
    from torch_kernelize.compiling.set_aside import SET_ASIDE, SetAside

    class Inner:
        witnesses = {}

        def lookup(self, key):
            return "hit", "entry", "stored"
        lookup_node = lookup_region = lambda self, node, spec: self.lookup(spec.key)

    class Spec:
        key = "b"
    lookups = SetAside(Inner(), frozenset({"a"}))
    assert lookups.lookup("a")[0] == "vendor" and SET_ASIDE in lookups.lookup("a")[2]
    assert lookups.lookup("b") == ("hit", "entry", "stored")
    assert lookups.lookup_region(None, Spec()) == ("hit", "entry", "stored")
    Spec.key = "a"
    assert lookups.lookup_node(None, Spec())[0] == "vendor"


def test_the_measure_worker_times_the_unit_and_the_interpreter_times_nothing(experts, tmp_path):
    """A fill measures in a worker process (measure_worker.IsolatedMeasurer.assemblies): on the
    interpreter it times nothing, and the region stays as stored."""
    _, _, _, glu, _ = experts
    cache, run = _filled(tmp_path, glu)
    run.close()
    run = FillRun(TARGET, cache, budget=1, resume=False, force=False, min_speedup=1.03, isolate=True)
    try:
        run.judge_regions([glu])
    finally:
        run.close()
    assert cache.lookup(glu.spec.key)[1].winner == "triton"


def test_serving_tries_the_whole_graph_first_then_the_gated_experts_then_the_stretches():
    """A whole graph's program, where it won, was timed against the assembly with the region (its
    own lowering holds it): the region must not keep that program from serving. A stretch's was
    not: the region comes before it, and is judged in its unit instead."""
    from test_kernels_grouped_mm_glu import BF16, F16, _experts, _inputs, _trace
    from torch_kernelize.compiling.lower import LoweredGraph, Session
    from torch_kernelize.core.options import Options
    order = {}
    for form, dtype, offs in (("aten", BF16, (8, 8, 21, 33, 40)), ("silu", F16, (8, 8, 21, 33, 36))):
        inputs = _inputs(dtype=dtype, offs=offs)  # (torch's grouped GEMM is an ATen op: no stretch)
        lowered = LoweredGraph(_trace(_experts(form), inputs), list(inputs),
                               Session(Options.for_fill("/nonexistent-kernelize-cache"), TARGET), "inference")
        order[form] = [(r.kind, r.stretch) for r in lowered.regions[:2]]
    assert order == {"aten": [(WHOLE, ""), (KIND, "")], "silu": [(KIND, ""), (WHOLE, BROKEN)]}


def test_a_unit_that_cannot_be_timed_leaves_the_region_as_stored(experts, tmp_path, caplog):
    from torch_kernelize.fill_cache.region_judgment import judge_regions
    _, _, _, glu, _ = experts
    cache, run = _filled(tmp_path, glu)
    run.close()
    closed = []

    class Failing:
        def assemblies(self, keys):
            raise RuntimeError("the unit's lowering failed")

        def close(self):
            closed.append(True)
    judge_regions([glu], cache, lambda unit: Failing(), run.rows)
    assert cache.lookup(glu.spec.key)[1].winner == "triton" and closed == [True]
    assert "could not be timed (RuntimeError: the unit's lowering failed)" in caplog.text
