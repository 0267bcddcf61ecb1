"""A candidate for _embedding_bag in mode 'mean' (no per_sample_weights, no padding_idx): one
program per bag averages the rows its ids name, between its offset and the next (an empty bag
is zeros), and writes the bookkeeping outputs ATen's CPU kernel returns in this mode: each
position's bag (offset2bag), and each bag's size (bag_size, and max_indices likewise)."""
import torch
import triton
import triton.language as tl

OP = "aten._embedding_bag.default"


@triton.jit
def bag_kernel(w, ids, offsets, out, offset2bag, bag_size, max_indices, n, bags, D: tl.constexpr,
               BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(offsets + b)
    end = tl.load(offsets + b + 1, mask=b + 1 < bags, other=n)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j in range(start, end):
        row = tl.load(ids + j)
        acc += tl.load(w + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(offset2bag + j, b.to(tl.int64))
    count = end - start
    mean = acc / tl.maximum(count, 1).to(tl.float32)
    tl.store(out + b * D + cols, mean.to(out.dtype.element_ty), mask=cols < D)
    tl.store(bag_size + b, count.to(tl.int64))
    tl.store(max_indices + b, count.to(tl.int64))


def launch(weight, indices, offsets, *rest):
    bags, d, n = offsets.numel(), weight.shape[1], indices.numel()
    out = torch.empty((bags, d), dtype=weight.dtype, device=weight.device)
    offset2bag = torch.empty(n, dtype=torch.int64, device=weight.device)
    bag_size = torch.empty(bags, dtype=torch.int64, device=weight.device)
    max_indices = torch.empty(bags, dtype=torch.int64, device=weight.device)
    bag_kernel[(bags,)](weight, indices, offsets, out, offset2bag, bag_size, max_indices, n, bags, D=d,
                        BLOCK_D=triton.next_power_of_2(d))
    return out, offset2bag, bag_size, max_indices
