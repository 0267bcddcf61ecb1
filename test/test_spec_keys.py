"""Spec keys are the cache's keys: a cache filled by an earlier version must still hit. These keys
were computed before the kernel families shared one scaffold (and before region refs had one
decoder); a change that moves any of them orphans every entry stored under it."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_kernelize.compiling.regions import find_regions, region_spec
from torch_kernelize.core.targets import get_target
from torch_kernelize.core.spec import KernelSpec

aten = torch.ops.aten
e = torch.empty


def _call(op, args, kwargs=None) -> KernelSpec:
    kwargs = kwargs or {}
    return KernelSpec.from_call(op, args, kwargs, op(*args, **kwargs))


def _region(fn, *inputs) -> KernelSpec:
    gm = make_fx(fn, tracing_mode="fake", decomposition_table=torch._decomp.core_aten_decompositions())(*inputs)
    spec, = (region_spec(r, {}) for r in find_regions(gm, get_target("interpreter")))
    return spec


CASES = {
    "gelu": (lambda: _call(aten.gelu.default, (e(1000),)), "051e90ec97b14d1be98a0cf3"),
    "add_alpha": (lambda: _call(aten.add.Tensor, (e(8, 64), e(64)), {"alpha": 2}), "71d0cdcfcf6436b562bc0069"),
    "sum_keepdim": (lambda: _call(aten.sum.dim_IntList, (e(64, 96), [0], True)), "3ec27fd1f5dd1c4f91704ba2"),
    "histc": (lambda: _call(aten.histc.default, (e(5000), 64, -2, 2)), "daa85e593d6963ecd0bed698"),
    "sort_stable": (lambda: _call(aten.sort.stable, (e(64, 96),), {"stable": True, "dim": 0, "descending": True}),
                    "2f607062869d2ca8e5418422"),
    "layer_norm": (lambda: _call(aten.native_layer_norm.default, (e(16, 64), [64], e(64), e(64), 1e-5)),
                   "dfde3f2a36845524721c8476"),
    "conv1d": (lambda: _call(aten.convolution.default, (e(2, 8, 50), e(16, 8, 3), e(16), [1], [1], [1], False, [0], 1)),
               "87ef470c8e8ed4e350198ed3"),
    "pointwise_region": (lambda: _region(lambda a, b: torch.sigmoid(a) * b + 1, e(16, 64), e(64)),
                         "2bbb3e49619056bc9a4ee759"),
    "matmul_region": (lambda: _region(lambda a, b: torch.relu(a @ b) * 2, e(64, 32), e(32, 48)),
                      "fc8b4a396f8b897f774bd56e"),
}


@pytest.mark.parametrize("name", CASES)
def test_spec_keys_are_unchanged(name):
    make, key = CASES[name]
    assert make().key == key
