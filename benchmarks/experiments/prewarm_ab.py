"""First calls with prewarm on and off (KERNELIZE_PREWARM) and Inductor's, in alternating fresh
processes (the first-call code of benchmarks/run.py), MoE and Llama; writes $OUT/ab.json with the
host's speed (us per eager add) before and after each workload, as first calls move with it. The
kernel cache must be filled at /tmp/kc (run.py --phases fill --cache-dir /tmp/kc).

    python benchmarks/experiments/prewarm_ab.py [N]
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
import run  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 5
res = {"host_us_per_eager_add": [run.host_speed_us()]}  # the host's speed, before and after each workload
for name in ("moe_T4096_d1024_E16_top4_fp16", "llama4L_d1024_b8_s512_fp16"):
    rows = {}
    variants = [("on", "kernelize"), ("off", "kernelize"), ("inductor", "inductor")]
    codes = {}
    for mode, backend in variants:
        # the mode in the code: each variant is its own program to prewarm's index
        code = run.FIRST_CALL.format(here=str(BENCH), backend=backend, name=name,
                                     cache="/tmp/kc", artifact="/tmp/none") + f"\n# mode {mode}\n"
        env = run._child_env(KERNELIZE_PREWARM=mode if mode != "inductor" else "on")
        codes[mode] = (code, env)
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=200)
    for i in range(N):
        for mode, _ in variants:
            code, env = codes[mode]
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=200)
            try:
                r = json.loads(p.stdout.strip().splitlines()[-1])
            except Exception:
                r = {"error": p.stderr[-1500:]}
            rows.setdefault(mode, []).append(r)
            print(name, mode, json.dumps(r), flush=True)
    summary = {}
    for mode, rs in rows.items():
        ok = [r for r in rs if "first_call_s" in r]
        summary[mode] = {k: round(statistics.median(r[k] for r in ok), 3) for k in ("first_call_s", "dynamo_s", "backend_s") if ok and all(k in r for r in ok)}
    print(name, "MEDIANS", json.dumps(summary), flush=True)
    res[name] = {"samples": rows, "median": summary}
    res["host_us_per_eager_add"].append(run.host_speed_us())
    json.dump(res, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
