"""Graphs compete as wholes (compiling/whole_graph.py, fill_cache/graph_candidates.py): on CPU,
Inductor's complete output for a graph of an extern GEMM, a Triton epilogue and a reduction is
captured as one program of launches and vendor steps (fill_cache/inductor_program.py), validated
at the graph level on the interpreter (a tampered one is rejected, one calling an op the chip
lacks is refused), chosen against kernelize's own assembly by measured (here injected) times,
and served whole by a warm process that compiles nothing."""
from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import torch

from conftest import COUNT_COMPILES, last_json, run_python
from torch_kernelize.core.program import KernelProgram
from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache import generators, measure
from torch_kernelize.fill_cache.cli import FillRun
from torch_kernelize.fill_cache.collect import specs_from_model
from torch_kernelize.fill_cache.inductor import GENERATOR_INSTANCE
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.compiling.whole_graph import is_whole_graph
from torch_kernelize.kernel_cache import KernelCache
from torch_kernelize.lowering.kernels import Config, KernelFamily
from torch_kernelize.lowering.kernels.recording import RecordingError

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
TARGET = get_target("interpreter")
DEFAULT = Config.of(generator="inductor", mode="default")

MODEL = """
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        return y, y.sum(dim=1)

def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(8, 16),)
"""


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The model's whole-graph spec as serving forms it, and Inductor's program for it."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "block.py").write_text(MODEL)
    ref = f"{folder / 'block.py'}:make"
    works = specs_from_model(ref, TARGET, folder / "cache", supported=lambda spec: True)
    # first: a fill stopped early still serves Inductor's whole program (collect.py)
    assert is_whole_graph(works[0].spec) and not any(is_whole_graph(w.spec) for w in works[1:])
    spec = works[0].spec
    return ref, spec, GENERATOR_INSTANCE.generate(spec, Config.of(mode="default"))


def evaluate(spec, family, config, target=TARGET):
    """One candidate of ``family`` measured (built, validated) for ``spec``."""
    measurer = Measurer(spec, family, target)
    try:
        return measurer.evaluate(config)
    finally:
        measurer.builder.close()


def fill(tmp_path, spec, times=None, monkeypatch=None):
    """One FillRun of the whole graph (Inductor asked); ``times``: (candidate ms, assembly ms) injected."""
    from torch_kernelize.fill_cache.collect import Work
    if times is not None:
        calls = []
        monkeypatch.setattr(measure, "timing_available", lambda t: True)
        monkeypatch.setattr(measure, "median_ms", lambda fn: calls.append(fn()) or times[(len(calls) - 1) % 2])
        monkeypatch.setattr(measure, "paired_ms", lambda a, b, rounds: (a(), b()) and (times[1], times[0]))
    cache = KernelCache.for_target(tmp_path / "cache", TARGET)
    run = FillRun(TARGET, cache, budget=1, resume=False, force=True, min_speedup=1.03,
                  generators=generators.chosen_generators("inductor", TARGET),
                  isolate=times is None)  # injected timings are patched in this process
    try:
        row = run.process(Work(spec, "test"))
    finally:
        run.close()
    entry = next((tmp_path / "cache").glob(f"*/entries/{spec.key}/entry.json"))
    return row, json.loads(entry.read_text())


def test_inductor_output_with_an_extern_gemm_is_captured_whole(whole):
    _, spec, program = whole
    step, = program.steps  # the GEMM with its bias: an extern call, on the caller's buffers
    assert step.op in ("aten.addmm.out", "aten.mm.out") and step.at == 0
    assert step.kwargs["out"]["buf"][0] == "out"  # Inductor writes the GEMM into the graph's output buffer
    launch, = program.launches  # relu and the row sum fused, after it, in place on that buffer
    assert launch.kernel.startswith("triton_per_fused_relu_sum") and ("out", 1) in launch.args
    again = KernelProgram.from_json(json.loads(json.dumps(program.to_json())), program.source)
    assert again == program
    ev = evaluate(spec, GENERATOR_INSTANCE, Config.of(mode="default"))
    assert ev.correct, ev.error
    assert ev.validation["kinds"][-1] == "special" and ev.validation["max_err"] < 1e-5


def test_a_decoders_concatenation_into_slices_of_a_buffer_is_captured_with_views_and_validates(tmp_path):
    """transformers' Llama: Inductor writes RoPE's rotate-half (a cat) as kernels that each write
    their part of one buffer (a pointer at an offset: program.View); an output it lays out
    otherwise than the trace is copied into the traced layout by a last step."""
    works = specs_from_model("torch_kernelize.model_zoo:make_hf_llama", TARGET, tmp_path / "cache",
                             supported=lambda spec: True)
    spec = works[0].spec
    assert is_whole_graph(spec)
    program = GENERATOR_INSTANCE.generate(spec, Config.of(mode="default"))
    assert program.views and all(v.offset > 0 for v in program.views)
    assert any(kind == "view" for launch in program.launches for kind, _ in launch.args)
    assert KernelProgram.from_json(json.loads(json.dumps(program.to_json())), program.source) == program
    family = generators.Competition.of(spec, None, [GENERATOR_INSTANCE])  # the whole graph's input domain
    ev = evaluate(spec, family, family.tagged(GENERATOR_INSTANCE.name, [Config.of(mode="default")])[0])
    assert ev.correct, ev.error


def test_a_view_must_point_past_the_start_and_inside_its_temporary():
    from torch_kernelize.core.program import Buffer, Launch, View
    launch = Launch("k", (1,), (("view", 0),))
    temps = (Buffer((16,), "float32"),)
    KernelProgram("", (launch,), temps=temps, views=(View(("tmp", 0), 8),))
    for bad in (View(("tmp", 0), 0), View(("tmp", 0), 16), View(("in", 0), 4), View(("tmp", 1), 4)):
        with pytest.raises(ValueError, match="view"):
            KernelProgram("", (launch,), temps=temps, views=(bad,))
    with pytest.raises(ValueError, match="no view buffer 1"):
        KernelProgram("", (Launch("k", (1,), (("view", 1),)),), temps=temps, views=(View(("tmp", 0), 8),))


def test_outputs_that_are_views_of_the_programs_buffers_are_made_by_alias_steps():
    """Inductor returns views (``reinterpret_tensor``) of its buffers: of another output's, of a
    temporary's; the program makes each with a last step, and the graph validates."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.regions import region_spec
    from torch_kernelize.compiling.whole_graph import whole_graph_region

    def f(a, b):
        y = torch.relu(a @ b)
        return y, y.t(), (y * 2)[:, :4]

    spec = region_spec(whole_graph_region(make_fx(f, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32)))[0], {})
    program = GENERATOR_INSTANCE.generate(spec, Config.of(mode="default"))
    aliases = [(s.args[0]["buf"], s.results) for s in program.steps if s.op == "aten.alias.default"]
    assert aliases == [(["out", 0], (("out", 1),)), (["tmp", 0], (("out", 2),))], program.steps
    assert len(program.output_init) == 3
    ev = evaluate(spec, GENERATOR_INSTANCE, Config.of(mode="default"))
    assert ev.correct, ev.error


def test_an_output_that_is_a_view_of_an_input_is_made_by_an_alias_step():
    """A stretch passes tensors on as views (Mixtral's router state): Inductor returns a view of
    the input; on the H200 such programs were refused ("an output must be a buffer the program
    makes"). The program aliases the input, as eager does, and the graph validates."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.regions import region_spec
    from torch_kernelize.compiling.whole_graph import whole_graph_region

    def f(a):
        return ((a.sin() * 2 + a.cos()).exp() - 1).abs(), a.view(4, 2, 8)[:, 0]

    spec = region_spec(whole_graph_region(make_fx(f, tracing_mode="fake")(torch.randn(4, 16)))[0], {})
    program = GENERATOR_INSTANCE.generate(spec, Config.of(mode="default"))
    aliases = [(s.args[0]["buf"], s.results) for s in program.steps if s.op == "aten.alias.default"]
    assert aliases == [(["in", 0], (("out", 1),))], program.steps
    ev = evaluate(spec, GENERATOR_INSTANCE, Config.of(mode="default"))
    assert ev.correct, ev.error


class Tampered(KernelFamily):
    """Inductor's program with one vendor step changed: the bias left out of the GEMM."""

    name = "tampered"

    def __init__(self, program: KernelProgram):
        self.program = program

    def supports(self, spec):
        return None

    def seed_configs(self, spec):
        return [Config.of(variant="no-bias")]

    def generate(self, spec, config):
        step, = self.program.steps
        args = step.args[1:] if step.op == "aten.addmm.out" else step.args
        return dataclasses.replace(self.program, steps=(dataclasses.replace(step, op="aten.mm.out", args=args),))


def test_a_tampered_graph_program_is_rejected_and_a_chip_without_its_gemm_refuses_it(whole, tmp_path):
    _, spec, program = whole
    ev = evaluate(spec, Tampered(program), Config.of(variant="no-bias"))
    assert not ev.correct and "RMSE against float64" in ev.error, ev.error  # (graph_accuracy.py)
    chip = tmp_path / "gemmless.toml"
    chip.write_text('name = "gemmless"\ndevice = "cpu"\ntriton = "interpreter"\n[ops]\n'
                    'unsupported = ["aten.addmm", "aten.mm"]\n')
    ev = evaluate(spec, GENERATOR_INSTANCE, Config.of(mode="default"), get_target(str(chip)))
    assert not ev.correct and "which target 'gemmless' does not run" in ev.error, ev.error


def test_the_faster_whole_candidate_wins_and_the_entry_says_who_competed(whole, tmp_path, monkeypatch):
    _, spec, _ = whole
    row, record = fill(tmp_path / "a", spec, (2.0, 1.0), monkeypatch)  # Inductor 2 ms, own assembly 1 ms
    assert row["status"] == "own assembly wins" and record["winner"] == "vendor", row
    assert record["note"].startswith("own assembly wins")
    names = [(c["name"], c["ms"], c["correct"]) for c in record["graph"]["candidates"]]
    assert names == [("inductor default", 2.0, True), ("assembly", 1.0, True)]
    assert record["graph"]["winner"] == "assembly" and row["graph"].endswith("-> assembly")
    row, record = fill(tmp_path / "b", spec, (1.0, 2.0), monkeypatch)
    assert row["status"] == "stored" and record["graph"]["winner"] == "inductor default", row
    assert record["provenance"]["generator"] == "inductor"


def test_the_evidence_shows_the_times_that_decided():
    """On the H200, BERT's evidence showed the program's first timing (3.77 ms) beside the
    assembly's confirmation (3.14 ms) while the program won on the confirmation's paired times: a
    near tie is timed again and those times decide, so those are the times the evidence shows."""
    from torch_kernelize.compiling.whole_graph import describe_evidence
    from torch_kernelize.fill_cache.graph_candidates import graph_evidence
    program = {"config": {"mode": "default"}, "candidate_ms": 3.77, "correct": True}
    wrong = {"config": {"mode": "max-autotune"}, "candidate_ms": None, "correct": False, "error": "off by 1"}
    timings = {"candidate_ms": 2.9, "vendor_ms": 3.14, "confirmed": True}
    evidence = graph_evidence([program, wrong], "triton", timings, program)
    assert [(c["name"], c["ms"], c.get("confirmed", False)) for c in evidence["candidates"]] == [
        ("inductor default", 2.9, True), ("inductor max-autotune", None, False), ("assembly", 3.14, True)]
    assert describe_evidence(evidence) == ("inductor default 2.900 ms (confirmed), inductor max-autotune wrong, "
                                           "assembly 3.140 ms (confirmed) -> inductor default")
    unconfirmed = graph_evidence([program], "vendor", {"candidate_ms": 3.77, "vendor_ms": 2.0}, program)
    assert describe_evidence(unconfirmed) == "inductor default 3.770 ms, assembly 2.000 ms -> assembly"


def test_a_program_that_won_first_is_timed_again_after_the_rest_and_gives_way_to_a_faster_assembly(
        whole, tmp_path, monkeypatch):
    from torch_kernelize.fill_cache.collect import Work
    _, spec, _ = whole
    row, record = fill(tmp_path, spec, (1.0, 2.0), monkeypatch)  # searched first: Inductor 1 ms, assembly 2
    assert row["status"] == "stored"
    cache = KernelCache.for_target(tmp_path / "cache", TARGET)
    run = FillRun(TARGET, cache, budget=1, resume=False, force=False, min_speedup=1.03,
                  generators=generators.chosen_generators("inductor", TARGET), isolate=False)
    try:
        run.rows = [dict(row, key=spec.key)]
        run.rejudge_wholes([Work(spec, "test")])  # nothing else was stored: nothing is timed again
        assert cache.lookup(spec.key)[1].winner == "triton"
        run.rows.append({"key": "a node", "status": "stored"})  # the rest of the run stored a kernel
        monkeypatch.setattr(measure, "paired_ms", lambda a, b, rounds: (a(), b()) and (1.0, 3.0))
        run.rejudge_wholes([Work(spec, "test")])  # now the assembly takes 1 ms, the program 3
    finally:
        run.close()
    entry = cache.lookup(spec.key)[1]
    assert entry.winner == "vendor" and entry.note.startswith("own assembly wins")
    assert entry.record["graph"]["winner"] == "assembly"
    assert {c["name"]: c["ms"] for c in entry.record["graph"]["candidates"]} == {"inductor default": 3.0,
                                                                                 "assembly": 1.0}
    assert run.rows[0]["status"] == "own assembly wins" and run.rows[0]["graph"].endswith("-> assembly")


def test_the_quick_fill_leaves_a_graph_its_program_serves_and_a_larger_budget_fills_it_too(whole, tmp_path, capsys):
    from torch_kernelize.fill_cache.cli import main
    from torch_kernelize.fill_cache.fill_run import IN_WHOLE
    ref, spec, _ = whole
    args = ["--model", ref, "--target", "interpreter", "--generators", "inductor", "--cache-dir",
            str(tmp_path / "cache"), "--quiet"]
    assert main([*args, "--budget", "1", "--summary", str(tmp_path / "quick.json")]) == 0
    rows = json.loads((tmp_path / "quick.json").read_text())["specs"]
    assert rows[0]["key"] == spec.key and rows[0]["whole"] and rows[0]["status"] == "stored", rows[0]
    assert len(rows) > 1 and all(r["status"] == IN_WHOLE for r in rows[1:]), [r["status"] for r in rows]
    assert main([*args, "--budget", "2", "--summary", str(tmp_path / "more.json")]) == 0
    rows = json.loads((tmp_path / "more.json").read_text())["specs"]
    assert rows[0]["status"] == "cached" and not any(r["status"] == IN_WHOLE for r in rows[1:])
    assert any(r["status"] == "stored" for r in rows[1:])


def test_a_whole_graphs_program_is_stored_without_binaries_for_unaligned_views(whole, tmp_path, monkeypatch):
    """Each would compile every launch a second time, which the next whole graph and the run's end
    waited for (Llama's fill: 7.7 s after its last spec); an unaligned call runs the graph's own
    assembly, as Inductor compiles again for one. A node's kernel keeps them."""
    _, spec, _ = whole
    from kernel_testing import spec_of
    from torch_kernelize.fill_cache.collect import Work
    run = FillRun(TARGET, KernelCache.for_target(tmp_path, TARGET), budget=2, resume=False, force=False,
                  min_speedup=1.03, isolate=False, generators=generators.chosen_generators("inductor", TARGET))
    searched = {}
    monkeypatch.setattr(run, "_searched", lambda search, row, progress: searched.update({search.key: search}) or row)
    node = spec_of(torch.ops.aten.relu.default, [torch.randn(8)])
    graph, op = Work(spec, "test"), Work(node, "test")
    try:
        run.process(graph, None)
        run.process(op, None)
    finally:
        run.close()
    assert searched[graph.spec.key].unaligned is False and searched[op.spec.key].unaligned is True


def test_budget_one_asks_inductor_for_the_default_mode_of_graphs_and_of_specs_no_family_generates(whole, monkeypatch):
    """The quick fill: Inductor's default mode for graph-level candidates; beside a node's own
    family it is asked at larger budgets only (a compile per node spec cost Mixtral's quick fill
    most of its 136 s on the H200), but a spec no family generates still gets its default."""
    from torch_kernelize.core.spec import KernelSpec, TensorMeta
    from torch_kernelize.fill_cache import inductor
    monkeypatch.setattr(inductor, "_on_gpu", lambda spec: True)  # (max-autotune is a GPU seed)
    from torch_kernelize.fill_cache.generators import Competition
    from torch_kernelize.lowering.kernels import family_for
    a, b = TensorMeta((64, 64), (64, 1), "float16", "cuda"), TensorMeta((64, 64), (64, 1), "float16", "cuda")
    spec = KernelSpec("aten.mm.default", [{"tensor": 0}, {"tensor": 1}], {}, (a, b),
                      (TensorMeta((64, 64), (64, 1), "float16", "cuda"),))
    modes = lambda budget, family=family_for(spec): [c.get("mode") for c in Competition.of(  # noqa: E731
        spec, family, [GENERATOR_INSTANCE], budget).seed_configs(spec) if c.get("mode")]
    assert modes(1) == [] and modes(2) == [] and modes(3) == ["default", "max-autotune"]
    assert modes(1, None) == ["default"]
    assert GENERATOR_INSTANCE.evaluations(spec, 1) == 0 and GENERATOR_INSTANCE.evaluations(whole[1], 1) == 1
    # budget 2: max-autotune for whole graphs that hold a GEMM, not yet for their nodes
    assert GENERATOR_INSTANCE.evaluations(spec, 2) == 0
    assert [c.get("mode") for c in GENERATOR_INSTANCE.seed_configs(whole[1])] == ["default", "max-autotune"]
    assert GENERATOR_INSTANCE.evaluations(whole[1], 2) == 2


def test_a_tuple_op_with_a_piece_that_is_no_tensor_still_has_a_region_meta():
    from torch_kernelize.compiling.regions import _node_meta
    metas = _node_meta((torch.empty(2, 3), 512, None), {})  # cuDNN attention returns max_q as an int
    assert metas[0]["shape"] == [2, 3] and metas[1:] == [None, None]


def test_a_written_out_references_result_takes_the_layout_the_op_gave():
    from torch_kernelize.core.region_graph import laid_out_as_traced
    out = torch.randn(2, 3, 4, 5, dtype=torch.float64)  # [b, h, s, d] as the reference writes it
    traced = {"shape": [2, 3, 4, 5], "stride": [60, 5, 15, 1]}  # CUDA's attention: [b, s, h, d] in memory
    laid, lse, max_q = laid_out_as_traced((out, out[..., 0], 4), [traced, None, None])
    assert laid.stride() == (60, 5, 15, 1) and torch.equal(laid, out) and lse is not None and max_q == 4
    laid.transpose(1, 2).view(2, 4, 15)  # what the graph does next: only that layout allows it


def test_a_discarded_candidate_is_built_again_not_read_from_its_removed_folder(tmp_path):
    from torch_kernelize.fill_cache.builder import Builder
    from torch_kernelize.lowering.kernels import family_for
    from torch_kernelize.core.spec import KernelSpec, TensorMeta
    m = TensorMeta((8,), (1,), "float32", "cpu")
    spec = KernelSpec("aten.relu.default", [{"tensor": 0}], {}, (m,), (m,))
    family = family_for(spec)
    builder = Builder(TARGET)
    try:
        config = family.seed_configs(spec)[0]
        first = builder.build(spec, family, config)
        builder.discard(spec)
        assert not first.exists()
        assert (builder.build(spec, family, config) / "program.json").exists()
    finally:
        builder.close()


def test_a_warm_process_serves_the_graph_winner_whole_and_compiles_nothing(whole, tmp_path, monkeypatch):
    ref, spec, _ = whole
    row, _ = fill(tmp_path, spec)  # unmeasured (interpreter): the validated program is stored
    assert row["status"] == "stored", row
    cache = tmp_path / "cache"
    from torch_kernelize.fill_cache.verify import verify_entries
    verdict, = verify_entries(KernelCache.for_target(cache, TARGET), TARGET, [spec.key])  # tools/cache.py verify
    assert verdict.ok, verdict.detail
    proc = run_python(COUNT_COMPILES + textwrap.dedent(f"""
        import importlib.util
        path, fn = {ref!r}.rsplit(":", 1)
        spec = importlib.util.spec_from_file_location("block", path)
        module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
        model, (x,) = getattr(module, fn)()
        compiled = torch.compile(model, backend="kernelize", options={{"target": "interpreter",
                                 "cache_dir": {str(cache)!r}, "repro_dir": "off",
                                 "report": {str(tmp_path / "report.json")!r}}})
        with torch.no_grad():
            for _ in range(3):
                got, want = compiled(x), model(x)
        err = max((g - w).abs().max().item() for g, w in zip(got, want))
        doc = json.load(open({str(tmp_path / "report.json")!r}))
        graph, = doc["graphs"]
        nodes = sorted({{(n["op"], n["tier"], n.get("family")) for n in graph["nodes"]}})
        print(json.dumps(dict(counts, err=err, nodes=nodes, whole=(graph.get("wholes") or [None])[0],
                              inductor_counters=sum(torch._dynamo.utils.counters["inductor"].values()))))
    """))
    res = last_json(proc)
    assert res["err"] < 1e-5, res
    assert res["triton_compile"] == 0 and res["jit_run"] == 0, res
    assert res["inductor_compile"] == 0 and res["inductor_counters"] == 0, res
    tiers = {op: (tier, family) for op, tier, family in res["nodes"]}
    assert tiers["aten.relu.default"] == ("triton", "inductor"), res
    assert tiers["aten.addmm.default"] == ("vendor", "inductor"), res
    assert res["whole"]["tier"] == "triton" and res["whole"]["spec_key"] == spec.key, res


def test_a_vendor_steps_result_becomes_a_buffer_the_runner_does_not_allocate():
    """What Inductor does around a convolution (extern, functional): the op's result is a program
    buffer that later steps (or launches) read; the runner runs the steps in order."""
    from torch_kernelize.core.program_steps import VendorStep
    from torch_kernelize.core.program import Buffer
    from torch_kernelize.core.spec import KernelSpec
    from torch_kernelize.serving.launch import ProgramRunner
    aten = torch.ops.aten
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    conv_args = [[1, 1], [1, 1], [1, 1], False, [0, 0], 1]
    want = torch.relu(aten.convolution.default(x, w, b, *conv_args))
    spec = KernelSpec.from_call(aten.convolution.default, [x, w, b, *conv_args], {}, want)
    conv = VendorStep("aten.convolution.default", [{"buf": ["in", 0]}, {"buf": ["in", 1]}, {"buf": ["in", 2]},
                                                   *conv_args], {}, 0, (("tmp", 0),))
    relu = VendorStep("aten.clamp_min.out", [{"buf": ["tmp", 0], "view": [[2, 4, 8, 8], [256, 64, 8, 1], 0]}, 0.0],
                      {"out": {"buf": ["out", 0]}}, 0)
    program = KernelProgram("", (), temps=(Buffer((512,), "float32"),), steps=(conv, relu))
    runner = ProgramRunner(spec, program, [], "interpreter")
    outs, temps = runner.allocate(torch.device("cpu"))
    assert temps == [None] and outs[0] is not None
    torch.testing.assert_close(runner(x, w, b), want)
    # the CUDA path: a launch after the step reads the step's result from the pool (a fake launcher)
    import types
    from torch_kernelize.serving import launch
    seen = []
    runner.backend, runner.program = "cuda", types.SimpleNamespace(launches=[None])
    runner._cuda_plans = [(lambda gx, gy, gz, stream, t: seen.append(t), launch._getter([4]), 1, 1, 1)]
    orig_stream = launch._raw_stream
    launch._raw_stream = lambda device: 0
    try:
        outs, temps = runner.allocate(torch.device("cpu"))
        runner._launch_with_steps([x, w, b], outs, temps)
    finally:
        launch._raw_stream = orig_stream
    assert len(seen) == 1 and seen[0] is temps[0]  # pool position 4: inputs 0-2, output 3, tmp 0
    torch.testing.assert_close(outs[0], want)
    with pytest.raises(ValueError, match="no tmp buffer 1"):
        dataclasses.replace(program, steps=(dataclasses.replace(conv, results=(("tmp", 1),)), relu))
    with pytest.raises(ValueError, match="calls an ATen op"):
        dataclasses.replace(program, steps=(dataclasses.replace(conv, op="myns.anything.default"), relu))
    with pytest.raises(ValueError, match="steps run in order"):
        dataclasses.replace(program, steps=(dataclasses.replace(conv, at=1), relu))


def test_a_whole_graphs_token_ids_are_drawn_in_range_of_the_embedding_they_index():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.regions import region_spec
    from torch_kernelize.compiling.whole_graph import whole_graph_region
    from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN, index_bounds

    def f(ids, mask, table):
        x = torch.nn.functional.embedding(ids.view(-1), table)
        return (x * mask.view(-1, 1)).sum(0), torch.index_select(table, 0, ids[:, 0]).exp()

    args = (torch.randint(0, 5, (3, 4)), torch.randint(0, 2, (3, 4)), torch.randn(5, 8))
    spec = region_spec(whole_graph_region(make_fx(f, tracing_mode="fake")(*args))[0], {})
    assert index_bounds(spec) == {0: 5}
    for kind in ("random", "zeros", "large", "negative", "special"):
        ids, mask, _ = WHOLE_GRAPH_DOMAIN.sample_inputs(spec, 0, kind)
        # an integer input that indexes nothing directly is zeros: in range wherever it ends up
        assert 0 <= ids.min() and ids.max() < 5 and mask.eq(0).all()
        spec.run_vendor([ids, mask, torch.randn(5, 8)])  # in range: the graph runs


def test_a_sorts_inverse_permutation_scattered_by_index_put_is_drawn_as_a_permutation():
    """An MoE router's inverse of its sort (``inv = empty(n).index_put([perm], arange(n))``, then
    ``x[inv]``): zeros for ``perm`` leave most of ``inv`` unwritten (Inductor then read garbage
    indices on Mixtral's stretches); a permutation writes every row once, and the graph runs."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.regions import region_spec
    from torch_kernelize.compiling.whole_graph import whole_graph_region
    from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN, permutation_inputs

    def f(perm, counts, keep, x):
        inv = torch.empty(perm.shape[0], dtype=torch.int64).index_put([perm], torch.arange(perm.shape[0]))
        summed = torch.zeros(8, 4).index_put([counts], x, accumulate=True)  # (accumulating: any index is fine)
        kept = torch.zeros(6, 4).index_put([keep], torch.tensor(1.0))  # (a mask selects: no permutation)
        return x[inv] * 2, summed.exp(), kept + 1

    args = (torch.randperm(6), torch.zeros(6, dtype=torch.int64), torch.rand(6) > 0.5, torch.randn(6, 4))
    spec = region_spec(whole_graph_region(make_fx(f, tracing_mode="fake")(*args))[0], {})
    assert permutation_inputs(spec) == {0}
    for kind in ("random", "zeros", "large"):
        drawn = WHOLE_GRAPH_DOMAIN.sample_inputs(spec, 3, kind)  # (and the graph's constant, 1.0)
        perm, counts, keep, x = drawn[:4]
        assert sorted(perm.tolist()) == list(range(6)) and counts.eq(0).all() and keep.dtype == torch.bool
        torch.testing.assert_close(spec.run_vendor(drawn)[0], x[torch.argsort(perm)] * 2)


def test_a_tensor_constant_is_an_input_of_the_whole_graph():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.whole_graph import whole_graph_region
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
    gm = make_fx(lambda x: ((x * scale).relu().sum(0),))(torch.randn(3, 4))  # (real: the constant is kept)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(torch.randn(3, 4))
    region, why = whole_graph_region(gm)
    assert region is not None, why
    assert sorted(n.op for n in region.inputs) == ["get_attr", "placeholder"]


@pytest.mark.parametrize("op", ["flash", "efficient", "cudnn"])
def test_cudas_fused_attention_has_a_float64_reference_written_out(op):
    """A whole graph keeps CUDA's attention ops; its float64 reference replays them written out
    (those kernels run no float64). Checked on the CPU against torch's own math attention."""
    from torch_kernelize.core.float64_references import float64_reference
    aten = torch.ops.aten
    q, k, v = (torch.randn(2, 3, 40, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(2, 3, 40, 40, dtype=torch.float64)
    target = {"flash": aten._scaled_dot_product_flash_attention.default,
              "efficient": aten._scaled_dot_product_efficient_attention.default,
              "cudnn": aten._scaled_dot_product_cudnn_attention.default}[op]
    args = [q, k, v] + ([] if op == "flash" else [mask, True]) + [0.0, op == "flash"]
    outs = float64_reference(target, args)(*args, scale=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, None if op == "flash" else mask,
                                                            is_causal=op == "flash", scale=0.5)
    torch.testing.assert_close(outs[0], want)
    assert len(outs) == len(target._schema.returns)
    lse = outs[1][..., :40].reshape(2, 3, 40)
    assert torch.isfinite(lse).all() and float64_reference(target, [q.half(), k, v]) is None


OFFSET_IDS = """
import torch

class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 8))

    def forward(self, x, ids):  # ids count from 1 (as positions after a padding offset): the graph takes ids - 1
        return (torch.nn.functional.embedding(ids - 1, self.table) * x).sum(-1).relu()

def make():
    torch.manual_seed(0)
    return Lookup(), (torch.randn(4, 6, 8), torch.randint(1, 11, (4, 6)))
"""


def test_a_graphs_index_inputs_are_the_models_own_and_its_program_is_judged_on_them(tmp_path):
    """No rule knows every index input's domain (1-based ids here; Mixtral's routing indices on
    the H200, where drawn ones hit device-side asserts). The fill takes a whole graph's integer
    and boolean inputs from one more call of the model (Work.pins); its candidates are captured
    and validated on them, its floating inputs drawn as before. Drawn (zeros), these ids index
    row -1: the graph could not be checked."""
    from torch_kernelize.fill_cache.collect import Work, load_model
    from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN
    (tmp_path / "lookup.py").write_text(OFFSET_IDS)
    works = specs_from_model(f"{tmp_path / 'lookup.py'}:make", TARGET, tmp_path / "cache", supported=lambda s: True)
    whole = works[0]
    assert is_whole_graph(whole.spec) and whole.pins is not None
    (at, ids), = whole.pins.items()   # the ids; the table and x are floating: drawn
    _, (_, want) = load_model(f"{tmp_path / 'lookup.py'}:make")
    assert whole.spec.inputs[at].dtype == "int64" and torch.equal(ids, want) and int(ids.min()) >= 1
    for kind in ("random", *WHOLE_GRAPH_DOMAIN.edge_kinds):
        WHOLE_GRAPH_DOMAIN.pin(whole.spec.key, whole.pins)
        assert torch.equal(WHOLE_GRAPH_DOMAIN.sample_inputs(whole.spec, 3, kind)[at], ids)

    def fill(work):   # in a fresh measure worker: the pins go with the spec
        run = FillRun(TARGET, KernelCache.for_target(tmp_path / "cache", TARGET), budget=1, resume=False,
                      force=True, min_speedup=1.03, generators=generators.chosen_generators("inductor", TARGET))
        try:
            return run.process(work)
        finally:
            run.close()
    row = fill(whole)
    assert row["status"] == "stored" and row["winner"].startswith("inductor"), row
    WHOLE_GRAPH_DOMAIN.pins.pop(whole.spec.key)
    drawn = fill(Work(whole.spec, "test"))
    assert drawn["status"] == "could not check" and "index out of range" in drawn["winner"], drawn


def test_a_model_whose_second_call_fails_has_its_graphs_index_inputs_drawn(tmp_path, monkeypatch, caplog):
    """Keeping the index inputs takes a second call of the model; where that call raises (a
    stateful model), the fill goes on with them drawn, and says so."""
    from torch_kernelize.serving import runtime

    def broken(self, *args):
        raise RuntimeError("a model that counts its calls")
    monkeypatch.setattr(runtime.CapturingInterpreter, "run", broken)
    (tmp_path / "lookup.py").write_text(OFFSET_IDS)
    works = specs_from_model(f"{tmp_path / 'lookup.py'}:make", TARGET, tmp_path / "cache", supported=lambda s: True)
    assert is_whole_graph(works[0].spec) and works[0].pins is None
    assert "could not be kept from a second call of the model (RuntimeError: a model that counts" in caplog.text


PATCH_MODEL = """
import torch

class PatchEmbed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 8, kernel_size=4, stride=4)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.proj(x).flatten(2).transpose(1, 2))

def make():
    torch.manual_seed(0)
    return PatchEmbed(), (torch.randn(2, 3, 9, 8),)
"""


def test_a_graph_rewritten_before_inductor_is_one_more_whole_graph_candidate(tmp_path, whole):
    """patch-conv (compiling/graph_rewrites.py): a convolution whose kernel is its stride becomes
    a GEMM over patches in the graph Inductor compiles; the candidate has no convolution step left
    and validates against the reference. A graph with nothing to rewrite gets the config only
    where it holds the op, and fails it before any compile."""
    (tmp_path / "patch.py").write_text(PATCH_MODEL)
    works = specs_from_model(f"{tmp_path / 'patch.py'}:make", TARGET, tmp_path / "cache", supported=lambda spec: True)
    spec = works[0].spec
    assert is_whole_graph(spec)
    rewritten = Config.of(mode="default", rewrite="patch-conv")
    assert GENERATOR_INSTANCE.seed_configs(spec)[:2] == [Config.of(mode="default"), rewritten]
    assert GENERATOR_INSTANCE.evaluations(spec, 1) == 2  # the quick fill asks for both
    program = GENERATOR_INSTANCE.generate(spec, rewritten)
    assert not any("convolution" in s.op for s in program.steps)
    assert any(s.op.startswith(("aten.mm", "aten.addmm")) for s in program.steps)
    family = generators.Competition.of(spec, None, [GENERATOR_INSTANCE])
    ev = evaluate(spec, family, family.tagged(GENERATOR_INSTANCE.name, [rewritten])[0])
    assert ev.correct, ev.error
    assert GENERATOR_INSTANCE.provenance(rewritten)["inductor"]["rewrite"] == "patch-conv"
    # a padded 3x3 convolution, and the block without one: not offered; asked anyway, refused
    (tmp_path / "padded.py").write_text(PATCH_MODEL.replace("kernel_size=4, stride=4", "kernel_size=3, padding=1"))
    padded = specs_from_model(f"{tmp_path / 'padded.py'}:make", TARGET, tmp_path / "cache2",
                              supported=lambda spec: True)[0].spec
    for other in (padded, whole[1]):
        assert all(c.get("rewrite") is None for c in GENERATOR_INSTANCE.seed_configs(other))
    with pytest.raises(RecordingError, match="changes nothing"):
        GENERATOR_INSTANCE.generate(whole[1], rewritten)


def test_patch_convolution_is_the_convolution_where_the_kernel_tiles_the_input_and_declines_elsewhere():
    import torch.nn.functional as F

    from torch_kernelize.compiling.graph_rewrites import patch_convolution
    torch.manual_seed(0)
    for k, size, conv in [((4,), (10,), F.conv1d), ((4, 4), (9, 8), F.conv2d), ((2, 3), (9, 8), F.conv2d),
                          ((2, 2, 2), (5, 4, 4), F.conv3d)]:
        x, w = torch.randn(2, 3, *size, dtype=torch.float64), torch.randn(5, 3, *k, dtype=torch.float64)
        for bias in (torch.randn(5, dtype=torch.float64), None):
            out = patch_convolution(x, w, bias, list(k), [0] * len(k), [1] * len(k), False, [0] * len(k), 1)
            ref = conv(x, w, bias, stride=k)  # (a remainder no patch covers is dropped, as here)
            assert out.shape == ref.shape and out.is_contiguous() and torch.allclose(out, ref, atol=1e-12)
    x, w = torch.randn(2, 4, 8, 8), torch.randn(4, 4, 2, 2)
    last = patch_convolution(x.to(memory_format=torch.channels_last), w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1)
    eager = F.conv2d(x.to(memory_format=torch.channels_last), w, stride=2)
    assert last.stride() == eager.stride() and torch.allclose(last, eager, atol=1e-5)  # (the layout cuDNN gives)
    declined = [([2, 2], [1, 1], [1, 1], False, 1), ([2, 2], [0, 0], [2, 2], False, 1),
                ([1, 2], [0, 0], [1, 1], False, 1), ([2, 2], [0, 0], [1, 1], True, 1),
                ([2, 2], [0, 0], [1, 1], False, 2)]
    for stride, padding, dilation, transposed, groups in declined:
        assert patch_convolution(x, w, None, stride, padding, dilation, transposed, [0, 0], groups) is NotImplemented
    one_by_one = torch.randn(4, 4, 1, 1)
    assert patch_convolution(x, one_by_one, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1) is NotImplemented


def test_a_whole_graphs_own_assembly_is_lowered_from_the_cache_being_filled(whole, tmp_path, monkeypatch):
    """The baseline a graph's program is timed against runs the kernels this fill stored: its
    lowering session opens the run's own namespace, not one nested under it (a session's
    cache_dir is the root; the first version passed the namespace, so every assembly ran ATen)."""
    from torch_kernelize.fill_cache import graph_candidates
    _, spec, _ = whole
    cache = KernelCache.for_target(tmp_path / "cache", TARGET)
    run = FillRun(TARGET, cache, budget=1, resume=False, force=False, min_speedup=1.03,
                  generators=generators.chosen_generators("inductor", TARGET), isolate=False)
    try:
        measurer = run._measurer(spec, run.space(spec), [])
        assembly = graph_candidates.assembly_runner(spec, TARGET, measurer.cache_dir)
    finally:
        run.close()
    assert assembly.lowered.session.cache.dir == cache.dir
