"""The Gluon conv1d experiment (benchmarks/experiments) still builds for the H200.

Gluon has no interpreter, so this checks what a CPU can: each variant compiles for sm_90, the
slab's shifted tap windows lower to shared loads feeding wgmma, and the geometry guards hold.
The numbers it documents come from a GPU run (benchmarks/results/*-conv1d-gluon.json).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kernel_testing import GPU_COMPILE
from torch_kernelize.launch import import_source

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "conv1d_gluon_slab.py"


def _module():
    return import_source(SCRIPT, "conv1d_gluon_slab")


@pytest.mark.parametrize("L,K,pad,dil", [(200, 3, 1, 1), (64, 5, 2, 1), (48, 3, 2, 2), (40, 3, 0, 1), (32, 1, 0, 1)])
def test_padded_position_space_reads_the_right_input_or_zero(L, K, pad, dil):
    """Every tap of every output slot reads its own input position, or a slot the loader masks
    to zero: the zero padding of the convolution comes from the slots between rows."""
    m = _module()
    g = m.geometry(L, K, pad, dil)
    assert g["Lout"] == L + 2 * pad - dil * (K - 1)
    lp, h = g["LP"], g["H"]
    for n in range(3):
        for l in range(g["Lout"]):
            for k in range(K):
                i = l + k * dil - pad
                slot = n * lp + h + l + k * dil - pad
                nn, ii = slot // lp, slot % lp - h
                if 0 <= i < L:
                    assert (nn, ii) == (n, i)
                else:
                    assert not 0 <= ii < L, (n, l, k)


def test_channel_chunks_and_guards():
    m = _module()
    assert m.chunks(96) == [(0, 64), (64, 32)]
    assert m.chunks(48) == [(0, 32), (32, 16)]
    with pytest.raises(ValueError, match="multiple of 16"):
        m.chunks(100)
    with pytest.raises(ValueError, match="vector hints"):
        m.source(N=2, Cin=16, Cout=16, L=20, K=3, pad=1, dil=1, BL=64, num_warps=4)


@pytest.mark.skipif(not GPU_COMPILE, reason="TK_TEST_GPU_COMPILE=0")
@pytest.mark.parametrize("variant", [dict(BL=64, num_warps=4, PADN=2), dict(BL=128, num_warps=8, PAD_SMEM=False, LOADT=1)])
def test_variants_compile_for_sm90(variant, tmp_path):
    m = _module()
    shape = dict(m.SHAPE, N=64)
    compiled = m.compile_sm90(m.source(**shape, **variant), tmp_path, "v", variant["num_warps"])
    counts = m.sass_counts(compiled.asm["cubin"])
    assert any(op.startswith("HGMMA") for op in counts), counts
    # the taps come out of shared memory, not from shifted global loads
    assert any(op.startswith(("LDS", "LDSM")) for op in counts), counts
    wide_global = sum(v for op, v in counts.items() if op in ("LDG.E.128", "LDG.E"))
    assert wide_global, counts
