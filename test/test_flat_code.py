"""The generated flat function of a specialization (flat_code.py) computes what the bound graph's
FX code computes -- views with the same strides and storage, kernel calls with the same failure
semantics -- while vendor ops go through eager's own bindings only where those dispatch the
node's very overload (op_bindings.py)."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from kernel_testing import spec_of
from torch_kernelize.serving.flat_code import flat_function
from torch_kernelize.serving.launch import MisalignedInput
from torch_kernelize.serving.op_bindings import PRIM_EQUIVALENTS, binding_by_name, binding_name, fast_binding
from torch_kernelize.serving.runtime import KernelState, TritonCall, guard_vendor_layouts
from torch_kernelize.serving.view_folding import fold_views

aten = torch.ops.aten


def _bound(fn, *inputs) -> fx.GraphModule:
    """``fn`` traced to ATen, as bind_graph makes graphs (plain positional code, no pytree)."""
    traced = make_fx(fn, tracing_mode="fake")(*inputs)
    graph = fx.Graph()
    graph.output(graph.graph_copy(traced.graph, {}))
    return fx.GraphModule(traced, graph)


def _globals(fn) -> dict:
    return {k: v for k, v in fn.__globals__.items() if k.startswith("K")}


def _same(got, want) -> None:
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.stride() == w.stride() and g.storage_offset() == w.storage_offset()


def test_vendor_ops_take_eager_bindings_where_they_dispatch_the_same_overload():
    def f(x, y):
        a = aten.add.Tensor(x, y, alpha=2)
        b = aten.add.Scalar(x, 2)                 # torch.add(x, 2) would dispatch add.Tensor
        c, d = aten.split.Tensor(a, 4)            # torch.split returns a tuple, the overload a list
        e = aten.view.default(b, [2, 4])          # a Tensor method only
        f = aten.full.default([3], 2.0, dtype=torch.float32, device=torch.device("cpu"), pin_memory=False)
        return aten.mul.Tensor(c, 0.5), d, e, aten.sum.dim_IntList(a, [0], True), f
    x, y = torch.randn(8), torch.randn(8)
    gm = _bound(f, x, y)
    fn = flat_function(gm)
    chosen = {n.target: n.meta["binding"] for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
    assert chosen[aten.add.Tensor] == torch.add and chosen[aten.mul.Tensor] == torch.mul
    assert chosen[aten.sum.dim_IntList] == torch.sum and chosen[aten.full.default] == torch.full
    assert chosen[aten.view.default] is torch._C.TensorBase.view
    assert chosen[aten.add.Scalar] is aten.add.Scalar._op and chosen[aten.split.Tensor] is aten.split.Tensor._op
    assert "torch.ops" not in fn.source and "= None" in fn.source  # values dropped after their last use
    _same(fn(x, y), gm(x, y))


def test_binding_names_round_trip_and_name_nothing_else():
    for fn in (torch.add, torch._C.TensorBase.view, torch._C._nn.gelu):
        assert binding_by_name(binding_name(fn)) == fn
    assert binding_name(aten.add.Tensor._op) is None and binding_name(print) is None
    assert binding_by_name("os.system") is None and binding_by_name("_VariableFunctions.__class__") is None


def test_a_prim_left_in_the_graph_takes_its_aten_equivalent_with_the_prims_result():
    """prims.convert_element_type (a dynamic graph's tensorified floats are cast with it) runs a
    Python implementation; its ATen equivalent makes the same tensor: values, dtype, layout."""
    prim = torch.ops.prims.convert_element_type.default
    gm = _bound(lambda x, s: aten.add.Tensor(x, prim(s, torch.float32)), torch.randn(4, 3),
                torch.tensor(1e-6, dtype=torch.float64))
    fn = flat_function(gm)
    (node,) = [n for n in gm.graph.nodes if n.target is prim]
    assert node.meta["binding"] is PRIM_EQUIVALENTS[prim] and binding_name(node.meta["binding"]) is None
    x, s = torch.randn(4, 3), torch.tensor(2.5, dtype=torch.float64)
    _same(fn(x, s), gm(x, s))
    base = torch.randn(6, 4, dtype=torch.float16)
    for a in (base, base.t(), base[::2], base[:, :1].expand(6, 5), torch.tensor(3.0, dtype=torch.float64),
              torch.randint(0, 9, (5,)), torch.randn(0, 3)):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32):
            want, got = prim(a, dtype), PRIM_EQUIVALENTS[prim](a, dtype)
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
            assert torch.equal(got, want) and (got.data_ptr() != a.data_ptr() or not a.numel())  # a new tensor


def test_symbolic_arguments_keep_the_overloads_own_entry():
    gm = make_fx(lambda x: aten.mul.Tensor(x, 2.0), tracing_mode="symbolic")(torch.randn(5))
    (node,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    assert fast_binding(aten.mul.Tensor, node.args, node.kwargs) is aten.mul.Tensor._op


def _views(x, w):
    h = aten.mm.default(aten.view.default(x, [8, 6]), w)          # a view of an input feeds the mm
    q = aten.permute.default(aten.view.default(h, [2, 4, 2, 2]), [0, 2, 1, 3])  # views of a vendor output
    return aten.add.Tensor(aten.t.default(aten.view.default(h, [8, 4])), 1.0), aten.select.int(q, 3, 0)


def test_folded_views_restride_like_the_fx_code_in_any_root_layout():
    x, w = torch.randn(2, 4, 6), torch.randn(6, 4)
    gm = _bound(_views, x, w)
    fold_views(gm)
    fn = flat_function(gm)
    assert "folded_view" in fn.source and "layout_ok_0 = v_x_1.stride() == (24, 6, 1)" in fn.source
    _same(fn(x, w), gm(x, w))
    other = torch.randn(2, 4, 8)[:, :, :6]  # an input in another layout: its views worked out anew
    _same(fn(other, w), gm(other, w))
    torch.testing.assert_close(fn(other, w)[0], _views(other, w)[0])


def _kernel_graph(runner):
    """mul(mm(a, b), a): the mul replaced by a 'kernel' (``runner``) whose first input comes from
    a vendor op, so its stride is checked."""
    def f(a, b):
        return aten.mul.Tensor(aten.mm.default(a, b), a)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    gm = _bound(f, a, b)
    (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    spec = spec_of(aten.mul.Tensor, (a, b))
    call = TritonCall(spec, runner, KernelState(spec.key))
    mul.target, mul.args = call, tuple(mul.args)
    guard_vendor_layouts(gm.graph)
    gm.recompile()
    return gm, flat_function(gm), (a, b), f(a, b), call


def test_a_kernel_call_runs_inline_and_keeps_the_failure_semantics():
    runs = []

    def runner(x, y):
        runs.append(1)
        if len(runs) == 2:
            raise MisalignedInput("this call only")
        if len(runs) == 3:
            raise RuntimeError("broken")
        return x * y
    gm, fn, args, want, call = _kernel_graph(runner)
    assert ".disabled is None" in fn.source and ".failed(e, " in fn.source  # inline, not the TritonCall
    assert ".stride() == (4, 1)" in fn.source  # the mm output's layout is checked
    for _ in range(2):  # the kernel, then a misaligned call on the vendor op: still enabled
        torch.testing.assert_close(fn(*args), want)
    assert call.state.disabled is None
    torch.testing.assert_close(fn(*args), want)  # a failure: the vendor's answer, the kernel disabled
    assert call.state.disabled == "RuntimeError: broken"
    torch.testing.assert_close(fn(*args), want)
    assert len(runs) == 3, "a disabled kernel is not launched again"


def test_a_kernel_input_in_another_layout_runs_on_the_vendor_op():
    gm, fn, args, want, call = _kernel_graph(lambda x, y: x * y + 1000)  # wrong on purpose: must not run
    (mm,) = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    mm.meta["binding"] = lambda a, b: torch.mm(b.t(), a.t()).t()  # same values, column-major
    fn = flat_function(gm)
    torch.testing.assert_close(fn(*args), want)
    assert call.state.disabled is None and call.state.layout_noted
