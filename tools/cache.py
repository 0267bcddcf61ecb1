"""Inspect and move a kernel cache: list, show, check, export, import, gc.

    python tools/cache.py list   --cache-dir DIR [--namespace NS | --target NAME]
    python tools/cache.py show   KEY --cache-dir DIR [--namespace NS]
    python tools/cache.py check  --cache-dir DIR            # exit 1 when any entry is bad
    python tools/cache.py verify --cache-dir DIR --target T # re-validate by running every kernel
    python tools/cache.py export OUT.tar.gz --cache-dir DIR [--namespace NS] [--keys K ...]
    python tools/cache.py import IN.tar.gz --cache-dir DIR [--replace]
    python tools/cache.py gc     --cache-dir DIR [--max-age-minutes M]   # also DIR/graphs and DIR/prewarm

Without --namespace, list/check/gc cover every namespace under DIR; show/export need exactly one
(given, or the only one there). Repo-side tool (tools/ is not installed); it imports torch_kernelize.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Callable

from torch_kernelize.errors import CacheError, KernelizeError
from torch_kernelize.kernel_cache import KernelCache, export_cache, import_cache

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2


def _namespaces(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and ((p / "entries").is_dir() or (p / "fingerprint.json").is_file()))


def _caches(args: argparse.Namespace, need_one: bool = False) -> list[KernelCache]:
    root = Path(args.cache_dir)
    if getattr(args, "target", None):
        from torch_kernelize.lowering.targets import get_target
        return [KernelCache.for_target(root, get_target(args.target))]
    if args.namespace:
        return [KernelCache(root, args.namespace)]
    found = _namespaces(root)
    if need_one and len(found) != 1:
        raise CacheError(f"{root} holds {len(found)} namespaces ({', '.join(found) or 'none'}); "
                         "pick one with --namespace")
    return [KernelCache(root, ns) for ns in found]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_list(args: argparse.Namespace) -> int:
    for cache in _caches(args):
        rows = [["KEY", "OP", "SHAPES", "WINNER", "SPEEDUP", "MEASURED"]]
        for key in cache.keys():
            status, entry, reason = cache.lookup(key)
            if entry is None:
                rows.append([key, "-", "-", "INVALID", "-", "-"])
                continue
            shapes = entry.spec.describe()[len(entry.spec.op):]
            speedup = "-" if entry.speedup is None else f"{entry.speedup:.3g}x"
            rows.append([key, entry.spec.op, shapes, entry.winner, speedup, "yes" if entry.measured else "no"])
        print(f"# {cache.dir}  ({len(rows) - 1} entries)")
        print(_table(rows))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    cache = _caches(args, need_one=True)[0]
    status, entry, reason = cache.lookup(args.key)
    print(f"{status}: {reason}")
    if entry is None:
        return EXIT_PROBLEMS if status == "invalid" else EXIT_OK
    print(json.dumps(entry.record, indent=2, sort_keys=True))
    if entry.program_dir is not None:
        print(f"program files in {entry.program_dir}:")
        for path in sorted(p for p in entry.program_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            print(f"  {path.relative_to(entry.program_dir).as_posix():<30} {path.stat().st_size:>10} bytes")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    bad = 0
    caches = _caches(args)
    for cache in caches:
        problems = cache.check_integrity()
        print(f"# {cache.dir}: {len(cache.keys())} entries, {len(problems)} problem(s)")
        for key, problem in problems:
            print(f"  {key}: {problem}")
        bad += len(problems)
    if not caches:
        print(f"no cache namespaces under {args.cache_dir}")
    return EXIT_PROBLEMS if bad else EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    cache = _caches(args, need_one=True)[0]
    n = export_cache(cache, Path(args.archive), args.keys)
    print(f"exported {n} entries of {cache.dir} to {args.archive}")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    keys = import_cache(Path(args.cache_dir), Path(args.archive), replace=args.replace)
    print(f"imported {len(keys)} entries from {args.archive} into {args.cache_dir}")
    for key in keys:
        print(f"  {key}")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    for cache in _caches(args):
        n = cache.gc(max_age_s=args.max_age_minutes * 60)
        print(f"{cache.dir}: removed {n} leftover(s)")
    graphs = Path(args.cache_dir) / "graphs"  # the graph and executable caches' default place
    if graphs.is_dir():
        from torch_kernelize.graph_cache import GraphCache
        n = GraphCache(graphs).gc(max_age_s=args.max_age_minutes * 60)
        print(f"{graphs}: removed {n} leftover(s)")
    if (Path(args.cache_dir) / "prewarm").is_dir():
        from torch_kernelize import prewarm
        n = prewarm.gc(Path(args.cache_dir), max_age_s=args.max_age_minutes * 60)
        print(f"{Path(args.cache_dir) / 'prewarm'}: removed {n} index(es) of gone executables or leftover(s)")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-validate every Triton entry of the target's namespace by running it (fresh seeds)."""
    from torch_kernelize.fill_cache.verify import verify_entries
    from torch_kernelize.lowering.targets import get_target

    target = get_target(args.target)
    cache = KernelCache.for_target(Path(args.cache_dir), target)
    verdicts = verify_entries(cache, target, args.keys)
    rows = [["KEY", "SPEC", "RESULT", "DETAIL"]]
    for v in verdicts:
        rows.append([v.key, v.spec, "ok" if v.ok else "FAILED", v.detail])
    print(_table(rows))
    bad = [v for v in verdicts if not v.ok]
    if bad and args.remove_bad:
        for v in bad:
            cache.remove(v.key)
        print(f"removed {len(bad)} failing entr{'y' if len(bad) == 1 else 'ies'}")
    print(f"{len(verdicts) - len(bad)}/{len(verdicts)} entries verified in {cache.dir}")
    return EXIT_PROBLEMS if bad else EXIT_OK


# Subcommand name -> handler.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "list": cmd_list,
    "show": cmd_show,
    "check": cmd_check,
    "verify": cmd_verify,
    "export": cmd_export,
    "import": cmd_import,
    "gc": cmd_gc,
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", required=True, help="the cache root (holds one folder per namespace)")
    common.add_argument("--namespace", help="a namespace folder under the root (a Target.fingerprint_id())")
    common.add_argument("--target", help="a target name or .toml file: use its fingerprint's namespace")
    common.add_argument("-v", "--verbose", action="store_true", help="log cache warnings and info")
    parser = argparse.ArgumentParser(prog="tools/cache.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", parents=[common], help="table of entries")
    p = sub.add_parser("show", parents=[common], help="one entry's record and files")
    p.add_argument("key")
    sub.add_parser("check", parents=[common], help="verify every entry's hashes and record; exit 1 on problems")
    p = sub.add_parser("verify", help="re-validate every Triton entry by running it on the target")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("-v", "--verbose", action="store_true", help="log cache warnings and info")
    p.add_argument("--target", required=True, help="the target whose entries to run (its namespace)")
    p.add_argument("--keys", nargs="+", help="only these keys")
    p.add_argument("--remove-bad", action="store_true", help="remove entries that fail")
    p = sub.add_parser("export", parents=[common], help="write valid entries to a .tar.gz/.tar")
    p.add_argument("archive")
    p.add_argument("--keys", nargs="+", help="only these keys (each must be present and valid)")
    p = sub.add_parser("import", parents=[common], help="verify an archive, then add its entries")
    p.add_argument("archive")
    p.add_argument("--replace", action="store_true", help="overwrite existing entries even when they are better")
    p = sub.add_parser("gc", parents=[common], help="remove leftovers of killed writers")
    p.add_argument("--max-age-minutes", type=float, default=30.0,
                   help="temp folders younger than this may belong to a live writer (default 30)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return COMMANDS[args.command](args)
    except KernelizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
