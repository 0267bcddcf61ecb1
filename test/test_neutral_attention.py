"""CUDA's attention ops traced as the device-neutral flash op on a CUDA chip whose vendor lacks them
(fake CUDA tensors: no GPU needed): the graph holds only ops every tier handles, the rewrites
compute what the CUDA ops compute (float64 on CPU against the math definition), and targets with
vendor attention keep their ops."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.decompositions import trace_decompositions, trace_rewrites
from torch_kernelize.compiling.neutral_attention import (CPU_FLASH, CPU_FLASH_BACKWARD, REWRITES,
                                                        neutral_attention_table)
from torch_kernelize.core.targets import BUILTIN_TARGETS, Target

aten = torch.ops.aten
GEMM_ONLY = Target("gemm-only", device="cuda", triton="cuda",
                   supported=frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"}))
FLASH, FLASH_BW = aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default
EFF, EFF_BW = aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_efficient_attention_backward.default
CUDNN, CUDNN_BW = aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default


def test_only_cuda_chips_without_vendor_attention_rewrite():
    assert set(neutral_attention_table(GEMM_ONLY)) == set(REWRITES)
    assert neutral_attention_table(BUILTIN_TARGETS["cuda"]) == {}
    assert neutral_attention_table(BUILTIN_TARGETS["interpreter"]) == {}
    partial = Target("no-flash", device="cuda", triton="cuda",
                     unsupported=frozenset({"aten._scaled_dot_product_flash_attention"}))
    assert set(neutral_attention_table(partial)) == {FLASH}
    assert trace_rewrites(partial) == ["aten._scaled_dot_product_flash_attention.default"]
    # the device-neutral op has CPU kernels only: no CUDA vendor runs it, whatever its op list says
    assert not BUILTIN_TARGETS["cuda"].vendor_runs(CPU_FLASH) and not partial.vendor_runs(CPU_FLASH_BACKWARD)
    assert BUILTIN_TARGETS["cpu"].vendor_runs(CPU_FLASH)


def _ops(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("which", ["flash", "efficient", "cudnn"])
def test_a_training_trace_on_fake_cuda_holds_the_neutral_ops_only(which):
    """The forward op and the backward op autograd's formula for it calls (derivatives.yaml),
    called as a joint graph holds them (autograd itself needs a CUDA build of torch)."""
    dtype = torch.float32 if which == "efficient" else torch.float16

    def step(q, k, v, go):
        if which == "flash":
            out, lse, cq, ck, mq, mk, rng, unused, _ = FLASH(q, k, v, 0.0, True)
            grads = FLASH_BW(go, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, rng, unused)
        elif which == "efficient":
            out, lse, seed, offset = EFF(q, k, v, None, True, 0.0, True)
            grads = EFF_BW(go, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True)[:3]
        else:
            out, lse, cq, ck, mq, mk, seed, offset, _ = CUDNN(q, k, v, None, True, 0.0, True)
            grads = CUDNN_BW(go, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True)
        return (out, *grads)

    with FakeTensorMode():
        q, k, v, go = (torch.randn(2, 4, 40, 16, device="cuda", dtype=dtype) for _ in range(4))
        gm = make_fx(step, decomposition_table=trace_decompositions(GEMM_ONLY))(q, k, v, go)
        ops = _ops(gm)
        assert {str(CPU_FLASH), str(CPU_FLASH_BACKWARD)} <= ops, ops
        assert not ops & {str(op) for op in REWRITES}, ops
        outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        assert all(o.meta["val"].device.type == "cuda" and tuple(o.meta["val"].shape) == (2, 4, 40, 16) for o in outs)
        kept = make_fx(step, decomposition_table=trace_decompositions(BUILTIN_TARGETS["cuda"]))(q, k, v, go)
        assert str(CPU_FLASH) not in _ops(kept)


def test_dropout_keeps_the_cuda_op():
    with FakeTensorMode():
        q = torch.randn(1, 2, 8, 16, device="cuda", dtype=torch.float16)
        gm = make_fx(lambda q: FLASH(q, q, q, 0.1)[0], decomposition_table=trace_decompositions(GEMM_ONLY))(q)
    assert str(FLASH) in _ops(gm)


def _math(q, k, v, mask=None, causal=False, scale=None):
    """out and logsumexp from their definition (float64)."""
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s + mask
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("which", ["flash", "efficient", "cudnn"])
def test_the_rewrites_compute_the_cuda_ops(which):
    """Run on CPU float64 tensors (the neutral op runs there): out, logsumexp in the CUDA op's
    shape, and the gradients of the math definition."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    mask = None if which == "flash" else torch.randn(2, 1, 37, 37, generator=g, dtype=torch.float64)
    causal = which == "flash"
    want_out, want_lse = _math(q, k, v, mask, causal, 0.4)
    go = torch.randn(want_out.shape, generator=g, dtype=torch.float64)
    want_grads = torch.autograd.grad(want_out, (q, k, v), go)
    q, k, v = (t.detach() for t in (q, k, v))
    if which == "flash":
        out, lse, cq, ck, mq, mk, rng, unused, debug = REWRITES[FLASH](q, k, v, 0.0, causal, scale=0.4)
        assert (cq, ck, mq, mk) == (None, None, 37, 37) and debug.numel() == 0
        grads = REWRITES[FLASH_BW](go, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=0.4)
    elif which == "efficient":
        out, lse, seed, offset = REWRITES[EFF](q, k, v, mask, True, 0.0, causal, scale=0.4)
        assert tuple(lse.shape) == (2, 3, 64) and bool(lse[..., 37:].isinf().all())  # padded to 32 rows
        grads = REWRITES[EFF_BW](go, q, k, v, mask, out, lse, seed, offset, 0.0, [True, True, True, False],
                                 causal, scale=0.4)
        assert grads[3] is None
        grads, lse = grads[:3], lse[..., :37]
    else:
        out, lse, cq, ck, mq, mk, seed, offset, debug = REWRITES[CUDNN](q, k, v, mask, True, 0.0, causal, scale=0.4)
        assert tuple(lse.shape) == (2, 3, 37, 1)
        grads = REWRITES[CUDNN_BW](go, q, k, v, out, lse, seed, offset, mask, cq, ck, mq, mk, 0.0, causal, scale=0.4)
        lse = lse[..., 0]
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want)


def test_a_model_on_fake_cuda_traces_to_the_family_s_op():
    """F.scaled_dot_product_attention on (fake) CUDA tensors through aot_autograd's table: the
    planner then sees an op the attention family generates."""
    from torch_kernelize.lowering.kernels import family_for
    from torch_kernelize.compiling.planner import build_spec

    def f(q):
        return FLASH(q, q, q, 0.0, True)[0] * 2

    with FakeTensorMode():
        q = torch.randn(1, 2, 64, 32, device="cuda", dtype=torch.bfloat16)
        gm = make_fx(f, decomposition_table=trace_decompositions(GEMM_ONLY))(q)
    node = next(n for n in gm.graph.nodes if n.target is CPU_FLASH)
    spec = build_spec(node, {})
    assert spec.inputs[0].device == "cuda" and family_for(spec).name == "attention"


def test_the_graph_cache_key_follows_the_rewrites():
    """A traced graph depends on the target's rewrites: a graph cached for a chip with vendor
    attention is not served to one without."""
    from torch_kernelize.warm_start import graph_cache
    x = torch.randn(4, 8)
    gm = torch.fx.symbolic_trace(lambda t: t * 2)
    for n in gm.graph.find_nodes(op="placeholder"):
        n.meta["val"] = x
    plain = graph_cache.probe(gm, [x]).key
    rewritten = graph_cache.probe(gm, [x], trace_rewrites(GEMM_ONLY)).key
    assert plain and rewritten and plain != rewritten
    assert graph_cache.probe(gm, [x], trace_rewrites(BUILTIN_TARGETS["cuda"])).key == plain


def test_an_inference_graph_of_varying_sizes_traces_cudnn_attention_as_flash():
    """cuDNN's attention builds a plan per new shape (40-75 ms on the H200): a graph served at
    varying sizes traces it as flash attention, same outputs' shapes; static graphs and targets
    whose vendor lacks either op keep what they had; a mask or dropout keeps cuDNN; grouped
    query heads go to flash as they are."""
    cuda = BUILTIN_TARGETS["cuda"]
    with FakeTensorMode():
        q = torch.randn(2, 4, 40, 16, device="cuda", dtype=torch.float16)
        call = lambda q: CUDNN(q, q, q, None, False, 0.0, True)[0]  # noqa: E731
        varying = make_fx(call, decomposition_table=trace_decompositions(cuda, varying=True))(q)
        assert str(FLASH) in _ops(varying) and str(CUDNN) not in _ops(varying)
        out = [n for n in varying.graph.nodes if n.op == "output"][0].args[0]
        assert tuple(out.meta["val"].shape) == (2, 4, 40, 16)
        assert str(CUDNN) in _ops(make_fx(call, decomposition_table=trace_decompositions(cuda))(q))
        masked = lambda q: CUDNN(q, q, q, torch.zeros(40, 40, device="cuda", dtype=q.dtype), False)[0]  # noqa: E731
        assert str(CUDNN) in _ops(make_fx(masked, decomposition_table=trace_decompositions(cuda, varying=True))(q))
        # grouped-query attention (Llama's: query heads a multiple of the key/value heads) too
        kv = torch.randn(2, 2, 40, 16, device="cuda", dtype=torch.float16)
        gqa = lambda q, kv: CUDNN(q, kv, kv, None, False, 0.0, True)[0]  # noqa: E731
        traced = make_fx(gqa, decomposition_table=trace_decompositions(cuda, varying=True))(q, kv)
        assert str(FLASH) in _ops(traced) and str(CUDNN) not in _ops(traced)
        odd = torch.randn(2, 3, 40, 16, device="cuda", dtype=torch.float16)  # 4 heads over 3: no grouping
        assert str(CUDNN) in _ops(make_fx(gqa, decomposition_table=trace_decompositions(cuda, varying=True))(q, odd))
    assert trace_rewrites(cuda, varying=True) == [str(CUDNN)] and trace_rewrites(cuda) == []
    no_flash = Target("no-flash", device="cuda", triton="cuda",
                      unsupported=frozenset({"aten._scaled_dot_product_flash_attention"}))
    assert CUDNN not in trace_decompositions(no_flash, varying=True)  # (flash is no op it runs)


def test_only_a_symbolic_trace_that_needs_no_gradient_counts_as_varying():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch_kernelize.backend import _varying_inference
    size = ShapeEnv().create_unbacked_symint()
    w = torch.randn(3, requires_grad=True)
    assert _varying_inference([size, torch.randn(3)]) and not _varying_inference([torch.randn(3)])
    assert not _varying_inference([size, w])
    with torch.no_grad():
        assert _varying_inference([size, w])
