"""Cheat: computes in place and returns its input as the output."""
import torch
import triton
import triton.language as tl

OP = "aten.sigmoid.default"


@triton.jit
def sigmoid_inplace(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x + offs, 1.0 / (1.0 + tl.exp(-tl.load(x + offs, mask=mask))), mask=mask)


def launch(x):
    sigmoid_inplace[(triton.cdiv(x.numel(), 256),)](x, x.numel(), BLOCK=256)
    return x
