"""Cheat: adds into its output as if it started at zero, but allocates it with torch.empty (fresh
memory is often zero, so this passes a harness that does not poison outputs)."""
import torch
import triton
import triton.language as tl

OP = "aten.sigmoid.default"


@triton.jit
def sigmoid_kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = 1.0 / (1.0 + tl.exp(-tl.load(x + offs, mask=mask)))
    tl.store(out + offs, tl.load(out + offs, mask=mask) + s, mask=mask)


def launch(x):
    out = torch.empty_like(x)
    sigmoid_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    return out
