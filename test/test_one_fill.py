"""One fill is enough: after ``fill_cache --model M``, compiling M looks up no spec the fill could
have filled and did not (a node skipped as "in a fused region" that serving then ran alone).

CI runs a few zoo models that cover the ways a skip can go wrong (one spec at several places of a
graph, regions that overlap, GEMM groups that would wait for each other). The whole zoo:

    KERNELIZE_ONE_FILL_ZOO=all .venv/bin/python -m pytest test/test_one_fill.py -n 0
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from torch_kernelize.core.targets import get_target
from torch_kernelize.fill_cache import cli
from torch_kernelize.fill_cache.collect import run_compiled

# statuses of a spec the fill searched and could not give a kernel: serving rightly misses it
COULD_NOT = ("no correct candidate", "too large", "failed", "no generator")
CI = ["make_transformer", "make_crossed", "make_small"]
# every zoo model that runs on the CPU at its default size (the others build on CUDA or are large)
WHOLE_ZOO = ["make_mlp", "make_conv1d", "make_transformer", "make_moe", "make_inplace", "make_log_scan", "make_demo",
             "make_small", "make_wide", "make_experts", "make_crossed", "make_attention", "make_centered",
             "make_hf_llama", "make_hf_gpt2", "make_hf_mixtral", "make_hf_qwen3_moe", "make_hf_bert", "make_hf_t5",
             "make_hf_llama_logits"]
MODELS = WHOLE_ZOO if os.environ.get("KERNELIZE_ONE_FILL_ZOO") == "all" else CI


def misses_after_one_fill(name: str, cache) -> list[str]:
    """Fill the cache for zoo model ``name`` (budget 1, interpreter), compile it, and return each
    spec serving looked up and missed that the fill did not try and fail to fill."""
    ref = f"torch_kernelize.model_zoo:{name}"
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["--quiet", "--model", ref, "--target", "interpreter", "--cache-dir", str(cache),
                         "--budget", "1", "--summary", str(cache / "summary.json")])
        assert code == 0
        status = {r["key"]: r["status"] for r in json.loads((cache / "summary.json").read_text())["specs"]}
        _, _, _, graphs = run_compiled(ref, get_target("interpreter"), cache)
    return sorted({f"{d.spec.describe()[:100]}: {status.get(d.spec.key, 'not collected')}"
                   for g in graphs for s in g.specializations().values() for d in list(s.decisions) + s.regions
                   if d.miss and d.spec is not None and status.get(d.spec.key) not in COULD_NOT})


@pytest.mark.parametrize("name", MODELS)
def test_one_fill_leaves_no_miss_it_could_have_filled(name, tmp_path):
    if name.startswith("make_hf_"):
        pytest.importorskip("transformers")
    assert misses_after_one_fill(name, tmp_path / "cache") == []
