"""A candidate file for aten.logcumsumexp (log of the running sum of exp along a dim).

The contract (docs/trust.md, "Candidate files"): @triton.jit kernels at the top level, ``launch(*args)``
called with the op's arguments in its schema's order -- here ``(self, dim)`` -- returning its
output, and ``OP`` (or ``SPECS``) naming what it is for. ``launch`` only allocates and launches:
fill_cache records those launches once per shape, and serving replays the recording.

    python -m torch_kernelize.fill_cache --repros REPROS --candidate examples/logcumsumexp_candidate.py

The scan runs in fp32 along ``dim`` of a contiguous input seen as (outer, n, inner): each program
takes a tile of ``inner`` columns and walks ``n`` in chunks, carrying the running log-sum-exp.
"""
import math

import torch
import triton
import triton.language as tl

OP = "aten.logcumsumexp.default"


@triton.jit
def _logaddexp(a, b):
    # log(exp(a) + exp(b)) without overflow; exact for -inf (log 0) and +inf, NaN propagates
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    r = hi + tl.log(1.0 + tl.exp(tl.where(lo == hi, 0.0, lo - hi)))
    return tl.where((a != a) | (b != b), float("nan"), r)


@triton.jit
def logcumsumexp_kernel(x, out, inner, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    outer = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    base = outer * N * inner
    carry = tl.full((BLOCK_I,), float("-inf"), tl.float32)
    for start in range(0, N, BLOCK_N):  # N is a constexpr: a static loop
        rows = start + tl.arange(0, BLOCK_N)
        offs = base + rows[:, None] * inner + cols[None, :]
        mask = (rows[:, None] < N) & (cols[None, :] < inner)
        v = tl.load(x + offs, mask=mask, other=float("-inf")).to(tl.float32)
        s = _logaddexp(tl.associative_scan(v, 0, _logaddexp), carry[None, :])
        tl.store(out + offs, s.to(out.dtype.element_ty), mask=mask)
        carry = _logaddexp(carry, tl.reduce(v, 0, _logaddexp))


def launch(x: torch.Tensor, dim: int) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError("this candidate handles contiguous inputs only")
    dim = dim % max(x.dim(), 1)
    n = x.shape[dim] if x.dim() else 1
    inner = math.prod(x.shape[dim + 1:])
    outer = x.numel() // max(n * inner, 1)
    out = torch.empty_like(x)
    block_n = min(triton.next_power_of_2(n), 1024)
    block_i = min(triton.next_power_of_2(inner), max(1, 4096 // block_n))
    logcumsumexp_kernel[(outer, triton.cdiv(inner, block_i))](x, out, inner, N=n, BLOCK_N=block_n, BLOCK_I=block_i)
    return out
