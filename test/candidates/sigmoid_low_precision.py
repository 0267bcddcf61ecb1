"""Cheat: an fp32 op computed in fp16, faster and beyond fp32's tolerance."""
import torch
import triton
import triton.language as tl

OP = "aten.sigmoid.default"


@triton.jit
def sigmoid_kernel(x, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs, mask=mask).to(tl.float16).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-v))).to(tl.float16)
    tl.store(out + offs, s.to(tl.float32), mask=mask)


def launch(x):
    out = torch.empty_like(x)
    sigmoid_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    return out
