"""Reinplacing of functional accumulations (torch_kernelize/compiling/reinplace.py): a private, dead buffer is
accumulated into in place; a graph input, or a buffer read elsewhere, keeps the functional copy."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.reinplace import reinplace_accumulations

aten = torch.ops.aten


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and "index_add" in str(n.target)]


def _args():
    torch.manual_seed(0)
    return torch.randn(8, 4), torch.tensor([0, 2, 2, 7]), torch.tensor([1, 1, 5])


def test_chain_on_a_fresh_buffer_runs_in_place():
    def f(x, i, j):
        out = torch.zeros_like(x)
        out = aten.index_add.default(out, 0, i, x[:4])
        return aten.index_add.default(out, 0, j, x[4:7] * 2)

    args = _args()
    gm = make_fx(f)(*args)
    want = f(*args)
    assert reinplace_accumulations(gm.graph) == 2
    gm.recompile()
    assert _targets(gm) == [aten.index_add_.default] * 2
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


def test_graph_input_and_shared_buffers_keep_the_copy():
    def f(x, i, j):
        a = aten.index_add.default(x, 0, i, x[:4])        # x is the caller's: never written
        z = torch.zeros_like(x)
        b = aten.index_add.default(z, 0, j, x[4:7])       # z is read again below: keep it intact
        return a, b, z + 1

    args = _args()
    gm = make_fx(f)(*args)
    want = f(*args)
    x_before = args[0].clone()
    assert reinplace_accumulations(gm.graph) == 0
    for got, w in zip(gm(*args), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    torch.testing.assert_close(args[0], x_before, rtol=0, atol=0)


def test_compiled_expert_loop_is_reinplaced_and_correct():
    """The MoE benchmark's pattern (out.index_add_ per expert) through the backend on the CPU."""
    import torch_kernelize.compiling.lower as lower

    seen = []
    original = lower.reinplace_accumulations

    def spy(graph):
        n = original(graph)
        seen.append((n, [x.target for x in graph.nodes if x.op == "call_function" and "index_add" in str(x.target)]))
        return n

    def loop(x, idx):
        out = torch.zeros_like(x)
        for e in range(3):
            out.index_add_(0, idx[e], x[e * 2:e * 2 + 2] * (e + 1))
        return out

    x, idx = torch.randn(6, 5), torch.tensor([[0, 1], [1, 3], [5, 5]])
    lower.reinplace_accumulations = spy
    try:
        torch._dynamo.reset()
        compiled = torch.compile(loop, backend="kernelize",
                                 options={"target": "cpu", "repro_dir": "off", "graph_cache": False})
        with torch.no_grad():
            got = compiled(x, idx)
    finally:
        lower.reinplace_accumulations = original
        torch._dynamo.reset()
    torch.testing.assert_close(got, loop(x, idx))
    assert seen and seen[0][0] == 3 and seen[0][1] == [aten.index_add_.default] * 3


def test_cached_index_add_kernels_take_over_a_private_buffer(tmp_path):
    """Nodes a cached kernel replaced (runtime.TritonCall) run in place too: the first on the
    fresh zeros, the next on the first one's output; a buffer read elsewhere keeps its copy."""
    from kernel_testing import load, spec_of
    from torch_kernelize.lowering.kernels.indexing import FAMILY
    from torch_kernelize.serving.runtime import KernelState, TritonCall

    def f(x, i, j):
        out = torch.zeros_like(x)
        out = aten.index_add.default(out, 0, i, x[:4])
        out = aten.index_add.default(out, 0, j, x[4:7] * 2)
        kept = aten.index_add.default(x, 0, j, x[4:7])  # x is the caller's: copied
        return out, kept

    args = _args()
    gm = make_fx(f)(*args)
    want = f(*args)
    calls = []
    for node in gm.graph.nodes:
        if node.target == aten.index_add.default:
            tensors = [torch.zeros(a.meta["val"].shape, dtype=a.meta["val"].dtype)
                       for a in node.args if isinstance(a, torch.fx.Node)]
            spec = spec_of(aten.index_add.default, (tensors[0], 0, tensors[1], tensors[2]))
            runner = load(tmp_path, spec, FAMILY.generate(spec, FAMILY.seed_configs(spec)[0]))
            node.target = TritonCall(spec, runner, KernelState(spec.key))
            node.args = tuple(a for a in node.args if isinstance(a, torch.fx.Node))
            calls.append(node)
    assert reinplace_accumulations(gm.graph) == 2
    gm.recompile()
    assert [getattr(n.target, "donated_inputs", None) for n in calls] == [frozenset({0})] * 2 + [None]
    x_before = args[0].clone()
    for got, w in zip(gm(*args), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-6)
    torch.testing.assert_close(args[0], x_before, rtol=0, atol=0)
