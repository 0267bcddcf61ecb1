"""The fill driver: FillRun searches one spec after another (its family and every other
generator of the run as one search space), stores the winners, and keeps what serving will run
in view: a spec inside a region (or a whole graph's program) that serving runs fused is not
searched (``never_run``), whole graphs are searched first and timed again at the end
(``rejudge_wholes``). cli.py parses the command line, collects the work and reports.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import platform
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from torch_kernelize.compiling.whole_graph import describe_evidence, is_whole_graph
from torch_kernelize.core.errors import InputRejected, machine_error
from torch_kernelize.core.program import remove_unaligned
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target
from torch_kernelize.fill_cache.builder import Builder
from torch_kernelize.fill_cache.collect import UsageError, Work
from torch_kernelize.fill_cache.generators import Competition, check_resumable
from torch_kernelize.fill_cache.graph_candidates import graph_evidence, rejudged_evidence
from torch_kernelize.fill_cache.journal import Journal
from torch_kernelize.fill_cache.measure import Measurer, device_fault
from torch_kernelize.fill_cache.measure_worker import (FILL_TIME_LIMIT_S, IsolatedMeasurer, MeasureWorker,
                                                       WorkerDied, time_limit_s)
from torch_kernelize.fill_cache.run_log import RunLog
from torch_kernelize.fill_cache.search import DeviceFault, SearchResult, run_search
from torch_kernelize.fill_cache.store_policy import needs_confirmation, verdict
from torch_kernelize.fill_cache.trials import SpecTooLarge, spec_bytes
from torch_kernelize.lowering.kernels import Config, family_for

log = logging.getLogger("torch_kernelize.fill_cache")
details = logging.getLogger("torch_kernelize.fill_cache.details")  # the run log only (run_log.py)

LOOKAHEAD = 3  # specs whose seed candidates are compiled ahead


MIX_LATER = "a stretch for a mix: searched at --budget 2 and more"
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
            row.update(status="no generator",
                       winner="write one: python -m torch_kernelize.repros task <its repro>, then --candidate")
            return row
        if work.mix and self.budget <= 1:  # the quick fill measures graphs whole, not mixed
            row["status"] = MIX_LATER
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
        if not any(r["status"] == "stored" and ("graph" not in r or r.get("mix")) for r in self.rows):
            return
        self._store_pending(wait=True)
        for w in sorted(work, key=lambda w: not w.mix):  # stretches first: the graph's assembly runs their winners
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
            **({"whole": True} if is_whole_graph(spec) else {}), **({"mix": True} if work.mix else {})}


def _winner_text(entry: Any) -> str:
    if entry is None:
        return ""
    if entry.winner == "vendor":
        return "vendor"
    return f"{entry.family} " + " ".join(f"{k}={v}" for k, v in sorted((entry.config or {}).items()))
