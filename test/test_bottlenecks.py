"""The bottleneck ledger (python -m torch_kernelize.bottlenecks): floors at a chip's ceilings, the
ranking, performance reproducers and their task, check_candidate --time, the reconnect history,
the outputs; timings are injected wherever a number is asserted (the CPU is noisy)."""
from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import REPO
from torch_kernelize import bottlenecks
from torch_kernelize.core.errors import TargetError
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target, get_target, load_target_file
from torch_kernelize.ledger import history, output
from torch_kernelize.ledger.floors import Ceilings, ceilings_for, floor
from torch_kernelize.ledger.perf_repro import write_perf_repro
from torch_kernelize.ledger.profile import NodeRun, Profile
from torch_kernelize.ledger.rank import rank, worth_a_reproducer

aten = torch.ops.aten
CHIP = Ceilings(1000.0, {"bfloat16": 100.0}, "chip file")   # 1 TB/s, 100 TFLOP/s


def _spec(op, *tensors, dtype=torch.float32) -> KernelSpec:
    tensors = [t.to(dtype) for t in tensors]
    return KernelSpec.from_call(op, tensors, {}, op(*tensors))


MM = _spec(aten.mm.default, torch.randn(1024, 512), torch.randn(512, 1024), dtype=torch.bfloat16)
TANH = _spec(aten.tanh.default, torch.randn(64, 256))
SIGMOID = _spec(aten.sigmoid.default, torch.randn(8, 32))


def test_floors_at_the_chip_files_ceilings(tmp_path):
    chip = tmp_path / "chip.toml"
    chip.write_text('name = "c"\ndevice = "cpu"\ntriton = "interpreter"\nbandwidth_gbs = 1000\n[tflops]\nbfloat16 = 100\n')
    ceilings = ceilings_for(load_target_file(chip), None)
    assert (ceilings.bandwidth_gbs, ceilings.tflops, ceilings.source) == (1000.0, {"bfloat16": 100.0}, "chip file")
    f = floor(MM, ceilings)   # 2*1024*512*1024 FLOPs at 100 TFLOP/s beats its bytes at 1 TB/s
    assert (f.flops, f.bytes, f.bound) == (2 * 1024 * 512 * 1024, 2 * (2 * 1024 * 512 + 1024 * 1024), "compute")
    assert f.us == pytest.approx(f.flops / 100e12 * 1e6)
    t = floor(TANH, ceilings)  # float32 FLOPs of an elementwise op are none: its bytes decide
    assert (t.flops, t.bytes, t.bound) == (0, 2 * 64 * 256 * 4, "memory")
    assert t.us == pytest.approx(t.bytes / 1e12 * 1e6)
    assert floor(TANH, ceilings_for(get_target("interpreter"), tmp_path)).us is None
    chip.write_text('name = "c"\ndevice = "cpu"\ntriton = "interpreter"\n[tflops]\nfloat17 = 3\n')
    with pytest.raises(TargetError, match="not torch dtype names"):
        load_target_file(chip)


def test_floors_count_the_work_torchs_flop_counter_has_no_formula_for():
    """An MoE's experts (transformers' opaque grouped GEMM op: FlopCounterMode sees none of its mms)
    and grouped-query attention (torch's formula asserts on fewer KV heads) count their matmuls."""
    pytest.importorskip("transformers.integrations.moe")
    experts = torch.ops.transformers.grouped_mm_fallback.default
    x, w, offs = torch.randn(10, 16), torch.randn(3, 16, 24), torch.tensor([4, 4, 10])
    assert floor(KernelSpec.from_call(experts, (x, w, offs), {}, experts(x, w, offs)), CHIP).flops == 2 * 10 * 16 * 24
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    q, kv = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32)
    out = sdpa(q, kv.repeat_interleave(4, 1), kv.repeat_interleave(4, 1))
    gqa = KernelSpec.from_call(sdpa, (q, kv, kv), {}, out)
    assert floor(gqa, CHIP).flops == 2 * (2 * 8) * 16 * 16 * (32 + 32)


def test_the_cuda_targets_ceilings_are_measured_once_and_kept(tmp_path):
    measured = []

    def measure():
        measured.append(1)
        return {"bandwidth_gbs": 4230.0, "tflops": {"bfloat16": 729.0}, "source": "measured"}
    gpu = Target("gpu", device="cuda", triton="cuda")
    first, again = ceilings_for(gpu, tmp_path, measure), ceilings_for(gpu, tmp_path, measure)
    assert first == again and first.bandwidth_gbs == 4230.0 and len(measured) == 1
    assert (tmp_path / gpu.fingerprint_id() / "ceilings.json").exists()


def _profile(host_s=None) -> Profile:
    nodes = [NodeRun("g0", "mm_1", "triton", "mm", MM, MM.key, 1, 300e-6),
             NodeRun("g0", "tanh", "vendor", "tanh", TANH, None, 1, 100e-6),
             NodeRun("g0", "view", "view", "aten.view.default", None, None, 0, 5e-6),
             NodeRun("g1", "mm_2", "triton", "mm", MM, MM.key, 2, 300e-6)]
    return Profile("cuda", 3, 1e-3, host_s, nodes)


class _Cache:
    """A cache with one entry, its journal beside it: what rank reads of a KernelCache."""

    def __init__(self, root: Path):
        self.dir = root
        (root / "journals").mkdir(parents=True)
        lines = [{"config": {"BLOCK": 64}, "family": "matmul+inductor", "correct": True, "candidate_ms": 0.5,
                  "vendor_ms": 0.4},
                 {"config": {"generator": "inductor"}, "family": "matmul+inductor", "correct": True,
                  "candidate_ms": 0.35, "vendor_ms": 0.41},
                 {"config": {"BLOCK": 32}, "family": "matmul+inductor", "correct": False, "candidate_ms": 0.01},
                 {"config": {"external": "9f2c"}, "family": "matmul+external", "correct": True, "candidate_ms": 0.45}]
        malformed = '\n[1, 2]\n{"correct": true, "config": 5}'  # skipped like the cut line
        (root / "journals" / f"{MM.key}.jsonl").write_text("\n".join(map(json.dumps, lines)) + malformed + "\n{cut")

    def get(self, key):
        if key != MM.key:
            return None
        return types.SimpleNamespace(winner="triton", family="matmul", timings={"measured": False},
                                     provenance={"generator": "inductor"})


def test_rows_are_specs_ranked_by_time_against_their_floor(tmp_path):
    rows = rank(_profile(), _Cache(tmp_path), CHIP)
    assert [r.key for r in rows] == [MM.key, TANH.key, "op:aten.view.default"]
    mm = rows[0]
    assert mm.where == ["g0:mm_1", "g1:mm_2"] and mm.launches == 3 and mm.seconds == pytest.approx(600e-6)
    assert mm.share == pytest.approx(600 / 705)
    assert mm.floor_s == pytest.approx(2 * floor(MM, CHIP).us * 1e-6)   # both nodes at the floor
    assert mm.distance == pytest.approx(600e-6 / mm.floor_s)
    # the served kernel's generator is the entry's provenance; the journal's best of each other one
    assert mm.generator == "inductor"
    assert mm.alternatives == {"vendor": 0.4, "matmul": 0.5, "inductor": 0.35, "external": 0.45}
    assert mm.best_alternative == ("vendor", 0.4)
    assert rows[1].generator == "vendor (miss)" and rows[1].floor_s == pytest.approx(floor(TANH, CHIP).us * 1e-6)
    assert rows[2].floor_s is None and rows[2].generator == "view"
    assert [r.key for r in worth_a_reproducer(rows, 5)] == [MM.key, TANH.key]
    near = Ceilings(1000.0, {"bfloat16": 100.0 * mm.floor_s / 600e-6}, "x")   # the mm at its floor now
    assert [r.key for r in worth_a_reproducer(rank(_profile(), _Cache(tmp_path / "2"), near), 5)] == [TANH.key]
    assert json.loads(json.dumps(mm.to_json()))["best_alternative"] == {"generator": "vendor", "ms": 0.4}


def test_a_performance_reproducer_says_what_to_beat_and_how(tmp_path):
    node = NodeRun("g0", "sigmoid", "vendor", "sigmoid", SIGMOID, None, 1, 40e-6)
    row = rank(Profile("cpu", 3, 1e-4, None, [node]), None, CHIP)[0]
    x = torch.randn(8, 32)
    folder = write_perf_repro(tmp_path / "repros", row, [x], get_target("interpreter"), tmp_path / "cache", CHIP,
                              "m.py:make")
    meta = json.loads((folder / "spec.json").read_text())
    perf = json.loads((folder / "perf.json").read_text())
    assert meta["kind"] == "slow" and meta["spec"]["key"] == SIGMOID.key and meta["perf"]["time_to_beat_us"] == 40.0
    assert perf["time_to_beat_us"] == pytest.approx(40.0) and perf["graph_replay_us"] is None
    assert perf["floor_us"] == pytest.approx(2 * 8 * 32 * 4 / 1e12 * 1e6) and perf["bound"] == "memory"
    assert torch.equal(torch.load(folder / "reference.pt")[0], torch.sigmoid(x.double()))
    task = (folder / "task.md").read_text()
    for text in ("## Time to beat", "time to beat: 40 us", "floor: 0.00205 us (memory-bound: 2,048 bytes",
                 "python check_candidate.py my_kernel.py --time",
                 f"fill_cache --repros {folder.parent} --candidate my_kernel.py", "python -m torch_kernelize.bottlenecks",
                 f'SPECS = ["{SIGMOID.key}"]'):
        assert text in task, text
    node.seconds = 20e-6   # a later run refreshes the time to beat in place
    write_perf_repro(tmp_path / "repros", rank(Profile("cpu", 3, 1e-4, None, [node]), None, CHIP)[0], [x],
                     get_target("interpreter"), tmp_path / "cache", CHIP, "m.py:make")
    assert json.loads((folder / "perf.json").read_text())["time_to_beat_us"] == pytest.approx(20.0)
    assert (folder / "task.md").read_text().count("## Time to beat") == 1

    from torch_kernelize.fill_cache.external import check_main
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = check_main(folder, [str(REPO / "test" / "candidates" / "sigmoid_ok.py"), "--time", "--target",
                                   "interpreter"])
    assert code == 0 and "ACCEPTED" in out.getvalue(), out.getvalue()
    assert "TIME: not measured: timing needs a GPU" in out.getvalue() and "time to beat: 20 us" in out.getvalue()


def test_the_history_shows_the_time_per_call_before_and_after(tmp_path):
    path = tmp_path / "ledger-history.jsonl"
    rows = rank(_profile(), None, CHIP)
    first = history.run_record("m.py:make", "cuda", _profile(), rows)
    assert history.last_run(path, "m.py:make") is None
    assert "first run" in history.compare(None, first)
    history.append(path, first)
    history.append(path, history.run_record("other.py:make", "cuda", Profile("cuda", 3, 9.0, None, []), []))
    with open(path, "a") as f:
        f.write("{half a line\n")
    faster = _profile()
    faster.call_s, faster.nodes[0].seconds, faster.nodes[3].seconds = 0.5e-3, 100e-6, 100e-6
    second = history.run_record("m.py:make", "cuda", faster, rank(faster, None, CHIP))
    before = history.last_run(path, "m.py:make")
    assert before["call_ms"] == pytest.approx(1.0)
    line = history.compare(before, second)
    assert "1 ms before" in line and "-> 0.5 ms per call (2x faster)" in line and "0.6 -> 0.2 ms" in line, line


def test_table_json_and_chart(tmp_path, monkeypatch):
    profile = _profile(host_s=2e-3)   # the host takes longer to issue a call than its kernels run
    rows = rank(profile, None, CHIP)
    text = output.table(rows, profile)
    assert "HOST-BOUND" in text and "1 ms per call" in text and "3 launches per call" not in text
    lines = text.splitlines()
    assert lines[3].split()[:3] == ["1", "600", "85.1%"] and "inductor" not in lines[3]
    assert "device-bound" in output.table(rows, _profile(host_s=1e-6))
    data = output.ledger_json(rows, profile, {"model": "m"})
    assert data["host_bound"] is True and [r["key"] for r in data["rows"]] == [r.key for r in rows]
    try:
        import matplotlib  # noqa: F401 - the optional `bench` extra
    except ImportError:
        pass
    else:
        assert output.chart(rows, tmp_path / "c.png", "t") == f"chart: {tmp_path / 'c.png'}"
        assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if it were not installed
    assert output.chart(rows, tmp_path / "d.png", "t").startswith("chart: skipped (matplotlib is not installed")



def test_a_row_that_runs_several_kernels_says_where_its_time_goes():
    """A whole graph's program is one row (one cache entry) of dozens of launches: the table
    lists its slowest device kernels under it, the JSON all of them."""
    node = NodeRun("g0", "whole", "triton", "whole", MM, MM.key, 5, 500e-6,
                   kernels={"nvjet_gemm": 300e-6, "triton_poi_fused_add_0": 100e-6, "triton_red_1": 60e-6,
                            "cudnn_sdpa": 30e-6, "Memset (Device)": 10e-6})
    profile = Profile("cuda", 5, 1e-3, None, [node])
    rows = rank(profile, None, CHIP)
    lines = output.table(rows, profile).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  1 "))   # the first ranked row
    assert [line.split()[-1] for line in lines[at + 1:at + 4]] == ["nvjet_gemm", "triton_poi_fused_add_0", "triton_red_1"]
    assert "60.0% of the row" in lines[at + 1] and lines[at + 4].strip() == "... 2 more kernels"
    assert list(output.ledger_json(rows, profile, {})["rows"][0]["kernels"]) == list(node.kernels)



def test_a_whole_graphs_program_gets_no_reproducer_of_its_own():
    """A whole program far above its floor is listed with its kernels, but no reproducer: the
    graph competes whole in every fill, and its reproducer would carry every weight."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_kernelize.compiling.regions import region_spec
    from torch_kernelize.compiling.whole_graph import whole_graph_region
    from torch_kernelize.ledger.rank import worth_a_reproducer
    gm = make_fx(lambda a, b: (torch.relu(a @ b) * 2).sum(-1), tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32))
    whole = region_spec(whole_graph_region(gm)[0], {})
    slow = [NodeRun("g0", "whole", "triton", "whole", whole, whole.key, 3, 900e-6, kernels={"a": 6e-4, "b": 3e-4}),
            NodeRun("g0", "tanh", "vendor", "tanh", TANH, None, 1, 100e-6)]
    rows = rank(Profile("cuda", 1, 1e-3, None, slow), None, CHIP)
    assert rows[0].spec is whole and rows[0].above_floor
    assert [r.spec for r in worth_a_reproducer(rows, 3)] == [TANH]


MODEL = '''
import torch
class M(torch.nn.Module):
    def forward(self, x):
        return (torch.tanh(x) * 2.0).exp()
def make():
    torch.manual_seed(0)
    return M(), (torch.randn(16, 32),)
'''


def test_fusion_opportunities_are_regions_whose_nodes_run_apart(tmp_path):
    from torch_kernelize.ledger.profile import RegionRun
    from torch_kernelize.ledger.rank import fusions
    region = KernelSpec("region", [], {}, TANH.inputs, TANH.outputs, False, '{"kind":"pointwise","nodes":[]}')
    nodes = [NodeRun("g", "tanh", "vendor", "tanh", TANH, None, 1, 10e-6),
             NodeRun("g", "view", "view", "view", None, None, 0, 1e-6),
             NodeRun("g", "mul", "triton", "mul", TANH, None, 1, 20e-6),
             NodeRun("g", "exp", "vendor", "exp", TANH, None, 1, 30e-6)]
    regions = [RegionRun("g", region, ["tanh", "view", "mul"], [("tanh", 0)], "miss"),
               RegionRun("g", region, ["mul", "exp"], [("mul", 0)], "miss"),     # overlaps the larger one
               RegionRun("g", region, ["view", "exp"], [("view", 0)], "miss")]   # one launch: nothing to fuse
    found = fusions(Profile("cpu", 1, 1e-4, None, nodes, regions), CHIP)
    assert len(found) == 1 and [n.node for n in found[0].nodes] == ["mul", "exp"]
    row = found[0]
    assert (row.tier, row.launches, row.calls, row.input_sources) == ("fusion", 2, 1, [("g", "mul", 0)])
    x = torch.randn(3)
    assert row.capture_points() == [("g", "mul")] and row.inputs_from({("g", "mul"): [x]}) == [x]
    assert row.inputs_from({}) is None
    assert row.seconds == pytest.approx(50e-6) and row.spec is region
    assert row.floor_s == pytest.approx(floor(TANH, CHIP).us * 1e-6)   # the region's bytes once
    # two layers' identical regions are one row, as two calls of one kernel are
    layer2 = [dataclasses.replace(n, node=n.node + "_2") for n in nodes]
    twice = [*regions, RegionRun("g", region, ["mul_2", "exp_2"], [("mul_2", 0)], "miss")]
    (row,) = fusions(Profile("cpu", 1, 1e-4, None, nodes + layer2, twice), CHIP)
    assert (row.calls, row.launches, row.where) == (2, 4, ["g:mul", "g:exp", "g:mul_2", "g:exp_2"])
    assert row.floor_s == pytest.approx(2 * floor(TANH, CHIP).us * 1e-6) and row.op.startswith("fuse 2 launches")


def test_the_command_ranks_offers_a_fusion_and_reconnects_after_the_fill(tmp_path, capsys):
    from torch_kernelize.fill_cache import cli as fill_cli
    model = tmp_path / "m.py"
    model.write_text(MODEL)
    ref, cache, repros = f"{model}:make", tmp_path / "cache", tmp_path / "repros"
    args = ["--target", "interpreter", "--cache-dir", str(cache)]
    ledger = ["--model", ref, *args, "--repro-dir", str(repros), "--out", str(tmp_path / "out"), "--top", "1"]
    assert bottlenecks.main(ledger) == 0   # nothing filled: three vendor ops, one region they could be
    first = capsys.readouterr().out
    assert "first run" in first and "host and kernel time are one here" in first
    assert "fuse 3 launches: pointwise region [tanh mul exp]" in first
    assert "(0 entries)" in first and "the cache is empty" in first   # said, not left to the table to show
    data = json.loads((tmp_path / "out" / "m_make-interpreter.json").read_text())
    assert {(r["tier"], r["generator"], r["launches"]) for r in data["rows"]} == {("vendor", "vendor (miss)", 1)}
    assert len(data["fusions"]) == 1 and len(data["reproducers"]) == 2
    fusion = next(Path(f) for f in data["reproducers"] if json.loads((Path(f) / "perf.json").read_text())["fusion_of"])
    assert "A fusion opportunity" in (fusion / "task.md").read_text()
    # the reproducers filled (as a candidate file would be): the region now runs as one kernel
    assert fill_cli.main(["--repros", str(repros), *args, "--quiet", "--budget", "1"]) == 0
    capsys.readouterr()
    assert bottlenecks.main(ledger) == 0
    second = capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "m_make-interpreter.json").read_text())
    assert [(r["tier"], r["generator"], r["launches"]) for r in data["rows"]] == [("triton", "fused", 1)]
    assert data["fusions"] == [] and "ms before (" in second and data["before"]["launches"] == 3
    assert "the cache is empty" not in second
    lines = list(cache.glob("*/ledger-history.jsonl"))[0].read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["model"] == ref for line in lines)
    assert bottlenecks.main(["--model", f"{tmp_path}/nope.py:make", *args]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_node_ranges_are_read_from_torch_profiler_events():
    """The CUDA path's reading of torch.profiler's events (their names and fields), on CPU events:
    each node's range is found by name, its device time (none here) and kernels counted."""
    import collections
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch_kernelize.ledger.profile import RANGE, _read_ranges
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function(f"{RANGE}inference_0|mm_1"):
                torch.randn(8, 8) @ torch.randn(8, 8)
            with record_function(f"{RANGE}inference_0|relu|x"):   # a node name holding the separator
                torch.relu(torch.randn(4))
    spent = collections.defaultdict(float)
    kernels = collections.defaultdict(lambda: collections.defaultdict(float))
    _read_ranges(prof.events(), spent, kernels)
    assert set(spent) == {("inference_0", "mm_1"), ("inference_0", "relu|x")}
    assert all(v == 0.0 for v in spent.values()) and not any(kernels.values())   # no device kernels on a CPU
    # as CUDA events come: the kernels hang off the launch calls under the range (microseconds)
    from torch.autograd.profiler_util import Kernel
    cpu = torch.autograd.DeviceType.CPU
    launch = types.SimpleNamespace(name="cuLaunchKernel", device_type=cpu, cpu_children=[],
                                   kernels=[Kernel("triton_poi_fused_0", 0, 3.0)])
    vendor = types.SimpleNamespace(name="aten::mm", device_type=cpu, kernels=[Kernel("sm90_gemm", 0, 5.0)],
                                   cpu_children=[launch])
    node = types.SimpleNamespace(name=f"{RANGE}g|whole", device_type=cpu, kernels=[], cpu_children=[vendor],
                                 device_time_total=8.0)
    _read_ranges([node, vendor, launch], spent, kernels)
    assert spent[("g", "whole")] == pytest.approx(8e-6)
    assert kernels[("g", "whole")] == {"sm90_gemm": pytest.approx(5e-6), "triton_poi_fused_0": pytest.approx(3e-6),
                                       "": 2}


def test_the_profile_maps_nodes_and_takes_the_median_call(tmp_path):
    """A real served model, timed with an injected clock: every node found with its spec and
    tier, the fusion opportunity found, and a call that a busy host stretched does not count."""
    from torch_kernelize.fill_cache.collect import served_model
    from torch_kernelize.ledger.profile import profile_model
    model = tmp_path / "m.py"
    model.write_text(MODEL)

    class Clock:
        t, step = 0.0, 1e-6

        def __call__(self):
            self.t += self.step
            return self.t
    clock, invoked = Clock(), []
    with served_model(f"{model}:make", get_target("interpreter"), tmp_path / "cache") as (_, inputs, compiled, _, graphs):
        def call(*args):
            invoked.append(1)
            clock.step = 1.0 if len(invoked) == 6 else 1e-6   # the second profiled call is preempted
            return compiled(*args)
        profile = profile_model(call, inputs, graphs, cuda=False, calls=3, clock=clock)
    assert len(invoked) == 7 and profile.call_s == pytest.approx(2e-6) and profile.host_s is None
    ops = {n.op.split("(")[0]: (n.tier, n.launches, n.seconds) for n in profile.nodes}
    assert set(ops) == {"aten.tanh.default", "aten.mul.Tensor", "aten.exp.default"}
    assert all(tier == "vendor" and launches == 1 and s == pytest.approx(1e-6) for tier, launches, s in ops.values())
    (region,) = [r for r in profile.regions if len(r.members) == 3]
    assert region.spec.op == "region" and region.inputs == [("tanh", 0)]


def test_a_whole_graph_without_its_program_is_no_fusion_opportunity():
    """Issue 35's whole-graph regions compete as wholes in the fill; a whole graph left to its
    regions ("own assembly wins") would cover every other opportunity."""
    import torch.fx as fx
    from torch_kernelize.compiling.regions import Region
    from torch_kernelize.ledger.profile import _unfused_regions
    gm = fx.symbolic_trace(lambda x: torch.exp(torch.tanh(x)))
    x, tanh, exp = [n for n in gm.graph.nodes if n.op != "output"]
    for n in (x, tanh, exp):
        n.meta["val"] = torch.empty(4)

    def decision(kind):
        graph = json.dumps({"kind": kind, "nodes": [{}, {}], "outputs": [1]})
        spec = KernelSpec("region", [], {}, TANH.inputs, TANH.outputs, False, graph)
        return types.SimpleNamespace(node=f"region:{tanh.name}", spec=spec, spec_key=spec.key, tier="vendor",
                                     reason="miss")
    graph = types.SimpleNamespace(name="g", regions=[Region(kind, [tanh, exp], [x], [exp]) for kind in ("whole", "pointwise")])
    spec = types.SimpleNamespace(regions=[decision("whole"), decision("pointwise")])
    found = _unfused_regions(graph, spec, {x.name, tanh.name, exp.name})
    assert [(r.members, r.inputs) for r in found] == [([tanh.name, exp.name], [(tanh.name, 0)])]
    assert json.loads(found[0].spec.graph)["kind"] == "pointwise"


def test_a_task_written_where_a_gpu_is_times_the_vendor_op(monkeypatch):
    """On a GPU the task states the vendor op's median time (on the H200 this path raised an
    ImportError and ended the ledger); faked here: CUDA available, the timer and the device name."""
    import torch_kernelize.fill_cache.benchmark as benchmark
    from torch_kernelize.core.spec import KernelSpec, TensorMeta
    from torch_kernelize.lowering.kernels.elementwise import ElementwiseFamily
    from torch_kernelize.repro import task

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU-X")
    monkeypatch.setattr(benchmark, "median_ms", lambda fn: 0.25)
    family = ElementwiseFamily()
    monkeypatch.setattr(family, "sample_inputs", lambda spec, seed, kind, device: [torch.randn(4, 8)])
    meta = TensorMeta((4, 8), (8, 1), "float32", "cpu")
    spec = KernelSpec("aten.sigmoid.default", [], {}, (meta,), (meta,))
    assert task._vendor_time(spec, family) == "250.00 us median on GPU-X (triton.testing.do_bench)"
