"""What prewarm's thread costs the main thread, and what it saves it, per kind of vendor call.

First a process per workload runs its first call with kernelize (a kernel cache filled at
/tmp/kc) and keeps the vendor calls prewarm recorded for it (in the program's index under the
default cache dir). Then fresh CUDA processes (3 per mode, alternating) run 0.6 s of Python in
the main thread (a stand-in for Dynamo's tracing) while a thread replays a subset of those calls
with prewarm's own code. ``waiting_s`` is the main thread's wall time minus its CPU time over
those 0.6 s (time spent waiting for the GIL, or off the CPU). Afterwards the main thread makes
every recorded call once and times each first use. Modes: ``none`` (no thread), ``all``,
``no_attention``, ``attention``. Writes $OUT/prewarm_gil.json.

    python benchmarks/experiments/prewarm_gil_probe.py
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
WORKLOADS = ("moe_T4096_d1024_E16_top4_fp16", "llama4L_d1024_b8_s512_fp16")
MODES = ("none", "all", "no_attention", "attention")

RECORD = r'''
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from workloads import WORKLOADS
from torch_kernelize import prewarm
model, inputs = WORKLOADS[sys.argv[2]]()
fn = torch.compile(model, backend="kernelize", options={"target": "cuda", "cache_dir": "/tmp/kc", "repro_dir": "off"})
with torch.no_grad():
    fn(*inputs)
torch.cuda.synchronize()
calls = [r for e in prewarm.read_index(prewarm.index_path()) for r in e.get("vendor") or ()]
json.dump(calls, open(sys.argv[3], "w"))
print(json.dumps({"calls": len(calls)}))
'''

BUSY = r'''
import collections, json, sys, threading, time
import torch
from torch_kernelize import prewarm
records, mode = json.load(open(sys.argv[1])), sys.argv[2]
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
attention = lambda r: "attention" in r["op"]
chosen = {"none": [], "all": records, "no_attention": [r for r in records if not attention(r)],
          "attention": [r for r in records if attention(r)]}[mode]
done = {}
def warm():
    t = time.perf_counter()
    with torch.no_grad():
        for r in chosen:
            prewarm._replay(r)
    torch.cuda.synchronize()
    done["thread_s"] = time.perf_counter() - t
th = threading.Thread(target=warm, daemon=True)
if chosen:
    th.start()
wall, cpu, turns = time.perf_counter(), time.thread_time(), 0
while time.perf_counter() - wall < 0.6:
    turns += sum(i * i for i in range(200)) > 0
wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
res = {"mode": mode, "replayed": len(chosen), "turns": turns, "waiting_s": round(wall - cpu, 4),
       "thread_alive_after_busy": th.is_alive() if chosen else None}
if chosen:
    th.join()
    res["thread_s"] = round(done["thread_s"], 4)
first = collections.Counter()
with torch.no_grad():
    for r in records:
        call = prewarm.Call.from_record(r)
        t = time.perf_counter(); call.run(); torch.cuda.synchronize()
        first[r["op"]] += 1e3 * (time.perf_counter() - t)
res["first_use_ms"] = round(sum(first.values()), 1)
res["first_use_ms_by_op"] = {k: round(v, 1) for k, v in first.items()}
print(json.dumps(res))
'''


def child(code: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except Exception:
        return {"error": p.stderr[-2000:]}


out: dict = {}
for name in WORKLOADS:
    records = f"/tmp/prewarm_gil_{name}.json"
    out[name] = {"record": child(RECORD, str(BENCH), name, records), "samples": []}
    print(name, out[name]["record"], flush=True)
for rep in range(3):
    for name in WORKLOADS:
        for mode in MODES:
            r = child(BUSY, f"/tmp/prewarm_gil_{name}.json", mode)
            out[name]["samples"].append(r)
            print(name[:5], json.dumps(r), flush=True)
for name in WORKLOADS:
    rows = {}
    for r in out[name]["samples"]:
        rows.setdefault(r.get("mode"), []).append(r)
    out[name]["median"] = {m: {k: round(statistics.median(x[k] for x in rs), 4)
                               for k in ("waiting_s", "first_use_ms", "thread_s") if all(k in x for x in rs)}
                           for m, rs in rows.items() if m}
    print(name, "MEDIANS", json.dumps(out[name]["median"]), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "prewarm_gil.json"), "w"), indent=1)
