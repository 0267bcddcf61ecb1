"""Attention through the whole product: a model with F.scaled_dot_product_attention compiled with
backend="kernelize", fill_cache, then a fresh process serves the attention from the cache on the
triton tier (the interpreter as the chip's Triton) and matches eager."""
from __future__ import annotations

import pytest

from conftest import write_target
from test_fill_cache import MODELS, compile_in_fresh_process, fill_cache

pytestmark = pytest.mark.slow

ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"
BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def _chip(tmp_path, vendor_attention: bool) -> str:
    unsupported = [] if vendor_attention else ["aten._scaled_dot_product_flash_attention_for_cpu"]
    return str(write_target(tmp_path / "chip.toml", name="chip", unsupported=unsupported))


def _fill_and_serve(tmp_path, target: str) -> tuple[dict, dict]:
    cache = tmp_path / "cache"
    before, _ = compile_in_fresh_process(tmp_path, cache, fn="make_attention", name="before.json", target=target)
    fill_cache("--model", f"{MODELS}:make_attention", "--target", target, "--cache-dir", str(cache))
    after, _ = compile_in_fresh_process(tmp_path, cache, fn="make_attention", name="after.json", target=target)
    return before, after


def test_attention_runs_on_the_triton_tier_after_one_fill(tmp_path):
    """A chip whose vendor runs attention: a miss first (vendor), the family's kernel after the fill."""
    before, after = _fill_and_serve(tmp_path, _chip(tmp_path, vendor_attention=True))
    assert before["tiers"][ATTENTION] == "vendor" and ATTENTION in before["misses"]
    assert after["tiers"][ATTENTION] == "triton", after["tiers"]
    assert after["misses"] == [] and after["err"] < 1e-5


def test_a_chip_without_vendor_attention_runs_the_flash_kernel(tmp_path):
    before, after = _fill_and_serve(tmp_path, _chip(tmp_path, vendor_attention=False))
    assert before["err"] < 1e-5   # before the fill: whatever tier the ladder chose, the right values
    assert after["tiers"][ATTENTION] == "triton", after["tiers"]
    assert after["misses"] == [] and after["err"] < 1e-5


TRAIN_SNIPPET = """
import json, torch
from torch_kernelize import model_zoo
model, (x,) = model_zoo.make_attention()
compiled = torch.compile(model, backend="kernelize", options={{"target": {target!r}, "cache_dir": {cache!r},
                         "repro_dir": {repros!r}, "report": {report!r}}})
weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
grads = []
for fn in (compiled, model):
    xg = x.clone().requires_grad_()
    (fn(xg) * weights).sum().backward()
    grads.append(xg.grad)
doc = json.load(open({report!r}))
tiers = {{n["op"]: n["tier"] for g in doc["graphs"] for n in g["nodes"]}}
print(json.dumps({{"err": (grads[0] - grads[1]).abs().max().item(), "tiers": tiers}}))
"""


def test_training_step_runs_forward_and_backward_attention_on_the_triton_tier(tmp_path):
    """A training step on a chip without the attention backward (it has no decomposition): the
    host fallback runs it and leaves a reproducer; fill_cache --repros fills both attention ops;
    then forward and backward run the flash kernels, with eager's gradients."""
    from conftest import last_json, run_python
    chip = str(write_target(tmp_path / "chip.toml", name="chip", unsupported=[BACKWARD.rsplit(".", 1)[0]]))
    cache, repros = tmp_path / "cache", tmp_path / "repros"

    def step(name):
        return last_json(run_python(TRAIN_SNIPPET.format(target=chip, cache=str(cache),
                                                         repros=str(repros), report=str(tmp_path / name))))

    before = step("before.json")
    assert before["tiers"][BACKWARD] == "fallback" and before["tiers"][ATTENTION] == "vendor"
    assert before["err"] < 1e-5
    fill_cache("--repros", str(repros), "--target", chip, "--cache-dir", str(cache))
    after = step("after.json")
    assert after["tiers"][ATTENTION] == "triton" and after["tiers"][BACKWARD] == "triton", after["tiers"]
    assert after["err"] < 1e-4


def test_a_tiny_llama_s_attention_runs_on_the_triton_tier(tmp_path):
    """transformers' Llama (GQA, causal, through SDPA): its attention node is the family's after one fill."""
    pytest.importorskip("transformers")
    cache = tmp_path / "cache"
    fill_cache("--model", f"{MODELS}:make_hf_llama_logits", "--target", "interpreter", "--cache-dir", str(cache))
    after, _ = compile_in_fresh_process(tmp_path, cache, fn="make_hf_llama_logits", target="interpreter")
    assert after["tiers"][ATTENTION] == "triton", after["tiers"]
    assert after["err"] < 1e-4
