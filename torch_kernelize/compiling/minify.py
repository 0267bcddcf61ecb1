"""Shrink failures that show in context to the smallest failing graph (functorch's minifier).

The predicate is always pinned to the original failure (the same kernel's spec key running on
the triton tier and mismatching; or the same exception type and message while lowering), so
the minifier cannot drift to another, unrelated failure. The predicates lower graphs, so they
live with the lowering (lower.py); this module knows only graphs and inputs.
"""
from __future__ import annotations

import contextlib
import io
import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

log = logging.getLogger("torch_kernelize.repro")


def retrace(fx_g: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """The minifier's candidate graphs have no metadata; re-trace to get an ATen graph with it."""
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(fx_g, tracing_mode="fake")(*inputs)


def tensor_outputs(x: Any) -> list[torch.Tensor]:
    x = x if isinstance(x, (tuple, list)) else [x]
    return [t for t in x if isinstance(t, torch.Tensor)]


def minify(gm: fx.GraphModule, inputs: Sequence[Any], fails: Callable[[fx.GraphModule, list], bool]
           ) -> tuple[fx.GraphModule, list] | None:
    """functorch's minifier on ``gm``; None when it cannot run (non-tensor inputs, no failure)."""
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        return None
    return torch._dynamo.disable(_minify)(gm, inputs, fails)


def _minify(gm, inputs, fails):
    # Runs outside Dynamo: a mismatch is found while a compiled graph runs, and the minifier's
    # own tracing must not be captured by the frame evaluation hook.
    from functorch.compile import minifier

    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            small, small_inputs = minifier(gm, list(inputs), fails, dump_state=lambda *a: None)
    except Exception as e:  # the minifier asserts that the full graph fails first
        log.debug("minifier did not run: %s\n%s", e, sink.getvalue())
        return None
    log.debug("minifier log:\n%s", sink.getvalue())
    return small, list(small_inputs)


def real_inputs_like(example_inputs: Sequence[Any]) -> list[Any]:
    """Random real tensors with the example inputs' (hinted) shapes, strides and dtypes."""
    from torch._dynamo.testing import rand_strided

    from torch_kernelize.core.shapes import _hint
    out = []
    for v in example_inputs:
        if isinstance(v, torch.Tensor):
            shape = [int(_hint(s)) for s in v.shape]
            stride = [int(_hint(s)) for s in v.stride()]
            out.append(rand_strided(shape, stride, v.dtype, v.device.type))
        else:
            out.append(_hint(v))
    return out
