"""Index outputs of ops with ties are judged by what the op promises (core/index_ties.py), and
complex outputs as complex numbers (core/validate.compare)."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import spec_of
from torch_kernelize.core.validate import compare, validate

aten = torch.ops.aten
UNSETTLED = lambda spec, inputs, outs, refs: outs  # noqa: E731


def _judge(op, x, args, run, kwargs=None):
    """(validated with the default tie rule, validated without any): ``run`` on the tied input ``x``."""
    spec = spec_of(op, (x, *args), kwargs)
    sample = lambda spec, seed, kind, device: [x.clone()]  # noqa: E731
    settled = validate(run, spec, sample, (), seeds=(0,))
    return settled, validate(run, spec, sample, (), seeds=(0,), resolve_ties=UNSETTLED)


def _tied(*shape):
    return torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(0)).float()


def _last_max_pool(x, *args):
    """max_pool2d_with_indices that picks the last of equal maxima (ATen's CPU kernel: the first)."""
    h, w = x.shape[-2:]
    v, i = aten.max_pool2d_with_indices.default(x.flip(-1, -2), *args)
    rows, cols = i // w, i % w
    return v.flip(-1, -2), ((h - 1 - rows) * w + (w - 1 - cols)).flip(-1, -2)


def test_max_pool_indices_of_any_equal_maximum_in_the_window_are_right():
    x = _tied(2, 3, 8, 8)
    settled, unsettled = _judge(aten.max_pool2d_with_indices.default, x, ([2, 2], [2, 2]),
                                lambda inputs: _last_max_pool(inputs[0], [2, 2], [2, 2]))
    assert settled.ok, settled.reason
    assert not unsettled.ok and "output 1" in unsettled.reason  # the fill's "no correct candidate" before


def test_max_pool_index_outside_its_window_or_of_another_value_is_wrong():
    x = torch.zeros(1, 1, 4, 4)   # every element ties: only the window tells a right index from a wrong one

    def first_element(inputs):
        v, i = aten.max_pool2d_with_indices.default(inputs[0], [2, 2], [2, 2])
        return v, torch.zeros_like(i)   # element 0 is a maximum, but only of the first window
    settled, _ = _judge(aten.max_pool2d_with_indices.default, x, ([2, 2], [2, 2]), first_element)
    assert not settled.ok and "output 1" in settled.reason

    y = _tied(1, 2, 6, 6)

    def off_by_one(inputs):
        v, i = aten.max_pool2d_with_indices.default(inputs[0], [3, 3], [1, 1], [1, 1])
        return v, (i + 1) % 36
    settled, _ = _judge(aten.max_pool2d_with_indices.default, y, ([3, 3], [1, 1], [1, 1]), off_by_one)
    assert not settled.ok


def _flipped(op, dim_arg):
    """``op`` along ``dim`` on the reversed input: the last of equal elements instead of the first."""
    def run(inputs):
        x = inputs[0]
        d = -1 if dim_arg is None else dim_arg
        flat = x.reshape(-1) if dim_arg is None else x
        out = op(flat.flip(d), *(() if dim_arg is None else (dim_arg,)))
        n = flat.shape[d]
        if isinstance(out, tuple):
            return out[0], n - 1 - out[1]
        return (n - 1 - out,)
    return run


@pytest.mark.parametrize("op,dim", [(aten.argmax.default, 1), (aten.argmin.default, 0), (aten.argmax.default, None),
                                    (aten.max.dim, 1), (aten.min.dim, -1)])
def test_argmax_and_max_with_dim_accept_any_equal_extremum(op, dim):
    x = _tied(6, 10)
    settled, unsettled = _judge(op, x, () if dim is None else (dim,), _flipped(op, dim))
    assert settled.ok, settled.reason
    assert not unsettled.ok


def test_max_dim_keepdim_and_a_wrong_index_is_rejected():
    x = _tied(4, 5, 7)

    def keep(inputs):
        v, i = aten.max.dim(inputs[0].flip(2), 2, True)
        return v, 6 - i
    settled, unsettled = _judge(aten.max.dim, x, (2, True), keep)
    assert settled.ok and not unsettled.ok, settled.reason

    def wrong(inputs):
        v, i = aten.max.dim(inputs[0], 2, True)
        return v, (i + 3) % 7   # in range, another element: equal only by chance
    settled, _ = _judge(aten.max.dim, x, (2, True), wrong)
    assert not settled.ok

    def out_of_range(inputs):
        v, i = aten.max.dim(inputs[0], 2, True)
        return v, i + 7
    settled, _ = _judge(aten.max.dim, x, (2, True), out_of_range)
    assert not settled.ok


def test_sort_of_equal_keys_accepts_any_order_of_them_but_not_an_element_twice():
    x = _tied(3, 9)

    def descending_last(inputs):   # a stable sort of the reversed row: equal keys in reverse order
        v, i = aten.sort.default(inputs[0].flip(-1), -1)
        return v, 8 - i
    settled, unsettled = _judge(aten.sort.default, x, (-1,), descending_last)
    assert settled.ok and not unsettled.ok, settled.reason

    def twice(inputs):
        v, i = aten.sort.default(inputs[0], -1)
        i = i.clone()
        i[:, 1] = i[:, 0]
        return v, i
    settled, _ = _judge(aten.sort.default, x, (-1,), twice)
    assert not settled.ok


def test_complex_outputs_are_compared_as_complex_numbers():
    ref = torch.tensor([1 + 2j, 3 - 1j, -0.5 + 0.25j], dtype=torch.complex128)
    assert compare(ref.to(torch.complex64), ref).ok   # within complex64's (float32's) tolerance
    wrong_imag = ref.to(torch.complex64).clone()
    wrong_imag[1] = 3 + 1j   # the real parts all agree
    c = compare(wrong_imag, ref)
    assert not c.ok and "3+1j" in c.reason and "3-1j" in c.reason
    assert c.max_abs == pytest.approx(2.0)   # |(3+1j) - (3-1j)|, the modulus of the difference
