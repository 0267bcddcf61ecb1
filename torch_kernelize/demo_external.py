"""`make demo-external`: a kernel from outside the project, from reproducer to served kernel, on CPU.

The chip's vendor library lacks aten.logcumsumexp, which has no decomposition: until a fill,
nothing on the chip can run it. (The scan family generates it too; on the interpreter, where
nothing is timed, a correct candidate wins the tie with the generated kernels.)

  1. compile + run a model that uses it: the op runs on the host fallback and leaves a reproducer;
  2. `python -m torch_kernelize.repros task` turns the reproducer into a task (task.md +
     check_candidate.py);
  3. the task's check_candidate.py accepts the candidate file shipped in examples/;
  4. fill_cache --repros ... --candidate FILE records its launches, validates and stores it
     (provenance "external", the file's sha256);
  5. a new process compiles again: the op now runs that kernel on the triton tier.

    python -m torch_kernelize.demo_external [--candidate FILE] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
from pathlib import Path

from torch_kernelize.demo import banner, model_script, run

CHIP = """\
name = "scan-chip"
device = "cpu"
triton = "interpreter"
[ops]
unsupported = ["aten.logcumsumexp"]
"""
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "logcumsumexp_candidate.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidate", type=Path, default=EXAMPLE, help=f"the candidate file (default: {EXAMPLE.name})")
    p.add_argument("--workdir", type=Path, default=None, help="where the chip file, cache and repros go")
    args = p.parse_args(argv)
    candidate = args.candidate.resolve()
    if not candidate.is_file():  # a regular install has no examples/: it ships in the repository
        print(f"error: no candidate file {candidate}; give one with --candidate (the repository's "
              f"examples/{EXAMPLE.name})", file=sys.stderr)
        return 2
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="kernelize-external-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    chip, cache, repros = work / "chip.toml", work / "cache", work / "repros"
    chip.write_text(CHIP)
    options = {"target": str(chip), "cache_dir": str(cache), "repro_dir": str(repros)}
    py = sys.executable
    print(f"workdir: {work}\nchip description ({chip.name}):\n{textwrap.indent(CHIP, '    ')}")

    banner("1. compile and run on the chip: aten.logcumsumexp has nothing to run it, a reproducer is written")
    first = run([py, "-c", model_script(options, "make_log_scan")], work)
    folder = next((f.parent for f in repros.glob("*/spec.json")
                   if json.loads(f.read_text())["op"] == "aten.logcumsumexp.default"), None)
    if first.returncode != 0 or folder is None:
        print(first.stderr)
        return 1

    banner("2. the reproducer becomes a task for a person or an agent")
    if run([py, "-m", "torch_kernelize.repros", "task", str(folder)], work).returncode != 0:
        return 1
    task = (folder / "task.md").read_text().splitlines()
    print(textwrap.indent("\n".join(task[:40]), "    ") + "\n    ...")

    banner(f"3. the task's check_candidate.py judges {candidate.name} as fill_cache will")
    if run([py, str(folder / "check_candidate.py"), str(candidate), "--target", str(chip)], folder).returncode != 0:
        return 1

    banner("4. fill_cache records the candidate's launches, validates it and stores the winner")
    filled = run([py, "-m", "torch_kernelize.fill_cache", "--quiet", "--repros", str(repros), "--target", str(chip),
                  "--cache-dir", str(cache), "--candidate", str(candidate)], work)
    if filled.returncode != 0:
        print(filled.stderr)
        return 1
    spec_key = json.loads((folder / "spec.json").read_text())["spec"]["key"]
    entry = next(cache.glob(f"*/entries/{spec_key}/entry.json"))
    record = json.loads(entry.read_text())
    print(f"\ncache entry {entry.parent.name}: family {record['family']!r}, candidate "
          f"{json.dumps(record['provenance'].get('candidate'))}")

    banner("5. a new process compiles again: the op runs the candidate's recorded kernel on the triton tier")
    report = work / "report.json"
    second = run([py, "-c", model_script(dict(options, repro_dir="off", report=str(report)), "make_log_scan")], work)
    nodes = [n for g in json.loads(report.read_text())["graphs"] for n in g["nodes"]] if report.exists() else []
    on_triton = any(n["op"] == "aten.logcumsumexp.default" and n["tier"] == "triton" for n in nodes)
    print(f"\naten.logcumsumexp.default on the triton tier: {on_triton}")
    return 0 if second.returncode == 0 and on_triton and record["family"] == "external" else 1


if __name__ == "__main__":
    sys.exit(main())
