"""What a cuBLAS GEMM costs on the host at an M the process has not run, and what warming it does.

Llama's widths (TinyLlama: d2048, kv 256, MLP 5632, vocab 32000), fp16, batch 8: M = 8 x length.
Per phase, one JSON line of rows [length, the host ms of the first call at each (K, N), then of a
second call]: new lengths cold; with the neighbouring length warmed first; with the very shape
run first on another thread; after a bulk warm of 92 lengths on another thread (and its time);
then a profile of one first call. serving/bucket_warm.py is built on what it showed (results:
2026-12-06-h100-gemm-first-call.log). Run: ``python benchmarks/gemm_first_call.py`` (one GPU,
about 5 s). The committed run printed no device line: that ``print`` was added after it.
(Each GEMM's A is a slice of one wider tensor, so its leading dimension is 5632, not K.)
"""
import json
import threading
import time

import torch

torch.cuda.init()
print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
dt = torch.float16
SHAPES = [(2048, 2048), (2048, 256), (2048, 5632), (5632, 2048), (2048, 32000)]  # (K, N): q/o, k/v, up, down, head
W = {s: torch.randn(s, device="cuda", dtype=dt) for s in SHAPES}
X = torch.randn(8 * 512, 5632, device="cuda", dtype=dt)


def mm_host_ms(M, K, N):
    a = X[:M, :K]
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.mm(a, W[(K, N)])
    host = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return host


def phase(name, lengths, before=None):
    out = []
    for L in lengths:
        M = 8 * L
        if before:
            before(M)
        out.append([L] + [round(mm_host_ms(M, K, N), 3) for K, N in SHAPES] + [round(mm_host_ms(M, K, N), 3) for K, N in SHAPES])
    print(json.dumps({"phase": name, "rows: L, first per shape..., second per shape...": out}), flush=True)


for K, N in SHAPES:  # cuBLAS set-up and the first kernels, at length 33
    mm_host_ms(8 * 33, K, N)
phase("cold new lengths", [34, 57, 101, 203, 301, 409])
phase("neighbour warmed (L-1)", [35, 58, 102, 204, 302, 410],
      before=lambda M: [mm_host_ms(M - 8, K, N) for K, N in SHAPES])


def warm_elsewhere(M):
    def work():
        for K, N in SHAPES:
            torch.mm(X[:M, :K], W[(K, N)])
        torch.cuda.synchronize()
    t = threading.Thread(target=work)
    t.start(); t.join()


phase("same shape warmed on another thread", [36, 59, 103, 205, 303, 411], before=warm_elsewhere)
# bulk: warm every M of a bucket on another thread, as a load-time warm would, and its cost
t0 = time.perf_counter()
def bulk():
    for L in range(420, 512):
        for K, N in SHAPES:
            torch.mm(X[:8 * L, :K], W[(K, N)])
    torch.cuda.synchronize()
th = threading.Thread(target=bulk); th.start(); th.join()
print(json.dumps({"bulk warm of 92 lengths x 5 shapes s": round(time.perf_counter() - t0, 3)}))
phase("after bulk warm", [421, 450, 500])
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    mm_host_ms(8 * 37, 2048, 2048)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
