"""The first use of vendor ops in a fresh CUDA process, cold against warmed by a background thread
while the main thread holds the GIL in Python for 0.5 s (a stand-in for Dynamo's tracing): what
torch_kernelize/prewarm.py relies on. Modes: none, thread, thread_stream (the thread on its own
stream); 3 fresh processes each. Writes $OUT/probe.txt (one JSON line per process).

    python benchmarks/experiments/first_use_probe.py
"""
import os
import subprocess
import sys

CHILD = r'''
import sys, time, threading, json
import torch, torch.nn.functional as F
mode = sys.argv[1]
dev = "cuda"
torch.zeros(1, device=dev); torch.cuda.synchronize()
def ops():
    x = torch.randn(4096, 1024, device=dev, dtype=torch.float16)
    w = torch.randn(2816, 1024, device=dev, dtype=torch.float16)
    q = torch.randn(8, 16, 512, 64, device=dev, dtype=torch.float16)
    lg = torch.randn(4096, 16, device=dev)
    idx = torch.randint(0, 16, (16384,), device=dev)
    return {
        "mm": lambda: torch.mm(x, w.t()),
        "sdpa": lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        "softmax": lambda: lg.softmax(-1),
        "argsort": lambda: idx.argsort(),
        "floordiv": lambda: idx // 4,
        "index": lambda: lg[idx // 4],
    }
def warm():
    for f in ops().values():
        f()
    torch.cuda.synchronize()
t_start = time.perf_counter()
if mode == "thread":
    th = threading.Thread(target=warm, daemon=True); th.start()
elif mode == "thread_stream":
    def w2():
        with torch.cuda.stream(torch.cuda.Stream()):
            warm()
    th = threading.Thread(target=w2, daemon=True); th.start()
# stand-in for Dynamo's tracing: 0.5 s of Python holding the GIL
t0 = time.perf_counter(); n = 0
while time.perf_counter() - t0 < 0.5:
    n += sum(i * i for i in range(200))
busy = time.perf_counter() - t0
warm_done = None
if mode.startswith("thread"):
    warm_done = th.is_alive()
    th.join()
res = {"mode": mode, "warm_alive_after_busy": warm_done, "busy_s": busy}
o = ops(); torch.cuda.synchronize()
tot = time.perf_counter()
for k, f in o.items():
    t = time.perf_counter(); f(); torch.cuda.synchronize(); res[k + "_ms"] = round(1e3 * (time.perf_counter() - t), 2)
res["all_first_ms"] = round(1e3 * (time.perf_counter() - tot), 1)
t = time.perf_counter()
for f in o.values(): f()
torch.cuda.synchronize(); res["all_second_ms"] = round(1e3 * (time.perf_counter() - t), 2)
print(json.dumps(res))
'''
out = []
for rep in range(3):
    for mode in ("none", "thread", "thread_stream"):
        p = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-2000:]
        print(line, flush=True); out.append(line)
open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.txt"), "w").write("\n".join(out))
