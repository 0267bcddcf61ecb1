"""Decompositions of frexp and of casts to complex (compiling/decompositions_elementwise.py) on a
chip that runs none of their ops: exactly eager's values, dtypes and strides."""
from __future__ import annotations

import pytest
import torch

from decomposition_testing import lowered_decomposing


def _outputs(fn, *args, op: str) -> list:
    """The outputs of ``fn`` lowered where ``op`` decomposed (a cast to complex leaves real
    conversions of its own: the host's here, the family's on a chip)."""
    got = lowered_decomposing(fn, *args, op=op, only=False)(list(args))
    return got if isinstance(got, (tuple, list)) else [got]


def _same(g: torch.Tensor, w: torch.Tensor) -> None:
    assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
    if w.is_complex():
        g, w = torch.view_as_real(g), torch.view_as_real(w)
    both_nan = (g != g) & (w != w)
    assert bool(((g == w) | both_nan).all()), (g, w)
    assert torch.equal(torch.signbit(g) | both_nan, torch.signbit(w) | both_nan), (g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_frexp_is_exact(dtype):
    """Normals, subnormals, signed zeros, +-inf and NaN (ATen's (x, 0)), the largest finite."""
    info = torch.finfo(dtype)
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.tiny, -info.tiny / 3, info.tiny * info.eps,
               info.max, -1.0, 0.75, 3.0]
    x = torch.cat([torch.tensor(special, dtype=torch.float64).to(dtype), (torch.randn(40) * 1e3).to(dtype)])
    for g, w in zip(_outputs(torch.frexp, x, op="aten.frexp.Tensor"), torch.frexp(x)):
        _same(g, w)


@pytest.mark.parametrize("case", ["f32_permuted_c64", "i64_c128", "f32_0d_c32", "c64_transposed_c128",
                                  "f64_sliced_c64", "c128_c64"])
def test_cast_to_complex(case):
    """Values, dtype and the traced output's strides: x's dense layout kept, contiguous otherwise."""
    r = torch.randn(3, 4, 5) * 3
    x, dtype = {"f32_permuted_c64": (r.permute(2, 0, 1), torch.complex64),
                "i64_c128": (r.to(torch.int64), torch.complex128),
                "f32_0d_c32": (r[0, 0, 0], torch.complex32),
                "c64_transposed_c128": (torch.complex(r, -r).transpose(0, 2), torch.complex128),
                "f64_sliced_c64": (r.double()[:, ::2], torch.complex64),
                "c128_c64": (torch.complex(r, r * 2).double().to(torch.complex128), torch.complex64)}[case]
    fn = lambda t: t.to(dtype)  # noqa: E731
    _same(_outputs(fn, x, op="aten._to_copy.default")[0], fn(x))
