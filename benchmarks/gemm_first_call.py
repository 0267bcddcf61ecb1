"""What a cuBLAS GEMM costs on the host at an M the process has not run, and what warming it does.

Llama's widths (TinyLlama: d2048, kv 256, MLP 5632, vocab 32000), fp16, batch 8: M = 8 x length.
Per phase, one JSON line of rows [length, the host ms of the first call at each (K, N), then of a
second call]: new lengths cold; with the neighbouring length warmed first; with the very shape
run first on another thread; after a bulk warm of 92 lengths on another thread (and its time);
then a profile of one first call. serving/bucket_warm.py is built on what it showed (results:
2026-12-06-h100-gemm-first-call.log, of these phases alone, when they were the whole script).
Last, a whole bucket's warm as bucket_warm.py does it for Llama, and whether the lengths warmed
first stay warm: in this process, then in a fresh one with a larger cache of cuBLASLt's heuristic
choices (CUBLASLT_HEURISTICS_CACHE_CAPACITY, read when cuBLAS starts). Run:
``python benchmarks/gemm_first_call.py`` (one GPU, about 40 s).
(In the first phases each GEMM's A is a slice of one wider tensor: its leading dimension is 5632, not K.)
"""
import json
import os
import subprocess
import sys
import threading
import time

import torch

from torch_kernelize.serving.bucket_warm import coarse_to_fine

dt = torch.float16
SHAPES = [(2048, 2048), (2048, 256), (2048, 5632), (5632, 2048), (2048, 32000)]  # (K, N): q/o, k/v, up, down, head
CALLED = set()  # the Ms the phases before the last one ran (cuBLAS may remember them)
BIG_CACHE = "65536"  # CUBLASLT_HEURISTICS_CACHE_CAPACITY of the second bucket part (cuBLASLt's default: 8192)


def mm_host_ms(W, X, M, K, N):
    CALLED.add(M)
    a = X[:M, :K]
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.mm(a, W[(K, N)])
    host = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return host


def phase(W, X, name, lengths, before=None):
    out = []
    for L in lengths:
        M = 8 * L
        if before:
            before(M)
        firsts = [round(mm_host_ms(W, X, M, K, N), 3) for K, N in SHAPES]
        out.append([L] + firsts + [round(mm_host_ms(W, X, M, K, N), 3) for K, N in SHAPES])
    print(json.dumps({"phase": name, "rows: L, first per shape..., second per shape...": out}), flush=True)


def single_shapes(W, X):
    """The first phases: new lengths cold, after their neighbour, after the very shape ran on
    another thread, after a bulk warm on another thread; a profile of one first call."""
    for K, N in SHAPES:  # cuBLAS set-up and the first kernels, at length 33
        mm_host_ms(W, X, 8 * 33, K, N)
    phase(W, X, "cold new lengths", [34, 57, 101, 203, 301, 409])
    phase(W, X, "neighbour warmed (L-1)", [35, 58, 102, 204, 302, 410],
          before=lambda M: [mm_host_ms(W, X, M - 8, K, N) for K, N in SHAPES])

    def elsewhere(work):
        t = threading.Thread(target=work)
        t.start()
        t.join()

    def warm_shape(M):
        for K, N in SHAPES:
            torch.mm(X[:M, :K], W[(K, N)])
        torch.cuda.synchronize()
    phase(W, X, "same shape warmed on another thread", [36, 59, 103, 205, 303, 411],
          before=lambda M: elsewhere(lambda: warm_shape(M)))

    def bulk():  # every M of a bucket, as a load-time warm would
        for L in range(420, 512):
            CALLED.add(8 * L)
            warm_shape(8 * L)
    t0 = time.perf_counter()
    elsewhere(bulk)
    print(json.dumps({"bulk warm of 92 lengths x 5 shapes s": round(time.perf_counter() - t0, 3)}))
    phase(W, X, "after bulk warm", [421, 450, 500])
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        mm_host_ms(W, X, 8 * 37, 2048, 2048)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def bucket_part(W, label):
    """480 lengths x 7 layouts warmed on zeros through aten.mm.out in serving/bucket_warm.py's
    order (3360 calls, Llama's warm); then a first call on other tensors at warmed lengths, by
    their place in that order (do the earliest stay warm, or does cuBLAS keep a bounded number of
    choices?), and at lengths left out of the warm."""
    wide = torch.zeros(8 * 512 * 11264, device="cuda", dtype=dt)

    def zeros(*shape):
        return torch.zeros(shape, device="cuda", dtype=dt)

    def layouts(M):
        """The 5 shapes on fresh tensors; A with a leading dimension of 4096; an output that is
        half of a twice-wider buffer (a fused gate/up projection)."""
        return [(zeros(M, K), W[(K, N)], zeros(M, N)) for K, N in SHAPES] + [
            (wide[:M * 4096].view(M, 4096)[:, :2048], W[(2048, 2048)], zeros(M, 2048)),
            (zeros(M, 2048), W[(2048, 5632)], wide[:M * 11264].view(M, 11264)[:, :5632])]

    def first_calls_ms(L):
        """The host ms of the first call at each layout, then of a second call at each (does
        the first call leave the shape cheap, where the warm did not?)."""
        times = []
        for a, b, o in layouts(8 * L) * 2:
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch.mm(a, b, out=o)
            times.append(round((time.perf_counter() - t) * 1e3, 3))
        torch.cuda.synchronize()
        return [round(sum(times[:7]), 3), times]

    order = [L for lo, hi in ((33, 64), (65, 128), (129, 256), (257, 512)) for L in coarse_to_fine(lo, hi)]
    left_out = {L for L in order if L % 11 == 5}
    t0 = time.perf_counter()
    for L in order:
        if L not in left_out:
            for a, b, o in layouts(8 * L):
                torch.ops.aten.mm.out(a, b, out=o)
    torch.cuda.synchronize()
    print(json.dumps({"bucket part": label, "warm s": round(time.perf_counter() - t0, 2),
                      "calls": 7 * (len(order) - len(left_out))}))
    warmed = [L for L in order if L % 7 == 3 and L not in left_out and 8 * L not in CALLED]
    each = "each call (7 layouts, twice)"
    print(json.dumps({"bucket part": label, f"warmed: [L, place in the warm order, [ms of its 7 first calls, {each}]]":
                      [[L, order.index(L), first_calls_ms(L)] for L in warmed]}))
    cold = [L for L in sorted(left_out) if 8 * L not in CALLED][:12]
    print(json.dumps({"bucket part": label, f"left out of the warm: [L, [ms of its 7 first calls, {each}]]":
                      [[L, first_calls_ms(L)] for L in cold]}), flush=True)


def main() -> None:
    torch.cuda.init()
    W = {s: torch.randn(s, device="cuda", dtype=dt) for s in SHAPES}
    if "--bucket-only" in sys.argv:
        capacity = os.environ.get("CUBLASLT_HEURISTICS_CACHE_CAPACITY")
        bucket_part(W, f"a fresh process, CUBLASLT_HEURISTICS_CACHE_CAPACITY={capacity}")
        return
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    single_shapes(W, torch.randn(8 * 512, 5632, device="cuda", dtype=dt))
    bucket_part(W, "after the phases above, cuBLASLt's default cache")
    env = {**os.environ, "CUBLASLT_HEURISTICS_CACHE_CAPACITY": BIG_CACHE}
    subprocess.run([sys.executable, __file__, "--bucket-only"], env=env, check=False)


if __name__ == "__main__":
    main()
