"""The SDPA backends on the Llama workload's attention (batch 8, 16 heads, seq 512, head dim 64,
causal, fp16, q a transposed view): each one's first use in a fresh CUDA process -- cold, and
after a background thread used it while the main thread held the GIL in Python for 0.5 s (what
prewarm.py does during Dynamo's tracing) -- and each one's time per call (do_bench median).
3 fresh processes per backend and mode. Writes $OUT/sdpa_first_use.json.

    python benchmarks/experiments/sdpa_first_use_probe.py
"""
import json
import os
import subprocess
import sys

CHILD = r'''
import json, sys, threading, time
import torch
backend, mode = sys.argv[1], sys.argv[2]
aten = torch.ops.aten
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
def inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(8, 512, 16, 64, device="cuda", dtype=torch.float16, generator=g).transpose(1, 2)
    k = torch.randn(8, 16, 512, 64, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(8, 16, 512, 64, device="cuda", dtype=torch.float16, generator=g)
    return q, k, v
CALLS = {
    "cudnn": lambda q, k, v: aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True)[0],
    "flash": lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0],
    "efficient": lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, False, 0.0, True)[0],
}
call = CALLS[backend]
res = {"backend": backend, "mode": mode}
if mode == "bench":
    import triton.testing
    q, k, v = inputs()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), is_causal=True)
    res["max_abs_err"] = float((call(q, k, v).double().cpu() - ref).abs().max())
    res["ms"] = triton.testing.do_bench(lambda: call(q, k, v), warmup=100, rep=500, return_mode="median")
    print(json.dumps(res)); sys.exit()
if mode == "thread":
    def warm():
        call(*inputs()); torch.cuda.synchronize()
    th = threading.Thread(target=warm, daemon=True); th.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:  # a stand-in for Dynamo's tracing
        sum(i * i for i in range(200))
    res["thread_alive_after_busy"] = th.is_alive()
    th.join()
q, k, v = inputs(); torch.cuda.synchronize()
for n in ("first", "second"):
    t = time.perf_counter(); call(q, k, v); torch.cuda.synchronize()
    res[n + "_ms"] = round(1e3 * (time.perf_counter() - t), 2)
print(json.dumps(res))
'''
out = []
for rep in range(3):
    for backend in ("cudnn", "flash", "efficient"):
        for mode in ("cold", "thread") + (("bench",) if rep == 0 else ()):
            p = subprocess.run([sys.executable, "-c", CHILD, backend, mode], capture_output=True, text=True)
            line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else \
                json.dumps({"backend": backend, "mode": mode, "error": p.stderr[-2000:]})
            print(line, flush=True)
            out.append(json.loads(line))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "sdpa_first_use.json"), "w"), indent=1)
