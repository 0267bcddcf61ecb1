"""The time to load every stored Triton binary of a kernel cache, in a fresh CUDA process: as the
runner loads them (cuda_binaries.StoredBinary read by torch's static launcher) against building
Triton's CompiledKernel for each first (what the runner did before), 3 processes per mode,
alternating; the modules both import are imported before the clock starts. Writes $OUT/binary_load.json.

    python benchmarks/experiments/binary_load_probe.py CACHE_DIR
"""
import json
import os
import subprocess
import sys

CHILD = r'''
import glob, json, sys, time
from pathlib import Path
import torch
from torch_kernelize import cuda_binaries
from torch_kernelize.spec import KernelSpec
from torch_kernelize.launch import load_program
mode, cache = sys.argv[1], sys.argv[2]
if mode == "compiledkernel":  # the runner before: Triton's CompiledKernel per binary
    init = cuda_binaries.CudaLaunch.__init__
    def with_compiled(self, binary, positions):
        compiled = binary.compiled()
        compiled._cubin_path = binary._cubin_path
        binary.compiled = lambda: compiled
        init(self, compiled, positions)
    cuda_binaries.CudaLaunch.__init__ = with_compiled
import torch._inductor.runtime.static_triton_launcher, triton.compiler  # imports are not timed
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
entries = sorted(Path(p).parent.parent for p in glob.glob(f"{cache}/cuda-*/entries/*/program/program.json"))
specs = [(e, KernelSpec.from_json(json.loads((e / "entry.json").read_text())["spec"])) for e in entries]
t = time.perf_counter()
runners = [load_program(e / "program", spec, "cuda") for e, spec in specs]
s = time.perf_counter() - t
print(json.dumps({"mode": mode, "programs": len(runners), "binaries": sum(len(r._kernels) for r in runners),
                  "static": sum(k.static for r in runners for k in r._kernels if hasattr(k, "static")),
                  "load_s": round(s, 4)}))
'''
cache = sys.argv[1]
out = []
for rep in range(3):
    for mode in ("stored", "compiledkernel"):
        p = subprocess.run([sys.executable, "-c", CHILD, mode, cache], capture_output=True, text=True)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else json.dumps({"mode": mode, "error": p.stderr[-2000:]})
        print(line, flush=True)
        out.append(json.loads(line))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "binary_load.json"), "w"), indent=1)
