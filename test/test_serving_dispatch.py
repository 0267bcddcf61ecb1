"""Dispatch between the specializations of a dynamic graph: one generated key of the varying
sizes and one dict lookup per call; the general key (SymInt hints) only for a new signature."""
from __future__ import annotations

import pytest
import torch

from torch_kernelize.model_zoo import make_mlp
from torch_kernelize.compiling.lower import LoweredGraph


def test_a_seen_shape_is_one_lookup_on_the_varying_sizes(monkeypatch):
    made: list[LoweredGraph] = []
    publish = LoweredGraph._publish
    monkeypatch.setattr(LoweredGraph, "_publish", lambda self, *a: made.append(self) or publish(self, *a))
    model, _ = make_mlp()
    compiled = torch.compile(model, backend="kernelize", dynamic=True, options={"target": "cpu"})
    with torch.no_grad():
        for batch in (2, 3, 5):
            compiled(torch.randn(batch, 32))
        (lowered,) = made
        binder = lowered.binder
        assert not binder.is_static
        seen = []
        call_key = binder.call_key
        monkeypatch.setattr(binder, "call_key", lambda args: seen.append((args, call_key(args))) or seen[-1][1])
        compiled(torch.randn(3, 32))
        ((args, key),) = seen
        assert key == binder.key(args) and (3 in key), "the generated key reads what the general key reads"

        def general_key(_args):
            raise AssertionError("a seen shape must not take the general key")
        monkeypatch.setattr(binder, "key", general_key)
        for batch in (2, 3, 5):  # all seen: the generated key and one lookup
            x = torch.randn(batch, 32)
            torch.testing.assert_close(compiled(x), model(x))
        with pytest.raises(AssertionError, match="general key"):
            compiled(torch.randn(7, 32))  # a new signature is specialised with the general key
