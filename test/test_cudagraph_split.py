"""CUDA graphs around host syncs (issue 38): the split plan of a bound graph, each stretch captured
and replayed through an injected capture backend (a fake one on CPU that records what it captured
and refuses syncs during a capture, as CUDA does), the size bound of data-dependent stretches, and
the report; on a GPU, an MoE layer with a host sync captured in pieces."""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from torch_kernelize.compiling.report import ReportWriter
from torch_kernelize.serving import cudagraphs
from torch_kernelize.serving.graph_split import split_plan, sync_reason

aten = torch.ops.aten


@torch.library.custom_op("kernelize_test_cg::grouped", mutates_args=())
def grouped(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Like transformers' MoE ``_grouped_mm_fallback``: reads the group sizes on the host."""
    sizes = counts.tolist()
    return torch.cat([part * (i + 1) for i, part in enumerate(x.split(sizes))])


@grouped.register_fake
def _(x, counts):
    return torch.empty_like(x)


class TinyMoE(torch.nn.Module):
    """A router whose token counts go to the host (a custom op's tolist, then an .item())."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 8)
        self.up = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.gate(x).relu()
        counts = torch.tensor([2, 2], device=x.device)
        y = grouped(h, counts)
        # a count read on the host, used as a scalar afterwards (each stretch launches more kernels
        # than its replay would copy inputs: split_plan runs cheaper ones eagerly)
        n = (y.relu() > 0).sum().item()
        return self.up(y).relu() * 2 + n


class _Refuse(TorchDispatchMode):
    """What a CUDA graph capture refuses: host reads of device values and opaque custom ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace not in ("aten", "prims") or func in (aten._local_scalar_dense.default, aten.nonzero.default):
            raise RuntimeError(f"Cannot copy between CPU and CUDA tensors during CUDA graph capture ({func})")
        return func(*args, **(kwargs or {}))


class FakeGraph:
    def __init__(self, run, args, outputs, pool):
        self.run, self.args, self.outputs, self.pool, self.replays = run, args, outputs, pool, 0


class FakeCapture:
    """Captures on the CPU: a capture runs the stretch once under ``_Refuse``; a replay runs it again
    on the captured inputs and writes its results into the captured outputs (as a replay would)."""

    device_type = "cpu"

    def __init__(self):
        self.graphs: list[FakeGraph] = []
        self.pools: list[tuple] = []

    def new_pool(self):
        self.pools.append(("pool", len(self.pools)))
        return self.pools[-1]

    def capture(self, run, args, pool):
        for _ in range(2):
            run(list(args))
        with _Refuse():
            outputs = run(list(args))
        self.graphs.append(FakeGraph(run, args, outputs, pool))
        return self.graphs[-1], outputs

    def replay(self, graph):
        graph.replays += 1
        for dst, src in zip(pytree.tree_leaves(graph.outputs), pytree.tree_leaves(graph.run(list(graph.args)))):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)

    def pool_bytes(self, pools):
        return sum(o.nbytes for g in self.graphs if g.pool in pools for o in pytree.tree_leaves(g.outputs)
                   if isinstance(o, torch.Tensor))


@pytest.fixture
def fake(monkeypatch):
    capture = FakeCapture()
    monkeypatch.setattr(cudagraphs, "CudaCapture", lambda: capture)
    monkeypatch.setattr(cudagraphs, "_stats", [])  # this test's compiled graphs only
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        yield capture


def _compiled(model, **options):
    return torch.compile(model, backend="kernelize",
                         options={"target": "interpreter", "cudagraphs": True, "repro_dir": "off", **options})


def _stats() -> dict:
    (entry,) = cudagraphs._stats
    return entry.to_json()


def test_an_moe_router_with_host_syncs_is_captured_in_stretches(fake):
    torch.manual_seed(0)
    model, compiled = TinyMoE(), None
    compiled = _compiled(model)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(4, 8)
            got = compiled(x).clone()
            torch.testing.assert_close(got, model(x))
    stats = _stats()
    (plan,) = stats["plans"].values()
    # cut at the custom op's tolist and at the .item(): three stretches, each one CUDA graph
    assert plan["stretches"] == 3
    assert [s.split(":")[0] for s in plan["syncs"]] == ["kernelize_test_cg.grouped.default",
                                                         "aten._local_scalar_dense.default"]
    assert "custom op not known to be capture-safe" in plan["syncs"][0]
    assert stats["per_call"] == {"graphs": 3, "stretches": 3, "syncs": 2}
    assert stats["calls"] == 3
    # the last stretch takes the count read on the host: one graph per value seen
    assert stats["graphs_captured"] == len(fake.graphs) == 3 + 2  # two more counts after the first call
    assert all(g.replays >= 1 for g in fake.graphs)
    # the first call's three graphs share one pool; a later call's new size gets a pool of its own
    # (it replays before graphs captured earlier, which a shared pool could let overwrite it)
    assert {g.pool for g in fake.graphs[:3]} == {fake.pools[0]}
    assert [g.pool for g in fake.graphs[3:]] == fake.pools[1:] and stats["pools"] == len(fake.pools)
    assert stats["pool_bytes"] > 0


def test_a_stretch_with_more_sizes_than_the_bound_runs_ungraphed(fake, monkeypatch):
    monkeypatch.setattr(cudagraphs, "MAX_SIZES", 2)

    def f(x, k):
        n = (x > k).sum().item()
        torch._check(n >= 0)
        return x * n + 1, torch.ones(n) * x.sum()  # a buffer sized by the count read on the host

    compiled = _compiled(f)
    x = torch.arange(8.0)
    for k in (6.5, 5.5, 4.5, 3.5, 6.5):  # n = 1, 2, 3, 4, 1: four sizes after the sync
        got = [t.clone() for t in compiled(x, torch.tensor(k))]
        torch.testing.assert_close(got, list(f(x, torch.tensor(k))))
    stats = _stats()
    assert stats["graphs_captured"] == 1 + 2  # the stretch before the sync, and two values after it
    (reason,) = stats["not_graphed"]
    assert "more than 2 input signatures" in reason and stats["not_graphed"][reason] == 3
    assert stats["per_call"]["graphs"] == 1


def test_a_stretch_whose_capture_fails_runs_ungraphed_with_its_reason(fake, monkeypatch):
    # its author says the custom op is capture-safe, but it reads on the host: the capture fails
    from torch_kernelize.serving import graph_split
    monkeypatch.setattr(graph_split, "CAPTURE_SAFE_OPS", {"kernelize_test_cg::grouped"})
    model = TinyMoE()
    compiled = _compiled(model)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(x).clone(), model(x))
    stats = _stats()
    assert stats["per_call"] == {"graphs": 1, "stretches": 2, "syncs": 1}  # only the stretch after the .item()
    (reason,) = stats["not_graphed"]
    assert reason.startswith("stretch 0: capture failed (RuntimeError: Cannot copy between CPU and CUDA")
    assert stats["not_graphed"][reason] == 2


def test_a_graph_without_syncs_is_one_graph_and_writes_reach_the_inputs(fake):
    def f(out, x, idx):
        out.index_add_(0, idx, x * 2)
        return out.sum()

    compiled = _compiled(f)
    idx = torch.tensor([0, 2, 2])
    for _ in range(2):
        x = torch.randn(3, 8)
        out, want = torch.ones(4, 8), torch.ones(4, 8)
        total = compiled(out, x, idx).clone()
        torch.testing.assert_close(total, f(want, x, idx))
        torch.testing.assert_close(out, want)
    stats = _stats()
    assert stats["per_call"] == {"graphs": 1, "stretches": 1, "syncs": 0}
    assert stats["graphs_captured"] == 1


def test_a_dynamic_graph_is_captured_per_call_signature(fake):
    def f(x):
        return torch.sigmoid(x) * 2 + x.view(-1).sum(), (x > 0).sum()

    compiled = torch.compile(f, backend="kernelize", dynamic=True,
                             options={"target": "interpreter", "cudagraphs": True, "repro_dir": "off"})
    for batch in (2, 3, 5, 3):
        x = torch.randn(batch, 8)
        torch.testing.assert_close([t.clone() for t in compiled(x)], list(f(x)))
    stats = _stats()
    assert stats["graphs_captured"] == 3 and stats["graph_replays"] == 4


def test_the_report_says_what_cuda_graphs_did(fake, tmp_path):
    report = tmp_path / "report.json"
    model = TinyMoE()
    compiled = _compiled(model, report=str(report))
    with torch.no_grad():
        compiled(torch.randn(4, 8))
        compiled(torch.randn(4, 8))
    ReportWriter.for_path(report).write()
    doc = json.loads(report.read_text())
    (name,) = [g["graph"] for g in doc["graphs"]]
    entry = doc["cudagraphs"][name]
    assert entry["per_call"] == {"graphs": 3, "stretches": 3, "syncs": 2}
    assert set(entry) >= {"calls", "graphs_captured", "graph_replays", "plans", "not_graphed", "pool_bytes"}
    # the benchmarks' line for a model: all its compiled graphs, one call
    summary = cudagraphs.cudagraph_summary()
    assert summary["per_call"] == entry["per_call"] and summary["compiled_graphs"] == 1


@pytest.mark.parametrize("read_later", [True, False], ids=["read-later", "not-read-later"])
def test_a_stretch_no_cheaper_replayed_than_run_runs_eagerly(read_later):
    """A replay copies each input an eager segment made, then launches the graph: a stretch whose
    own launches (plus the copies its outputs would cost a later stretch) are no more runs eagerly."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, counts):
        h = x.relu()                 # one launch, reading only the graph's input: captured
        y = grouped(h, counts)       # sync
        z = y * 2                    # one launch against a copy of y and a replay: eager
        w = grouped(z, counts)       # sync
        a = (w * 3).exp()            # two launches against a copy of w and a replay, plus a copy of a
        b = grouped(a, counts)       # sync                 in the last stretch if that reads it
        return (b.sin() + a).cos() if read_later else b.sin().cos().exp()

    cpu = torch.device("cpu")
    plan = split_plan(make_fx(f)(torch.randn(4, 8), torch.tensor([2, 2])), cpu)
    kinds = ["eager" if s.eager else "stretch" for s in plan.segments]
    ops = [[str(n.target).split(".")[1] for n in s.nodes if n.op == "call_function"] for s in plan.segments]
    if read_later:
        assert kinds == ["stretch", "eager", "stretch", "eager", "stretch"]
        assert ops[1] == ["grouped", "mul", "grouped"] and ops[2] == ["mul", "exp"]
    else:
        assert kinds == ["stretch", "eager", "stretch"]
        assert ops[1] == ["grouped", "mul", "grouped", "mul", "exp", "grouped"]
    assert [op for op, _ in plan.syncs] == ["kernelize_test_cg.grouped.default"] * 3


def test_a_stretch_of_one_program_counts_its_launches():
    """A whole graph's program is one node of the bound graph but a hundred launches: replayed, it
    is one launch and a copy; its stretch stays captured."""
    import types
    from torch_kernelize.serving.graph_split import launch_count

    class Program:  # a bound node's target as lower.py makes it: a call whose runner holds a program
        def __init__(self, launches):
            self.runner = types.SimpleNamespace(program=types.SimpleNamespace(launches=[None] * launches, steps=()))
            self.__name__ = "program"

        def __call__(self, x):
            return x * 2

    def plan(launches):
        g = torch.fx.Graph()
        x, counts = g.placeholder("x"), g.placeholder("counts")
        for n, v in ((x, torch.empty(4, 8)), (counts, torch.empty(2, dtype=torch.long))):
            n.meta["val"] = v
        y = g.call_function(torch.ops.kernelize_test_cg.grouped.default, (x, counts))
        y.meta["val"] = torch.empty(4, 8)
        z = g.call_function(Program(launches), (y,))
        z.meta["val"] = torch.empty(4, 8)
        g.output(z)
        gm = torch.fx.GraphModule(torch.nn.Module(), g)
        assert launch_count(z) == launches
        return ["eager" if s.eager else "stretch" for s in split_plan(gm, torch.device("cpu")).segments]

    assert plan(120) == ["eager", "stretch"]
    assert plan(1) == ["eager"]


def test_sync_table_and_rules():
    """Which nodes are syncs, by the table and by their outputs (traced on the meta device, which
    stands for the graph's device: a value on the CPU is one the host must compute or wait for)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        k = (x > 0).sum().item()
        idx = torch.nonzero(x > 0)
        y = (x @ w).cpu()
        return y + k, idx, torch.zeros(k, device=x.device)

    def g(x, m, v):
        x = x.clone()
        x[m] = v
        return x

    meta = torch.device("meta")
    gm = make_fx(f, tracing_mode="symbolic")(torch.empty(4, 4, device=meta), torch.empty(4, 4, device=meta))
    reasons = {str(n.target): sync_reason(n, meta) for n in gm.graph.nodes}
    assert reasons["aten._local_scalar_dense.default"].startswith("reads a device value on the host")
    assert "depends on device data" in reasons["aten.nonzero.default"]
    assert reasons["aten._to_copy.default"] == "copies between devices"
    assert reasons["aten.add.Tensor"] == "computes on the CPU"
    assert reasons["aten.mm.default"] is None and reasons["aten.sum.default"] is None
    assert reasons["aten.zeros.default"] is None  # sized by a value already read: captured per value
    mask = torch.empty(4, dtype=torch.bool, device=meta)
    gm_mask = make_fx(g, tracing_mode="symbolic")(torch.empty(4, device=meta), mask, torch.empty((), device=meta))
    (put,) = [n for n in gm_mask.graph.nodes if n.target is aten.index_put_.default]
    assert sync_reason(put, meta) == "a boolean mask index (its positions are found on the host)"
    plan = split_plan(gm, meta)
    assert [s.eager for s in plan.segments] == [False, True, False, True, False, True, False]
    assert [op for op, _ in plan.syncs] == ["aten._local_scalar_dense.default", "aten.nonzero.default",
                                           "aten._to_copy.default", "aten.add.Tensor"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_moe_layer_with_a_host_sync_is_captured_in_pieces_on_the_gpu(monkeypatch):
    monkeypatch.setattr(cudagraphs, "_stats", [])
    torch.manual_seed(0)
    model = TinyMoE().cuda()
    compiled = torch.compile(model, backend="kernelize", options={"cudagraphs": True, "repro_dir": "off"})
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        for _ in range(4):
            x = torch.randn(4, 8, device="cuda")
            torch.testing.assert_close(compiled(x).clone(), model(x))
    stats = _stats()
    assert stats["per_call"]["stretches"] >= 2 and stats["per_call"]["syncs"] >= 1
    assert stats["per_call"]["graphs"] == stats["per_call"]["stretches"]
    assert stats["pool_bytes"] > 0


def _served_mixtral(device: str, **options) -> tuple[dict, dict]:
    """transformers' tiny Mixtral compiled with ``options``, its outputs checked on three calls;
    the CUDA-graph stats and the one plan."""
    pytest.importorskip("transformers")
    from torch_kernelize import model_zoo
    model, inputs = model_zoo.make_hf_mixtral()
    model, inputs = model.to(device), tuple(t.to(device) for t in inputs)
    compiled = torch.compile(model, backend="kernelize", options={"repro_dir": "off", **options})
    with torch.no_grad():
        want = model(*inputs).logits
        for _ in range(3):
            torch.testing.assert_close(compiled(*inputs).logits.clone(), want)
    stats = _stats()
    (plan,) = stats["plans"].values()
    return stats, plan


def _mixtral_in_pieces(device: str, **options) -> dict:
    """transformers' tiny Mixtral (fp32: under torch.compile its experts go through the custom op
    ``transformers::grouped_mm_fallback``, which reads the expert offsets with ``tolist()``)."""
    stats, plan = _served_mixtral(device, **options)
    assert {s.split(":")[0] for s in plan["syncs"]} == {"transformers.grouped_mm_fallback.default"}
    n_syncs = len(plan["syncs"])  # two per layer (gate-up, down)
    # Between a layer's two syncs transformers 5.23 has the SiLU-and-multiply alone: it runs
    # eagerly (a replay would copy the gate-up output and save no launch), one stretch per layer
    # and the one after the last. 5.17 (the GPU machine's) also masks the gate-up output with
    # ``where``: five launches there, which a replay saves, so every stretch is captured.
    stretches = stats["per_call"]["stretches"]
    assert stretches in (n_syncs // 2 + 1, n_syncs + 1), stats
    assert stats["per_call"] == {"graphs": stretches, "stretches": stretches, "syncs": n_syncs}
    assert not stats["not_graphed"]
    return stats


@pytest.mark.slow
def test_transformers_mixtral_is_captured_around_its_expert_syncs(fake):
    _mixtral_in_pieces("cpu", target="interpreter", cudagraphs=True)  # ~20 s, most of it transformers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transformers_mixtral_runs_in_pieces_under_reduce_overhead_on_the_gpu(monkeypatch):
    # Inductor's reduce-overhead fails here ("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    monkeypatch.setattr(cudagraphs, "_stats", [])
    stats = _mixtral_in_pieces("cuda", cudagraphs=True)
    assert stats["pool_bytes"] > 0


@pytest.mark.slow
def test_transformers_mixtral_with_its_expert_matmuls_filled_is_one_graph(fake, tmp_path):
    """Once fill_cache has stored kernels for ``transformers::grouped_mm_fallback`` (grouped_mm.py:
    the expert offsets stay on the device), nothing in the call reads the device on the host: the
    whole call is one CUDA graph, where Inductor's reduce-overhead fails on the same model."""
    pytest.importorskip("transformers")
    from torch_kernelize.fill_cache import cli
    cache = tmp_path / "filled"
    ref = "torch_kernelize.model_zoo:make_hf_mixtral"
    assert cli.main(["--quiet", "--target", "interpreter", "--model", ref, "--cache-dir", str(cache), "--budget", "1"]) == 0
    stats, plan = _served_mixtral("cpu", target="interpreter", cudagraphs=True, cache_dir=str(cache))
    assert plan["syncs"] == [] and stats["per_call"] == {"graphs": 1, "stretches": 1, "syncs": 0}
    assert not stats["not_graphed"]
