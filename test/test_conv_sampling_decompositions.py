"""3-D and transposed convolutions (compiling/decompositions_conv.py), grid_sampler_3d and
antialiased bilinear resizing (compiling/decompositions_sampling.py) on a chip that runs none of
them: decomposed, and eager's values (float64) for stride, padding, dilation, groups, output
padding and bias, every sampling mode, upsampling and downsampling."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.lower import lower
from torch_kernelize.core.targets import Target

D64 = torch.float64


def _check(fn, *args, op: str):
    """Only ``op`` is missing on the chip (its pieces run on the vendor: cheap to plan; the
    breadth suite checks that they run on the chip)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    chip = Target("chip", device="cpu", triton="none", unsupported=frozenset({op}))
    lowered = lower(gm, list(args), {"repro_dir": "off"}, target=chip)
    assert [d.tier for d in lowered.report.decisions if d.op == op] == ["decompose"]
    got, want = lowered(list(args)), fn(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def _r(*shape):
    return torch.randn(*shape, dtype=D64)


CONV = "aten.convolution.default"


def test_conv3d_groups_stride_padding_dilation_bias():
    _check(lambda x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1), padding=(1, 0, 2), dilation=(2, 1, 1), groups=2),
           _r(2, 4, 5, 4, 6), _r(6, 2, 3, 2, 2), _r(6), op=CONV)


@pytest.mark.parametrize("case", ["1d_groups_dilation", "2d_crop", "3d_sample"])
def test_conv_transpose(case):
    """Output padding below stride or dilation, a padding past dilation * (k - 1) (the padded
    input is cropped), groups with in/out channels swapped per group."""
    if case == "1d_groups_dilation":
        _check(lambda x, w, b: F.conv_transpose1d(x, w, b, stride=3, padding=1, output_padding=2, groups=2,
                                                  dilation=2), _r(2, 4, 5), _r(4, 3, 3), _r(6), op=CONV)
    elif case == "2d_crop":
        _check(lambda x, w: F.conv_transpose2d(x, w, stride=(2, 1), padding=(3, 1), output_padding=(1, 0)),
               _r(1, 3, 4, 5), _r(3, 2, 3, 2), op=CONV)
    else:
        _check(lambda x, w, b: F.conv_transpose3d(x, w, b, stride=2, padding=2, output_padding=1),
               _r(1, 3, 4, 4, 4), _r(3, 3, 3, 3, 3), _r(3), op=CONV)


@pytest.mark.parametrize("mode,padding,align", [("bilinear", "zeros", False), ("bilinear", "reflection", True),
                                                ("bilinear", "reflection", False), ("nearest", "border", False)])
def test_grid_sampler_3d(mode, padding, align):
    """Points inside, on the corners and far outside (an inf at the clipped index stays out)."""
    x = _r(2, 3, 4, 5, 3)
    x[:, :, 0, 0, 0] = float("inf")
    grid = torch.rand(2, 3, 4, 2, 3, dtype=D64) * 3 - 1.5
    grid[0, 0, 0, 0] = torch.tensor([1.0, -1.0, 0.5])
    if padding == "zeros":
        grid[:, 0] = -4.0  # every corner outside: 0, not inf * 0
    _check(lambda a, g: F.grid_sample(a, g, mode=mode, padding_mode=padding, align_corners=align), x, grid,
           op="aten.grid_sampler_3d.default")


@pytest.mark.parametrize("size,align", [((3, 3), False), ((11, 25), True)], ids=str)
def test_upsample_bilinear2d_aa(size, align):
    """Down (the support stretched by the scale) and up."""
    _check(lambda a: torch.ops.aten._upsample_bilinear2d_aa(a, list(size), align), _r(2, 3, 10, 20),
           op="aten._upsample_bilinear2d_aa.default")


def test_upsample_bilinear2d_aa_scale_factors():
    """Given scale factors set the filter's scale (1 / factor), not the sizes' ratio."""
    _check(lambda a: F.interpolate(a, scale_factor=(0.37, 2.6), mode="bilinear", antialias=True), _r(1, 2, 9, 7),
           op="aten._upsample_bilinear2d_aa.default")


@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_backward_3d_and_transposed(transposed):
    """convolution_backward of a 3-D convolution, and of a transposed one whose output padding
    makes the regular convolution of its gradient longer than the input."""
    from torch_kernelize.compiling.backward_decompositions import BACKWARD_DECOMPOSITIONS
    aten = torch.ops.aten
    s, p, d, op, g = [2, 1, 1], [1, 0, 1], [1, 2, 1], ([1, 1, 0] if transposed else [0, 0, 0]), 2
    x, w = _r(2, 4, 5, 4, 3), _r(*((4, 3) if transposed else (6, 2)), 3, 2, 2)
    go = torch.randn_like(aten.convolution(x, w, None, s, p, d, transposed, op, g))
    args = (go, x, w, [6], s, p, d, transposed, op, g, [True, True, True])
    for got, want in zip(BACKWARD_DECOMPOSITIONS[aten.convolution_backward.default](*args),
                         aten.convolution_backward(*args)):
        torch.testing.assert_close(got, want)
