"""The fill driver: FillRun searches one cache entry after another, stores the winners, and keeps
what serving will run in view: a spec inside a region (or a whole graph's program) that serving
runs fused is not searched (``never_run``), whole graphs are searched first and timed again at the
end (``rejudge_wholes``). cli.py parses the command line, collects the work and reports.

Every entry is searched the same way (``_search``: search, re-check, time a near tie again,
decide through store_policy.verdict, store); what differs is the strategy's ``Search``:

- a plain spec (``process``): the spec's family and every other generator of the run that
  supports it, as one search space (generators.Competition), measured in a worker;
- an external candidate: a plain spec whose family has the candidate files joined in
  (external.with_candidates: ``family_for``);
- a whole graph: a plain spec whose baseline is the graph's own assembly (Measurer.baseline),
  searched first, its evidence recorded, and timed again at the end (``rejudge_wholes``);
- a shape bucket (``process_bucket``): buckets.BucketFamily at the bucket's upper edge, its
  correct candidates validated at the other sizes too (buckets.BucketMeasurer), stored under
  the bucket's key with no binaries for unaligned views.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import platform
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.compiling.whole_graph import describe_evidence, is_whole_graph
from torch_kernelize.core.errors import InputRejected, machine_error
from torch_kernelize.core.program import remove_unaligned
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target
from torch_kernelize.fill_cache.buckets import BucketFamily, BucketMeasurer, BucketWork
from torch_kernelize.fill_cache.builder import Builder
from torch_kernelize.fill_cache.collect import UsageError, Work
from torch_kernelize.fill_cache.generators import Competition, FamilyFor, KernelGenerator, check_resumable
from torch_kernelize.fill_cache.graph_candidates import WHOLE_GRAPH_DOMAIN, graph_evidence, rejudged_evidence
from torch_kernelize.fill_cache.journal import Journal
from torch_kernelize.fill_cache.measure import CandidateMeasurer, Measurer, device_fault
from torch_kernelize.fill_cache.region_judgment import judge_regions
from torch_kernelize.fill_cache.measure_worker import (FILL_TIME_LIMIT_S, IsolatedMeasurer, MeasureWorker,
                                                       WorkerDied, generate_in, time_limit_s)
from torch_kernelize.fill_cache.run_log import RunLog
from torch_kernelize.fill_cache.search import DeviceFault, SearchResult, run_search
from torch_kernelize.fill_cache.store_policy import needs_confirmation, verdict
from torch_kernelize.fill_cache.trials import SpecTooLarge, spec_bytes
from torch_kernelize.kernel_cache.entry import CacheEntry
from torch_kernelize.kernel_cache.interfaces import Cache
from torch_kernelize.lowering.kernels import Config, KernelFamily, family_for
from torch_kernelize.serving.launch import read_program

log = logging.getLogger("torch_kernelize.fill_cache")
details = logging.getLogger("torch_kernelize.fill_cache.details")  # the run log only (run_log.py)

LOOKAHEAD = 3  # specs whose seed candidates are compiled ahead
# ... but not while a whole graph (or a stretch of one) is searched: its candidates run host-bound
# (hundreds of launches a call), where compiles on every core beside their timing add noise to
# what decides between them (on a busy H100 host Inductor's ResNet-50 program, GPU 1.5 ms, was timed
# 0.83x of its own assembly, GPU 3.3 ms, and lost). The specs after it wait; at budget 1 most of
# them are then inside its program anyway.


MIX_LATER = "a stretch for a mix: searched at --budget 2 and more"
IN_WHOLE = "in the whole graph's program"  # a spec serving never runs: its graph runs a program whole


def _registry_family(spec: KernelSpec) -> KernelFamily | None:
    return family_for(spec)  # looked up at call time (tests replace it)


@dataclasses.dataclass
class Search:
    """One cache entry's search, as a strategy hands it to the driver (FillRun._search)."""
    key: str                          # the entry's key: the spec's, or its bucket's
    spec: KernelSpec                  # what candidates are made for (a bucket's representative)
    family: KernelGenerator           # the search space
    measurer: CandidateMeasurer
    journal: Journal
    previous: list[dict[str, Any]]    # journaled evaluations it takes up again
    replace: bool                     # its winner replaces the entry stored under ``key``
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the entry holds beside (a bucket)
    unaligned: bool = True            # a Triton winner gets binaries for unaligned views (on CUDA)


class FillRun:
    def __init__(self, target: Target, cache: Cache, budget: int, resume: bool, force: bool, min_speedup: float,
                 isolate: bool = True, family_for: FamilyFor | None = None, generators: Sequence[KernelGenerator] = (),
                 time_limit: float | None = None):
        """``isolate``: run candidates in a worker process (measure_worker.py), where a fault or
        a hang fails only the candidate; False runs them in this process, for trusted unit tests
        of measurement only. ``generators``: asked beside each spec's family (generators.py).
        ``time_limit``: seconds per candidate in the worker (default: measure_worker's)."""
        self.target, self.cache, self.budget = target, cache, budget
        # spec -> its family (candidate files joined in: external.py); the registry's by default
        self.family_for = family_for or _registry_family
        self.generators = list(generators)
        self._spaces: dict[str, KernelGenerator | None] = {}  # spec key -> its generators as one search space
        self.builder = Builder(target)
        self.isolate = isolate
        # started before the trace on CUDA (start_worker), else with the first build (prebuild): it
        # imports torch and sets up the device meanwhile
        inductor = any(g.name == "inductor" for g in self.generators)
        self._worker = MeasureWorker.for_target(target, time_limit_s(time_limit, FILL_TIME_LIMIT_S), inductor) \
            if isolate else None
        if self._worker is not None:  # Inductor runs what it captures on the device: a fault ends the worker only
            self.builder.generate_elsewhere = generate_in(self._worker)
        self.resume, self.force, self.min_speedup = resume, force, min_speedup
        self._pending: list[tuple[Any, dict, Path, bool, CandidateMeasurer]] = []  # winners awaiting their put
        self.search_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.rows: list[dict[str, Any]] = []
        self.trace_seconds: float | None = None  # the fill's trace of its models, before run() (cli.py)
        self.closing_seconds: float | None = None  # the last winners stored, the pool and worker ended
        # (spec, when its search began): what an interrupt stopped, for its summary (cli.py)
        self.in_flight: tuple[str, float] | None = None
        self.log: RunLog | None = None  # tags the run log's lines with the spec being searched
        # region place -> (its spec key, the places tried before it that share a node: Work.places)
        self.region_places: dict[str, tuple[str, list[str]]] = {}
        self.whole_places: set[str] = set()  # the places of whole graphs among them

    def space(self, spec: KernelSpec) -> KernelGenerator | None:
        """The spec's family and every other generator of the run that supports it, as one
        search space (generators.Competition); None when nothing generates it. Kept per spec:
        generators keep what they recorded (candidate files, Inductor's captures)."""
        if spec.key not in self._spaces:
            self._spaces[spec.key] = Competition.of(spec, self.family_for(spec), self.generators, self.budget)
        return self._spaces[spec.key]

    def _provenance(self, family: str, result: SearchResult) -> dict[str, Any]:
        import triton
        return {"generator": family, "search_id": self.search_id, "torch": torch.__version__,
                "triton": triton.__version__, "host": socket.gethostname(), "platform": platform.platform(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "budget": self.budget, "evaluated": len(result.evaluated)}

    def process(self, work: Work, progress: Any = None) -> dict[str, Any]:
        """Search one spec (the caller holds its lock) and store the result: the plain spec's
        strategy, a whole graph's and an external candidate's too (see the module's docstring)."""
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
        journal, previous = self._journal(spec.key, family)
        if is_whole_graph(spec):  # its baseline is the graph as assembled from every entry stored before it
            self._store_pending(wait=True)
            WHOLE_GRAPH_DOMAIN.pin(spec.key, work.pins)  # its index inputs as the model gave them (here and in the worker)
        measurer = self._measurer(spec, family, [work.captured] if work.captured else [])
        # A whole graph's program gets no binaries for unaligned views (each a second compile of
        # every launch, which the next whole graph and the run's end waited for): its inputs are
        # the model's parameters and inputs, and Inductor compiles for 16-byte aligned ones too
        # (it compiles again for others); an unaligned call runs the graph's own assembly.
        search = Search(spec.key, spec, family, measurer, journal, previous, work.replace or self.force,
                        unaligned=not is_whole_graph(spec))
        return self._searched(search, row, progress)

    def process_bucket(self, work: BucketWork, builder: Builder, family: KernelFamily | None = None) -> dict[str, Any]:
        """Search one shape bucket and store the result (buckets.py), under the rules of any
        spec (store_policy.verdict). ``family``: the spec's registered one by default.
        ``builder``: the buckets' own (builds are keyed by spec and config, and a bucket's
        representative may be an exact shape whose plain candidates were built before)."""
        row = work.row()
        status, entry, _ = self.cache.lookup(work.key)
        if status in ("hit", "vendor") and not self.force:
            row.update(status="cached", winner=_winner_text(entry), speedup=entry.speedup)
            return row
        family = BucketFamily(family or work.generator or _registry_family(work.spec), work.dims)
        journal = Journal(self.cache.journal_path(work.key))
        journal.archive()  # (a bucket's search starts afresh)
        measurer = BucketMeasurer(work, family, self.target, builder, self.cache.root)
        search = Search(work.key, work.spec, family, measurer, journal, [], self.force, work.record(), unaligned=False)
        try:
            return self._searched(search, row, None)
        finally:
            builder.discard(work.spec)

    def _journal(self, key: str, family: KernelGenerator) -> tuple[Journal, list[dict[str, Any]]]:
        """The search journal of ``key`` and the evaluations taken up from it: every one with
        --resume; else only the candidates that faulted the device (never run again), in a fresh
        journal."""
        journal = Journal(self.cache.journal_path(key))
        previous = journal.records()
        if self.resume:
            check_resumable(family, previous)
            return journal, previous
        previous = [r for r in previous if r.get("fault")]
        journal.archive()
        for r in previous:
            journal.append(r)
        return journal, previous

    def _searched(self, search: Search, row: dict[str, Any], progress: Any) -> dict[str, Any]:
        """``_search``, where what no candidate is to blame for (the inputs drawn, the spec's
        size, a dead worker) is the row's status and the run goes on; the measurer is closed
        unless its winner waits for its last check (_store_pending)."""
        measurer = search.measurer
        try:
            return self._search(search, row, progress)
        except InputRejected as e:  # the harness drew inputs the op rejects: nothing was judged
            log.warning("%s", e)
            row.update(status="could not check", winner=str(e)[:200])
            return row
        except SpecTooLarge as e:  # no candidate is at fault: the vendor op runs it, the run goes on
            log.warning("%s: too large to validate here (%s); the vendor op runs it", row["spec"][:90], e)
            row.update(status="too large", winner=str(e))
            return row
        except WorkerDied as e:  # the winner's last timing killed the worker: nothing is stored, the run goes on
            log.warning("%s: %s; nothing stored", row["spec"][:90], e)
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

    def _measurer(self, spec: KernelSpec, family: KernelGenerator, captured: list) -> CandidateMeasurer:
        # a whole graph's own assembly is lowered from this cache: a session's cache_dir is the
        # root of the target namespaces, not this run's namespace under it
        cache_dir = self.cache.root
        if not self.isolate:
            return Measurer(spec, family, self.target, captured, self.builder, cache_dir)
        return IsolatedMeasurer(spec, family, self.target, captured, self.builder, self._worker, cache_dir)

    def _search(self, search: Search, row: dict[str, Any], progress: Any) -> dict[str, Any]:
        """Search ``search``'s space under the run's budget, take its best correct candidate
        (re-checked here if resumed), time it again near a tie, decide (store_policy.verdict)
        and store; the row of the summary."""
        spec, family, measurer = search.spec, search.family, search.measurer
        measurer.check_fits()
        evaluate = self._evaluator(search)

        def step(r):
            if progress is not None:
                progress.set_postfix_str(f"{spec.short_name} {'ok' if r['correct'] else 'x'} "
                                         f"{r['fitness']:.2f}", refresh=True)

        result = run_search(spec, family, evaluate, family.evaluations(spec, self.budget), search.previous,
                            search.journal.append, step, measurer.prepare)
        row.update(evaluated=len(result.evaluated), resumed=result.resumed)
        best = _rechecked(spec, result, evaluate)
        if best is None:
            errors: dict[str, str] = {}  # candidates failing alike, once each, with the first's details
            for r in result.evaluated:
                if r["error"]:
                    errors.setdefault(r["error"][:120], r["error"][:400])
            row.update(status="no correct candidate", winner="; ".join([errors[k] for k in sorted(errors)][:2]))
            return row
        row["max_err"] = (best["validation"] or {}).get("max_err")
        best, timings = _confirmed(best, measurer)
        record = self._record(search, best, timings, result)
        if is_whole_graph(spec):
            row.update(graph=describe_evidence(record["graph"]), graph_candidates=record["graph"])
        return self._store(search, record, best, row)

    def _evaluator(self, search: Search) -> Callable[[Config], dict[str, Any]]:
        """One candidate's evaluation as the journal keeps it."""
        def evaluate(config: Config) -> dict[str, Any]:
            ev = search.measurer.evaluate(config).to_json()
            ev.update(spec=search.key, search_id=self.search_id, family=search.family.name, time=time.time())
            if self.log is not None and (said := self.log.take(search.spec.key)):
                ev["log"] = said  # what Inductor, Triton or warnings said while its candidates were made
            return ev
        return evaluate

    def _record(self, search: Search, best: dict[str, Any], timings: dict[str, Any],
                result: SearchResult) -> dict[str, Any]:
        """The cache record of ``best``, its winner and note decided by store_policy.verdict (the
        bring-up rule: no "vendor wins" for an op the target's vendor does not run)."""
        origin = search.family.provenance(Config.from_json(best["config"]))
        record = {"format": 1, "key": search.key, "spec": search.spec.to_json(), "family": origin["generator"],
                  "config": best["config"], "validation": best["validation"], "timings": timings, **search.record,
                  "provenance": {**self._provenance(search.family.name, result), **origin}}
        winner, note = verdict(best, self.target, search.spec, self.min_speedup)
        record.update(winner=winner, note=note)
        if is_whole_graph(search.spec):  # who competed for the graph, their times, who won (graph_candidates.py)
            record["graph"] = graph_evidence(result.evaluated, winner, timings, best)
        return record

    def _store(self, search: Search, record: dict[str, Any], best: dict[str, Any],
               row: dict[str, Any]) -> dict[str, Any]:
        """Put ``record``: "vendor wins" alone, a Triton winner with its built program (on CUDA
        once its binaries for unaligned views are compiled, where the strategy has them)."""
        spec, measurer = search.spec, search.measurer
        if record["winner"] == "vendor":
            self.cache.put(record, None, replace=search.replace)
            who = "own assembly" if is_whole_graph(spec) else "vendor"
            row.update(status=f"{who} wins", winner=f"{who} (best {search.family.name} {best['fitness']:.2f}x)",
                       speedup=best["fitness"])
            return row
        pending = False
        try:
            built, _ = measurer.build(Config.from_json(best["config"]))
            if search.unaligned and self.target.triton == "cuda" and not read_program(built).aligned_only:
                # stored once its binaries for unaligned views are compiled (in the build pool, while
                # the next specs are searched): see _store_pending
                self._pending.append((self.builder.submit_unaligned(spec, built), record, built, search.replace,
                                      measurer))
                pending = True
            else:
                self.cache.put(record, built, replace=search.replace)
        finally:
            if not pending:
                measurer.builder.discard(spec)
        row.update(status="stored", winner=f"{record['family']} " + " ".join(
            f"{k}={v}" for k, v in sorted(best["config"].items())), speedup=record["timings"]["speedup"])
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

    def _timed(self, work: Work | BucketWork, progress: Any, builder: Builder | None = None) -> dict[str, Any]:
        """Fill ``work`` by its strategy (a shape bucket's in ``builder``: process_bucket), timed.
        A failure of its own is its row: its ops stay on the vendor and the run goes on."""
        bucket = isinstance(work, BucketWork)
        started = time.perf_counter()
        self.in_flight = (work.spec.describe(), started)
        if self.log is not None:
            self.log.spec(work.spec.key, work.spec.short_name)
        if progress is not None:
            progress.set_postfix_str(work.spec.short_name, refresh=True)
        try:
            row = self.process_bucket(work, builder) if bucket else self.process(work, progress)
        except (DeviceFault, UsageError):  # the CUDA context is gone; the arguments must change (exit 2)
            raise
        except Exception as e:  # one spec's failure never ends the run: its ops stay on the vendor
            if machine_error(e):  # a full disk, a permission: the machine's, exit 4 (not the spec's)
                raise
            blank = work.row() if bucket else _row(work)
            log.warning("%s: failed (%s: %s); its ops run on the vendor", blank["spec"][:90],
                        type(e).__name__, str(e)[:300])
            details.error("%s: failed", blank["spec"], exc_info=True)  # (the run log only)
            row = dict(blank, status="failed", winner=f"{type(e).__name__}: {e}"[:300])
        row["seconds"] = round(time.perf_counter() - started, 2)
        self.in_flight = None
        log.info("%s: %s in %.1fs (%d evaluated) %s", row["spec"][:90], row["status"], row["seconds"],
                 row["evaluated"], row["winner"])
        return row

    def run(self, work: list[Work], quiet: bool = False, buckets: Sequence[BucketWork] = ()) -> list[dict[str, Any]]:
        """Fill ``work`` (whole graphs first: collect.py), time the whole graphs again, then fill
        the shape ``buckets``; the summary's rows, one per spec or bucket."""
        interrupted = False
        self.add_places(work)
        try:
            return self._run(work, quiet, buckets)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            closing = time.perf_counter()
            try:  # winners found before a fault or an interrupt are kept
                self._store_pending(wait=True, check=not interrupted)
            finally:
                self.close()
                self.closing_seconds = time.perf_counter() - closing

    def start_worker(self) -> None:
        """On CUDA, start the measure worker now (the CLI does, before it traces the models): its
        imports, CUDA context and Inductor's start overlap the trace instead of the first search.
        Elsewhere it starts with the first build, as a fill that finds everything cached needs none."""
        if self._worker is not None and self.target.device == "cuda":
            self._worker.start()

    def close(self, kill: bool = False) -> None:
        """End the build pool and the measure worker (run() does; a caller of process() must);
        ``kill``: the run never began (its trace failed): no need to wait for the worker's start."""
        self.builder.close()
        if self._worker is not None and kill:
            self._worker.stop()
        elif self._worker is not None:
            self._worker.close()

    def _run(self, work: list[Work], quiet: bool, buckets: Sequence[BucketWork]) -> list[dict[str, Any]]:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        def prebuild(i: int) -> None:
            # Compile the seed candidates of the next few specs while this one is measured; not
            # all at once, or a search's later candidates would queue behind every other spec's.
            if is_whole_graph(work[i].spec):
                return  # (timed host-bound: see LOOKAHEAD)
            for w in work[i:i + LOOKAHEAD]:
                family = self.space(w.spec)
                if w.mix and self.budget <= 1:  # not searched at this budget (process)
                    continue
                if family is not None and (self.force or self.cache.lookup(w.spec.key)[0] == "miss"):
                    with self.log.about(w.spec.key, w.spec.short_name) if self.log else contextlib.nullcontext():
                        self.builder.submit(w.spec, family, family.seed_configs(w.spec)[:self.budget], ahead=True)
                    if self._worker is not None:
                        self._worker.start()

        deferred: list[Work] = []
        # specs done of all, elapsed<time left, and the spec being searched (its last candidate's verdict)
        bar = tqdm(total=len(work), desc="fill_cache", unit="spec", disable=quiet, file=sys.stderr)
        with logging_redirect_tqdm():  # log lines print above the bar, not through it
            self._loop(work, bar, prebuild, deferred)
            self.judge_regions(work)
            self.rejudge_wholes(work)
        bar.close()
        self._fill_buckets(buckets)
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

    def _fill_buckets(self, works: Sequence[BucketWork]) -> None:
        """Fill the shape buckets (deduplicated by key), after the exact shapes (whose winners
        are stored first); each under its lock, waited for, in a builder of their own. As for
        exact shapes, the quick fill (budget 1) takes each dynamic graph's buckets first and skips
        a node's or region's bucket wherever a graph's program serves its sizes (a fill stopped
        early serves the programs); a larger budget fills the nodes and regions first, the
        assembly each graph's program then competes with."""
        if not works:
            return
        self._store_pending(wait=True)
        quick = self.budget <= 1 and not self.force
        works = sorted(works, key=lambda w: not w.whole) if quick else list(works)
        programs: dict[str, list[tuple[int, int]]] = {}  # graph -> the sizes its stored programs serve
        builder = Builder(self.target)
        seen: set[str] = set()
        try:
            for w in works:
                if w.key in seen:
                    continue
                seen.add(w.key)
                if quick and not w.whole and w.places and all(
                        _covered(span, programs.get(g, ())) for g, span in w.places):
                    self.rows.append(dict(w.row(), status=IN_WHOLE))
                    continue
                with self.cache.lock(w.key):
                    self.rows.append(self._timed(w, None, builder))
                if w.whole and self.cache.lookup(w.key)[0] == "hit":
                    programs.setdefault(w.places[0][0], []).append(w.places[0][1])
        finally:
            builder.close()

    def judge_regions(self, work: list[Work]) -> None:
        """A fused region serving tries before the stretches it overlaps is timed in the graph where
        both serve against the parts it keeps from their own winners, and set aside where it does
        not make that graph faster (region_judgment.py). Before the whole graphs are timed again:
        their assemblies run what this decides."""
        if not any(w.judged_in is not None for w in work):
            return
        self._store_pending(wait=True)
        judge_regions(work, self.cache, lambda unit: self._measurer(unit, WHOLE_GRAPH_DOMAIN, []), self.rows)

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
        best = {"measured": True, "fitness": assembly_ms / program_ms if program_ms > 0 else 0.0,
                "config": entry.config}
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


def _covered(span: tuple[int, int], ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether the sizes ``span`` (lo, hi) all lie in the union of ``ranges``."""
    at = span[0]
    for lo, hi in sorted(ranges):
        if lo <= at <= hi:
            at = hi + 1
    return at > span[1]


def _confirmed(best: dict[str, Any], measurer: CandidateMeasurer) -> tuple[dict[str, Any], dict[str, Any]]:
    """``best`` and the timings its entry keeps; near a tie (store_policy.needs_confirmation) the
    winner and the vendor kernel are timed again, alternately, and those times decide."""
    timings = {"candidate_ms": best["candidate_ms"], "vendor_ms": best["vendor_ms"],
               "speedup": best["fitness"] if best["measured"] else None, "measured": best["measured"]}
    if needs_confirmation(best):
        confirmed = measurer.confirm(Config.from_json(best["config"]))
        if confirmed is not None:
            vendor_ms, cand_ms = confirmed
            best = dict(best, fitness=vendor_ms / cand_ms if cand_ms > 0 else 0.0)
            timings.update(search_speedup=timings["speedup"], candidate_ms=cand_ms, vendor_ms=vendor_ms,
                           speedup=best["fitness"], confirmed=True)
    return best, timings


def _winner_text(entry: CacheEntry | None) -> str:
    if entry is None:
        return ""
    if entry.winner == "vendor":
        return "vendor"
    return f"{entry.family} " + " ".join(f"{k}={v}" for k, v in sorted((entry.config or {}).items()))
