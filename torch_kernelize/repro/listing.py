"""List reproducers, or replay them all in fresh processes with a summary table (from each
folder's data: spec.json and its captured inputs; its repro.py runs only with --run-scripts).
Each of the ``--jobs`` processes replays its share of the folders in turn (torch imported once
per process, not once per folder); a folder whose process crashed, hung or stopped after a
folder that could not run is replayed again alone.

    python -m torch_kernelize.repros list   kernelize_repros
    python -m torch_kernelize.repros replay kernelize_repros [--target T] [--cache-dir D] [--jobs N] [--run-scripts]
    python -m torch_kernelize.repros task   kernelize_repros/<folder>   # task.md + check_candidate.py

(``python -m torch_kernelize.repro.listing``, the ``kernelize-repros`` script and, in a checkout,
``python tools/repros.py`` are the same command.)

replay exits 0 when every repro is fixed, 1 when some still reproduce, 2 when some could not run.
task writes a self-contained task for a person or an agent into the folder (repro/task.py).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

from torch_kernelize import flush_repros

STATUS = {0: "fixed", 1: "reproduces", 2: "error"}


def find(root: Path) -> list[Path]:
    flush_repros()  # this process's own misses are written in the background
    return sorted(p.parent for p in Path(root).glob("*/spec.json"))


def _meta(folder: Path) -> dict:
    try:
        return json.loads((folder / "spec.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return {"kind": "?", "error": str(e)}


def _describe(meta: dict) -> str:
    spec = meta.get("spec")
    if not spec:
        return meta.get("cause", "")[:80]
    ins = ", ".join(f"{i['dtype']}{i['shape']}" for i in spec["inputs"])
    return f"{spec['op']}({ins})"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_list(args: argparse.Namespace) -> int:
    folders = find(args.root)
    rows = [["FOLDER", "KIND", "WHAT", "TARGET", "CREATED"]]
    for f in folders:
        m = _meta(f)
        rows.append([f.name, m.get("kind", "?"), _describe(m), str(m.get("target", "?")), m.get("created", "?")])
    print(_table(rows))
    print(f"{len(folders)} reproducer(s) in {args.root}")
    return 0


def replay_one(folder: Path, target: str | None, cache_dir: str | None, timeout: int,
               run_scripts: bool = False) -> tuple[Path, int, str]:
    """One folder replayed in a fresh process: from its data (repro/run.py), or, with
    ``run_scripts``, by running its repro.py (code: only for folders you trust)."""
    cmd = [sys.executable] + ([str(folder / "repro.py")] if run_scripts else
                              ["-m", "torch_kernelize.repro.run", str(folder.resolve())])
    if target:
        cmd += ["--target", target]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=folder)
    except subprocess.TimeoutExpired:
        return folder, 2, f"timed out after {timeout}s"
    lines = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
    return folder, proc.returncode if proc.returncode in STATUS else 2, lines[-1] if lines else ""


def replay_batch(folders: list[Path], target: str | None, cache_dir: str | None,
                 timeout: int) -> list[tuple[Path, int, str]]:
    """``folders`` replayed from their data in ONE fresh process (torch imported once, not once per
    folder); a folder it gave no answer for (it crashed, ran out of time, or stopped after a
    folder that could not run) is replayed alone in a fresh process of its own."""
    cmd = [sys.executable, "-m", "torch_kernelize.repro.run", "--batch", *(str(f.resolve()) for f in folders)]
    cmd += (["--target", target] if target else []) + (["--cache-dir", cache_dir] if cache_dir else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * len(folders)).stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
    answers = {}
    for line in out.splitlines():
        try:
            a = json.loads(line)
            answers[a["folder"]] = (int(a["code"]), str(a["detail"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line the replayed graph printed itself
    return [(f, *answers[str(f.resolve())]) if str(f.resolve()) in answers
            else replay_one(f, target, cache_dir, timeout) for f in folders]


def cmd_replay(args: argparse.Namespace) -> int:
    folders = find(args.root)
    jobs = max(1, min(args.jobs, len(folders)))
    if args.run_scripts:  # code from the folders: each in a process of its own
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(lambda f: replay_one(f, args.target, args.cache_dir, args.timeout, True),
                                    folders))
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            shares = pool.map(lambda i: replay_batch(folders[i::jobs], args.target, args.cache_dir, args.timeout),
                              range(jobs))
        order = {f: i for i, f in enumerate(folders)}
        results = sorted((r for share in shares for r in share), key=lambda r: order[r[0]])
    rows = [["FOLDER", "KIND", "RESULT", "DETAIL"]]
    for folder, code, detail in results:
        rows.append([folder.name, _meta(folder).get("kind", "?"), STATUS[code], detail[:120]])
    print(_table(rows))
    counts = {s: sum(STATUS[c] == s for _, c, _ in results) for s in STATUS.values()}
    print(f"{len(results)} reproducer(s): {counts['reproduces']} reproduce, {counts['fixed']} fixed, "
          f"{counts['error']} error")
    return 2 if counts["error"] else 1 if counts["reproduces"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_kernelize.repros", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("list", help="one line per reproducer")
    lp.add_argument("root", type=Path)
    rp = sub.add_parser("replay", help="replay every reproducer from its data in a fresh process; summary table")
    rp.add_argument("root", type=Path)
    rp.add_argument("--target", help="override the recorded target")
    rp.add_argument("--cache-dir", help="override the recorded kernel cache")
    rp.add_argument("--jobs", type=int, default=2)
    rp.add_argument("--timeout", type=int, default=600)
    rp.add_argument("--run-scripts", action="store_true",
                    help="run each folder's repro.py instead of replaying its data: EXECUTES THE FOLDERS' CODE, "
                         "only for folders you trust (needed for a graph that failed to lower)")
    tp = sub.add_parser("task", help="write task.md and check_candidate.py into a reproducer's folder")
    tp.add_argument("root", type=Path, metavar="REPRO_FOLDER")
    args = p.parse_args(argv)
    if not args.root.is_dir():
        print(f"error: {args.root} is not a folder", file=sys.stderr)
        return 2
    return {"list": cmd_list, "replay": cmd_replay, "task": cmd_task}[args.command](args)


def cmd_task(args: argparse.Namespace) -> int:
    from torch_kernelize.repro.task import write_task
    if not (args.root / "spec.json").is_file():
        print(f"error: {args.root} is not a reproducer folder (no spec.json)", file=sys.stderr)
        return 2
    try:
        path = write_task(args.root)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {path.parent / 'check_candidate.py'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
