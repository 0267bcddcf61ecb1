"""Cheat: reads its output and computes the op only where it finds the poison (NaN), writing 0
elsewhere: right on a harness that always poisons with NaN, wrong on any other memory."""
import torch
import triton
import triton.language as tl

OP = "aten.sigmoid.default"


@triton.jit
def sigmoid_kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    old = tl.load(out + offs, mask=mask)
    s = 1.0 / (1.0 + tl.exp(-tl.load(x + offs, mask=mask)))
    tl.store(out + offs, tl.where(old != old, s, 0.0), mask=mask)


def launch(x):
    out = torch.empty_like(x)
    sigmoid_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    return out
