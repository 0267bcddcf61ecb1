"""Sorts of index keys on the narrowest type (compiling/narrow_sorts.py): an MoE router's sort of
its expert ids runs on int8 keys, its outputs the same as eager's; keys of unknown range stay."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.backend import compile_with_session
from torch_kernelize.compiling.lower import Session
from torch_kernelize.compiling.narrow_sorts import index_bound, narrow_sorts
from torch_kernelize.core.options import Options

aten = torch.ops.aten


def _router(logits: torch.Tensor, h: torch.Tensor):
    """transformers' experts code: the tokens sorted by expert id, the rows gathered, the ids read."""
    _, idx = torch.topk(logits, 2, dim=-1)
    ids, perm = torch.sort(idx.reshape(-1), stable=True)
    return h[perm // 2] * ids.ge(3).unsqueeze(-1), ids.int()


def _sort_keys(gm) -> list[torch.dtype]:
    return [n.args[0].meta["val"].dtype for n in gm.graph.nodes if n.target in (aten.sort.stable, aten.sort.default)]


@pytest.mark.parametrize("experts,narrow", [(4, torch.int8), (128, torch.int8), (129, torch.int16),
                                            (40000, torch.int32)])
def test_index_keys_are_sorted_on_the_narrowest_type_that_holds_them(experts, narrow):
    gm = make_fx(_router, tracing_mode="fake")(torch.randn(16, experts), torch.randn(16, 8))
    assert index_bound(next(n for n in gm.graph.nodes if n.target is aten.sort.stable).args[0]) == experts
    assert narrow_sorts(gm.graph) == 1 and _sort_keys(gm) == [narrow]
    gm.graph.lint()


def test_keys_of_unknown_range_are_left_as_they_are():
    def sort_input(x):
        return torch.sort(x.reshape(-1), stable=True)
    gm = make_fx(sort_input, tracing_mode="fake")(torch.randint(0, 9, (4, 4)))
    assert narrow_sorts(gm.graph) == 0 and _sort_keys(gm) == [torch.int64]


def test_the_router_compiled_gives_eagers_outputs(tmp_path):
    opts = Options.resolve({"target": "interpreter", "cache_dir": str(tmp_path / "cache"), "repro_dir": "off",
                            "graph_cache": "off"})
    session, graphs = Session(opts), []
    compiled = torch.compile(_router, backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    logits, h = torch.randn(32, 4), torch.randn(32, 8)
    logits[:, 0] = logits[:, 1] = 5.0  # (ties: every token's picks are experts 0 and 1)
    for got, want in zip(compiled(logits, h), _router(logits, h)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert _sort_keys(graphs[0].plan.gm) == [torch.int8]
