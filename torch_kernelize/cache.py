"""Inspect, verify and move a kernel cache: list, show, check, verify, export, import, trust, gc.

    python -m torch_kernelize.cache list   --cache-dir DIR [--namespace NS | --target NAME]
    python -m torch_kernelize.cache show   KEY --cache-dir DIR [--namespace NS]
    python -m torch_kernelize.cache check  --cache-dir DIR            # exit 1 when any entry is bad
    python -m torch_kernelize.cache verify --cache-dir DIR --target T # re-validate by running every kernel
                                                                      # (in a worker, --time-limit S per entry);
                                                                      # failing entries go to <ns>/quarantine/
    python -m torch_kernelize.cache export OUT.tar.gz --cache-dir DIR [--namespace NS] [--keys K ...]  # signed
    python -m torch_kernelize.cache import IN.tar.gz --cache-dir DIR [--replace] [--revalidate --target T]
    python -m torch_kernelize.cache trust  key | list | add KEY [--name NAME] | remove KEY
    python -m torch_kernelize.cache gc     --cache-dir DIR [--max-age-minutes M]   # also DIR/graphs and DIR/prewarm

Without --namespace, list/check/gc cover every namespace under DIR; show/export need exactly one
(given, or the only one there). A missing folder or a namespace without entries is an error, not
an empty success. Installed with the package (also as the ``kernelize-cache`` script); in a
checkout, ``python tools/cache.py`` is the same command.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Callable

from torch_kernelize.core.errors import CacheError, KernelizeError
from torch_kernelize.kernel_cache import KernelCache, export_cache, import_cache
from torch_kernelize.kernel_cache import signing
from torch_kernelize.kernel_cache.store import QUARANTINE_DIR

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_CODES = f"""exit codes:
  {EXIT_OK}  done; every entry looked at is fine
  {EXIT_PROBLEMS}  done, but problems were found: check found bad entries, verify failed (and quarantined)
     entries, import --revalidate rejected entries (the others were stored), import stopped partway (a full
     disk: what was stored is listed, and the entry that failed), show found no valid entry
  {EXIT_ERROR}  nothing was done: bad arguments, a missing cache folder or a namespace without entries,
     an archive refused (unsigned, untrusted, tampered) or unreadable, a key problem
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C, SIGTERM): entries stored so far stay, staging folders are removed

Signing key and trusted keys: {signing.KEY_FILE} and {signing.TRUSTED_FILE} in ${signing.CONFIG_ENV}, else
$XDG_CONFIG_HOME/torch_kernelize, else ~/.config/torch_kernelize."""


def _namespaces(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and ((p / "entries").is_dir() or (p / "fingerprint.json").is_file()))


def _root(args: argparse.Namespace) -> Path:
    root = Path(args.cache_dir)
    if not root.exists():
        raise CacheError(f"no kernel cache at {root}: the folder does not exist (check --cache-dir)")
    if not root.is_dir():
        raise CacheError(f"--cache-dir {root} is not a folder")
    return root


def _caches(args: argparse.Namespace, need_one: bool = False, need_entries: bool = True) -> list[KernelCache]:
    """The namespaces a command works on; CacheError when there is nothing there to work on (a typo
    must not pass as an empty, healthy cache)."""
    root = _root(args)
    found = _namespaces(root)
    if getattr(args, "target", None):
        from torch_kernelize.core.targets import get_target
        caches = [KernelCache.for_target(root, get_target(args.target))]
    elif getattr(args, "namespace", None):
        caches = [KernelCache(root, args.namespace)]
    else:
        if not found:
            raise CacheError(f"{root} holds no kernel cache namespace (no <namespace>/entries folder); "
                             "check --cache-dir")
        if need_one and len(found) != 1:
            raise CacheError(f"{root} holds {len(found)} namespaces ({', '.join(found)}); pick one with --namespace")
        caches = [KernelCache(root, ns) for ns in found]
    if need_entries and not any(c.keys() for c in caches):
        where = ", ".join(str(c.dir) for c in caches)
        raise CacheError(f"no cache entries in {where}; namespaces under {root}: {', '.join(found) or 'none'}")
    return caches


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
        quarantine = cache.dir / QUARANTINE_DIR
        held = sorted(p.name for p in quarantine.iterdir() if p.is_dir()) if quarantine.is_dir() else []
        if held:
            print(f"# {len(held)} entr{'y' if len(held) == 1 else 'ies'} out of service in {quarantine} "
                  "(failed verify; each <folder>.json says why)")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    cache = _caches(args, need_one=True)[0]
    status, entry, reason = cache.lookup(args.key)
    print(f"{status}: {reason}")
    if entry is None:  # a miss or an invalid entry: a key given by hand that is not served
        return EXIT_PROBLEMS
    print(json.dumps(entry.record, indent=2, sort_keys=True))
    if entry.program_dir is not None:
        print(f"program files in {entry.program_dir}:")
        for path in sorted(p for p in entry.program_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            print(f"  {path.relative_to(entry.program_dir).as_posix():<30} {path.stat().st_size:>10} bytes")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    bad = 0
    for cache in _caches(args):
        problems = cache.check_integrity()
        print(f"# {cache.dir}: {len(cache.keys())} entries, {len(problems)} problem(s)")
        for key, problem in problems:
            print(f"  {key}: {problem}")
        bad += len(problems)
    return EXIT_PROBLEMS if bad else EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    cache = _caches(args, need_one=True)[0]
    n = export_cache(cache, Path(args.archive), args.keys)
    key = signing.own_public_key()
    print(f"exported {n} entries of {cache.dir} to {args.archive}, signed with your key {key}")
    print(f"whoever imports it trusts that key once with: python -m torch_kernelize.cache trust add {key}")
    return EXIT_OK


def _revalidator(target_name: str, time_limit: float | None):
    """import --revalidate: fill_cache.verify's re-validation, on this machine's target (each
    entry in a worker process, within ``time_limit`` seconds)."""
    from torch_kernelize.fill_cache.verify import verify_entries
    target = _runnable_target(target_name)

    def revalidate(staging: KernelCache, keys: list[str]) -> dict[str, str | None]:
        if staging.namespace != target.fingerprint_id():
            raise CacheError(f"the archive is for namespace {staging.namespace}, but target {target.name!r} on "
                             f"this machine is {target.fingerprint_id()}: revalidate it where it can run")
        return {v.key: None if v.ok else v.detail for v in verify_entries(staging, target, keys, time_limit)}
    return revalidate


def cmd_import(args: argparse.Namespace) -> int:
    if args.revalidate and not args.target:
        raise CacheError("--revalidate runs every entry, so it needs --target (the target of this machine)")
    revalidate = _revalidator(args.target, args.time_limit) if args.revalidate else None
    result = import_cache(Path(args.cache_dir), Path(args.archive), replace=args.replace, revalidate=revalidate)
    where = Path(args.cache_dir) / result.namespace
    print(f"imported {len(result.imported)} entries from {args.archive} into {where} "
          f"(accepted by {result.accepted_by})")
    for key in result.imported:
        print(f"  {key}")
    if result.kept:
        print(f"kept the existing entry of {len(result.kept)} key(s)"
              + ("" if args.replace else " (--replace puts the archive's in their place)") + ":")
        for key in result.kept:
            print(f"  {key}")
    if result.rejected:
        print(f"rejected {len(result.rejected)} entr{'y' if len(result.rejected) == 1 else 'ies'} "
              "(not stored):")
        for key, why in sorted(result.rejected.items()):
            print(f"  {key}: {why}")
    if result.failed:
        key, why = result.failed
        print(f"error: import stopped at entry {key} ({why}): the entries listed above were stored, the others "
              "were not; fix that (free space, permissions) and import again", file=sys.stderr)
    return EXIT_PROBLEMS if result.rejected or result.failed else EXIT_OK


def cmd_trust(args: argparse.Namespace) -> int:
    if args.action == "key":
        key = signing.own_public_key()
        print(key)
        print(f"# your public key (id {signing.key_id(key)}); its private part is "
              f"{signing.config_dir() / signing.KEY_FILE}", file=sys.stderr)
    elif args.action == "list":
        for key, name in signing.trusted_keys().items():
            print(f"{signing.key_id(key)}  {key}  {name}".rstrip())
    elif args.action == "add":
        new = signing.trust_add(args.key, args.name or "")
        print(f"{'now trusting' if new else 'already trusted'}: {args.key.strip()} (key id {signing.key_id(args.key)})")
    else:
        if not signing.trust_remove(args.key):
            raise CacheError(f"{args.key.strip()} is not in {signing.config_dir() / signing.TRUSTED_FILE}")
        print(f"no longer trusting {args.key.strip()}")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    for cache in _caches(args, need_entries=False):
        n = cache.gc(max_age_s=args.max_age_minutes * 60)
        print(f"{cache.dir}: removed {n} leftover(s)")
    graphs = Path(args.cache_dir) / "graphs"  # the graph and executable caches' default place
    if graphs.is_dir():
        from torch_kernelize.warm_start.graph_cache import GraphCache
        n = GraphCache(graphs).gc(max_age_s=args.max_age_minutes * 60)
        print(f"{graphs}: removed {n} leftover(s)")
    if (Path(args.cache_dir) / "prewarm").is_dir():
        from torch_kernelize.warm_start import prewarm
        n = prewarm.gc(Path(args.cache_dir), max_age_s=args.max_age_minutes * 60)
        print(f"{Path(args.cache_dir) / 'prewarm'}: removed {n} index(es) of gone executables or leftover(s)")
    return EXIT_OK


def _runnable_target(name: str):
    from torch_kernelize.core.targets import get_target
    target = get_target(name)
    if target.device == "cuda":
        import torch
        if not torch.cuda.is_available():  # else every entry would fail, and be quarantined, for nothing
            raise CacheError(f"target {target.name!r} needs CUDA, which this machine does not have")
    return target


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-validate every Triton entry of the target's namespace by running it (fresh seeds); move
    the failing ones out of service (quarantine, or --remove-bad)."""
    from torch_kernelize.fill_cache.verify import verify_entries

    target = _runnable_target(args.target)
    cache = _caches(args)[0]
    verdicts = verify_entries(cache, target, args.keys, args.time_limit)
    rows = [["KEY", "SPEC", "RESULT", "DETAIL"]]
    for v in verdicts:
        rows.append([v.key, v.spec, "ok" if v.ok else "FAILED", v.detail])
    print(_table(rows))
    bad = [v for v in verdicts if not v.ok]
    moved = 0
    for v in bad:
        if args.remove_bad:
            cache.remove(v.key)
            moved += 1
        elif (dest := cache.quarantine(v.key, f"torch_kernelize.cache verify: {v.detail}")) is not None:
            print(f"quarantined {v.key}: {dest} (why: {dest}.json)")
            moved += 1
    if moved:
        what = "removed" if args.remove_bad else f"moved to {cache.dir / 'quarantine'}, never served"
        print(f"{moved} failing entr{'y' if moved == 1 else 'ies'} {what}")
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
    "trust": cmd_trust,
    "gc": cmd_gc,
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse prints the whole usage too)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def _time_limit_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="seconds one entry's kernels may run (in a worker process) before the entry is rejected "
                   "as hanging (default: $KERNELIZE_TIME_LIMIT, else 120 on cuda, 600 on the interpreter)")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", required=True, help="the cache root (holds one folder per namespace)")
    common.add_argument("--namespace", help="a namespace folder under the root (a Target.fingerprint_id())")
    common.add_argument("--target", help="a target name or .toml file: use its fingerprint's namespace")
    common.add_argument("-v", "--verbose", action="store_true", help="log cache warnings and info")
    parser = _Parser(prog="python -m torch_kernelize.cache", description=__doc__.split("\n\n")[0],
                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", parents=[common], help="table of entries")
    p = sub.add_parser("show", parents=[common], help="one entry's record and files")
    p.add_argument("key")
    sub.add_parser("check", parents=[common], help="verify every entry's hashes and record; exit 1 on problems")
    p = sub.add_parser("verify", help="re-validate every Triton entry by running it on the target; "
                       "failing entries are quarantined")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("-v", "--verbose", action="store_true", help="log cache warnings and info")
    p.add_argument("--target", required=True, help="the target whose entries to run (its namespace)")
    p.add_argument("--keys", nargs="+", help="only these keys")
    p.add_argument("--remove-bad", action="store_true",
                   help="delete failing entries instead of moving them to <namespace>/quarantine/")
    _time_limit_arg(p)
    p = sub.add_parser("export", parents=[common], help="write valid entries to a .tar.gz/.tar, signed with your key")
    p.add_argument("archive")
    p.add_argument("--keys", nargs="+", help="only these keys (each must be present and valid)")
    p = sub.add_parser("import", parents=[common], help="add an archive's entries: signed by a key you trust, "
                       "or each re-validated here (--revalidate)")
    p.add_argument("archive")
    p.add_argument("--replace", action="store_true", help="overwrite existing entries even when they are better")
    p.add_argument("--revalidate", action="store_true",
                   help="for an archive you do not trust: check each entry's source (parsed, not run), run its "
                        "validation on this machine (--target), store only what passes")
    _time_limit_arg(p)
    p = sub.add_parser("trust", help="your signing key and the keys whose archives you accept")
    p.add_argument("-v", "--verbose", action="store_true", help="log cache warnings and info")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("key", help="print your public key (made on first use), for others to trust")
    actions.add_parser("list", help="the keys you trust")
    a = actions.add_parser("add", help="trust a public key (ed25519:...), as its owner gave it to you")
    a.add_argument("key")
    a.add_argument("--name", help="who it belongs to (shown by list)")
    a = actions.add_parser("remove", help="stop trusting a key")
    a.add_argument("key")
    p = sub.add_parser("gc", parents=[common], help="remove leftovers of killed writers")
    p.add_argument("--max-age-minutes", type=float, default=30.0,
                   help="temp folders younger than this may belong to a live writer (default 30)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    # SIGTERM (timeout, kill) unwinds like Ctrl-C: staging folders and the worker go with it
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return COMMANDS[args.command](args)
    except (KernelizeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted: the entries stored so far are complete; nothing else was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
