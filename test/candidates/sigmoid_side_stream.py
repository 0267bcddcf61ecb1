"""Cheat: launches on a stream of its own, which a timer on the current stream does not wait for."""
import torch
import triton
import triton.language as tl

OP = "aten.sigmoid.default"


@triton.jit
def sigmoid_kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, 1.0 / (1.0 + tl.exp(-tl.load(x + offs, mask=mask))), mask=mask)


def launch(x):
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        sigmoid_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    return out
