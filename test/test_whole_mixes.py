"""Mixes: a graph that competes whole is also cut into stretches where few tensors cross
(compiling/graph_cuts.py); each stretch competes on its own at --budget 2 and more (the quick
fill measures graphs whole only), and the graph's own assembly runs each stretch by its winner,
so the whole program is timed against that mix at the end of the fill."""
from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.graph_cuts import MIN_STRETCH_COMPUTE, cut_stretches
from torch_kernelize.compiling.regions import region_spec
from torch_kernelize.compiling.whole_graph import CUT, whole_graph_regions

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")

MODEL = """
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block() for _ in range(8)])

    def forward(self, x):
        return self.blocks(x).sum(dim=1)

def make():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(8, 16),)
"""


def _traced():
    namespace: dict = {}
    exec(MODEL, namespace)
    model, (x,) = namespace["make"]()
    params = dict(model.named_parameters())  # graph inputs, as Dynamo lifts them
    with torch.no_grad():
        return make_fx(lambda p, x: torch.func.functional_call(model, p, (x,)))(params, x)


def test_a_graph_is_cut_where_the_fewest_tensors_cross_and_identical_layers_share_a_spec():
    gm = _traced()
    regions, why = whole_graph_regions(gm)
    assert why == "" and not regions[0].stretch  # the whole graph first
    cuts = regions[1:]
    # about two blocks each: cut after a residual add (one tensor crosses), the row sum with the last
    assert len(cuts) == 4 and all(r.stretch == CUT for r in cuts)
    for before, after in zip(cuts, cuts[1:]):
        crossing = [n for n in after.inputs if n.op != "placeholder"]
        assert crossing == [before.nodes[-1]] and str(crossing[0].target) == "aten.add.Tensor", crossing
    # the middle ones hold the same ops, each with its own weights: one spec for both
    assert region_spec(cuts[1], {}).key == region_spec(cuts[2], {}).key != region_spec(cuts[0], {}).key


def test_a_graph_too_small_to_cut_in_two_is_not_cut():
    gm = make_fx(lambda x: (x.exp() + 1).relu().sum(0))(torch.randn(4, 4))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(nodes) < 2 * MIN_STRETCH_COMPUTE and cut_stretches(nodes) == []
    regions, _ = whole_graph_regions(gm)
    assert len(regions) == 1


def test_the_quick_fill_leaves_the_mix_and_a_larger_budget_fills_its_stretches(tmp_path):
    from torch_kernelize.fill_cache.cli import main
    from torch_kernelize.fill_cache.fill_run import MIX_LATER
    (tmp_path / "net.py").write_text(MODEL)
    ref = f"{tmp_path / 'net.py'}:make"
    args = ["--model", ref, "--target", "interpreter", "--generators", "inductor", "--cache-dir",
            str(tmp_path / "cache"), "--quiet"]
    assert main([*args, "--budget", "1", "--summary", str(tmp_path / "quick.json")]) == 0
    rows = json.loads((tmp_path / "quick.json").read_text())["specs"]
    wholes = [r for r in rows if r.get("whole")]
    assert [r["status"] for r in wholes] == ["stored"] + [MIX_LATER] * 3, wholes  # 3 specs of 4 stretches
    assert main([*args, "--budget", "2", "--summary", str(tmp_path / "more.json")]) == 0
    rows = json.loads((tmp_path / "more.json").read_text())["specs"]
    wholes = [r for r in rows if r.get("whole")]
    assert [r["status"] for r in wholes] == ["cached"] + ["stored"] * 3, wholes

    # the graph's own assembly (the whole graph's lookup off, as the fill times it) runs the stretches' programs
    from torch_kernelize.fill_cache.collect import run_compiled
    from torch_kernelize.core.targets import get_target
    import torch_kernelize.compiling.lower as lower_mod
    made = []
    real = lower_mod.LoweredGraph.__init__

    def assembly(self, *a, **k):
        made.append(self)
        real(self, *a, **{**k, "whole": False})
    lower_mod.LoweredGraph.__init__ = assembly
    try:
        model, inputs, got, graphs = run_compiled(ref, get_target("interpreter"), tmp_path / "cache")
    finally:
        lower_mod.LoweredGraph.__init__ = real
    (graph,) = made
    assert [d.tier for d in graph.wholes] == ["triton"] * 4
    with torch.no_grad():
        torch.testing.assert_close(got, model(*inputs), rtol=1e-5, atol=1e-5)
