"""The scaffold kernel families share (lowering/kernels/base.py): one memoized analysis per spec
from which supports, seeds, neighbours and generation derive; reasons raised from deep inside an
analysis; the one schema binder; the one decoder of region node arguments."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import spec_of
from torch_kernelize.core import region_graph
from torch_kernelize.lowering.kernels import _codegen as cg
from torch_kernelize.lowering.kernels.elementwise import ElementwiseFamily
from torch_kernelize.lowering.kernels.topk import TopkFamily

aten = torch.ops.aten


def counting(family, monkeypatch) -> list:
    calls = []
    analyse = family._analyse
    monkeypatch.setattr(family, "_analyse", lambda spec: calls.append(spec.key) or analyse(spec))
    return calls


def test_a_spec_is_analysed_once(monkeypatch):
    family = ElementwiseFamily()
    calls = counting(family, monkeypatch)
    spec = spec_of(aten.gelu.default, (torch.randn(300),))
    assert family.supports(spec) is None
    seeds = family.seed_configs(spec)
    near = family.neighbours(spec, seeds[0])
    family.generate(spec, seeds[0])
    assert near and all(family._valid(family.plan(spec), c) for c in seeds + near)
    assert seeds[0] not in near
    assert calls == [spec.key]
    other = spec_of(aten.gelu.default, (torch.randn(301),))
    family.supports(other)
    assert calls == [spec.key, other.key]


def test_the_memo_keeps_the_latest_plans(monkeypatch):
    family = ElementwiseFamily()
    family.PLANS_KEPT = 2
    calls = counting(family, monkeypatch)
    specs = [spec_of(aten.gelu.default, (torch.randn(n),)) for n in (10, 11, 12)]
    for s in specs + specs[-1:]:
        family.supports(s)
    family.supports(specs[0])   # pushed out by the third: analysed again
    assert calls == [s.key for s in specs] + [specs[0].key]


def test_reasons_come_from_the_plan():
    family = TopkFamily()
    x = torch.randn(4, 10)
    assert "does not handle aten.sort.default" in family.supports(spec_of(aten.sort.default, (x,)))
    assert "topk of dtype int64 is not generated" in family.supports(spec_of(aten.topk.default, (x.long(), 2)))
    with pytest.raises(ValueError, match="topk of dtype int64"):
        family.seed_configs(spec_of(aten.topk.default, (x.long(), 2)))
    assert family.neighbours(spec_of(aten.topk.default, (x.long(), 2)), family.seed_configs(
        spec_of(aten.topk.default, (x, 2)))[0]) == []


def test_arguments_that_fit_no_schema_are_a_reason():
    spec = spec_of(aten.topk.default, (torch.randn(4, 10), 2))
    bad = type(spec)(spec.op, spec.args, {"kk": 3}, spec.inputs, spec.outputs, spec.tuple_output)
    assert "unknown keyword arguments ['kk']" in TopkFamily().supports(bad)


def test_the_schema_binder():
    bound = cg.bind_arguments("aten.topk.default", [{"tensor": 0}, 3], {"largest": False})
    assert bound == {"self": {"tensor": 0}, "k": 3, "dim": -1, "largest": False, "sorted": True}
    with pytest.raises(cg.ArgumentError, match="6 positional arguments for 5"):
        cg.bind_arguments("aten.topk.default", [{"tensor": 0}, 3, -1, True, True, 0], {})
    with pytest.raises(cg.ArgumentError, match="unknown op"):
        cg.bind_arguments("aten.no_such_op.default", [], {})


def test_region_refs_have_one_decoder():
    assert region_graph.node_ref({"input": 2}) == ("input", 2)
    assert region_graph.node_ref({"node": 0}) == ("node", 0)
    assert region_graph.node_ref({"tensor": 1}) is None and region_graph.node_ref(3) is None and region_graph.node_ref([{"node": 1}]) is None
    assert region_graph.node_arg([{"tensor": 1}, [{"tensor": 0}, 2], {"float": "inf"}]) == \
        [{"input": 1}, [{"input": 0}, 2], {"float": "inf"}]


def test_generating_leaves_the_plan_as_analysed():
    """The plan is shared by every later call for the spec: generation must not annotate it."""
    from test_kernels_fused import one_region
    from torch_kernelize.lowering.kernels.fused import FAMILY as FUSED
    from torch_kernelize.lowering.kernels.layernorm import FAMILY as LAYERNORM

    x, w = torch.randn(16, 64), torch.randn(64)
    for family, spec in ((FUSED, one_region(lambda a, b: torch.sigmoid(a) * b + 1, x, w)),
                         (LAYERNORM, spec_of(aten.native_layer_norm.default, (x, [64], w, w, 1e-5)))):
        before = repr(family.plan(spec))
        for config in family.seed_configs(spec)[:3]:
            family.generate(spec, config)
        assert repr(family.plan(spec)) == before, family.name
