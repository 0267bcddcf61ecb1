"""Room in cuBLASLt's cache of heuristic choices for the shapes a bucket warm runs.

cuBLAS chooses a kernel for each GEMM shape by heuristics (0.2-0.3 ms of host time per new shape
on the H100: benchmarks/results/2026-12-06-h100-gemm-first-call.log) and keeps each choice in a
cache of bounded capacity, cuBLASLt's heuristics cache (8192 entries unless the environment's
CUBLASLT_HEURISTICS_CACHE_CAPACITY said otherwise when cuBLAS started). A bucket warm
(bucket_warm.py) runs every distinct GEMM of a bucket's program at every size of the bucket:
Llama's four buckets over lengths 33-512 are 3360 shapes, beside what the model itself runs. A
cache too small for them forgets the first shapes warmed before a served call needs them. So
before a warm, ``reserve`` raises the capacity (never lowers it) to cuBLASLt's default plus every
shape the process's warms have planned, through cuBLASLt's own API
(``cublasLtHeuristicsCacheGetCapacity`` / ``SetCapacity``) in the library torch loaded. An entry is
a few hundred bytes of host memory.

Where no cuBLASLt is loaded (a CPU build of torch, another vendor) nothing happens: ``reserve``
returns None.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger("torch_kernelize.serving.cublas_heuristics")

DEFAULT_CAPACITY = 8192  # cuBLASLt's default, kept for the shapes the model runs outside warms
_reserved = 0            # shapes the warms of this process planned
_lib: Any = None         # the loaded cuBLASLt, False where there is none


def _loaded_library() -> Any:
    """The cuBLASLt this process has loaded (torch's CUDA build links it), by its path in
    /proc/self/maps: opening that very file returns the loaded library, not a second copy."""
    global _lib
    if _lib is None:
        _lib = False
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcublasLt" in line}
        except OSError:
            paths = set()
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path)
                lib.cublasLtHeuristicsCacheGetCapacity.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
                lib.cublasLtHeuristicsCacheSetCapacity.argtypes = [ctypes.c_size_t]
                _lib = lib
                break
            except (OSError, AttributeError) as e:
                log.debug("cuBLASLt at %s: %s", path, e)
    return _lib or None


def capacity(lib: Any = None) -> int | None:
    """The heuristics cache's capacity in entries; None without cuBLASLt."""
    lib = lib or _loaded_library()
    if lib is None:
        return None
    value = ctypes.c_size_t(0)
    if lib.cublasLtHeuristicsCacheGetCapacity(ctypes.byref(value)) != 0:
        return None
    return int(value.value)


def reserve(shapes: int, lib: Any = None) -> int | None:
    """Count ``shapes`` more warmed GEMM shapes and raise the cache's capacity to hold them beside
    cuBLASLt's default; the capacity after (None without cuBLASLt or where it refused)."""
    global _reserved
    _reserved += max(0, int(shapes))
    lib = lib or _loaded_library()
    now = capacity(lib)
    if now is None:
        return None
    want = DEFAULT_CAPACITY + _reserved
    if now >= want:
        return now
    if lib.cublasLtHeuristicsCacheSetCapacity(ctypes.c_size_t(want)) != 0:
        log.info("cuBLASLt kept its heuristics cache at %d entries (asked for %d)", now, want)
        return now
    log.debug("cuBLASLt heuristics cache: %d -> %d entries", now, want)
    return want
