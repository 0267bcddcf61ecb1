"""A sync op's race as a CUDA graph serves it (issue 38): its spec's GRAPHED key, filled beside the
plain one, looked up first under the ``cudagraphs`` option (compiling/graphed_lookups.py), so that a
kernel that keeps the op on the device serves captured graphs where the op's own loop wins alone."""
from __future__ import annotations

import json

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from test_cudagraph_split import FakeCapture
from test_kernels_grouped_mm import _op
from torch_kernelize.compiling.graphed_lookups import GraphedLookups
from torch_kernelize.compiling.report import ReportWriter
from torch_kernelize.core.spec import GRAPHED, KernelSpec
from torch_kernelize.core.targets import get_target
from torch_kernelize.kernel_cache.store import KernelCache
from torch_kernelize.serving import cudagraphs


def _inputs():
    torch.manual_seed(0)
    return torch.randn(40, 24), torch.randn(5, 24, 36) / 5, torch.tensor([8, 8, 21, 33, 40])


class Experts(torch.nn.Module):
    """transformers' expert matmul (a sync as given: it reads ``offs`` with tolist) between two
    ops that capture."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(_inputs()[1])

    def forward(self, x, offs):
        return (_op()(x.relu(), self.w, offs) * 2).sum(-1)


def make_experts():
    x, _, offs = _inputs()
    return Experts(), (x, offs)


def test_a_graphed_spec_has_a_key_of_its_own_and_keeps_its_condition():
    x, w, offs = _inputs()
    spec = KernelSpec.from_call(_op(), (x, w, offs), {}, torch.empty(40, 36))
    graphed = spec.graphed()
    assert graphed.condition == GRAPHED and graphed.key != spec.key and "condition" not in spec.canonical()
    assert KernelSpec.from_json(json.loads(json.dumps(graphed.to_json()))) == graphed
    assert graphed.describe() == spec.describe() + " [graphed]"


class _Recording:
    """Lookups that miss everything but the keys given, remembering what was asked."""

    def __init__(self, found: dict[str, str]):
        self.found, self.asked, self.witnesses = found, [], {}

    def lookup(self, key):
        self.asked.append(("key", key))
        return (self.found[key], None, "") if key in self.found else ("miss", None, "")

    def lookup_node(self, node, spec):
        self.asked.append(("node", spec.key))
        return self.lookup(spec.key)

    def lookup_region(self, region, spec):
        return self.lookup(spec.key)


def test_a_node_that_syncs_is_looked_up_under_its_graphed_key_first():
    x, w, offs = _inputs()
    gm = make_fx(lambda x, w, offs: _op()(x, w, offs) * 2)(x, w, offs)
    op_node = next(n for n in gm.graph.nodes if n.target is _op())
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    spec = KernelSpec.from_call(_op(), (x, w, offs), {}, torch.empty(40, 36))
    cpu = torch.device("cpu")
    inner = _Recording({spec.graphed().key: "hit"})
    assert GraphedLookups(inner, cpu).lookup_node(op_node, spec)[0] == "hit"
    assert inner.asked == [("key", spec.graphed().key)]
    inner = _Recording({spec.key: "vendor"})  # no graphed entry: the node's own lookup
    assert GraphedLookups(inner, cpu).lookup_node(op_node, spec)[0] == "vendor"
    assert inner.asked == [("key", spec.graphed().key), ("node", spec.key), ("key", spec.key)]
    inner = _Recording({})
    GraphedLookups(inner, cpu).lookup_node(mul, spec)  # a node that captures: its own lookup only
    assert inner.asked == [("node", spec.key), ("key", spec.key)]


def test_served_under_cuda_graphs_the_graphed_winner_keeps_the_op_on_the_device(tmp_path, monkeypatch):
    """The fill stores both races; where the op's own loop won the plain one (on a GPU: each timed
    alone), plain serving runs the loop, and a captured model the graphed winner: one CUDA graph."""
    from torch_kernelize.fill_cache import cli
    cache_dir = tmp_path / "cache"
    assert cli.main(["--quiet", "--target", "interpreter", "--model", f"{__file__}:make_experts",
                     "--cache-dir", str(cache_dir), "--budget", "1"]) == 0
    cache = KernelCache.for_target(cache_dir, get_target("interpreter"))
    entries = [cache.get(k) for k in cache.keys()]
    ours = [e for e in entries if e.spec.op == "transformers.grouped_mm_fallback.default"]
    assert sorted(e.spec.condition for e in ours) == ["", GRAPHED] and all(e.winner == "triton" for e in ours)
    plain = next(e for e in ours if not e.spec.condition)
    cache.put(dict(plain.record, winner="vendor", note="the op's loop won, each timed alone"), None, replace=True)

    model, (x, offs) = make_experts()
    want = model(x, offs)
    monkeypatch.setattr(cudagraphs, "CudaCapture", FakeCapture)
    monkeypatch.setattr(cudagraphs, "_stats", [])
    tiers = {}
    for graphed in (False, True):
        torch._dynamo.reset()
        report = tmp_path / f"report-{graphed}.json"
        compiled = torch.compile(model, backend="kernelize", options={
            "target": "interpreter", "cache_dir": str(cache_dir), "repro_dir": "off", "cudagraphs": graphed,
            "report": str(report)})
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(compiled(x, offs).clone(), want)
        ReportWriter.for_path(report).write()
        doc = json.loads(report.read_text())
        tiers[graphed] = [n["tier"] for g in doc["graphs"] for n in g["nodes"]
                          if n["op"] == "transformers.grouped_mm_fallback.default"]
    assert tiers == {False: ["vendor"], True: ["triton"]}
    (stats,) = cudagraphs._stats
    (plan,) = stats.plans.values()
    assert plan == {"stretches": 1, "syncs": []}  # the graphed winner: nothing reads the device on the host
