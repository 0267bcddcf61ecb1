"""`make demo`: bringing a model up on a new chip, end to end, on CPU.

The chip is described in a TOML file: its vendor library lacks aten.histc (no decomposition
exists: nothing can run it) and aten.gelu (decomposable); its Triton backend is the CPU
interpreter. The embedded example is a small MoE layer behind an MLP (torch_kernelize.model_zoo).

  1. compile + run: the coverage report shows each node's tier; misses and the missing op are
     dumped as reproducers;
  2. a repro.py reproduces the missing op (exit 1);
  3. fill_cache --repros generates, validates and stores kernels for them;
  4. a new process compiles again: those nodes run on the triton tier, outputs match eager;
  5. the same repro.py now exits 0.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHIP = """\
name = "demo-chip"
device = "cpu"
triton = "interpreter"
[ops]
unsupported = ["aten.histc", "aten.gelu"]
"""

RUN_MODEL = """
import json, logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
logging.getLogger("torch_kernelize.fallbacks").setLevel(logging.WARNING)
from torch_kernelize.model_zoo import {maker}
model, inputs = {maker}()
compiled = torch.compile(model, backend="kernelize", options={options!r})
with torch.no_grad():
    got, want = compiled(*inputs), model(*inputs)
import torch_kernelize
torch_kernelize.flush_repros()  # the reproducers are written in the background: the next steps read them
print(json.dumps({{"max_abs_diff_vs_eager": (got - want).abs().max().item()}}))
"""


def model_script(options: dict, maker: str = "make_demo") -> str:
    """Python source that compiles and runs ``torch_kernelize.model_zoo.<maker>`` with ``options``."""
    return RUN_MODEL.format(options=options, maker=maker)


def banner(text: str) -> None:
    print(f"\n{'=' * 100}\n{text}\n{'=' * 100}", flush=True)


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    print(f"$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=cwd, text=True, capture_output=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode not in (0, 1):
        sys.stdout.write(proc.stderr)
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=None, help="where the chip file, cache and repros go")
    args = p.parse_args(argv)
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="kernelize-demo-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    chip, cache, repros, report = work / "chip.toml", work / "cache", work / "repros", work / "report.json"
    chip.write_text(CHIP)
    options = {"target": str(chip), "cache_dir": str(cache), "repro_dir": str(repros), "report": str(report)}
    py = sys.executable
    print(f"workdir: {work}\nchip description ({chip.name}):\n{textwrap.indent(CHIP, '    ')}")

    banner("1. compile and run the example on the chip: the coverage report")
    first = run([py, "-c", model_script(options)], work)
    if first.returncode != 0:
        print(first.stderr)
        return 1
    folders = sorted(f.parent for f in repros.glob("*/spec.json"))
    print(f"\n{len(folders)} reproducer(s) written to {repros}:")
    run([py, "-m", "torch_kernelize.repros", "list", str(repros)], work)

    missing = [f for f in folders if json.loads((f / "spec.json").read_text())["kind"] == "missing"]
    banner("2. the missing op's repro.py reproduces (exit 1)")
    before = run([py, str(missing[0] / "repro.py")], missing[0])
    print(f"exit status: {before.returncode}")

    banner("3. fill_cache turns the reproducers into validated kernels")
    filled = run([py, "-m", "torch_kernelize.fill_cache", "--quiet", "--repros", str(repros), "--target", str(chip),
                  "--cache-dir", str(cache)], work)
    if filled.returncode != 0:
        print(filled.stderr)
        return 1

    banner("4. a new process compiles again: the same nodes now run on the triton tier")
    second = run([py, "-c", model_script(dict(options, repro_dir="off"))], work)
    if second.returncode != 0:
        print(second.stderr)
        return 1

    banner("5. the missing op's repro.py now exits 0; every reproducer replayed")
    after = run([py, str(missing[0] / "repro.py")], missing[0])
    print(f"exit status: {after.returncode}")
    replay = run([py, "-m", "torch_kernelize.repros", "replay", str(repros), "--jobs", "2"], work)
    print(f"\nJSON coverage report: {report}\nkernel cache: {cache}\nreproducers: {repros}")
    return 0 if before.returncode == 1 and after.returncode == 0 and replay.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
