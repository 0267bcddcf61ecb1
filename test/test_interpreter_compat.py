"""serving/interpreter_compat.py: Triton 3.6's interpreter under numpy >= 2.4's scalar rule."""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from torch_kernelize.serving.launch import _interpreted


@triton.jit
def _tiles(n_ptr, out_ptr, STEP: tl.constexpr):
    # a persistent kernel's tile loop: Python's range over tensor bounds
    n = tl.load(n_ptr)
    count = 0
    for _ in range(tl.program_id(0), n, STEP):
        count += 1
    tl.store(out_ptr + tl.program_id(0), count)


def test_a_range_over_tensor_bounds_runs_under_numpys_scalar_rule():
    # numpy < 2.4 warns (DeprecationWarning) where 2.4 raises: as an error here, the same check
    n, out = torch.tensor([10], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ndim > 0 to a scalar", category=DeprecationWarning)
        _interpreted(_tiles)[(3,)](n, out, STEP=3)
    assert out.tolist() == [4, 3, 3]
    assert not hasattr(tl.tensor, "__index__")  # both patches undone after the run
