"""The accumulator-shift conv1d experiment (benchmarks/experiments/conv1d_accshift.py) stays correct.

Its numbers come from a GPU run (benchmarks/results/*-conv1d-accshift.json); what a CPU can check
is that every variant, scaled down, computes the convolution on the Triton interpreter: rows that
end inside a tile, tiles that span two rows, and the halo columns at both edges of a tile.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from torch_kernelize.launch import import_source

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "conv1d_accshift.py"


def _module():
    return import_source(SCRIPT, "conv1d_accshift")


@pytest.mark.parametrize("shift", ["gather", "dot"])
def test_variants_match_float64(shift, tmp_path):
    m = _module()
    for i, v in enumerate(x for x in m.VARIANTS if x["SHIFT"] == shift):
        assert m.check_small(v, tmp_path, f"v{i}") < 2e-3, v
