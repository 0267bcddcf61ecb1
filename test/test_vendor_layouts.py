"""Cached kernels bake their inputs' traced strides in. A vendor op can lay its output out
otherwise than its meta function said: the kernels reading it check its strides (runtime.
guard_vendor_layouts) and run such a call on the vendor op instead of misreading the tensor; a
kernel's vendor fallback hands on its outputs in the traced layout."""
from __future__ import annotations

import logging

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kernel_testing import load, spec_of
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.serving.runtime import KernelState, TritonCall, guard_vendor_layouts

aten = torch.ops.aten


def _cached(node, tmp_path) -> TritonCall:
    """The node replaced by its cached kernel (the interpreter runs it), as bind_graph does."""
    tensors = [torch.randn(a.meta["val"].shape) for a in node.args if isinstance(a, torch.fx.Node)]
    scalars = [a for a in node.args if not isinstance(a, torch.fx.Node)]
    spec = spec_of(node.target, (*tensors, *scalars))
    family = family_for(spec)
    call = TritonCall(spec, load(tmp_path, spec, family.generate(spec, family.seed_configs(spec)[0])),
                      KernelState(spec.key))
    node.target, node.args = call, tuple(a for a in node.args if isinstance(a, torch.fx.Node))
    return call


def _graph(tmp_path):
    def f(a, b):
        h = aten.mm.default(a, b)               # a vendor op: its output layout is its own
        return aten.mul.Tensor(h, a[:, :3]), aten.mul.Tensor(a, a)
    a, b = torch.randn(4, 3), torch.randn(3, 3)
    gm = make_fx(f)(a, b)
    muls = [n for n in gm.graph.nodes if n.target == aten.mul.Tensor]
    for n in muls:
        _cached(n, tmp_path)
    return gm, muls, (a, b), f(a, b)


def test_inputs_from_vendor_ops_are_checked_the_others_not(tmp_path):
    gm, (from_mm, from_input), args, want = _graph(tmp_path)
    assert guard_vendor_layouts(gm.graph) == 1
    assert from_mm.target.layout_checks == ((0, (3, 1)),)   # the mm output; the slice of ``a`` is exact
    assert from_input.target.layout_checks == ()
    gm.recompile()
    for got, w in zip(gm(*args), want):
        torch.testing.assert_close(got, w)


def test_a_vendor_output_in_another_layout_runs_on_the_vendor_op(tmp_path, caplog):
    gm, (from_mm, _), args, want = _graph(tmp_path)
    (mm,) = [n for n in gm.graph.nodes if n.target == aten.mm.default]
    mm.target = lambda a, b: torch.mm(b.t(), a.t()).t()  # same values, column-major: strides (1, 4)
    guard_vendor_layouts(gm.graph)
    gm.recompile()
    with caplog.at_level(logging.WARNING, logger="torch_kernelize.serving.runtime"):
        for _ in range(2):
            for got, w in zip(gm(*args), want):
                torch.testing.assert_close(got, w)
    assert len([r for r in caplog.records if "arrived with strides (1, 4)" in r.getMessage()]) == 1  # once
    assert from_mm.target.state.disabled is None  # the kernel stays enabled for calls that fit it


def test_vendor_fallback_outputs_keep_the_traced_layout(tmp_path):
    x = torch.randn(4, 6).t()  # strides (1, 6): a pointwise op's output follows that layout
    spec = spec_of(aten.mul.Tensor, (x, 2.0))
    family = family_for(spec)
    call = TritonCall(spec, load(tmp_path, spec, family.generate(spec, family.seed_configs(spec)[0])),
                      KernelState(spec.key))
    out = call.vendor(x.contiguous())  # the vendor op on a contiguous input answers contiguously
    assert out.stride() == spec.outputs[0].stride == (1, 6)
    torch.testing.assert_close(out, x * 2.0)


def test_a_backward_graph_checks_its_inputs_too(tmp_path):
    # a backward graph's inputs are saved tensors, laid out by whatever made them: not guarded
    gm, (from_mm, from_input), _, _ = _graph(tmp_path)
    assert guard_vendor_layouts(gm.graph, guarded_inputs=False) == 4  # h, the slice of a, a and a
    assert [i for i, _ in from_input.target.layout_checks] == [0, 1]
