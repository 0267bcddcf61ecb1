"""Decompositions of backward ops torch has none for, into ops a bring-up chip runs: a training
step's backward graph on a chip whose vendor library runs only GEMMs and convolutions.

``convolution_backward`` becomes convolutions and a sum: the input's gradient is the transposed
convolution of the output's gradient with the weight (output padding restoring the input's size);
the weight's gradient a convolution of the input with the output's gradient, the batch taken as
the channels, the groups kept apart, stride and dilation swapped. For a transposed convolution
the roles swap: the input's gradient is the regular convolution of the output's gradient (cut to
the input's size where output padding made the output longer), the weight's the same batch
convolution with the input and the output's gradient exchanged. 1-D to 3-D.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten
BACKWARD_DECOMPOSITIONS: dict[Any, Callable] = {}  # merged into decompositions.OWN_DECOMPOSITIONS


def _grad_input(go: torch.Tensor, weight: torch.Tensor, in_sizes, stride, padding, dilation, groups: int):
    """d out / d input: the transposed convolution, sized back to the input."""
    k = weight.shape[2:]
    reach = [(o - 1) * s - 2 * p + d * (kk - 1) + 1
             for o, s, p, d, kk in zip(go.shape[2:], stride, padding, dilation, k)]
    extra = [want - have for want, have in zip(in_sizes[2:], reach)]
    return aten.convolution.default(go, weight, None, list(stride), list(padding), list(dilation), True, extra, groups)


def _grad_weight(go: torch.Tensor, x: torch.Tensor, k, stride, padding, dilation, groups: int):
    """d out / d weight: the input convolved with the output's gradient over the batch."""
    g, spatial = groups, x.dim() - 2
    n, cin = x.shape[:2]
    cout = go.shape[1]
    cin_g, cout_g = cin // g, cout // g
    # batch <- the input's channels within a group; channels <- (group, batch)
    xs = x.reshape(n, g, cin_g, *x.shape[2:]).transpose(0, 2).reshape(cin_g, g * n, *x.shape[2:])
    ws = go.reshape(n, g, cout_g, *go.shape[2:]).permute(1, 2, 0, *range(3, 3 + spatial))
    ws = ws.reshape(g * cout_g, n, *go.shape[2:])
    out = aten.convolution.default(xs, ws, None, list(dilation), list(padding), list(stride), False,
                                   [0] * spatial, g)  # (cin_g, cout, k' ...): k' >= k where the stride leaves a rest
    out = out[(slice(None), slice(None)) + tuple(slice(0, kk) for kk in k)]
    return out.transpose(0, 1).contiguous()


def _grad_input_transposed(go: torch.Tensor, weight: torch.Tensor, in_sizes, stride, padding, dilation,
                           groups: int) -> torch.Tensor:
    """d out / d input of a transposed convolution: the regular convolution, cut to the input."""
    gi = aten.convolution.default(go, weight, None, list(stride), list(padding), list(dilation), False,
                                  [0] * len(stride), groups)
    return gi[(slice(None), slice(None)) + tuple(slice(0, n) for n in in_sizes[2:])]


def _convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    if weight.dim() not in (3, 4, 5):
        return NotImplemented
    k = weight.shape[2:]
    if transposed:
        gi = _grad_input_transposed(grad_output, weight, input.shape, stride, padding, dilation, groups) \
            if output_mask[0] else None
        gw = _grad_weight(input, grad_output, k, stride, padding, dilation, groups) if output_mask[1] else None
    else:
        gi = _grad_input(grad_output, weight, input.shape, stride, padding, dilation, groups) if output_mask[0] else None
        gw = _grad_weight(grad_output, input, k, stride, padding, dilation, groups) if output_mask[1] else None
    gb = grad_output.sum([0] + list(range(2, grad_output.dim()))) if output_mask[2] else None
    return gi, gw, gb


BACKWARD_DECOMPOSITIONS[aten.convolution_backward.default] = _convolution_backward
