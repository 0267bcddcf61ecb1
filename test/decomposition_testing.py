"""Shared helper for the decomposition tests: a function traced with fake tensors and lowered on
a chip whose vendor runs nothing (and with no Triton), so that each op under test must take the
decomposition tier; the pieces it decomposes into run on the host here (cheap), and the breadth
suite shows they run on the chip."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from torch_kernelize.compiling.lower import lower
from torch_kernelize.core.targets import Target

NOTHING = Target("nothing", device="cpu", triton="none", supported=frozenset())


def lowered_decomposing(fn: Callable, *args: Any, op: str, only: bool = True) -> Any:
    """``fn`` lowered for ``args`` on NOTHING; asserts that ``op`` decomposed (each of its nodes if
    ``only``, else the first: a cast to complex leaves real conversions of its own)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    lowered = lower(gm, list(args), {"repro_dir": "off"}, target=NOTHING)
    tiers = [d.tier for d in lowered.report.decisions if d.op == op]
    assert (tiers == ["decompose"]) if only else (tiers[:1] == ["decompose"]), (op, tiers)
    return lowered


def check_against_eager(fn: Callable, *args: Any, op: str, tol: float = 1e-12) -> None:
    """``fn`` lowered where ``op`` decomposed gives eager's outputs: dtypes and shapes, integers
    and bools exactly, floats within ``tol`` (NaN where eager has NaN)."""
    got = pytree.tree_leaves(lowered_decomposing(fn, *args, op=op)(list(args)))
    want = pytree.tree_leaves(fn(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
        torch.testing.assert_close(g, w, equal_nan=True, rtol=tol, atol=tol)
