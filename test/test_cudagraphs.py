"""CUDA graphs (option ``cudagraphs``): which inputs a graph writes to, and (on a GPU) that a
replay's writes reach the caller's tensors."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.serving.cudagraphs import is_static_input, mutated_inputs

aten = torch.ops.aten


def test_mutated_inputs_follow_the_schemas():
    def f(a, b, c, idx):
        a.add_(b)                                   # in place on input 0
        aten.index_put_.default(c, [idx], b[:2], True)  # accumulate into input 2
        return (a * c).sum()

    x = torch.randn(4, 3)
    gm = make_fx(f)(x.clone(), x.clone(), x.clone(), torch.tensor([0, 1]))
    assert mutated_inputs(gm) == [0, 2]
    assert mutated_inputs(make_fx(lambda a, b: a + b)(x, x)) == []


def test_parameters_and_buffers_are_static_inputs_activations_are_not():
    # a replay reads static inputs in place; anything else is copied into the captured buffer
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4), persistent=False)

        def forward(self, x):
            return self.lin(x) * self.scale

    seen = []

    def backend(gm, example_inputs):
        def run(*args):
            seen.append([is_static_input(a) for a in args])
            return gm(*args)
        return run

    model, x = M(), torch.randn(2, 4)
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    assert sorted(seen[0]) == [False, True, True, True]  # weight, bias, buffer; x is not
    assert not is_static_input(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_replay_writes_back_to_the_inputs_it_mutates():
    def f(out, x, idx):
        out.index_add_(0, idx, x * 2)
        return out.sum()

    compiled = torch.compile(f, backend="kernelize", options={"cudagraphs": True, "repro_dir": "off"})
    idx = torch.tensor([0, 2, 2], device="cuda")
    for step in range(3):
        x = torch.randn(3, 8, device="cuda")
        out, want = torch.ones(4, 8, device="cuda"), torch.ones(4, 8, device="cuda")
        total = compiled(out, x, idx).clone()
        expected = f(want, x, idx)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(total, expected)


def test_mutated_inputs_of_list_arguments():
    # a Tensor(a!)[] argument: each of its tensors that is a graph input is written
    def f(a, b, c):
        torch._foreach_add_([a, b], [c, c])
        return a + b

    x = torch.randn(3)
    assert mutated_inputs(make_fx(f)(x.clone(), x.clone(), x.clone())) == [0, 1]
