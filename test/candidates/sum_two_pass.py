"""A correct candidate with an intermediate buffer and two launches: row sums of a 2-D tensor as
per-chunk partial sums (into a zeroed temporary), then a sum of the partials."""
import torch
import triton
import triton.language as tl

OP = "aten.sum.dim_IntList"


@triton.jit
def partial_sums(x, partial, n_cols, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    tl.store(partial + row * CHUNKS + chunk, tl.sum(v, 0))


@triton.jit
def sum_partials(partial, out, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    tl.store(out + row, tl.sum(tl.load(partial + row * CHUNKS + tl.arange(0, CHUNKS)), 0))


def launch(x, dims, keepdim=False, dtype=None):
    rows, cols = x.shape
    block = 32
    chunks = triton.next_power_of_2(triton.cdiv(cols, block))
    partial = torch.zeros(rows * chunks, dtype=torch.float32, device=x.device)
    out = torch.empty(rows, dtype=x.dtype, device=x.device)
    partial_sums[(rows, chunks)](x, partial, cols, CHUNKS=chunks, BLOCK=block)
    sum_partials[(rows,)](partial, out, CHUNKS=chunks, num_warps=1)
    return out
