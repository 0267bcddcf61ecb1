"""The fill_cache command line: collect work, search each spec under a lock, store winners.

    python -m torch_kernelize.fill_cache --model torch_kernelize.model_zoo:make_moe --target interpreter
    python -m torch_kernelize.fill_cache --repros kernelize_repros --target chip.toml --resume

Several processes may fill one cache at once (one per GPU, or per node under torchrun): each
spec is searched under its own file lock, and a spec another process is busy with is taken up
again at the end (and skipped if that process stored it). Under torchrun, rank 0 deals the specs
out first and reports the whole run (distributed.py).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import logging
import os
import platform
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from torch_kernelize.core.errors import InputRejected, KernelizeError, machine_error
from torch_kernelize.core.program import remove_unaligned
from torch_kernelize.fill_cache import distributed
from torch_kernelize.fill_cache.buckets import fill_buckets, works_from_args
from torch_kernelize.fill_cache.builder import Builder
from torch_kernelize.fill_cache.collect import UsageError, Work, check_cache_dir, specs_from_model, specs_from_repros
from torch_kernelize.fill_cache.external import with_candidates
from torch_kernelize.compiling.whole_graph import describe_evidence, is_whole_graph
from torch_kernelize.fill_cache.graph_candidates import graph_evidence, rejudged_evidence
from torch_kernelize.fill_cache.generators import Competition, check_resumable, chosen_generators, generator_notes
from torch_kernelize.fill_cache.journal import Journal
from torch_kernelize.fill_cache.measure import Measurer, device_fault, phase_totals
from torch_kernelize.fill_cache.measure_worker import (FILL_TIME_LIMIT_S, IsolatedMeasurer, MeasureWorker,
                                                       WorkerDied, time_limit_s)
from torch_kernelize.fill_cache.run_log import RunLog
from torch_kernelize.fill_cache.search import DeviceFault, SearchResult, run_search
from torch_kernelize.fill_cache.store_policy import MIN_SPEEDUP, needs_confirmation, verdict
from torch_kernelize.fill_cache.trials import SpecTooLarge, spec_bytes
from torch_kernelize.lowering.kernels import Config, family_for
from torch_kernelize.core.targets import Target, get_target
from torch_kernelize.core.options import OPTIONS, default_cache_dir
from torch_kernelize.core.spec import KernelSpec

log = logging.getLogger("torch_kernelize.fill_cache")
details = logging.getLogger("torch_kernelize.fill_cache.details")  # the run log only (run_log.py)

EXIT_MACHINE = 4  # an OS error stopped the run (docs/filling.md)
DEFAULT_BUDGET = {"cuda": 12, "interpreter": 2}
LOOKAHEAD = 3  # specs whose seed candidates are compiled ahead


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


IN_WHOLE = "in the whole graph's program"  # a spec serving never runs: its graph runs a program whole


def _registry_family(spec: Any) -> Any:
    return family_for(spec)  # looked up at call time (tests replace it)


class FillRun:
    def __init__(self, target: Target, cache: Any, budget: int, resume: bool, force: bool, min_speedup: float,
                 isolate: bool = True, family_for: Any = None, generators: Sequence[Any] = (),
                 time_limit: float | None = None):
        """``isolate``: run candidates in a worker process (measure_worker.py), where a fault or
        a hang fails only the candidate; False runs them in this process, for trusted unit tests
        of measurement only. ``generators``: asked beside each spec's family (generators.py).
        ``time_limit``: seconds per candidate in the worker (default: measure_worker's)."""
        self.target, self.cache, self.budget = target, cache, budget
        # spec -> its family (candidate files joined in: external.py); the registry's by default
        self.family_for = family_for or _registry_family
        self.generators = list(generators)
        self._spaces: dict[str, Any] = {}  # spec key -> its generators as one search space
        self.builder = Builder(target)
        self.isolate = isolate
        # started with the first build (prebuild): it imports torch and sets up the device meanwhile
        self._worker = MeasureWorker.for_target(target, time_limit_s(time_limit, FILL_TIME_LIMIT_S)) \
            if isolate else None
        self.resume, self.force, self.min_speedup = resume, force, min_speedup
        self._pending: list[tuple[Any, dict, Path, bool, Measurer]] = []  # winners awaiting their put
        self.search_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.rows: list[dict[str, Any]] = []
        self.log: RunLog | None = None  # tags the run log's lines with the spec being searched
        # region place -> (its spec key, the places tried before it that share a node: Work.places)
        self.region_places: dict[str, tuple[str, list[str]]] = {}
        self.whole_places: set[str] = set()  # the places of whole graphs among them

    def space(self, spec: Any) -> Any:
        """The spec's family and every other generator of the run that supports it, as one
        search space (generators.Competition); None when nothing generates it. Kept per spec:
        generators keep what they recorded (candidate files, Inductor's captures)."""
        if spec.key not in self._spaces:
            self._spaces[spec.key] = Competition.of(spec, self.family_for(spec), self.generators, self.budget)
        return self._spaces[spec.key]

    def provenance(self, family: str, result: SearchResult) -> dict[str, Any]:
        import triton
        return {"generator": family, "search_id": self.search_id, "torch": torch.__version__,
                "triton": triton.__version__, "host": socket.gethostname(), "platform": platform.platform(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "budget": self.budget, "evaluated": len(result.evaluated)}

    def process(self, work: Work, progress: Any = None) -> dict[str, Any]:
        """Search one spec (the caller holds its lock) and store the result."""
        spec = work.spec
        row = _row(work)
        self.add_places([work])   # (a cached region can be blocked too)
        status, entry, _ = self.cache.lookup(spec.key)
        if status in ("hit", "vendor") and not self.force and not work.replace:
            row.update(status="cached", winner=_winner_text(entry), speedup=entry.speedup)
            return row
        family = self.space(spec)
        if family is None:  # a person or an agent can still write it: the reproducer's task.md says how
            row.update(status="no generator", winner="write one: tools/repros.py task <its repro>, then --candidate")
            return row
        if not self.force and self.never_run(work):
            row["status"] = IN_WHOLE if self._in_whole(work) else "in a fused region"
            return row
        journal = Journal(self.cache.journal_path(spec.key))
        previous = journal.records()
        if not self.resume:  # a fresh search; candidates that faulted the device stay excluded
            previous = [r for r in previous if r.get("fault")]
            journal.archive()
            for r in previous:
                journal.append(r)
        if self.resume:
            check_resumable(family, previous)
        if is_whole_graph(spec):  # its baseline is the graph as assembled from every entry stored before it
            self._store_pending(wait=True)
        measurer = self._measurer(spec, family, [work.captured] if work.captured else [])
        try:
            return self._search(work, family, journal, previous, measurer, row, progress)
        except InputRejected as e:  # the harness drew inputs the op rejects: nothing was judged
            log.warning("%s", e)
            row.update(status="could not check", winner=str(e)[:200])
            return row
        except SpecTooLarge as e:  # no candidate is at fault: the vendor op runs it, the run goes on
            log.warning("%s: too large to validate here (%s); the vendor op runs it", spec.describe()[:90], e)
            row.update(status="too large", winner=str(e))
            return row
        except WorkerDied as e:  # the winner's last timing killed the worker: nothing is stored, the run goes on
            log.warning("%s: %s; nothing stored", spec.describe()[:90], e)
            row.update(status="no correct candidate", winner=str(e))
            return row
        finally:
            row["time"] = {k: round(v, 2) for k, v in measurer.seconds.items()}
            row["peak_extra_bytes"] = measurer.peak_extra_bytes()
            if not any(p[4] is measurer for p in self._pending):  # else kept for the winner's last check
                measurer.close()

    def add_places(self, work: Sequence[Work]) -> None:
        """Learn where the regions of ``work`` occur (collect.Work.places), for never_run."""
        for w in work:
            self.region_places.update(zip(w.place_ids, ((w.spec.key, p) for p in w.places)))
            if is_whole_graph(w.spec):
                self.whole_places.update(w.place_ids)

    def never_run(self, work: Work) -> bool:
        """Whether serving would never run ``work``'s spec: at every place it occurs, a region
        holding it (or, for a region, one tried before it) runs fused. Only then is its search
        skipped: a spec that serving looks up anywhere is filled (one fill is enough)."""
        return bool(work.places) and all(any(self._served(p) for p in place) for place in work.places)

    def _will_hit(self, key: str) -> bool:
        """The cache serves a kernel for ``key``, or will once its winner's binaries for unaligned
        views are compiled (a pending winner is stored whatever they give: _store_pending)."""
        return self.cache.lookup(key)[0] == "hit" or any(p[1]["key"] == key for p in self._pending)

    def _in_whole(self, work: Work) -> bool:
        return all(any(p in self.whole_places and self._served(p) for p in place) for place in work.places)

    def _served(self, place: str, seen: frozenset = frozenset()) -> bool:
        """Whether serving runs the region at ``place`` fused: it hits, and no region tried before
        it there that shares a node with it does. A place not known here is not. A whole graph's
        program counts at the quick fill's budget (1) only: a larger budget fills the graph's
        nodes and regions too, so that its own assembly competes with the program at the end of
        the run (rejudge_wholes)."""
        if place in self.whole_places and self.budget > 1:
            return False
        key, before = self.region_places.get(place, (None, ()))
        return key is not None and self._will_hit(key) and not any(
            self._served(p, seen | {place}) for p in before if p not in seen)

    def _measurer(self, spec: Any, family: Any, captured: list) -> Measurer | IsolatedMeasurer:
        cache_dir = getattr(self.cache, "dir", None)  # a whole graph's own assembly runs from it
        if not self.isolate:
            return Measurer(spec, family, self.target, captured, self.builder, cache_dir)
        return IsolatedMeasurer(spec, family, self.target, captured, self.builder, self._worker, cache_dir)

    def _search(self, work: Work, family: Any, journal: Journal, previous: list[dict],
                measurer: Measurer | IsolatedMeasurer, row: dict[str, Any], progress: Any) -> dict[str, Any]:
        spec = work.spec
        measurer.check_fits()

        def evaluate(config):
            ev = measurer.evaluate(config).to_json()
            ev.update(spec=spec.key, search_id=self.search_id, family=family.name, time=time.time())
            if self.log is not None and (said := self.log.take(spec.key)):
                ev["log"] = said  # what Inductor, Triton or warnings said while its candidates were made
            return ev

        def step(r):
            if progress is not None:
                progress.set_postfix_str(f"{spec.short_name} {'ok' if r['correct'] else 'x'} "
                                         f"{r['fitness']:.2f}", refresh=True)

        result = run_search(spec, family, evaluate, family.evaluations(spec, self.budget), previous, journal.append,
                            step, measurer.prepare)
        row.update(evaluated=len(result.evaluated), resumed=result.resumed)
        best = _rechecked(spec, result, evaluate)
        if best is None:
            errors = sorted({r["error"][:120] for r in result.evaluated if r["error"]})
            row.update(status="no correct candidate", winner="; ".join(errors[:2]))
            return row
        row["max_err"] = (best["validation"] or {}).get("max_err")
        timings = {"candidate_ms": best["candidate_ms"], "vendor_ms": best["vendor_ms"],
                   "speedup": best["fitness"] if best["measured"] else None, "measured": best["measured"]}
        if needs_confirmation(best):
            # near a tie: time the winner and the vendor kernel again, alternately, before deciding
            confirmed = measurer.confirm(Config.from_json(best["config"]))
            if confirmed is not None:
                vendor_ms, cand_ms = confirmed
                best = dict(best, fitness=vendor_ms / cand_ms if cand_ms > 0 else 0.0)
                timings.update(search_speedup=timings["speedup"], candidate_ms=cand_ms, vendor_ms=vendor_ms,
                               speedup=best["fitness"], confirmed=True)
        origin = family.provenance(Config.from_json(best["config"]))
        record = {"format": 1, "key": spec.key, "spec": spec.to_json(), "family": origin["generator"],
                  "config": best["config"], "validation": best["validation"], "timings": timings,
                  "provenance": {**self.provenance(family.name, result), **origin}}
        winner, note = verdict(best, self.target, spec, self.min_speedup)
        record.update(winner=winner, note=note)
        if is_whole_graph(spec):  # who competed for the graph, their times, who won (graph_candidates.py)
            record["graph"] = graph_evidence(result.evaluated, winner, timings["vendor_ms"], best)
            row.update(graph=describe_evidence(record["graph"]), graph_candidates=record["graph"])
        if winner == "vendor":
            self.cache.put(record, None, replace=True if work.replace else self.force)
            who = "own assembly" if is_whole_graph(spec) else "vendor"
            row.update(status=f"{who} wins", winner=f"{who} (best {family.name} {best['fitness']:.2f}x)",
                       speedup=best["fitness"])
            return row
        pending = False
        try:
            built, _ = measurer.build(Config.from_json(best["config"]))
            if self.target.triton == "cuda":
                # stored once its binaries for unaligned views are compiled (in the build pool, while
                # the next specs are searched): see _store_pending
                self._pending.append((self.builder.submit_unaligned(spec, built), record, built,
                                      work.replace or self.force, measurer))
                pending = True
            else:
                self.cache.put(record, built, replace=work.replace or self.force)
        finally:
            if not pending:
                self.builder.discard(spec)
        row.update(status="stored", winner=f"{origin['generator']} " + " ".join(f"{k}={v}" for k, v in sorted(best["config"].items())),
                   speedup=timings["speedup"])
        return row

    def _store_pending(self, wait: bool, check: bool = True) -> None:
        """Store the winners whose binaries for unaligned views are compiled (all of them: wait).
        Without ``check`` (Ctrl-C: the user is waiting) they are stored without those binaries."""
        waiting = []
        for fut, record, built, replace, measurer in self._pending:
            if not wait and not fut.done():
                waiting.append((fut, record, built, replace, measurer))
                continue
            spec = measurer.spec
            try:
                error = fut.result()
                if error is None and not check:
                    error = "interrupted before they were validated"
                if error is None:
                    error = measurer.validate_unaligned(built)
                    if error is not None:
                        error = f"failed validation: {error}"
            except Exception as e:  # the pool failed, or the unaligned binary did not run
                error = f"{type(e).__name__}: {e}"
            if error is not None:
                remove_unaligned(built)
                log.warning("%s: no binary for unaligned views (%s); such calls will run the vendor op",
                            spec.describe()[:90], error[:300])
            try:
                self.cache.put(record, built, replace=replace)
            finally:
                self.builder.discard(spec)
                measurer.close()
            if error is not None and device_fault(error) and not measurer.contains_faults:  # the CUDA context is gone
                self._pending = waiting
                raise DeviceFault(spec, {"config": record["config"], "error": f"unaligned binary: {error}"})
        self._pending = waiting

    def _timed(self, work: Work, progress: Any) -> dict[str, Any]:
        started = time.perf_counter()
        if self.log is not None:
            self.log.spec(work.spec.key, work.spec.short_name)
        if progress is not None:
            progress.set_postfix_str(work.spec.short_name, refresh=True)
        try:
            row = self.process(work, progress)
        except (DeviceFault, UsageError):  # the CUDA context is gone; the arguments must change (exit 2)
            raise
        except Exception as e:  # one spec's failure never ends the run: its ops stay on the vendor
            if machine_error(e):  # a full disk, a permission: the machine's, exit 4 (not the spec's)
                raise
            log.warning("%s: failed (%s: %s); its ops run on the vendor", work.spec.describe()[:90],
                        type(e).__name__, str(e)[:300])
            details.error("%s: failed", work.spec.describe(), exc_info=True)  # (the run log only)
            row = dict(_row(work), status="failed", winner=f"{type(e).__name__}: {e}"[:300])
        row["seconds"] = round(time.perf_counter() - started, 2)
        log.info("%s: %s in %.1fs (%d evaluated) %s", work.spec.describe()[:90], row["status"], row["seconds"],
                 row["evaluated"], row["winner"])
        return row

    def run(self, work: list[Work], quiet: bool = False) -> list[dict[str, Any]]:
        interrupted = False
        self.add_places(work)
        try:
            return self._run(work, quiet)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            try:  # winners found before a fault or an interrupt are kept
                self._store_pending(wait=True, check=not interrupted)
            finally:
                self.close()

    def close(self) -> None:
        """End the build pool and the measure worker (run() does; a caller of process() must)."""
        self.builder.close()
        if self._worker is not None:
            self._worker.close()

    def _run(self, work: list[Work], quiet: bool) -> list[dict[str, Any]]:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        def prebuild(i: int) -> None:
            # Compile the seed candidates of the next few specs while this one is measured; not
            # all at once, or a search's later candidates would queue behind every other spec's.
            for w in work[i:i + LOOKAHEAD]:
                family = self.space(w.spec)
                if family is not None and (self.force or self.cache.lookup(w.spec.key)[0] == "miss"):
                    with self.log.about(w.spec.key, w.spec.short_name) if self.log else contextlib.nullcontext():
                        self.builder.submit(w.spec, family, family.seed_configs(w.spec)[:self.budget])
                    if self._worker is not None:
                        self._worker.start()

        deferred: list[Work] = []
        # specs done of all, elapsed<time left, and the spec being searched (its last candidate's verdict)
        bar = tqdm(total=len(work), desc="fill_cache", unit="spec", disable=quiet, file=sys.stderr)
        with logging_redirect_tqdm():  # log lines print above the bar, not through it
            self._loop(work, bar, prebuild, deferred)
            self.rejudge_wholes(work)
        bar.close()
        if self.log is not None:
            self.log.spec(None)  # (what follows concerns no one spec of these)
        return self.rows

    def _loop(self, work: list[Work], bar: Any, prebuild: Any, deferred: list[Work]) -> None:
        from filelock import Timeout

        for i, w in enumerate(work):
            prebuild(i)
            lock = self.cache.lock(w.spec.key)
            try:
                lock.acquire(timeout=0)
            except Timeout:  # another process searches this spec now: come back to it at the end
                deferred.append(w)
                continue
            try:
                self.rows.append(self._timed(w, bar))
            finally:
                lock.release()
            self._store_pending(wait=False)
            bar.update(1)
        for w in deferred:
            with self.cache.lock(w.spec.key):
                row = self._timed(w, bar)
                if row["status"] == "cached":
                    row["status"] = "cached (by another process)"
                self.rows.append(row)
            bar.update(1)


    def rejudge_wholes(self, work: list[Work]) -> None:
        """Whole graphs are searched first (collect.py); where this run then stored kernels for
        the rest, a graph whose entry runs a program is timed again, alternately, against its own
        assembly as the cache gives it now, and becomes "own assembly wins" where that is faster
        (store_policy.verdict)."""
        if not any(r["status"] == "stored" and "graph" not in r for r in self.rows):
            return
        self._store_pending(wait=True)
        for w in work:
            if is_whole_graph(w.spec) and self.cache.lookup(w.spec.key)[0] == "hit":
                self._rejudge(w.spec)

    def _rejudge(self, spec: KernelSpec) -> None:
        entry = self.cache.lookup(spec.key)[1]
        measurer = self._measurer(spec, self.space(spec), [])
        try:
            confirmed = measurer.confirm(Config.from_json(entry.config))
        finally:
            measurer.close()
            self.builder.discard(spec)
        if confirmed is None:
            return
        assembly_ms, program_ms = confirmed
        best = {"measured": True, "fitness": assembly_ms / program_ms if program_ms > 0 else 0.0}
        winner, note = verdict(best, self.target, spec, self.min_speedup)
        log.info("%s: timed again after the rest of the run: program %.3f ms, own assembly %.3f ms -> %s",
                 spec.describe()[:90], program_ms, assembly_ms, "own assembly" if winner == "vendor" else "program")
        if winner != "vendor":
            return
        graph = rejudged_evidence(entry.record["graph"], assembly_ms, program_ms)
        timings = dict(entry.timings, vendor_ms=assembly_ms, candidate_ms=program_ms, speedup=best["fitness"])
        self.cache.put(dict(entry.record, winner="vendor", note=note, timings=timings, graph=graph), None,
                       replace=True)
        for row in self.rows:
            if row["key"] == spec.key:
                row.update(status="own assembly wins", speedup=best["fitness"], graph=describe_evidence(graph),
                           graph_candidates=graph, winner=f"own assembly (after the rest: {note})")


def _rechecked(spec: KernelSpec, result: SearchResult, evaluate: Any) -> dict[str, Any] | None:
    """The best correct evaluation of ``result``, one that this process evaluated: a winner
    resumed from the journal of an earlier process is evaluated again here (its build folder went
    with that process, and a generator such as Inductor's may not build the same program twice);
    one that fails now gives way to the next best. Not journaled: the search is the journal's."""
    resumed = {id(r) for r in result.evaluated[:result.resumed]}
    for r in sorted((r for r in result.evaluated if r["correct"]), key=lambda r: -r["fitness"]):
        if id(r) not in resumed:
            return r
        again = evaluate(Config.from_json(r["config"]))
        if again.get("fault") and not again.get("contained"):
            raise DeviceFault(spec, again)
        if again["correct"]:
            return again
        log.warning("a winner resumed from the journal fails now (%s); the next best is taken", again["error"][:200])
    return None


def _row(work: Work) -> dict[str, Any]:
    """A spec's row of the summary, before its search."""
    spec = work.spec
    return {"spec": spec.describe(), "key": spec.key, "source": work.source, "status": "", "winner": "",
            "speedup": None, "max_err": None, "evaluated": 0, "resumed": 0, "bytes": spec_bytes(spec),
            **({"whole": True} if is_whole_graph(spec) else {})}


def _winner_text(entry: Any) -> str:
    if entry is None:
        return ""
    if entry.winner == "vendor":
        return "vendor"
    return f"{entry.family} " + " ".join(f"{k}={v}" for k, v in sorted((entry.config or {}).items()))


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'spec':<58} {'status':<22} {'speedup':>8} {'max err':>9} {'evals':>7}  winner"
    # max err: max |out - ref| / max(1, max |ref|) over all validation trials (see validate.py)
    lines = [head, "-" * len(head)]
    for r in rows:
        spec = r["spec"] if len(r["spec"]) <= 58 else r["spec"][:55] + "..."
        speed = f"{r['speedup']:.2f}x" if isinstance(r["speedup"], (int, float)) else "n/a"
        err = r["max_err"]
        err = f"{err:.2e}" if isinstance(err, (int, float)) else "-"
        evals = f"{r['evaluated'] - r['resumed']}+{r['resumed']}" if r["resumed"] else str(r["evaluated"])
        lines.append(f"{spec:<58} {r['status']:<22} {speed:>8} {err:>9} {evals:>7}  {r['winner']}")
    return "\n".join(lines)


def collect_work(args: argparse.Namespace, target: Target, generators: Sequence[Any] = ()) -> dict[str, Work]:
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
    interrupted, so a script that stops fills at a limit still reads what they stored."""
    if run is None or not run.rows:
        return
    path = args.summary or run.cache.dir / "runs" / f"{run.search_id}.json"
    meta = {"search_id": run.search_id, "target": run.target.describe(), "cache": str(run.cache.dir),
            "budget": run.budget, "interrupted": True, "log": str(run.log.path) if run.log else None}
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
    unchecked = [r for r in rows if r["status"] == "could not check"]
    unfilled = count("no generator")
    if unfilled:
        print(f"fill_cache: {unfilled} spec(s) no generator fills: each one's reproducer is a task for a person or "
              "an agent (python tools/repros.py task REPRO_FOLDER; then fill_cache --candidate FILE --repros DIR)")
    print(f"fill_cache: {len(rows)} spec(s) in {elapsed:.1f}s; {count('stored')} stored, {count('vendor wins')} "
          f"vendor wins, {own}{count('no correct candidate')} without a correct candidate, {count('too large')} too "
          f"large, {count('failed')} failed; " + ", ".join(f"{k} {v:.1f}s" for k, v in summary["time"].items())
          + f"; summary: {summary_path}{log_note}")
    return 2 if unchecked else 1 if strict and left else 0


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
        work = list(collect_work(args, target, generators).values())
        log.info("generators beside each spec's family: %s", ", ".join(g.name for g in generators) or "none")
        for note in generator_notes(target) if args.generators is None else ():
            log.info("generator %s", note)
        budget = args.budget or DEFAULT_BUDGET.get(target.triton, 4)
        run = FillRun(target, cache, budget, args.resume, args.force, args.min_speedup,
                      family_for=with_candidates(args.candidate, work) if args.candidate else None,
                      generators=generators, time_limit=args.time_limit)
        if group is not None:
            def served(w: Work) -> bool:  # on rank 0: its cache has it, and it is not to be searched again
                return not (args.force or w.replace) and cache.lookup(w.spec.key)[0] in ("hit", "vendor")
            total = len(work)
            work, run.search_id = group.share(work, lambda w: 0 if served(w) else spec_bytes(w.spec), run.search_id,
                                              to_rank0=served if args.gather_to_rank0 else lambda w: False)
            log.info("rank %d of %d: %d of the %d spec(s)", group.rank, group.world, len(work), total)
        log.info("fill_cache %s: %d spec(s) on target %r, cache %s, budget %d", run.search_id, len(work),
                 target.name, cache.dir, budget)
        started = time.perf_counter()  # the fill's time, without the trace
        run.log = RunLog(run_log_path(cache.dir, run.search_id, group.rank if group is not None else None))
        with run.log.captured():
            rows = run.run(work, quiet=args.quiet or (group is not None and group.rank != 0))  # one bar
            rows += fill_buckets(run, buckets)  # shape buckets, after the exact shapes
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
    summary_path = args.summary or cache.dir / "runs" / f"{run.search_id}.json"
    try:
        return report(rows, elapsed, summary_path, {"search_id": run.search_id, "target": target.describe(),
                                                    "cache": str(cache.dir), "budget": budget,
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
