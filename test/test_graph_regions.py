"""Graph regions (compiling/graph_regions.py): a compiler's fusion groups between boundary ops.

Formation on representative graphs (a decoder block, LayerNorm + GELU, softmax chains, several
reductions, training graphs), their specs and float64 references, and the serving ladder on the
interpreter target: a graph region that hits covers its nodes; one that misses, has no correct
candidate or whose entry is "vendor wins" leaves them to the smaller regions and then the nodes.
The served big region comes from a test generator (test/graph_family.py), standing for the
Inductor generator."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import graph_family
from torch_kernelize import flush_repros, model_zoo
from torch_kernelize.lowering import kernels
from torch_kernelize.core import targets
from torch_kernelize.compiling.graph_regions import MAX_GRAPH_NODES, find_graph_regions
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.core.targets import op_name
from torch_kernelize.compiling.regions import find_regions, region_spec
from torch_kernelize.core.region_graph import describe_region

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
aten = torch.ops.aten
BOUNDARIES = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.convolution.default",
              "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.embedding.default"}


def trace(fn, *inputs):
    return make_fx(fn, tracing_mode="fake", decomposition_table=torch._decomp.core_aten_decompositions())(*inputs)


def trace_module(model, *inputs):
    """``model``'s inference graph, its parameters as graph inputs (after the model's inputs)."""
    names, params = zip(*model.named_parameters())
    n = len(inputs)

    def fn(*args):
        return torch.func.functional_call(model, dict(zip(names, args[n:])), args[:n])
    with torch.no_grad():
        return trace(fn, *inputs, *[p.detach() for p in params])


def graph_regions(gm):
    return find_graph_regions(gm, find_regions(gm, targets.get_target("interpreter")))


def ops_of(region) -> list[str]:
    return [op_name(n.target).removeprefix("aten.") for n in region.nodes]


def holding(regions, *ops):
    """The one region whose ops include all of ``ops``."""
    found = [r for r in regions if all(op in ops_of(r) for op in ops)]
    assert len(found) == 1, [ops_of(r) for r in regions]
    return found[0]


def sample(spec, seed=0):
    return kernels.base.KernelFamily().sample_inputs(spec, seed)


def check_reference(spec):
    """The float64 reference replays every node and agrees with the vendor run; both keep the
    traced output strides."""
    inputs = sample(spec)
    refs, outs = spec.reference(inputs), spec.run_vendor(inputs)
    for meta, ref, out in zip(spec.outputs, refs, outs):
        assert ref.dtype == (torch.float64 if out.is_floating_point() else out.dtype)
        assert tuple(out.shape) == tuple(meta.shape)
        for t in (ref, out):
            assert all(a == b for a, b, n in zip(t.stride(), meta.stride, meta.shape) if n != 1), (t.stride(), meta)
        torch.testing.assert_close(out.double() if out.is_floating_point() else out, ref, rtol=1e-4, atol=1e-4)


# --- formation -----------------------------------------------------------------------------------

def test_a_decoder_blocks_chains_form_between_its_gemms():
    model = model_zoo.TransformerBlock().eval()
    gm = trace_module(model, torch.randn(2, 8, 32))
    regions = graph_regions(gm)
    assert regions and all(r.kind == "graph" for r in regions)
    for r in regions:  # GEMMs and attention are boundaries; views never start or end a region
        assert not BOUNDARIES & {str(n.target) for n in r.nodes}
        assert all(n.op == "call_function" and not n.target.is_view for n in r.outputs)
        assert all(any(a in r.nodes for a in n.all_input_nodes) for n in r.nodes if n.target.is_view)
    # the residual add runs with the RMSNorm after it, the GEMM's scale with the masked softmax,
    # SiLU with the product of the two GEMMs it joins
    # (the first norm's region is exactly a rowwise region: the rowwise one is kept, not both)
    small = find_regions(gm, targets.get_target("interpreter"))
    assert not {frozenset(r.nodes) for r in small} & {frozenset(r.nodes) for r in regions}
    norm, = [r for r in regions + small if ops_of(r).count("add.Tensor") == 2 and "rsqrt.default" in ops_of(r)]
    assert ops_of(norm).count("mean.dim") == 1 and len(norm.outputs) == 2   # the residual sum, the norm
    softmax = holding(regions, "div.Tensor", "_softmax.default", "where.self")
    assert not any(set(r.nodes) >= set(softmax.nodes) for r in small)  # larger than the smaller kinds'
    holding(regions + small, "sigmoid.default", "mul.Tensor")
    assert all(len(r.nodes) > 1 for r in regions)


def test_a_gemm_epilogue_alone_stays_with_its_gemm():
    """SwiGLU's epilogue is all a matmul region's: a graph region of it alone would only take the
    epilogue off the GEMM kernel."""
    gm = trace(lambda x, w1, w3: F.silu(x @ w1) * (x @ w3), torch.randn(8, 32), torch.randn(32, 16),
               torch.randn(32, 16))
    matmul, = find_regions(gm, targets.get_target("interpreter"))
    assert matmul.kind == "matmul" and ops_of(matmul)[1:] == ["sigmoid.default", "mul.Tensor", "mul.Tensor"]
    assert graph_regions(gm) == []


def test_layernorm_gelu_forms_one_region_with_its_tuple_pieces(tmp_path):
    def fn(x, r, w, b):
        return F.gelu(F.layer_norm(x + r, (32,), w, b)) * 2.0

    gm = trace(fn, torch.randn(4, 32), torch.randn(4, 32), torch.randn(32), torch.randn(32))
    region, = graph_regions(gm)
    assert {"add.Tensor", "native_layer_norm.default", "gelu.default", "mul.Tensor"} <= set(ops_of(region))
    assert "getitem" in ops_of(region)
    spec = region_spec(region, {})
    graph = json.loads(spec.graph)
    ln_node = next(n for n in graph["nodes"] if n["op"] == "aten.native_layer_norm.default")
    assert isinstance(ln_node["meta"], list) and len(ln_node["meta"]) == 3   # out, mean, rstd
    assert describe_region(spec).startswith("graph region [add native_layer_norm")
    check_reference(spec)
    # one loop: our fused family writes the LayerNorm out as rowwise nodes
    from kernel_testing import assert_valid
    assert family_for(spec).name == "fused"
    assert_valid(family_for(spec), spec, tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_layernorm_whose_mean_and_rstd_are_saved_is_one_loop_too(tmp_path, dtype):
    """A training forward keeps LayerNorm's mean and rstd for the backward: region outputs."""
    def fn(x, r, w, b):
        out, mean, rstd = aten.native_layer_norm.default(x + r, [64], w, b, 1e-5)
        return out * 0.5, mean, rstd

    x, r, w, b = (torch.randn(*s, dtype=dtype) for s in ((6, 64), (6, 64), (64,), (64,)))
    gm = trace(fn, x, r, w, b)
    region, = graph_regions(gm)
    spec = region_spec(region, {})
    assert len(spec.outputs) == 3
    from kernel_testing import assert_valid
    assert_valid(family_for(spec), spec, tmp_path)


def test_bert_residual_and_gelu_join_their_layernorms(tmp_path):
    pytest.importorskip("transformers")
    model, inputs = model_zoo.make_hf_bert()
    with torch.no_grad():
        _, _, graphs = compiled_graphs(model, inputs, tmp_path, train=False)
    regions = [r for g in graphs for r in g.regions if r.kind == "graph"]
    norms = [r for r in regions if {"add.Tensor", "native_layer_norm.default"} <= set(ops_of(r))]
    assert len(norms) >= 4   # after attention and after the feed-forward block, in each of 2 layers
    assert any({"gelu.default", "native_layer_norm.default"} <= set(ops_of(r)) for r in regions)  # the MLM head
    # (attention is one SDPA op here: a boundary)
    for r in norms:
        check_reference(region_spec(r, {}))


def test_the_reference_returns_the_traced_output_strides():
    """Where ATen lays an output out otherwise than the trace did (a kernel on another device
    may), the region's vendor run and reference still hand on the traced layout."""
    import dataclasses
    from torch_kernelize.core.spec import TensorMeta
    gm = trace(lambda x: (x * 2.0).sin() + 1.0, torch.randn(4, 8))
    spec = region_spec(find_regions(gm, targets.get_target("interpreter"))[0], {})
    out = spec.outputs[0]
    column_major = dataclasses.replace(spec, outputs=(TensorMeta(out.shape, (1, 4), out.dtype, out.device),))
    x = torch.randn(4, 8)
    for got in (column_major.run_vendor([x])[0], column_major.reference([x])[0]):
        assert got.stride() == (1, 4)
        torch.testing.assert_close(got.float(), (x * 2.0).sin() + 1.0)


def test_several_reductions_over_different_dims_share_a_region():
    def fn(x):
        centered = x - x.mean(0, keepdim=True)
        scaled = centered / centered.std(-1, keepdim=True)
        return scaled.softmax(-1) * scaled.amax(-1, keepdim=True), torch.logsumexp(scaled, -1)

    gm = trace(fn, torch.randn(6, 16))
    region, = graph_regions(gm)
    # (the core decompositions turn std and logsumexp into var, sqrt, amax, exp, sum, log)
    reductions = [op for op in ops_of(region) if op in {"mean.dim", "var.correction", "_softmax.default",
                                                         "amax.default", "sum.dim_IntList"}]
    assert set(reductions) == {"mean.dim", "var.correction", "_softmax.default", "amax.default",
                               "sum.dim_IntList"}, ops_of(region)
    spec = region_spec(region, {})
    assert len(spec.outputs) == 2
    check_reference(spec)


def test_var_mean_and_half_to_float_softmax_replay_in_float64():
    def fn(x):
        var, mean = torch.var_mean(x.float(), -1, keepdim=True)
        y = ((x.float() - mean) * torch.rsqrt(var + 1e-5)).half()
        return aten._softmax.default(y, -1, True) * 2.0

    gm = trace(fn, torch.randn(4, 32, dtype=torch.float16))
    region, = graph_regions(gm)
    assert {"var_mean.correction", "_softmax.default"} <= set(ops_of(region))
    check_reference(region_spec(region, {}))


def test_random_ops_and_gemms_are_boundaries():
    def fn(x, w):
        h = (torch.sigmoid(x) * 2.0).softmax(0)
        d = F.dropout(h, 0.5, training=True)
        return (torch.tanh(d + 1.0) - d.mean(0)) @ w

    gm = trace(torch.func.functionalize(fn), torch.randn(4, 16), torch.randn(16, 16))
    assert any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in gm.graph.nodes)
    regions = graph_regions(gm)
    for r in regions:
        assert not any(n.target is aten.mm.default or torch.Tag.nondeterministic_seeded in n.target.tags
                       for n in r.nodes)
    # the mask is drawn outside (an input of the region); what uses it is fused with the rest
    region, = regions
    assert aten.bernoulli.p in {n.target for n in region.inputs}
    assert {"sigmoid.default", "_softmax.default", "div.Scalar", "tanh.default", "mean.dim"} <= set(ops_of(region))
    assert region.outputs == [n for n in gm.graph.nodes if n.target is aten.sub.Tensor]


def test_keys_are_stable_across_identical_graphs_and_differ_with_shapes():
    model = model_zoo.TransformerBlock().eval()

    def keys(batch):
        gm = trace_module(model, torch.randn(batch, 8, 32))
        return [region_spec(r, {}).key for r in graph_regions(gm)]

    first = keys(2)
    assert first == keys(2) and len(set(first)) == len(first)
    assert not set(first) & set(keys(3))


def test_regions_are_capped():
    def fn(x):
        for i in range(MAX_GRAPH_NODES + 40):
            x = x * 1.0001 if i % 2 else x + 0.5
        return x

    regions = graph_regions(trace(fn, torch.randn(8)))
    assert len(regions) == 2 and all(len(r.nodes) <= MAX_GRAPH_NODES for r in regions)
    assert sum(len(r.nodes) for r in regions) == MAX_GRAPH_NODES + 40


def test_a_one_loop_graph_region_is_generated_by_our_fused_family(tmp_path):
    """The product of two GEMM outputs through SiLU and a row sum: one region after the GEMMs,
    one loop, so our fused family generates it."""
    def fn(x, r, w1, w3):
        a = x @ w1
        return (F.silu(a) * (x @ w3) + r.sum(-1, keepdim=True)).sigmoid()

    gm = trace(fn, torch.randn(8, 32), torch.randn(8, 16), torch.randn(32, 16), torch.randn(32, 16))
    region, = graph_regions(gm)
    spec = region_spec(region, {})
    assert family_for(spec).name == "fused"
    from kernel_testing import assert_valid
    assert_valid(family_for(spec), spec, tmp_path)
    # the smaller kinds: the first GEMM with this epilogue (the row sum of r is outside it)
    matmul, = find_regions(gm, targets.get_target("interpreter"))
    assert matmul.kind == "matmul" and set(region.nodes) - set(matmul.nodes) == {
        n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList}
    assert set(matmul.nodes) - set(region.nodes) == {n for n in gm.graph.nodes if n.target is aten.mm.default
                                                     and n in matmul.nodes}


def test_a_norm_backwards_broadcast_row_is_generated_in_one_loop(tmp_path):
    """RMSNorm's backward broadcasts a row sum back along the row (an expand between two
    reductions' worth of pointwise ops): one rowwise loop of our fused family."""
    def fn(x, g, w):
        gw = g * w
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        s = (gw * x).sum(-1, keepdim=True) * (-0.5) * rstd.pow(3)
        return gw * rstd + (s / 64).expand(8, 64) * 2.0 * x

    gm = trace(fn, torch.randn(8, 64), torch.randn(8, 64), torch.randn(64))
    region, = graph_regions(gm)
    assert "expand.default" in ops_of(region)
    spec = region_spec(region, {})
    from kernel_testing import assert_valid
    from torch_kernelize.lowering.kernels.base import Config
    family = family_for(spec)
    assert family.name == "fused"
    assert_valid(family, spec, tmp_path)
    # the looped variant too: the broadcast row is known in the pass after its reduction
    assert_valid(family, spec, tmp_path, Config.of(BLOCK_M=2, BLOCK_N=16, num_warps=1, num_stages=2, ALIGN=True,
                                                   EVICT=False), eager=False)


def test_a_region_reducing_rows_and_columns_is_tried_whole_then_as_its_row_loop(tmp_path):
    """RMSNorm's backward with its weight gradient (a sum over the rows): the whole region for a
    whole-graph generator first, then its row loop alone, which our fused family generates."""
    def fn(x, g, w):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        s = (g * w * x).sum(-1, keepdim=True) * (-0.5) * rstd.pow(3)
        dx = g * w * rstd + (s / 64).expand(8, 64) * 2.0 * x
        return dx, (g * x * rstd).sum(0)

    gm = trace(fn, torch.randn(8, 64), torch.randn(8, 64), torch.randn(64))
    whole, rows = graph_regions(gm)
    assert set(rows.nodes) < set(whole.nodes)
    assert set(whole.nodes) - set(rows.nodes) == {n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList
                                                 and n.args[1] == [0]}
    assert family_for(region_spec(whole, {})) is None
    spec = region_spec(rows, {})
    assert len(spec.outputs) == 2   # dx, and what the weight gradient's sum reads
    from kernel_testing import assert_valid
    assert_valid(family_for(spec), spec, tmp_path)


# --- training graphs -----------------------------------------------------------------------------

class NormMLP(nn.Module):
    """BERT's feed-forward block: GELU between two Linear layers, the residual, then LayerNorm."""

    def __init__(self, d=32, f=64):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.norm(x + self.fc2(F.gelu(self.fc1(x)))) * 0.5


def compiled_graphs(model, inputs, tmp_path, train: bool, **options):
    """Compile ``model`` with the backend (interpreter target) and run it once (with a backward
    pass when ``train``): its output, its gradients and the LoweredGraphs it made."""
    from torch_kernelize.backend import compile_with_session
    from torch_kernelize.compiling.lower import Session
    from torch_kernelize.core.options import Options

    session = Session(Options(target=None, cache_dir=tmp_path / "cache", **options),
                      targets.get_target("interpreter"))
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    out = compiled(*inputs)
    out = out.logits if hasattr(out, "logits") else out
    grads = None
    if train:
        out.float().square().mean().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad()
    return out.detach(), grads, graphs


def eager(model, inputs):
    out = model(*inputs)
    out = out.logits if hasattr(out, "logits") else out
    out.float().square().mean().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), grads


def test_training_graphs_get_graph_regions_forward_and_backward(tmp_path):
    torch.manual_seed(0)
    model, x = NormMLP(), torch.randn(8, 32)
    _, _, graphs = compiled_graphs(model, (x,), tmp_path, train=True)
    kinds = {g.kind: [r for r in g.regions if r.kind == "graph"] for g in graphs}
    assert set(kinds) == {"forward", "backward"} and all(kinds.values())
    forward = [ops_of(r) for r in kinds["forward"]]
    assert any({"add.Tensor", "native_layer_norm.default", "mul.Tensor"} <= set(ops) for ops in forward)
    # the backward: LayerNorm's (its weight and bias gradients are sums over the rows) and GELU's
    backward = [ops_of(r) for r in kinds["backward"]]
    assert any(ops.count("sum.dim_IntList") >= 2 for ops in backward), backward
    assert any("erf.default" in ops for ops in backward), backward
    for g in graphs:
        for r in (r for r in g.regions if r.kind == "graph"):
            check_reference(region_spec(r, {}))


def test_llama_training_graphs_get_graph_regions(tmp_path):
    pytest.importorskip("transformers")
    model, inputs = model_zoo.make_hf_llama()
    model.train()
    _, _, graphs = compiled_graphs(model, inputs, tmp_path, train=True)
    by_kind = {g.kind: g for g in graphs}
    assert set(by_kind) == {"forward", "backward"}
    for g in graphs:
        regions = [r for r in g.regions if r.kind == "graph"]
        assert regions, g.kind
        for r in regions:
            assert not BOUNDARIES & {str(n.target) for n in r.nodes}
            check_reference(region_spec(r, {}))
    # the backward of RMSNorm: its reductions and the broadcast of their gradient in one region
    backward = [ops_of(r) for r in by_kind["backward"].regions if r.kind == "graph"]
    assert any({"sum.dim_IntList", "pow.Tensor_Scalar", "expand.default"} <= set(ops) for ops in backward)


# --- the serving ladder ----------------------------------------------------------------------------

@pytest.fixture
def with_family(monkeypatch):
    """Put a test generator first in the family table (as an installed plugin would be)."""
    def use(family):
        monkeypatch.setattr(kernels, "FAMILIES", [family] + [f for f in kernels.families() if f is not family])
    return use


def centered(tmp_path, **options):
    """make_centered compiled under no_grad, run once: (output, eager output, its report)."""
    model, inputs = model_zoo.make_centered()
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kernelize", options={
        "target": "interpreter", "cache_dir": str(tmp_path / "cache"), "report": str(report),
        "graph_cache": "off", **options})
    with torch.no_grad():
        out, want = compiled(*inputs), model(*inputs)
    graph, = json.loads(report.read_text())["graphs"]
    return out, want, graph


def region_rows(graph):
    return {r["shapes"].split(" [")[0].split()[0]: r for r in graph["regions"]}


def fill(tmp_path, *args):
    from torch_kernelize.fill_cache.cli import main
    summary = tmp_path / "summary.json"
    assert main(["--quiet", "--target", "interpreter", "--cache-dir", str(tmp_path / "cache"), "--budget", "2",
                 "--summary", str(summary), *args]) in (0, 1)
    return {r["key"]: r for r in json.loads(summary.read_text())["specs"]}


def test_a_served_graph_region_covers_its_nodes_and_blocks_the_gemm_epilogue(tmp_path, with_family):
    with_family(graph_family.RIGHT)
    out, want, before = centered(tmp_path, repro_dir=str(tmp_path / "repros"))
    torch.testing.assert_close(out, want)
    rows = region_rows(before)
    graph_row = rows["graph"]
    assert graph_row["miss"] and graph_row["family"] == "test_centered_region"
    assert rows["matmul"]["miss"] and rows["pointwise"]["miss"]
    # the big region's miss is recorded like any: a reproducer, with its spec
    flush_repros()  # misses are recorded in the background
    repro = Path(graph_row["repro"])
    assert json.loads((repro / "spec.json").read_text())["spec"]["key"] == graph_row["spec_key"]

    specs = fill(tmp_path, "--model", "torch_kernelize.model_zoo:make_centered")
    assert specs[graph_row["spec_key"]]["status"] == "stored"
    # inside the graph region (the pointwise one), or blocked by it (the GEMM's epilogue region)
    assert specs[rows["pointwise"]["spec_key"]]["status"] == "in a fused region"
    assert specs[rows["matmul"]["spec_key"]]["status"] == "in a fused region"
    addmm = [d for d in before["nodes"] if d["op"] == "aten.addmm.default" and d["node"] == "addmm"]
    assert specs[addmm[0]["spec_key"]]["status"] != "in a fused region"  # its epilogue's region never runs

    out, want, after = centered(tmp_path)
    torch.testing.assert_close(out, want)
    rows = region_rows(after)
    assert rows["graph"]["tier"] == "triton" and rows["graph"]["family"] == "test_centered_region"
    inside = [d for d in after["nodes"] if d["op"] in graph_family.OPS]
    assert inside and all(d["tier"] == "triton" and "in fused region" in d["reason"] for d in inside)
    assert after["summary"]["misses"] == [] and after["summary"]["fused_by_kind"] == {"graph": 1}


def test_a_graph_region_without_a_correct_candidate_splits_then_vendor_wins_splits_too(tmp_path, with_family):
    with_family(graph_family.WRONG)
    _, _, before = centered(tmp_path, repro_dir=str(tmp_path / "repros"))
    graph_row = region_rows(before)["graph"]
    graph_key = graph_row["spec_key"]
    specs = fill(tmp_path, "--model", "torch_kernelize.model_zoo:make_centered")
    assert specs[graph_key]["status"] == "no correct candidate"
    # the smaller regions inside it are searched then, and served
    rows = region_rows(before)
    assert specs[rows["pointwise"]["spec_key"]]["status"] == "stored"
    assert specs[rows["matmul"]["spec_key"]]["status"] == "stored"
    out, want, after = centered(tmp_path)
    torch.testing.assert_close(out, want)
    rows = region_rows(after)
    assert rows["graph"]["tier"] == "vendor" and rows["graph"]["miss"]     # still a miss: it splits
    assert rows["matmul"]["tier"] == "triton" and rows["pointwise"]["tier"] == "triton"

    # "vendor wins" for the graph region: no miss any more, and the same split
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.core.region_graph import region_graph
    from torch_kernelize.core.spec import KernelSpec
    store = KernelCache.for_target(tmp_path / "cache", targets.get_target("interpreter"))
    flush_repros()  # misses are recorded in the background
    spec = KernelSpec.from_json(json.loads((Path(graph_row["repro"]) / "spec.json").read_text())["spec"])
    assert region_graph(spec)["kind"] == "graph"
    store.put({"key": spec.key, "spec": spec.to_json(), "winner": "vendor", "validation": {},
               "timings": {"speedup": 0.5, "measured": True}}, replace=True)
    out, want, vendor = centered(tmp_path)
    torch.testing.assert_close(out, want)
    rows = region_rows(vendor)
    assert rows["graph"]["tier"] == "vendor" and not rows["graph"].get("miss")
    assert "vendor wins" in rows["graph"]["reason"]
    assert rows["matmul"]["tier"] == "triton" and rows["pointwise"]["tier"] == "triton"



def _llama():
    pytest.importorskip("transformers")
    model, inputs = model_zoo.make_hf_llama()
    return model, inputs


def _norm_mlp():
    torch.manual_seed(0)
    return NormMLP(), (torch.randn(8, 32),)


@pytest.mark.parametrize("make", [_norm_mlp, _llama], ids=["norm_mlp", "llama"])
def test_training_with_region_kernels_stored_matches_eager(tmp_path, make):
    """Forward and backward: most graph regions have no generator here (they need a whole-graph
    one, like Inductor) and split into the smaller regions; the region misses (the graph regions
    our fused family generates among them: residual + LayerNorm with its saved mean and rstd,
    RMSNorm's backward) are filled from their reproducers and served in both graphs; outputs and
    gradients match eager."""
    import shutil
    model, inputs = make()
    model.train()
    want, want_grads = eager(model, inputs)
    repros = tmp_path / "repros"
    # (every miss of forward and backward is filled from its repro: more than the default cap)
    _, _, graphs = compiled_graphs(model, inputs, tmp_path, train=True, repro_dir=repros, repro_max=1000)
    decided = [(g.kind, d) for g in graphs for spec in g.specializations().values() for d in spec.regions]
    assert {kind for kind, d in decided if d.shapes.startswith("graph region")} == {"forward", "backward"}
    misses = {d.spec_key: d for _, d in decided if d.miss}
    graph_misses = {k for k, d in misses.items() if d.shapes.startswith("graph region")}
    assert graph_misses and all(misses[k].family == "fused" for k in graph_misses)
    flush_repros()
    chosen = tmp_path / "region_repros"
    for d in misses.values():
        shutil.copytree(d.repro, chosen / Path(d.repro).name, dirs_exist_ok=True)
    specs = fill(tmp_path, "--repros", str(chosen))
    stored = {k for k, r in specs.items() if r["status"] == "stored"}

    out, grads, graphs = compiled_graphs(model, inputs, tmp_path, train=True)
    served = {(g.kind, d.spec_key) for g in graphs for spec in g.specializations().values() for d in spec.regions
              if d.tier == "triton"}
    assert {kind for kind, _ in served} == {"forward", "backward"}
    # (reproducers name no regions around them: a region inside a served graph region is filled
    # too, and then not looked up)
    assert graph_misses <= {k for _, k in served} <= stored
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-4, msg=name)


def test_a_broadcast_view_never_leaves_a_region_as_an_output():
    """An expand read inside the region and outside it: no kernel can write a stride-0 output, so
    the region ends before it (what reads it inside leaves too)."""
    def fn(x):
        s = x.sum(-1, keepdim=True) * 2.0
        e = s.expand(4, 16)
        return e, (e * x).exp().amax(0)

    gm = trace(fn, torch.randn(4, 16))
    expand = next(n for n in gm.graph.nodes if n.target is aten.expand.default)
    for r in graph_regions(gm):
        assert expand not in r.nodes and all(n not in r.nodes for n in expand.users)
        spec = region_spec(r, {})
        assert all(0 not in m.stride for m in spec.outputs)
        check_reference(spec)


def test_a_graph_region_no_family_generates_is_a_miss_where_inductor_fills_it():
    """On a target whose Triton is CUDA, fill_cache asks Inductor by default, which generates any
    graph region: such a region's miss is recorded (named for Inductor) instead of dropped. On the
    interpreter Inductor is not asked by default, and only the smaller kinds have generators."""
    from torch_kernelize.compiling.planner import offline_generator

    assert offline_generator("graph", targets.get_target("cuda")) == "inductor"
    assert offline_generator("graph", targets.get_target("interpreter")) is None
    assert offline_generator("rowwise", targets.get_target("cuda")) is None  # its families answer for it
