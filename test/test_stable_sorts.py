"""Sorts made stable in lowered graphs (compiling/stable_sorts.py): a whole graph that sorts keys
with ties and gathers by the order (an MoE router) has one right answer, which Inductor's program
and the reference both give."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.regions import region_spec
from torch_kernelize.compiling.stable_sorts import stable_sorts
from torch_kernelize.compiling.whole_graph import whole_graph_region
from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache.generators import Competition
from torch_kernelize.fill_cache.inductor import GENERATOR_INSTANCE
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.lowering.kernels import Config

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
aten = torch.ops.aten


def route(x, expert):
    """Tokens grouped by expert, as transformers' MoE sorts them: ties everywhere."""
    order = torch.sort(expert, dim=-1).indices
    return x[order] * 2.0, order


def _graph():
    return make_fx(route, tracing_mode="fake")(torch.randn(64, 8), torch.zeros(64, dtype=torch.int64))


def test_unstable_sorts_become_stable_ones_with_their_arguments():
    gm = make_fx(lambda x: torch.sort(x, 0, True), tracing_mode="fake")(torch.randn(4, 5))
    assert stable_sorts(gm.graph) == 1
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "sort" in str(n.target)]
    assert node.target is aten.sort.stable and node.kwargs == {"stable": True, "dim": 0, "descending": True}
    gm.recompile()
    x = torch.tensor([[1.0, 1.0, 0.0, 2.0, 1.0]] * 4).t().contiguous()
    values, indices = gm(x)
    assert torch.equal(indices[:, 0], torch.tensor([3, 0, 1, 4, 2]))   # equal keys keep their order
    assert stable_sorts(gm.graph) == 0


@pytest.mark.parametrize("stable", [False, True])
def test_a_graph_that_gathers_by_a_sort_of_ties_validates_once_its_sort_is_stable(stable):
    """On CPU (Mixtral's router stretches, zoo size): unstable, Inductor's order of the tied
    expert ids differed from ATen's in 60 of 64 places; stable, its program is right."""
    gm = _graph()
    if stable:
        stable_sorts(gm.graph)
        gm.recompile()
    spec = region_spec(whole_graph_region(gm)[0], {})
    measurer = Measurer(spec, Competition.of(spec, None, [GENERATOR_INSTANCE], 1), get_target("interpreter"))
    try:
        ev = measurer.evaluate(Config.of(generator="inductor", mode="default"))
    finally:
        measurer.builder.close()
    assert ev.correct == stable, ev.error
    if not stable:   # the expert ids are drawn as zeros: every key ties
        assert ev.error.startswith("trial 1 (random, seed 0): output 0")
