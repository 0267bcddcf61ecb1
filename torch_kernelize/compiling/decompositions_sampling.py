"""Samplers torch has no decomposition for, as gathers and matmuls (issue 44): merged into
decompositions.OWN_DECOMPOSITIONS.

- ``grid_sampler_3d``: the 3-D analogue of torch's ``grid_sampler_2d`` decomposition (trilinear
  and nearest; zeros, border and reflection padding; align_corners): one gather per corner. A
  corner outside the input adds nothing (selected away, not multiplied by a zero weight, so an
  inf or NaN at the clipped index does not leak in, as in ATen).
- ``_upsample_bilinear2d_aa``: antialiased bilinear resizing is separable and its weights depend
  only on the sizes and the scale: two dense interpolation matrices (ATen's triangle filter,
  support ``max(scale, 1)``, each row normalized) built from aranges, applied as mm and bmm.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from torch_kernelize.compiling.decomposition_registry import registrar

aten = torch.ops.aten
SAMPLING_DECOMPOSITIONS: dict[Any, Callable] = {}
_register = registrar(SAMPLING_DECOMPOSITIONS)


# --- grid_sampler_3d -------------------------------------------------------------------------------

def _reflect(coords: torch.Tensor, twice_low: int, twice_high: int) -> torch.Tensor:
    """Reflects coordinates into [low, high] (bounds passed doubled: half-integers stay exact)."""
    if twice_low == twice_high:
        return torch.zeros_like(coords)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    c = (coords - low).abs()
    extra = torch.fmod(c, span)
    flips = (c / span).floor()
    return torch.where(torch.fmod(flips, 2) == 0, extra + low, span + low - extra)


def _source_index(coords: torch.Tensor, size: int, padding_mode: int, align_corners: bool) -> torch.Tensor:
    """Grid coordinates in [-1, 1] to input coordinates, after the padding mode's clipping."""
    mul = (size * 0.5 - 0.5) if align_corners else size * 0.5
    coords = coords * mul + (size * 0.5 - 0.5)
    if padding_mode == 1:  # border
        return coords.clamp(0, size - 1)
    if padding_mode == 2:  # reflection
        coords = _reflect(coords, 0, 2 * (size - 1)) if align_corners else _reflect(coords, -1, 2 * size - 1)
        return coords.clamp(0, size - 1)
    return coords


@_register(aten.grid_sampler_3d.default)
def _grid_sampler_3d(a: torch.Tensor, grid: torch.Tensor, interpolation_mode: int, padding_mode: int,
                     align_corners: bool):
    """(N, C, D, H, W) sampled at grid (N, oD, oH, oW, 3) of (x, y, z) -> (N, C, oD, oH, oW)."""
    if interpolation_mode not in (0, 1) or padding_mode not in (0, 1, 2) or a.numel() == 0 or grid.numel() == 0:
        return NotImplemented  # bicubic is 2-D only in ATen; empty: nothing to gather
    n, c, sizes = a.shape[0], a.shape[1], a.shape[2:]
    grid = grid.unsqueeze(1)  # (N, 1, oD, oH, oW, 3): broadcasts against the channels
    # per dim (z, y, x) <- grid's (2, 1, 0): the input coordinate along D, H, W
    src = [_source_index(grid[..., 2 - k], sizes[k], padding_mode, align_corners) for k in range(3)]
    n_idx = torch.arange(n, device=a.device).reshape(n, 1, 1, 1, 1)
    c_idx = torch.arange(c, device=a.device).reshape(1, c, 1, 1, 1)

    def corner(idx: list[torch.Tensor], weight: torch.Tensor | None) -> torch.Tensor:
        inside = None
        for i, size in zip(idx, sizes):
            ok = (i >= 0) & (i < size)
            inside = ok if inside is None else inside & ok
        safe = [torch.where(inside, i, 0).to(torch.int64) for i in idx]
        v = a[n_idx, c_idx, safe[0], safe[1], safe[2]]
        return torch.where(inside, v if weight is None else v * weight, 0)

    if interpolation_mode == 1:  # nearest: round half to even, as ATen's nearbyint
        return corner([s.round() for s in src], None)
    low = [s.floor() for s in src]
    out = None
    for bits in itertools.product((0, 1), repeat=3):  # ATen's order: tnw, tne, tsw, tse, bnw, ...
        idx = [lo + b for lo, b in zip(low, bits)]
        w = None
        for s, lo, b in zip(src, low, bits):
            f = (s - lo) if b else (lo + 1 - s)
            w = f if w is None else w * f
        term = corner(idx, w)
        out = term if out is None else out + term
    return out


# --- antialiased bilinear upsampling ---------------------------------------------------------------

def _aa_matrix(n_in: int, n_out: int, align_corners: bool, scale: float | None, dtype, device) -> torch.Tensor:
    """(n_out, n_in) weights of ATen's antialiased linear interpolation along one dim: a triangle
    filter stretched by the scale when downsampling, centred at ``scale * (i + 0.5)``, each
    row divided by its sum (ATen computes them only inside the support: outside it they are 0)."""
    if align_corners:
        s = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        s = 1.0 / scale if scale is not None and scale > 0 else n_in / n_out
    invscale = 1.0 / s if s >= 1.0 else 1.0
    center = (torch.arange(n_out, dtype=dtype, device=device) + 0.5) * s
    j = torch.arange(n_in, dtype=dtype, device=device)
    w = (1.0 - ((j.reshape(1, n_in) - center.reshape(n_out, 1) + 0.5) * invscale).abs()).clamp_min(0.0)
    total = w.sum(1, keepdim=True)
    return torch.where(total != 0, w / torch.where(total != 0, total, 1.0), w)


@_register(aten._upsample_bilinear2d_aa.default)
def _upsample_bilinear2d_aa(x: torch.Tensor, output_size, align_corners: bool, scales_h: float | None = None,
                            scales_w: float | None = None):
    """(N, C, H, W) -> (N, C, oH, oW): the width's matrix by mm, then the height's by bmm."""
    if not x.is_floating_point() or x.dim() != 4 or x.numel() == 0 or min(output_size) <= 0:
        return NotImplemented  # uint8 rounds in fixed point in ATen
    n, c, h, w = x.shape
    oh, ow = output_size
    work = torch.float64 if x.dtype == torch.float64 else torch.float32  # ATen's opmath
    wh = _aa_matrix(h, oh, align_corners, scales_h, work, x.device)
    ww = _aa_matrix(w, ow, align_corners, scales_w, work, x.device)
    y = torch.mm(x.to(work).reshape(n * c * h, w), ww.t()).reshape(n * c, h, ow)
    out = torch.bmm(wh.unsqueeze(0).expand(n * c, oh, h), y).reshape(n, c, oh, ow)
    return out.to(x.dtype)
