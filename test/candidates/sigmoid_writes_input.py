"""Cheat: scribbles on its input (here: stores the result into it as well)."""
import torch
import triton
import triton.language as tl

OP = "aten.sigmoid.default"


@triton.jit
def sigmoid_kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = 1.0 / (1.0 + tl.exp(-tl.load(x + offs, mask=mask)))
    tl.store(out + offs, s, mask=mask)
    tl.store(x + offs, s, mask=mask)


def launch(x):
    out = torch.empty_like(x)
    sigmoid_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    return out
