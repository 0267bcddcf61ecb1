"""Bring-up on a chip with almost no vendor library: the layout contract, the cost-aware ladder,
attention's decompositions, no backend exception on real model definitions, the bring-up command."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize import bringup
from torch_kernelize.backend import kernelize
from torch_kernelize.model_zoo import HF_MODELS
from torch_kernelize.compiling.lower import lower
from torch_kernelize.compiling import decompositions
from torch_kernelize.compiling.decompositions import NotDecomposable, host_implementation, trace_decomposition
from torch_kernelize.core.targets import Target

aten = torch.ops.aten
pytest.importorskip("transformers")

GEMM_ONLY = ["aten.mm", "aten.addmm", "aten.bmm", "aten.convolution"]


def _chip_file(tmp_path, supported: list[str], triton: str = "interpreter") -> str:
    path = tmp_path / "chip.toml"
    path.write_text(f'name = "chip"\ndevice = "cpu"\ntriton = "{triton}"\n[ops]\nsupported = {supported!r}\n'
                    .replace("'", '"'))
    return str(path)


def _chip(supported: list[str] | None = None, unsupported: tuple[str, ...] = (), triton: str = "interpreter"):
    return Target("chip", device="cpu", triton=triton, unsupported=frozenset(unsupported),
                  supported=frozenset(supported) if supported is not None else None)


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _compiled(model, target: str, errors: list[str] | None = None, backend=None):
    """torch.compile with kernelize (or ``backend``), recording every exception the backend raises
    (Dynamo would turn some of them into graph breaks and run the frame in eager)."""
    def wrapped(gm, example_inputs):
        try:
            if backend is not None:
                return backend(gm, example_inputs)
            return kernelize(gm, example_inputs, options={"target": target, "repro_dir": "off"})
        except Exception as e:
            if errors is not None:
                errors.append(f"{type(e).__name__}: {e}")
            raise
    return torch.compile(model, backend=wrapped)


def _grads(model, loss) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [g if g is not None else torch.zeros_like(p)
            for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


# --- 1. the layout contract ------------------------------------------------------------------

@pytest.mark.parametrize("supported", [[], GEMM_ONLY], ids=["empty", "gemm_only"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_hf_models_run_on_chips_without_a_vendor_library(name, supported, tmp_path):
    # Before the layout contract, decomposing CPU flash attention returned (B, H, S, D) memory
    # where the graph viewed (B, S, H, D): "view size is not compatible" at the first call.
    model, (x,) = HF_MODELS[name]()
    compiled = _compiled(model, _chip_file(tmp_path, supported))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x).logits, model(x).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,supported", [("llama", []), ("bert", GEMM_ONLY)], ids=["llama-empty", "bert-gemm_only"])
def test_hf_training_step_on_chips_without_a_vendor_library(name, supported, tmp_path):
    model, (x,) = HF_MODELS[name]()
    model = _no_dropout(model.train())
    compiled = _compiled(model, _chip_file(tmp_path, supported))
    loss = compiled(x, labels=x).loss
    got = _grads(model, loss)
    want_loss = model(x, labels=x).loss
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, _grads(model, want_loss)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_a_decomposition_hands_on_the_traced_layout():
    # the op returns (B, S, H, D) memory viewed as (B, H, S, D); its math decomposition a
    # contiguous (B, H, S, D) tensor: a copy into the traced layout follows it
    q, k, v = (torch.randn(2, 4, 8, 16).transpose(1, 2).contiguous().transpose(1, 2) for _ in range(3))
    gm = make_fx(lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0],
                 tracing_mode="fake")(q, k, v)
    node = next(n for n in gm.graph.nodes if n.target is aten._scaled_dot_product_flash_attention_for_cpu.default)
    sub = trace_decomposition(node)
    traced = node.meta["val"][0]
    assert not traced.is_contiguous()  # else the test shows nothing
    out = next(n for n in sub.graph.nodes if n.op == "output").args[0][0]
    assert out.meta["val"].stride() == traced.stride()
    assert out.target is aten.permute.default and out.args[0].target is aten.clone.default


def test_the_layout_copy_is_never_decomposed_again():
    q = torch.randn(2, 8, 3, 4).transpose(1, 2)  # (B, H, S, D) viewed over (B, S, H, D) memory

    def fn(q):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[0].transpose(1, 2).reshape(2, 8, 12)
    lowered = lower(make_fx(fn, tracing_mode="fake")(q), [q], {"repro_dir": "off"},
                    target=_chip(supported=[], triton="none"))
    clones = [d for d in lowered.report.decisions if d.op == "aten.clone.default"]
    assert clones and all(d.tier == "fallback" for d in clones), clones
    assert any("traced layout" in d.rejected["decompose"] for d in clones)
    torch.testing.assert_close(lowered([q]), fn(q))


# --- attention --------------------------------------------------------------------------------
# torch's decomposition of CPU flash attention returns the attention weights as its second
# output; the op's backward reads a logsumexp there, so training graphs got wrong gradients

@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_attention_training_on_a_chip_without_it(causal, tmp_path):
    path = tmp_path / "chip.toml"
    path.write_text('name = "chip"\ndevice = "cpu"\ntriton = "none"\n[ops]\n'
                    'unsupported = ["aten._scaled_dot_product_flash_attention_for_cpu"]\n')
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    kv = torch.randn(2, 2, 8, 16, requires_grad=True)  # grouped-query attention

    def fn(q, k, v, kv):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                + F.scaled_dot_product_attention(q, kv, kv, is_causal=causal, enable_gqa=True))
    compiled = _compiled(fn, str(path))
    out = compiled(q, k, v, kv)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, kv), g)
    want = torch.autograd.grad(fn(q, k, v, kv), (q, k, v, kv), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_decomposition_returning_other_outputs_is_refused(monkeypatch):
    monkeypatch.setattr(decompositions, "OVERRIDES", set())  # torch's: (output, attention weights)
    q = torch.randn(1, 2, 4, 8)
    gm = make_fx(lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q), tracing_mode="fake")(q)
    node = next(n for n in gm.graph.nodes if n.target is aten._scaled_dot_product_flash_attention_for_cpu.default)
    with pytest.raises(NotDecomposable, match="returns other outputs"):
        trace_decomposition(node)


def test_cuda_attention_ops_run_on_the_host_through_their_decomposition():
    # the host fallback of a chip without vendor attention: the CPU has no kernel for CUDA's ops
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    want, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    flash = host_implementation(aten._scaled_dot_product_flash_attention.default)
    assert flash is not aten._scaled_dot_product_flash_attention.default
    out = flash(q, k, v, 0.0, True)
    torch.testing.assert_close(out[0], want)
    torch.testing.assert_close(out[1], lse)
    efficient = host_implementation(aten._scaled_dot_product_efficient_attention.default)(q, k, v, None, False, 0.0, True)
    torch.testing.assert_close(efficient[0], want)
    assert host_implementation(aten.mm.default) is aten.mm.default


@pytest.mark.parametrize("case", ["two", "three_neg_dim", "same_tensor_twice", "legacy_empty", "empty_piece"])
def test_cat_decomposition_matches_aten(case):
    a, b = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    pieces, dim = {"two": ([a, b], 1), "three_neg_dim": ([a, b, a], -2), "same_tensor_twice": ([a, a], -1),
                   "legacy_empty": ([torch.empty(0), a], 0), "empty_piece": ([a, a[:, :0], b], 1)}[case]
    assert torch.equal(decompositions.OWN_DECOMPOSITIONS[aten.cat.default](pieces, dim), torch.cat(pieces, dim))


# --- 2. the cost-aware ladder ------------------------------------------------------------------

def _decisions(fn, inputs, target):
    lowered = lower(make_fx(fn, tracing_mode="fake")(*inputs), list(inputs), {"repro_dir": "off"}, target=target)
    return lowered, {d.op: d for d in lowered.report.decisions}


def test_a_gemm_stays_whole_when_its_decomposition_would_materialize_m_k_n():
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    lowered, by = _decisions(lambda a, b: a @ b, (a, b), _chip(supported=[]))
    mm = by["aten.mm.default"]
    assert mm.tier == "fallback" and mm.family == "matmul" and mm.missing
    assert "would write" in mm.rejected["decompose"] and "matmul family generates" in mm.rejected["decompose"]
    torch.testing.assert_close(lowered([a, b]), a @ b)
    # without a Triton backend no family can help: the decomposition is the only way on the target
    _, by = _decisions(lambda a, b: a @ b, (a, b), _chip(supported=[], triton="none"))
    assert by["aten.mm.default"].tier == "decompose"


def test_a_cheap_decomposition_is_still_taken():
    # addmm -> mm + add writes no more than the op's own tensors: the more abstract tier wins
    x, a, b = torch.randn(48), torch.randn(64, 32), torch.randn(32, 48)
    lowered, by = _decisions(lambda x, a, b: torch.addmm(x, a, b), (x, a, b), _chip(supported=["aten.mm", "aten.add"]))
    assert by["aten.addmm.default"].tier == "decompose"
    assert by["aten.mm.default"].tier == "vendor"
    torch.testing.assert_close(lowered([x, a, b]), torch.addmm(x, a, b))


def test_a_decomposition_into_ops_nothing_runs_is_not_taken_over_a_family(monkeypatch):
    # torch's clamp decomposition tests isnan: with isnan out of the elementwise family (it is in
    # it now), nothing would run that, and clamp stays whole for the family
    from torch_kernelize.lowering.kernels import elementwise
    monkeypatch.delitem(elementwise.OPS, "aten.isnan.default")
    monkeypatch.delitem(elementwise.FAMILY.__dict__, "_plan_memo", raising=False)
    x = torch.arange(12)
    _, by = _decisions(lambda x: x.clamp(2, 9), (x,), _chip(supported=[]))
    clamp = by["aten.clamp.default"]
    assert clamp.tier == "fallback" and clamp.family == "elementwise"
    assert "aten.isnan.default" in clamp.rejected["decompose"]


def test_fill_stores_a_slower_kernel_for_an_op_the_vendor_cannot_run():
    # "vendor wins" means the target's library runs the op; on a bring-up chip it does not
    from torch_kernelize.fill_cache.store_policy import ops_not_on_vendor
    from torch_kernelize.compiling.regions import find_regions, region_spec
    from torch_kernelize.compiling.planner import build_spec
    x = torch.randn(8, 16)
    gm = make_fx(lambda x: (x * 2).relu(), tracing_mode="fake")(x)
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    spec = build_spec(mul, {})
    assert ops_not_on_vendor(_chip(), spec) == []
    assert ops_not_on_vendor(_chip(supported=["aten.relu"]), spec) == ["aten.mul.Tensor"]
    [region] = find_regions(gm, _chip(supported=["aten.mul"]))
    assert ops_not_on_vendor(_chip(supported=["aten.mul"]), region_spec(region, {})) == ["aten.relu.default"]


# --- 5. no backend exception where aot_eager compiles --------------------------------------------

@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_no_backend_exception_on_real_model_definitions(name, train):
    from torch._dynamo.backends.debugging import aot_eager

    def step(compiled, model):
        if train:
            compiled(*inputs, labels=inputs[0]).loss.backward()
        else:
            with torch.no_grad():
                compiled(*inputs)

    model, inputs = HF_MODELS[name]()
    model = _no_dropout(model.train(train))
    reference: list[str] = []
    step(_compiled(model, "cpu", reference, backend=aot_eager), model)
    torch._dynamo.reset()
    errors: list[str] = []
    step(_compiled(model, "cpu", errors), model)
    # kernelize may fail only where aot_eager itself does (a model's own data-dependent custom op)
    assert len(errors) <= len(reference), errors


# --- 4. the bring-up command -------------------------------------------------------------------

def _bring_up_to_100(tmp_path, capsys, *models: str) -> str:
    """bringup of ``models`` on a GEMM-only chip at budget 1: exit 0, every node of each on the
    chip after one fill, outputs matching eager; its output."""
    import json
    chip = _chip_file(tmp_path, GEMM_ONLY)
    code = bringup.main(["--target", chip, *[a for m in models for a in ("--model", f"torch_kernelize.model_zoo:{m}")],
                         "--budget", "1", "--cache-dir", str(tmp_path / "kc"), "--repro-dir", str(tmp_path / "repros"),
                         "--json", str(tmp_path / "bringup.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no host fallback left" in out
    rows = json.loads((tmp_path / "bringup.json").read_text())
    assert len(rows) == len(models)
    for row in rows:
        assert row["tiers"]["fallback"] == 0 and row["tiers"]["triton"] > 0 and row["matches"], row
    return out


def test_bringup_fills_and_reports_every_node_on_the_target(tmp_path, capsys):
    """transformers Llama and GPT-2 (the version the test extras pin) at 100% on a GEMM-only chip
    after one fill, their outputs matching eager."""
    assert "100.0%" in _bring_up_to_100(tmp_path, capsys, "make_hf_llama", "make_hf_gpt2")


def test_bringup_puts_the_moe_models_on_a_gemm_only_chip_after_one_fill(tmp_path, capsys):
    """Mixtral and Qwen3-MoE route tokens with an integer sort, a floor division, a cumsum of float
    counts to int32 and an index_put: each generated by a family, so no node is left on the host."""
    _bring_up_to_100(tmp_path, capsys, "make_hf_mixtral", "make_hf_qwen3_moe")


def test_bringup_lists_what_is_left_on_the_host(tmp_path, capsys):
    chip = _chip_file(tmp_path, [], triton="none")  # no Triton: nothing can be filled
    code = bringup.main(["--target", chip, "--model", "torch_kernelize.model_zoo:make_mlp",
                         "--cache-dir", str(tmp_path / "kc"), "--repro-dir", str(tmp_path / "repros")])
    out = capsys.readouterr().out
    assert code == 1
    assert "host fallbacks left" in out and "missing ops across all models:" in out
    assert str(tmp_path / "repros") in out


def test_bringup_bad_input_exits_2(tmp_path, capsys):
    assert bringup.main(["--target", str(tmp_path / "nope.toml"), "--model", "torch_kernelize.model_zoo:make_mlp"]) == 2
    assert bringup.main(["--target", "cpu", "--model", "no_such_module:make", "--no-fill"]) == 2
    assert "error" in capsys.readouterr().err


# --- 6. training bring-up ----------------------------------------------------------------------

@pytest.mark.parametrize("case", ["depthwise_7x7", "stride_4_stem", "grouped_dilated", "conv1d_stride_rest"])
def test_convolution_backward_decomposes_into_convolutions(case):
    from torch_kernelize.compiling.backward_decompositions import BACKWARD_DECOMPOSITIONS
    shape, w, s, p, d, g = {"depthwise_7x7": ((2, 6, 9, 11), (6, 1, 7, 7), [1, 1], [3, 3], [1, 1], 6),
                            "stride_4_stem": ((2, 3, 16, 16), (8, 3, 4, 4), [4, 4], [0, 0], [1, 1], 1),
                            "grouped_dilated": ((2, 4, 9, 9), (6, 2, 3, 3), [2, 2], [1, 1], [2, 2], 2),
                            "conv1d_stride_rest": ((2, 4, 10), (6, 4, 3), [2], [1], [1], 1)}[case]
    x, weight = torch.randn(shape, dtype=torch.float64), torch.randn(w, dtype=torch.float64)
    go = torch.randn_like(aten.convolution(x, weight, None, s, p, d, False, [0] * len(s), g))
    args = (go, x, weight, [w[0]], s, p, d, False, [0] * len(s), g, [True, True, True])
    for got, want in zip(BACKWARD_DECOMPOSITIONS[aten.convolution_backward.default](*args),
                         aten.convolution_backward(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("models", [["make_convnext"], ["make_hf_llama", "make_hf_bert"]], ids=["convnext", "llama_bert"])
def test_bringup_training_puts_a_step_on_a_gemm_only_chip(models, tmp_path, capsys):
    """Forward and backward graphs filled and compiled: convolution_backward decomposes into the
    chip's convolutions, layer norm's, GELU's, attention's and embedding's backward into ops the
    families generate; the gradients match eager's. (Llama and BERT share one cache: one run.)"""
    chip = _chip_file(tmp_path, GEMM_ONLY)
    code = bringup.main(["--target", chip, *[a for m in models for a in ("--model", f"torch_kernelize.model_zoo:{m}")],
                         "--training", "--budget", "1", "--cache-dir", str(tmp_path / "kc"),
                         "--repro-dir", str(tmp_path / "repros"), "--json", str(tmp_path / "bringup.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    import json
    rows = json.loads((tmp_path / "bringup.json").read_text())
    assert len(rows) == len(models)
    for row in rows:
        assert row["kinds"] == {"forward": 100.0, "backward": 100.0} and row["matches"], row
    if models == ["make_convnext"]:
        assert rows[0]["per_op"]["aten.convolution_backward.default"] == {"decompose": 4}
