"""The runner side of fill_cache: candidates of one spec are judged on the same trials."""
from __future__ import annotations

import pytest
import torch

from kernel_testing import spec_of
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.lowering.kernels.elementwise import FAMILY
from torch_kernelize.lowering.targets import get_target
from torch_kernelize.spec import KernelSpec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_references_are_computed_once_per_trial_for_all_candidates(monkeypatch):
    spec = spec_of(torch.ops.aten.add.Tensor, (torch.randn(33, 17), torch.randn(33, 17)))
    calls = []
    reference = KernelSpec.reference

    def counting(self, tensors, device="cpu"):
        calls.append(device)
        return reference(self, tensors, device)
    monkeypatch.setattr(KernelSpec, "reference", counting)
    measurer = Measurer(spec, FAMILY, get_target("interpreter"))
    configs = FAMILY.seed_configs(spec)[:2]
    assert len(configs) == 2
    first = measurer.evaluate(configs[0])
    assert first.correct, first.error
    per_candidate = len(calls)
    assert per_candidate == first.validation["trials"]
    second = measurer.evaluate(configs[1])
    assert second.correct, second.error
    assert len(calls) == per_candidate, "the second candidate recomputed the references"
    assert set(calls) == {measurer.reference_device} == {"cpu"}
