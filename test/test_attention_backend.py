"""Attention through the whole product: a model with F.scaled_dot_product_attention compiled with
backend="kernelize", fill_cache, then a fresh process serves the attention from the cache on the
triton tier (the interpreter as the chip's Triton) and matches eager."""
from __future__ import annotations

import pytest

from conftest import write_target
from test_fill_cache import MODELS, compile_in_fresh_process, fill_cache

pytestmark = pytest.mark.slow

ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"


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


@pytest.mark.xfail(strict=True, reason="needs issue 22's cost-aware ladder: today a chip without the "
                   "attention op takes its math decomposition (tier 1) although the attention family "
                   "generates it whole")
def test_a_chip_without_vendor_attention_runs_the_flash_kernel(tmp_path):
    before, after = _fill_and_serve(tmp_path, _chip(tmp_path, vendor_attention=False))
    assert before["err"] < 1e-5   # before the fill: whatever tier the ladder chose, the right values
    assert after["tiers"][ATTENTION] == "triton", after["tiers"]
    assert after["misses"] == [] and after["err"] < 1e-5
