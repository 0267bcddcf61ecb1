"""Where loading a kernel cache's stored programs spends its time, in a fresh CUDA process
(3 processes per mode, alternating). Writes $OUT/program_load.json.

- ``driver``: each aligned binary loaded by ctypes calls into libcuda, step by step
  (cuModuleLoad, cuModuleGetFunction, cuFuncGetAttribute, cuFuncLoad: under the lazy module
  loading torch asks for, a function's code may reach the GPU only at a later step); then the
  same files through torch's static launcher (``_load_kernel``), from copies;
- ``programs``: every program loaded as the runner loads it (``launch.load_program``), then
  again in the same process;
- ``profile``: the same under cProfile: the functions that take most of the first load.

    python benchmarks/experiments/program_load_probe.py CACHE_DIR
"""
import json
import os
import subprocess
import sys

CHILD = r'''
import cProfile, ctypes, glob, io, json, os, pstats, shutil, sys, tempfile, time
from pathlib import Path
import torch
mode, cache = sys.argv[1], sys.argv[2]
import torch._inductor.runtime.static_triton_launcher, triton.compiler  # imports are not timed
from torch_kernelize.launch import load_program
from torch_kernelize.spec import KernelSpec
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
res = {"mode": mode}
if mode == "driver":
    lib = ctypes.CDLL("libcuda.so.1")
    files = []
    for cubin in sorted(glob.glob(f"{cache}/cuda-*/entries/*/program/launch*.cubin")):
        meta = json.load(open(cubin[:-len(".cubin")] + ".json"))
        if not cubin.endswith(".unaligned.cubin") and "name" in meta:
            files.append((cubin, meta["name"], int(meta["shared"])))
    res["binaries"] = len(files)
    steps = dict.fromkeys(("load", "function", "attribute", "funcload"), 0.0)
    for path, name, _ in files:
        mod, fn, regs = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
        t = time.perf_counter(); assert lib.cuModuleLoad(ctypes.byref(mod), path.encode()) == 0
        steps["load"] += time.perf_counter() - t
        t = time.perf_counter(); assert lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()) == 0
        steps["function"] += time.perf_counter() - t
        t = time.perf_counter(); lib.cuFuncGetAttribute(ctypes.byref(regs), 4, fn)
        steps["attribute"] += time.perf_counter() - t
        t = time.perf_counter(); lib.cuFuncLoad(fn); steps["funcload"] += time.perf_counter() - t
    res.update({k + "_s": round(v, 4) for k, v in steps.items()})
    from torch._C import _StaticCudaLauncher
    d = tempfile.mkdtemp()
    copies = [(shutil.copy(p, os.path.join(d, f"{i}.cubin")), n, s) for i, (p, n, s) in enumerate(files)]
    t = time.perf_counter()
    for path, name, shared in copies:
        _StaticCudaLauncher._load_kernel(path, name, shared, 0)
    res["static_launcher_s"] = round(time.perf_counter() - t, 4)
else:
    entries = sorted(Path(p).parent.parent for p in glob.glob(f"{cache}/cuda-*/entries/*/program/program.json"))
    specs = [(e, KernelSpec.from_json(json.loads((e / "entry.json").read_text())["spec"])) for e in entries]
    prof = cProfile.Profile()
    t = time.perf_counter()
    if mode == "profile":
        prof.enable()
    runners = [load_program(e / "program", spec, "cuda") for e, spec in specs]
    prof.disable()
    res["load_s"] = round(time.perf_counter() - t, 4)
    res["programs"] = len(runners)
    t = time.perf_counter()
    [load_program(e / "program", spec, "cuda") for e, spec in specs]  # again: what the first paid once
    res["second_load_s"] = round(time.perf_counter() - t, 4)
    if mode == "profile":
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(25)
            res["profile_" + key] = s.getvalue()[-5000:]
print(json.dumps(res))
'''
cache = sys.argv[1]
out = []
for rep in range(3):
    for mode in ("driver", "programs", "profile"):
        p = subprocess.run([sys.executable, "-c", CHILD, mode, cache], capture_output=True, text=True)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else json.dumps({"mode": mode, "error": p.stderr[-2000:]})
        print({k: v for k, v in json.loads(line).items() if not k.startswith("profile")}, flush=True)
        out.append(json.loads(line))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "program_load.json"), "w"), indent=1)
