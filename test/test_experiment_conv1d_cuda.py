"""The CUDA C++ conv1d experiment (benchmarks/experiments/conv1d_mma_cuda.py) keeps building.

Its numbers come from GPU runs (benchmarks/results/*-conv1d-cuda-*.json); what a CPU with nvcc
can check is that every variant and every checked shape still compiles for sm_90a, within the
registers its launch bounds give (no spills where the recorded runs had none).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from torch_kernelize import cuda_cxx
from torch_kernelize.launch import import_source

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "conv1d_mma_cuda.py"


@pytest.mark.skipif(cuda_cxx.nvcc() is None, reason="needs nvcc (the CUDA toolkit)")
def test_every_variant_builds_for_sm90a(tmp_path):
    m = import_source(SCRIPT, "conv1d_mma_cuda")
    for i, v in enumerate(m.VARIANTS + m.CHECKS):
        cubin, report = m.build({**m.SHAPE, **v}, tmp_path, f"v{i}")
        assert cubin and "registers" in report, v
        if v["KERNEL"] == "bulk":
            assert "0 bytes spill stores" in report, (v, report)
