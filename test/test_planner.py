"""The planner's tier ladder: decompositions (torch's and ours), fallbacks and the reasons given."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.lower import lower
from torch_kernelize.core.targets import Target

aten = torch.ops.aten


def _chip(*unsupported: str, triton: str = "none") -> Target:
    return Target("chip", device="cpu", triton=triton, unsupported=frozenset(unsupported))


def _lower(fn, inputs, target):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    return lower(gm, inputs, {"repro_dir": "off"}, target=target)


def _by_op(lowered):
    out = {}
    for d in lowered.report.decisions:
        out.setdefault(d.op, []).append(d)
    return out


@pytest.mark.parametrize("name,fn,inputs,op", [
    ("mm", lambda a, b: a @ b, (torch.randn(5, 7), torch.randn(7, 3)), "aten.mm.default"),
    ("bmm", lambda a, b: torch.bmm(a, b), (torch.randn(2, 5, 7), torch.randn(2, 7, 3)), "aten.bmm.default"),
    ("max.dim", lambda x: torch.max(x, 1), (torch.randn(4, 9),), "aten.max.dim"),
    ("min.dim", lambda x: torch.min(x, 0, keepdim=True), (torch.randn(4, 9),), "aten.min.dim"),
    ("conv1d", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1, dilation=2),
     (torch.randn(2, 4, 17), torch.randn(6, 4, 3), torch.randn(6)), "aten.convolution.default"),
    ("conv1d_groups", lambda x, w: F.conv1d(x, w, None, padding=1, groups=2),
     (torch.randn(2, 4, 11), torch.randn(6, 2, 3)), "aten.convolution.default"),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=(1, 2), padding=(1, 0)),
     (torch.randn(2, 3, 7, 8), torch.randn(5, 3, 3, 2), torch.randn(5)), "aten.convolution.default"),
])
def test_own_decompositions_match_aten(name, fn, inputs, op):
    lowered = _lower(fn, inputs, _chip(op))
    decisions = _by_op(lowered)
    assert [d.tier for d in decisions[op]] == ["decompose"], decisions[op]
    assert not any(d.tier == "fallback" for d in lowered.report.decisions)
    got, want = lowered(list(inputs)), fn(*inputs)
    for g, w in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (got, want))):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_decomposed_nodes_are_planned_again():
    # gelu decomposes to erf & co; with erf unsupported too (no decomposition), erf falls back
    x = torch.randn(4, 8)
    lowered = _lower(lambda t: F.gelu(t) * 2, (x,), _chip("aten.gelu", "aten.erf"))
    by = _by_op(lowered)
    assert by["aten.gelu.default"][0].tier == "decompose"
    erf = by["aten.erf.default"][0]
    assert erf.tier == "fallback" and erf.missing
    assert "decomposes only to primitives (prims.erf" in erf.rejected["decompose"]
    assert "does not run aten.erf.default" in erf.rejected["vendor"]
    assert "no Triton backend" in erf.rejected["triton"]
    torch.testing.assert_close(lowered([x]), F.gelu(x) * 2)


def test_identical_nodes_share_one_trace_of_their_decomposition(monkeypatch):
    """A model's repeated layers: nodes alike in op, sizes, constants and which arguments are the
    same node are traced once; any difference is traced on its own; every splice is right."""
    from torch_kernelize.compiling import decomposition_memo
    traced = []
    real = decomposition_memo.trace_decomposition
    monkeypatch.setattr(decomposition_memo, "trace_decomposition", lambda n: traced.append(n.target) or real(n))

    def fn(x, y, z):
        return (F.gelu(x) + F.gelu(y),                                # alike: one trace
                F.gelu(z), F.gelu(x, approximate="tanh"),                # another size, another constant
                torch.addcmul(x, y, y) - torch.addcmul(x, y, x),        # the same node twice, or not
                torch.addcmul(y, x, x, value=0.5) * torch.addcmul(x, y, y),
                torch.addcmul(F.gelu(y), F.gelu(x), y))  # two splices of one trace meet in one node
    inputs = (torch.randn(4, 8), torch.randn(4, 8), torch.randn(3, 8))
    lowered = _lower(fn, inputs, _chip("aten.gelu", "aten.addcmul"))
    by = _by_op(lowered)
    assert [d.tier for d in by["aten.gelu.default"]] == ["decompose"] * 6
    assert [d.tier for d in by["aten.addcmul.default"]] == ["decompose"] * 5
    assert traced.count(aten.gelu.default) == 3 and traced.count(aten.addcmul.default) == 4, traced
    for got, want in zip(lowered(list(inputs)), fn(*inputs)):
        torch.testing.assert_close(got, want)


def test_every_decision_says_why_higher_tiers_were_rejected():
    x = torch.randn(4, 8)
    lowered = _lower(lambda t: torch.histc(t.relu(), bins=5), (x,), _chip("aten.histc", triton="interpreter"))
    by = _by_op(lowered)
    relu, histc = by["aten.relu.default"][0], by["aten.histc.default"][0]
    assert relu.tier == "vendor" and set(relu.rejected) == {"decompose", "triton"}
    assert relu.rejected["decompose"] == "the target runs it"
    assert histc.tier == "fallback" and set(histc.rejected) == {"decompose", "triton", "vendor"}
    assert histc.spec_key and histc.shapes.startswith("aten.histc.default(f32[4x8])")
    table = lowered.report.table()
    assert "MISSING aten.histc.default" in table and "aten.relu.default" in table


def test_view_and_factory_ops_are_not_kernel_candidates():
    x = torch.randn(4, 8)
    lowered = _lower(lambda t: t.t().reshape(-1) + torch.ones(32), (x,), _chip())
    views = [d for d in lowered.report.decisions if d.op in ("aten.permute.default", "aten.view.default",
                                                              "aten.ones.default", "aten.t.default")]
    assert views and all(d.tier == "vendor" and not d.miss and ("view op" in d.reason or "factory" in d.reason)
                         for d in views)


def test_attention_stays_whole_and_decomposes_only_where_the_target_lacks_it():
    q = torch.randn(2, 4, 16, 8)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    from torch_kernelize.compiling.decompositions import trace_decompositions
    gm = make_fx(f, tracing_mode="fake", decomposition_table=trace_decompositions())(q, q, q)
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops  # not the math decomposition
    lowered = lower(gm, [q, q, q], {"repro_dir": "off"}, target=_chip())
    assert _by_op(lowered)["aten._scaled_dot_product_flash_attention_for_cpu.default"][0].tier == "vendor"
    chip = _chip("aten._scaled_dot_product_flash_attention_for_cpu")
    lowered = lower(make_fx(f, tracing_mode="fake", decomposition_table=trace_decompositions())(q, q, q),
                    [q, q, q], {"repro_dir": "off"}, target=chip)
    assert _by_op(lowered)["aten._scaled_dot_product_flash_attention_for_cpu.default"][0].tier == "decompose"
    torch.testing.assert_close(lowered([q, q, q])[0] if isinstance(lowered([q, q, q]), tuple) else lowered([q, q, q]),
                               f(q, q, q), rtol=1e-4, atol=1e-5)


def test_index_add_stays_whole_and_decomposes_only_where_the_target_lacks_it():
    """Kept whole at trace time (its decomposition, index_put with accumulate, is a sort plus checks
    on CUDA); a chip without index_add still runs it, decomposed."""
    from torch_kernelize.compiling.decompositions import trace_decompositions

    def f(x, i, s):
        return aten.index_add.default(x * 1, 0, i, s) + 1

    args = (torch.randn(6, 3), torch.tensor([0, 5, 5, 2]), torch.randn(4, 3))
    want = f(*args)
    for chip, tier in ((_chip(), "vendor"), (_chip("aten.index_add"), "decompose")):
        gm = make_fx(f, tracing_mode="fake", decomposition_table=trace_decompositions())(*args)
        assert aten.index_add.default in {n.target for n in gm.graph.nodes}
        lowered = lower(gm, list(args), {"repro_dir": "off"}, target=chip)
        assert _by_op(lowered)["aten.index_add.default"][0].tier == tier
        got = lowered(list(args))
        torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, want)


def test_random_ops_never_take_a_cached_kernel():
    x = torch.randn(4, 8)
    lowered = _lower(lambda t: torch.ops.aten.native_dropout.default(t, 0.5, True)[0] + 1, (x,),
                     _chip(triton="interpreter"))
    drop = _by_op(lowered)["aten.native_dropout.default"][0]
    assert drop.tier == "vendor" and "random op" in drop.rejected["triton"] and not drop.miss
