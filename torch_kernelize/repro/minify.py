"""Shrink failures that show in context to the smallest failing graph (functorch's minifier).

The predicate is always pinned to the original failure (the same kernel's spec key running on
the triton tier and mismatching; or the same exception type and message while lowering), so
the minifier cannot drift to another, unrelated failure.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from torch_kernelize.core.validate import compare

log = logging.getLogger("torch_kernelize.repro")


def _retrace(fx_g: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """The minifier's candidate graphs have no metadata; re-trace to get an ATen graph with it."""
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(fx_g, tracing_mode="fake")(*inputs)


def _outputs(x: Any) -> list[torch.Tensor]:
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


def _quiet(options: Any) -> Any:
    """The predicate's own lowerings: no check mode, no repros, no report, no strict errors."""
    return dataclasses.replace(options, check=False, repro_dir=None, report=None, strict=False)


def mismatch_predicate(spec_key: str, target: Any, options: Any) -> Callable[[fx.GraphModule, list], bool]:
    """True while lowering the graph puts kernel ``spec_key`` on the triton tier and the
    outputs differ from the graph run by ATen."""
    from torch_kernelize.compiling.lower import LoweredGraph, Session

    options = _quiet(options)

    def fails(fx_g: fx.GraphModule, inputs: list) -> bool:
        try:
            gm = _retrace(fx_g, inputs)
            session = Session(options, target, private_kernel_states=True)
            lowered = LoweredGraph(gm, inputs, session, "minify")
            decisions = lowered.report.decisions + lowered.report.regions
            if not any(d.spec_key == spec_key and d.tier == "triton" for d in decisions):
                return False
            got = _outputs(lowered(list(inputs)))
            want = _outputs(fx_g(*inputs))
            return any(not compare(g, w.to(torch.float64) if w.is_floating_point() else w, None, factor=2.0).ok
                       for g, w in zip(got, want))
        except Exception:
            return False
    return fails


def lowering_error_predicate(error: BaseException, target: Any, options: Any
                             ) -> Callable[[fx.GraphModule, list], bool]:
    """True while lowering the graph raises the same exception type with the same first line."""
    from torch_kernelize.compiling.lower import LoweredGraph, Session

    options = _quiet(options)
    first_line = str(error).splitlines()[0] if str(error) else ""

    def fails(fx_g: fx.GraphModule, inputs: list) -> bool:
        try:
            gm = _retrace(fx_g, inputs)
        except Exception:
            return False
        try:
            LoweredGraph(gm, inputs, Session(options, target, private_kernel_states=True), "minify")
        except Exception as e:
            return type(e) is type(error) and (str(e).splitlines()[0] if str(e) else "") == first_line
        return False
    return fails


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
