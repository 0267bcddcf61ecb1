"""The fill_cache command line: parse the arguments, collect the work, run the fill driver
(fill_run.FillRun), report the run.

    python -m torch_kernelize.fill_cache --model torch_kernelize.model_zoo:make_moe --target interpreter
    python -m torch_kernelize.fill_cache --repros kernelize_repros --target chip.toml --resume

Several processes may fill one cache at once (one per GPU, or per node under torchrun): each
spec is searched under its own file lock, and a spec another process is busy with is taken up
again at the end (and skipped if that process stored it). Under torchrun, rank 0 deals the specs
out first and reports the whole run (distributed.py).
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch

from torch_kernelize.core.errors import KernelizeError
from torch_kernelize.core.spec import GRAPHED
from torch_kernelize.fill_cache import distributed
from torch_kernelize.fill_cache.buckets import BucketWork, works_from_args
from torch_kernelize.fill_cache.collect import UsageError, Work, check_cache_dir, specs_from_model, specs_from_repros
from torch_kernelize.fill_cache.external import with_candidates
from torch_kernelize.fill_cache.fill_run import FillRun
from torch_kernelize.fill_cache.measure_worker import FILL_TIME_LIMIT_S
from torch_kernelize.fill_cache.generators import KernelGenerator, chosen_generators, generator_notes
from torch_kernelize.fill_cache.measure import phase_totals
from torch_kernelize.fill_cache.run_log import RunLog
from torch_kernelize.fill_cache.search import DeviceFault
from torch_kernelize.fill_cache.region_judgment import PARTS_WIN
from torch_kernelize.fill_cache.store_policy import MIN_SPEEDUP
from torch_kernelize.fill_cache.trials import spec_bytes
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.core.targets import Target, get_target
from torch_kernelize.core.options import OPTIONS, default_cache_dir
from torch_kernelize.core.spec import KernelSpec

log = logging.getLogger("torch_kernelize.fill_cache")
details = logging.getLogger("torch_kernelize.fill_cache.details")  # the run log only (run_log.py)

EXIT_MACHINE = 4  # an OS error stopped the run (docs/filling.md)
DEFAULT_BUDGET = {"cuda": 12, "interpreter": 2}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse prints the whole usage too)
        self.exit(2, f"fill_cache: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m torch_kernelize.fill_cache", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="PATH.py:FN|pkg.module:FN",
                   help="a function returning (model, example_inputs); may be repeated")
    p.add_argument("--training", action="store_true",
                   help="--model: trace a training step (forward and backward graphs), not inference")
    p.add_argument("--repros", action="append", default=[], metavar="DIR", type=Path,
                   help="a folder of reproducers recorded by the backend; may be repeated")
    p.add_argument("--candidate", action="append", default=[], metavar="FILE.py", type=Path,
                   help="a kernel file for the reproducer(s) whose spec it names (docs/trust.md: candidate files); "
                   "it competes with the generated kernels; may be repeated")
    p.add_argument("--generators", default=None, metavar="all|none|NAME,...",
                   help="the generators asked beside each spec's kernel family (docs/filling.md: generators); default: "
                   "those on by default for the target (inductor on cuda) and every installed plugin")
    p.add_argument("--dynamic", action="append", default=[], metavar="INPUT:DIM:LO-HI",
                   help="with --model: fill the shape buckets covering sizes LO-HI of dim DIM of example input "
                        "INPUT (repeatable; see docs/filling.md, Shape buckets)")
    p.add_argument("--buckets", default=None, metavar="EDGE,EDGE,...",
                   help="the buckets' upper edges (default: powers of two: 1, 2, 3-4, 5-8, ...)")
    p.add_argument("--target", default=os.environ.get(OPTIONS["target"].env),
                   help="target name or TOML file (default: $KERNELIZE_TARGET, else cuda if available)")
    p.add_argument("--cache-dir", type=Path, default=os.environ.get(OPTIONS["cache_dir"].env) or default_cache_dir())
    p.add_argument("--budget", type=int, default=None, help="candidates evaluated per spec (default: 12 on "
                   "cuda, 2 on the interpreter)")
    p.add_argument("--resume", action="store_true", help="continue searches from their journals")
    p.add_argument("--force", action="store_true", help="search specs that already have an entry")
    p.add_argument("--min-speedup", type=float, default=MIN_SPEEDUP,
                   help=f"a Triton winner must beat the vendor kernel by this factor (default {MIN_SPEEDUP}: "
                   "closer than that is timing noise, and the vendor kernel is the safer one to run)")
    p.add_argument("--gather-to-rank0", action="store_true",
                   help="under torchrun, for nodes without a shared filesystem: each rank but 0 fills its own "
                   "cache (<cache-dir>/rank-<N>) and sends its entries to rank 0, which imports them into "
                   "--cache-dir (signed by a key it trusts, else re-validated there)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help=f"seconds one candidate's validation and timing may take in the measure worker before it "
                   f"is failed as hanging (default: $KERNELIZE_TIME_LIMIT, else {FILL_TIME_LIMIT_S:g})")
    p.add_argument("--summary", type=Path, default=None, help="JSON summary path (default: in the cache)")
    p.add_argument("--strict", action="store_true", help="exit 1 if a spec is left on the vendor op without a "
                   "kernel (no correct candidate, too large to validate, or its search failed); by default such "
                   "specs are listed in the summary and the run exits 0: the cache serves them on the vendor")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="with an error (a --model that raises, an OS error), "
                   "its traceback too")
    args = p.parse_args(argv)
    if not args.model and not args.repros:
        p.error("give --model and/or --repros: what should the cache be filled for?")
    if args.budget is not None and args.budget < 1:
        p.error("--budget must be at least 1")
    for c in args.candidate:
        if c.suffix != ".py":
            p.error(f"--candidate {c}: a candidate is a Python file named *.py")
    if args.summary is not None and args.summary.is_dir():
        p.error(f"--summary {args.summary} is a folder; give the JSON file to write (e.g. {args.summary / 'fill.json'})")
    if args.time_limit is not None and not args.time_limit > 0:
        p.error("--time-limit must be a positive number of seconds")
    return args


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'spec':<58} {'status':<22} {'speedup':>8} {'max err':>9} {'evals':>7}  winner"
    # max err: max |out - ref| / max(1, max |ref|) over all validation trials (see validate.py)
    lines = [head, "-" * len(head)]
    for r in rows:
        spec, tag = r["spec"], f" [{GRAPHED}]" if r["spec"].endswith(f" [{GRAPHED}]") else ""
        spec = spec if len(spec) <= 58 else spec[:55 - len(tag)] + "..." + tag  # (a graphed race stays told apart)
        speed = f"{r['speedup']:.2f}x" if isinstance(r["speedup"], (int, float)) else "n/a"
        err = r["max_err"]
        err = f"{err:.2e}" if isinstance(err, (int, float)) else "-"
        evals = f"{r['evaluated'] - r['resumed']}+{r['resumed']}" if r["resumed"] else str(r["evaluated"])
        lines.append(f"{spec:<58} {r['status']:<22} {speed:>8} {err:>9} {evals:>7}  {r['winner']}")
    return "\n".join(lines)


def collect_work(args: argparse.Namespace, target: Target, generators: Sequence[KernelGenerator] = ()) -> dict[str, Work]:
    """The specs to search, by key: every --model's trace, then every --repros folder's."""
    work: dict[str, Work] = {}

    def supported(spec: KernelSpec) -> bool:
        return family_for(spec) is not None or any(g.supports(spec) is None for g in generators)

    for ref in args.model:
        for w in specs_from_model(ref, target, args.cache_dir, supported, training=args.training):
            work.setdefault(w.spec.key, w)
    for folder in args.repros:
        for w in specs_from_repros(folder):
            if w.spec.key not in work or w.replace:
                work[w.spec.key] = w
    return work


def time_line(elapsed: float, summary: dict[str, Any]) -> str:
    """Where the time went: the trace before the fill, the phases of the searches, and the rest
    (the lookups, storing, waiting for the last compiles), so that nothing goes unaccounted."""
    phases = dict(summary["time"])
    if summary.get("closing_seconds") is not None:  # (the end of run(): its last stores, the workers ended)
        phases["closing"] = summary["closing_seconds"]
    rest = max(0.0, elapsed - sum(phases.values()))
    trace = f"trace {summary['trace_seconds']:.1f}s before; " if summary.get("trace_seconds") is not None else ""
    return trace + ", ".join(f"{k} {v:.1f}s" for k, v in {**phases, "other": rest}.items())


# statuses of specs whose ops the cache leaves on the vendor op without a kernel (--strict: an error)
LEFT_ON_VENDOR = ("no correct candidate", "too large", "failed")


def run_log_path(cache_dir: Path, search_id: str, rank: int | None) -> Path:
    """The run's log file (run_log.py): beside its summary and the journals, in the cache."""
    return Path(cache_dir) / "runs" / (f"{search_id}.log" if rank is None else f"{search_id}-rank{rank}.log")


def write_summary(path: Path, rows: list[dict[str, Any]], elapsed: float, meta: dict[str, Any]) -> dict[str, Any]:
    """The run's JSON summary (``meta``, its time, its phases' totals, one row per spec), written to ``path``."""
    summary = {**meta, "seconds": round(elapsed, 2), "time": phase_totals(rows), "specs": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _interrupted_summary(args: argparse.Namespace, run: "FillRun | None", elapsed: float) -> None:
    """Ctrl-C (or a time limit's SIGINT): the summary of the specs searched so far, marked
    interrupted, with the spec it stopped in and for how long it had been searched, so a script
    that stops fills at a limit still reads what they stored and where the time went."""
    if run is None:
        return
    path = args.summary or run.cache.dir / "runs" / f"{run.search_id}.json"
    meta = {"search_id": run.search_id, "target": run.target.describe(), "cache": str(run.cache.dir),
            "budget": run.budget, "interrupted": True, "trace_seconds": run.trace_seconds,
            "log": str(run.log.path) if run.log else None}
    if run.in_flight is not None:
        spec, since = run.in_flight
        meta["stopped_in"] = {"spec": spec, "seconds": round(time.perf_counter() - since, 2)}
        print(f"fill_cache: stopped {meta['stopped_in']['seconds']:.1f}s into {spec[:120]}", file=sys.stderr)
    try:
        write_summary(path, run.rows, elapsed, meta)
        print(f"fill_cache: the {len(run.rows)} spec(s) searched so far: {path}", file=sys.stderr)
    except OSError as e:
        print(f"fill_cache: the summary could not be written ({e})", file=sys.stderr)


def report(rows: list[dict[str, Any]], elapsed: float, summary_path: Path, summary: dict[str, Any],
           strict: bool = False) -> int:
    """Print the table, the specs left on the vendor op and the one-line total; write the JSON
    summary. The run finished and the cache serves the model: 0, unless ``strict`` and some spec
    is left on the vendor without a kernel (1); 2 if a spec could not be checked
    (its reference rejects the drawn inputs)."""
    print(format_table(rows))
    for r in rows:  # whole graphs: who competed, their times, who won (graph_candidates.py)
        if r.get("graph"):
            print(f"whole graph {r['key']}: {r['graph']}")
    summary = write_summary(summary_path, rows, elapsed, summary)
    left = [r for r in rows if r["status"] in LEFT_ON_VENDOR]
    if left:
        print(f"left on the vendor op ({len(left)}; a later fill with a larger --budget, or a candidate file, may "
              "find them a kernel):")
        for r in left:
            print(f"  {r['spec'][:90]}: {r['status']}" + (f" ({r['winner'][:120]})" if r["winner"] else ""))
    count = lambda status: sum(r["status"] == status for r in rows)  # noqa: E731
    log_note = f", log: {summary['log']}" if summary.get("log") else ""
    own = f"{count('own assembly wins')} own assembly wins, " if count("own assembly wins") else ""
    own += f"{count(PARTS_WIN)} regions whose parts win, " if count(PARTS_WIN) else ""
    unchecked = [r for r in rows if r["status"] == "could not check"]
    unfilled = count("no generator")
    if unfilled:
        print(f"fill_cache: {unfilled} spec(s) no generator fills: each one's reproducer is a task for a person or "
              "an agent (python -m torch_kernelize.repros task REPRO_FOLDER; then fill_cache --candidate FILE "
              "--repros DIR)")
    print(f"fill_cache: {len(rows)} spec(s) in {elapsed:.1f}s; {count('stored')} stored, {count('vendor wins')} "
          f"vendor wins, {own}{count('no correct candidate')} without a correct candidate, {count('too large')} too "
          f"large, {count('failed')} failed; {time_line(elapsed, summary)}; summary: {summary_path}{log_note}")
    return 2 if unchecked else 1 if strict and left else 0


def _start_run(args: argparse.Namespace, group: distributed.RankGroup | None
               ) -> tuple[FillRun, list[Work], list[BucketWork]]:
    """The fill driver the arguments ask for (target, cache, generators, candidate files), the
    specs it searches (under torchrun, this rank's share) and the shape buckets after them. Bad
    arguments raise UsageError before anything is searched."""
    if group is not None:
        distributed.pin_device(group.local_rank)
    target = get_target(args.target or ("cuda" if torch.cuda.is_available() else None))
    if not target.has_triton:
        raise UsageError(f"target {target.name!r} has no Triton backend: there is nothing to fill "
                         "(use --target interpreter, cuda, or a target file with triton = ...)")
    from torch_kernelize.kernel_cache import KernelCache
    private = group is not None and group.rank != 0 and args.gather_to_rank0
    cache = KernelCache.for_target(args.cache_dir / f"rank-{group.rank}" if private else args.cache_dir, target)
    check_cache_dir(cache.dir)
    generators = chosen_generators(args.generators, target)
    if group is not None and args.dynamic:
        raise UsageError("--dynamic (shape buckets) runs in one process, not under torchrun")
    buckets = works_from_args(args, target) if group is None else []  # (its bad arguments first)
    budget = args.budget or DEFAULT_BUDGET.get(target.triton, 4)
    run = FillRun(target, cache, budget, args.resume, args.force, args.min_speedup,
                  generators=generators, time_limit=args.time_limit)
    run.start_worker()  # (it starts while the models are traced)
    try:
        work = list(collect_work(args, target, generators).values())
    except BaseException:
        run.close(kill=True)
        raise
    if args.candidate:
        run.family_for = with_candidates(args.candidate, work)
    log.info("generators beside each spec's family: %s", ", ".join(g.name for g in generators) or "none")
    for note in generator_notes(target) if args.generators is None else ():
        log.info("generator %s", note)
    if group is not None:
        def served(w: Work) -> bool:  # on rank 0: its cache has it, and it is not to be searched again
            return not (args.force or w.replace) and cache.lookup(w.spec.key)[0] in ("hit", "vendor")
        total = len(work)
        work, run.search_id = group.share(work, lambda w: 0 if served(w) else spec_bytes(w.spec), run.search_id,
                                          to_rank0=served if args.gather_to_rank0 else lambda w: False)
        log.info("rank %d of %d: %d of the %d spec(s)", group.rank, group.world, len(work), total)
    log.info("fill_cache %s: %d spec(s) on target %r, cache %s, budget %d", run.search_id, len(work),
             target.name, cache.dir, budget)
    return run, work, buckets


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    group = None
    if distributed.launched():  # torchrun: this process is one rank of several
        group = distributed.RankGroup.from_env()
        group.start()
    run, rows, code, error = None, [], 0, None
    started = time.perf_counter()
    try:
        run, work, buckets = _start_run(args, group)
        run.trace_seconds = time.perf_counter() - started  # the models traced, candidate files read
        started = time.perf_counter()  # the fill's time, without the trace
        run.log = RunLog(run_log_path(run.cache.dir, run.search_id, group.rank if group is not None else None))
        with run.log.captured():
            # one bar; the shape buckets after the exact shapes
            rows = run.run(work, quiet=args.quiet or (group is not None and group.rank != 0), buckets=buckets)
    except KernelizeError as e:
        _traceback(args, e)
        print(f"fill_cache: error: {e}", file=sys.stderr)
        code, error = 2, str(e)
    except OSError as e:  # the machine's (a full disk, a permission): everything so far is journaled or stored whole
        _traceback(args, e)
        error = machine_stop(e, args.cache_dir)
        print(f"fill_cache: {error}", file=sys.stderr)
        code = EXIT_MACHINE
    except KeyboardInterrupt:  # every evaluation so far is journaled (fsynced); winners found are stored
        _interrupted_summary(args, run, time.perf_counter() - started)
        print("fill_cache: interrupted; run the same command with --resume to continue where it stopped",
              file=sys.stderr)
        return 130
    except DeviceFault as e:  # the CUDA context is gone: report what was done, then stop
        print(format_table(run.rows))
        print(f"fill_cache: {e}\nIt is recorded as failed and will not be run again. This process can no "
              f"longer use the GPU: run the same command with --resume to continue.", file=sys.stderr)
        code, error, rows = 3, str(e), run.rows
    elapsed = time.perf_counter() - started
    if group is not None:
        return _finish_rank(group, args, run, rows, code, error, started)
    if code:
        return code
    summary_path = args.summary or run.cache.dir / "runs" / f"{run.search_id}.json"
    try:
        return report(rows, elapsed, summary_path, {"search_id": run.search_id, "target": run.target.describe(),
                                                    "cache": str(run.cache.dir), "budget": run.budget,
                                                    "trace_seconds": round(run.trace_seconds, 2),
                                                    "closing_seconds": round(run.closing_seconds or 0.0, 2),
                                                    "log": str(run.log.path)}, args.strict)
    except OSError as e:  # the summary could not be written (everything else is stored)
        _traceback(args, e)
        print(f"fill_cache: {machine_stop(e, args.cache_dir)}", file=sys.stderr)
        return EXIT_MACHINE


def _traceback(args: argparse.Namespace, e: BaseException) -> None:
    if args.verbose:
        traceback.print_exception(e)


def machine_stop(e: OSError, cache_dir: Path) -> str:
    """One line for an OS error that stopped the run: what happened, where, what to do."""
    what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = f"free disk space (the cache is in {cache_dir})"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        todo = "make it writable again"
    else:
        todo = "fix that"
    return (f"stopped by an OS error ({what}); {todo}, then run the same command with --resume: every "
            "evaluation so far is journaled and every winner stored whole")


def _finish_rank(group: distributed.RankGroup, args: argparse.Namespace, run: FillRun | None,
                 rows: list[dict[str, Any]], code: int, error: str | None, started: float) -> int:
    """Under torchrun: hand this rank's rows to rank 0, which reports the whole run. Ranks other
    than 0 exit 0 once rank 0 has their result (a non-zero exit would make torchrun stop rank 0
    before its summary); rank 0 exits with the worst code of all ranks (3 for one lost)."""
    if args.gather_to_rank0 and group.rank != 0 and run is not None:
        try:  # before the result: rank 0 looks for it once it has the result
            data = distributed.export_bytes(run.cache, [r["key"] for r in rows])
            if data is not None:
                group.send_archive(data)
        except KernelizeError as e:
            code = distributed.worst([code, 3])
            error = f"its entries were not sent to rank 0 ({e}); they are in {run.cache.dir}"
    result = {"rank": group.rank, "host": socket.gethostname(), "code": code, "error": error,
              "seconds": round(time.perf_counter() - started, 2), "rows": [dict(r, rank=group.rank) for r in rows]}
    try:
        gathered = group.finish(result)
    except KeyboardInterrupt:
        _interrupted_summary(args, run, time.perf_counter() - started)
        print("fill_cache: interrupted; run the same command with --resume to continue where it stopped",
              file=sys.stderr)
        return 130
    if gathered is None:
        return 0
    results, missing = gathered
    for r in missing:
        print(f"fill_cache: rank {r} did not answer (killed, or its node was lost): its share is not "
              "finished; run the same command with --resume to continue", file=sys.stderr)
    for r, res in sorted(results.items()):
        if r and res["error"]:
            print(f"fill_cache: rank {r} ({res['host']}): exit {res['code']}: {res['error']}", file=sys.stderr)
    codes = [res["code"] for res in results.values()] + [3] * len(missing)
    if args.gather_to_rank0 and run is not None:
        for r, res in sorted(results.items()):
            data = group.received_archive(r) if r else None
            if data is not None:
                codes.append(_import_gathered(r, res, data, args.cache_dir, run.target))
    all_rows = [row for _, res in sorted(results.items()) for row in res["rows"]]
    if all_rows and run is not None:
        ranks = [{k: res[k] for k in ("rank", "host", "code", "error", "seconds", "gathered") if k in res}
                 | {"specs": len(res["rows"])} for _, res in sorted(results.items())]
        ranks += [{"rank": r, "code": None, "error": "did not answer"} for r in missing]
        cache_dir = run.cache.dir
        summary_path = args.summary or cache_dir / "runs" / f"{run.search_id}.json"
        codes.append(report(all_rows, time.perf_counter() - started, summary_path,
                            {"search_id": run.search_id, "target": run.target.describe(),
                             "cache": str(cache_dir), "budget": run.budget, "ranks": ranks,
                             "log": str(run.log.path) if run.log else None}, args.strict))
    return distributed.worst(codes)


def _import_gathered(rank: int, res: dict[str, Any], data: bytes, root: Path, target: Target) -> int:
    """Import the entries ``rank`` sent (--gather-to-rank0) into rank 0's cache; record how in
    ``res``; the exit code it adds: 1 if some entry failed re-validation, 2 if refused."""
    try:
        imported = distributed.import_bytes(root, data, target)
    except KernelizeError as e:
        res["gathered"] = {"error": str(e)}
        print(f"fill_cache: rank {rank}'s entries were not imported: {e}", file=sys.stderr)
        return 2
    res["gathered"] = {"accepted_by": imported.accepted_by, "imported": len(imported.imported),
                       "kept": len(imported.kept), "rejected": imported.rejected}
    log.info("rank %d: %d entr(ies) imported, %d kept (accepted by %s)", rank, len(imported.imported),
             len(imported.kept), imported.accepted_by)
    for key, why in sorted(imported.rejected.items()):
        print(f"fill_cache: rank {rank}'s entry {key} failed re-validation here, not stored: {why}", file=sys.stderr)
    return 1 if imported.rejected else 0
