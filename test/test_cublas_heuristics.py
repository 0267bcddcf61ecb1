"""serving/cublas_heuristics.py: room in cuBLASLt's cache of heuristic choices for a bucket warm's
GEMM shapes (through a stand-in for the library: the CPU build of torch loads no cuBLASLt)."""
from __future__ import annotations

import ctypes

import pytest

from torch_kernelize.serving import bucket_warm, cublas_heuristics


class FakeLt:
    """cuBLASLt's two calls as the module makes them (ctypes arguments), over a capacity."""

    def __init__(self, capacity: int, refuse: bool = False):
        self.capacity, self.refuse, self.sets = capacity, refuse, []

    def cublasLtHeuristicsCacheGetCapacity(self, ref) -> int:
        ref._obj.value = self.capacity
        return 0

    def cublasLtHeuristicsCacheSetCapacity(self, value: ctypes.c_size_t) -> int:
        self.sets.append(value.value)
        if self.refuse:
            return 7  # CUBLAS_STATUS_INVALID_VALUE
        self.capacity = value.value
        return 0


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(cublas_heuristics, "_reserved", 0)


def test_reserve_raises_the_capacity_to_the_default_plus_every_warm_planned_and_never_lowers_it():
    lt = FakeLt(8192)
    assert cublas_heuristics.reserve(3000, lt) == 8192 + 3000 and lt.sets == [11192]
    assert cublas_heuristics.reserve(500, lt) == 8192 + 3500  # the warms of a process add up
    big = FakeLt(100_000)
    assert cublas_heuristics.reserve(10, big) == 100_000 and big.sets == []  # (a larger one set by the user stays)


def test_a_refused_capacity_is_reported_as_it_stays_and_no_library_is_none(monkeypatch):
    lt = FakeLt(8192, refuse=True)
    assert cublas_heuristics.reserve(100, lt) == 8192 and lt.sets == [8292]
    monkeypatch.setattr(cublas_heuristics, "_lib", False)  # (no cuBLASLt loaded: a CPU build)
    assert cublas_heuristics.reserve(100) is None and cublas_heuristics.capacity() is None


def test_the_warm_makes_room_for_its_gemm_shapes_at_every_size_on_cuda_only(monkeypatch):
    asked = []
    monkeypatch.setattr(cublas_heuristics, "reserve", lambda n: asked.append(n) or 9000)
    records = [{"op": "aten.mm.default"}, {"op": "aten._softmax.default"}, {"op": "aten.addmm.out"}]
    assert bucket_warm._make_room(records, 10, "cuda:0") == 9000 and asked == [20]
    assert bucket_warm._make_room(records, 10, "cpu") is None and asked == [20]
