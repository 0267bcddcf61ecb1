"""Lower one ATen graph: plan it, report the plan, and return its executable.

``lower`` is also the public entry for code that already holds an ATen FX graph (the repro
scripts use it): it runs kernelize's own lowering without Dynamo or Inductor.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from torch_kernelize import flush_repros
from torch_kernelize.core.buckets import PREFIX_LEN, metas_at, pow2_bucket, spec_at
from torch_kernelize.core.errors import MissingOpsError, TargetError
from torch_kernelize.fallbacks import HostFallback
from torch_kernelize.serving.bucket_call import BucketCall, SizedCall, readable
from torch_kernelize.serving.bucket_warm import warm_bucket
from torch_kernelize.serving.flat_code import flat_function
from torch_kernelize.serving.launch import deferred_checks
from torch_kernelize.kernel_cache.entry import CacheEntry
from torch_kernelize.kernel_cache.interfaces import Lookups
from torch_kernelize.kernel_cache.store import KernelCache, LookupLog
from torch_kernelize.compiling import folded_capture
from torch_kernelize.compiling.bucket_lookup import GraphBuckets, bucket_runner
from torch_kernelize.compiling.graphed_lookups import GraphedLookups
from torch_kernelize.compiling.set_aside import SetAside
from torch_kernelize.compiling.decompositions import host_implementation
from torch_kernelize.compiling.op_classes import NodeClass
from torch_kernelize.compiling.shape_classes import (bindings_at, bucket_symbols, node_symbols, node_tensors,
                                                     region_symbols, region_tensors, shape_classes, variable_sizes)
from torch_kernelize.compiling.glu_regions import find_glu_regions, halve_products
from torch_kernelize.compiling.graph_regions import find_graph_regions
from torch_kernelize.compiling.whole_graph import WHOLE, dynamic_wholes, step_tier_ops, whole_graph_regions
from torch_kernelize.compiling.minify import minify, retrace, tensor_outputs
from torch_kernelize.compiling.regions import Region, find_regions, group_matmuls, region_spec
from torch_kernelize.core.targets import Target, get_target
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.core.options import Options, default_cache_dir
from torch_kernelize.core.program_steps import refused_ops
from torch_kernelize.core.sized_programs import SIZES, Resizer, SizeSource
from torch_kernelize.compiling.planner import GraphPlan, decide_regions, downgrade, plan_graph, resolve_family
from torch_kernelize.core.decision import Decision
from torch_kernelize.compiling.reinplace import reinplace_accumulations
from torch_kernelize.compiling.narrow_sorts import narrow_sorts
from torch_kernelize.compiling.stable_sorts import stable_sorts
from torch_kernelize.serving.view_folding import fold_view_chains
from torch_kernelize.compiling.report import GraphReport, Planning, ReportWriter, fill_command
from torch_kernelize.serving.runtime import (CapturingInterpreter, CheckedTritonCall, KernelState, Specialization,
                                     TritonCall, ValueCapture, bind_graph)
from torch_kernelize.core.shapes import SymbolBinder, concrete_meta, meta_of_size
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.validate import compare

log = logging.getLogger("torch_kernelize")
_graph_ids = itertools.count()
STRICT_WAIT_S = 60.0  # the most strict mode waits for the repros its MissingOpsError names


class Session:
    """What the graphs of one torch.compile call share: options, target, cache, repro writer."""

    # (cache namespace dir, spec key, entry identity) -> loaded runner, per process: an entry
    # replaced on disk (refill, --force, quarantine, import --replace) has another identity, so the
    # next compile loads it instead of launching the old kernel
    _runners: dict[tuple[str, ...], Any] = {}
    _loaded: dict[tuple[str, str], str] = {}  # (cache namespace dir, key) -> identity loaded last
    _states: dict[tuple[str, str], KernelState] = {}  # (cache namespace dir, spec key) -> health, per process
    _runner_lock = threading.Lock()

    def __init__(self, options: Options, target: Target | None = None, private_kernel_states: bool = False):
        self.options = options
        self._target = target
        self._cache = None
        self._repros = None
        self._made = threading.Lock()  # the cache and repro writer are made once, by one thread
        # The minifier re-runs a disabled kernel on purpose: it gets its own, fresh states.
        self._kernel_states = {} if private_kernel_states else self._states
        # fill_cache's trace of a model: whole graphs and stretches are looked up but their
        # programs not taken, so every spec below them is seen (planner.decide_regions)
        self.survey = False
        self.set_aside: frozenset[str] = frozenset()  # keys taken as "vendor wins" (fill_cache's: set_aside.py)

    def kernel_state(self, key: str) -> KernelState:
        k = (str(self.cache.dir), key)
        with self._runner_lock:
            return self._kernel_states.setdefault(k, KernelState(key))

    def target_for(self, example_inputs: Sequence[Any]) -> Target:
        if self._target is None:
            device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
            self._target = get_target(self.options.target, device)
            if self._target.device == "cuda" and not torch.cuda.is_available():
                raise TargetError(f"target {self._target.name!r} needs CUDA, which this machine does not have; "
                                  "use target='interpreter' or 'cpu', or a target file with device = 'cpu'")
        return self._target

    @property
    def cache(self) -> KernelCache | None:
        """The target's kernel cache (None: the target has no Triton backend, or is not known yet)."""
        if self._cache is None and self._target is not None and self._target.has_triton:
            with self._made:
                if self._cache is None:
                    cache = KernelCache.for_target(self.options.cache_dir, self._target)
                    cache.warn_if_unusable()
                    self._cache = cache
        return self._cache

    @property
    def repros(self):
        if self._repros is None and self.options.repro_dir is not None:
            from torch_kernelize.serving.repro_writer import ReproWriter
            with self._made:
                if self._repros is None:
                    self._repros = ReproWriter(self.options.repro_dir, self.options)
        return self._repros

    def load_runner(self, spec: KernelSpec, entry: CacheEntry):
        """The launcher of a cache hit, loaded once per process; None (with a warning) if it fails."""
        from torch_kernelize.serving.launch import load_program
        cache = self.cache
        bucketed = "bucket" in entry.record  # a shape bucket's entry (bucket_lookup.py), loaded once
        where = (str(cache.dir), entry.key if bucketed else spec.key)
        k = (*where, entry.identity)
        with self._runner_lock:
            if self._loaded.get(where, k[2]) != k[2]:  # replaced since: its runners and health go
                for old in [o for o in self._runners if o[:2] == where]:
                    del self._runners[old]
                self._kernel_states.pop(where, None)  # (graphs compiled before keep theirs)
            self._loaded[where] = k[2]
            if k in self._runners:
                runner = self._runners[k]
                return runner if not bucketed or runner is None else self._sized(spec, entry, runner)
            try:
                runner = load_program(entry.program_dir, entry.spec if bucketed else spec, self._target.triton)
                refused = refused_ops(runner.program.steps, self._target)
                if refused:  # a bring-up chip: the program's vendor calls do not run there
                    raise ValueError(f"its program calls {', '.join(refused)}, which target "
                                     f"{self._target.name!r} does not run")
            except Exception as e:
                log.warning("cache entry %s (%s) could not be loaded and is skipped: %s: %s",
                            spec.key, entry.path, type(e).__name__, e)
                runner = None
            self._runners[k] = runner
            return runner if not bucketed or runner is None else self._sized(spec, entry, runner)

    def _sized(self, spec: KernelSpec, entry: CacheEntry, base: Any):
        """A bucket's runner for the sizes of ``spec`` (memoized per spec; caller holds the lock)."""
        k = (str(self.cache.dir), entry.key, entry.identity, spec.key)
        if k not in self._runners:
            bucket = entry.bucket
            self._runners[k] = bucket_runner(spec, bucket.dims, base, bucket.scale) if spec != entry.spec else base
        return self._runners[k]

    def runner_failed(self, key: str) -> bool:
        """Whether this process tried to load the kernel of ``key`` and could not."""
        cache = self.cache
        if cache is None:
            return False
        where = (str(cache.dir), key)
        return self._runners.get((*where, self._loaded.get(where, "")), True) is None


class LoweredGraph:
    """The executable of one ATen graph; called with one list of arguments (aot_autograd's boxed
    convention; backend.py marks its wrapper as such)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], session: Session, kind: str,
                 name: str | None = None, whole: bool = True):
        """``whole``: look the whole graph up first (whole_graph.py); off where fill_cache measures
        the graph as assembled from its nodes and regions."""
        self.session = session
        self.target = session.target_for(example_inputs)
        self.kind = kind
        self.name = name or f"{kind}_{next(_graph_ids)}"
        # Plan a copy: the graph we were given stays intact (a failing one is minified from it).
        # The copy is only read (its code is generated if the minifier runs it): a lazy module
        # skips the Python codegen of each recompile (~10 ms a pass for a graph of 300 nodes).
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        stable_sorts(graph)  # one order of equal keys, whoever sorts (stable_sorts.py)
        narrow_sorts(graph)  # index keys sorted on the narrowest type (narrow_sorts.py)
        halve_products(graph)  # an MoE's gate and up as slices, one tensor each (glu_regions.py)
        self.plan: GraphPlan = plan_graph(_LazyGraphModule(gm, graph), self.target)
        self.binder = SymbolBinder(self.plan.gm)
        self.regions: list[Region] = []
        self._dynamic_wholes: list = []  # the graph whole over each of its sizes (whole_graph.DynamicWhole)
        if self.target.has_triton:
            regions = find_regions(self.plan.gm, self.target)
            # the largest first: a hit covers what it holds, a miss (or "vendor wins") leaves it
            # to the regions inside, then to the nodes. GEMM groups, then a compiler's fusion
            # groups (which hold the matmul regions' epilogues), then the regions of our family.
            self.regions = (group_matmuls(self.plan.gm, regions, self.target)
                            + find_graph_regions(self.plan.gm, regions) + regions)
            if self.binder.is_static:  # the whole graph (or its stretches) first: a hit runs its winner's program
                wholes = whole_graph_regions(self.plan.gm)[0]
                # without the whole graph itself (its own assembly, timed against its program) its
                # stretches still run their winners: the mix, or those around ops no program calls
                self.regions[:0] = [r for r in wholes if whole or r.stretch]
            elif whole:  # a dynamic graph whole over one of its sizes: its buckets (bucket_lookup.py)
                self._dynamic_wholes = dynamic_wholes(self.plan.gm, self.binder.symbols)
                self.regions[:0] = list({id(w.region): w.region for w in self._dynamic_wholes}.values())
            # an MoE's gated experts after the whole graph (its program was timed against the assembly
            # with them) and before the stretches, whose programs store the product the region's
            # kernel never does (glu_regions.py; fill_cache judges it in its unit: region_judgment.py)
            at = next((i for i, r in enumerate(self.regions) if r.kind != WHOLE or r.stretch), len(self.regions))
            self.regions[at:at] = find_glu_regions(self.plan.gm)
        self._region_of: dict[str, Region] = {}
        self._region_at: dict[str, Region] = {}  # a region decision's node -> its region (one per region)
        self.wholes: list[Decision] = []  # the lookups of the whole graph or its stretches (whole_graph.py)
        self._specializations: dict[tuple, Specialization] = {}
        self._lock = threading.Lock()
        self._buckets = None  # a dynamic graph's shape buckets, made when it is first planned
        self._classes = None  # its shape classes (shape_classes.py), made then too
        self._by_class: dict[tuple, Specialization] = {}  # a class -> the specialization serving all of it
        self.planning = Planning()
        first = self._specialize(self.binder.key(list(example_inputs)))
        if self._classes is not None:
            self._plan_whole_buckets(first.key)
        self._publish(first, self._signature(first.key))
        self._static = first if self.binder.is_static else None
        self._check = session.options.check

    @classmethod
    def from_bound(cls, session: Session, example_inputs: Sequence[Any], kind: str,
                   bind: Callable[["LoweredGraph"], Specialization], signature: str,
                   mutated_inputs: list[int]) -> "LoweredGraph":
        """The executable of a static graph whose bound form is already known (the executable
        cache rebuilt it): no plan, and nothing to specialise again. ``bind`` makes the
        Specialization; it gets the new object to make its kernel calls (``triton_call``)."""
        self = cls.__new__(cls)
        self.session = session
        self.target = session.target_for(example_inputs)
        self.kind = kind
        self.name = f"{kind}_{next(_graph_ids)}"
        self.plan = self.binder = None
        self.regions, self._region_of, self._region_at, self._lock, self._buckets = [], {}, {}, threading.Lock(), None
        self.wholes = []
        self.planning = Planning()
        self._mutated_inputs = mutated_inputs
        self._check = False
        first = bind(self)
        self._specializations = {first.key: first}
        self._publish(first, signature)
        self._static = first
        return self

    def _publish(self, first: Specialization, signature: str) -> None:
        """The report of the first specialisation: to the log, and to the report file if asked."""
        options = self.session.options
        target = self.target.describe()
        hint = fill_command(target, options.repro_dir,
                            options.cache_dir if Path(options.cache_dir) != default_cache_dir() else None)
        dynamic = self.binder is not None and not self.binder.is_static
        self.report = GraphReport(self.name, self.kind, target, signature, first.decisions, first.regions, hint,
                                  self.planning if dynamic else None)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", self.report.table())
        if self.session.options.report is not None:
            ReportWriter.for_path(self.session.options.report).add(self.report)

    @property
    def mutated_inputs(self) -> list[int]:
        """Positions of the graph's inputs that it writes to (CUDA graphs copy them back)."""
        if self.plan is None:
            return self._mutated_inputs
        from torch_kernelize.serving.cudagraphs import mutated_inputs
        return mutated_inputs(self.plan.gm)

    def specializations(self) -> dict[tuple, Specialization]:
        """Every shape signature planned so far (its size symbols' values) and its bound
        executable; the signatures of one shape class share one (shape_classes.py)."""
        with self._lock:
            return dict(self._specializations)

    def region_of(self, spec_key: str) -> Region | None:
        """The fused region (or whole graph) that the latest lookup of ``spec_key`` was made for;
        identical regions (a model's layers) share a key. None: no region was looked up under it."""
        return self._region_of.get(spec_key)

    def static_specialization(self) -> Specialization | None:
        """The one bound executable of a graph of static shapes (None for a dynamic one)."""
        return self._static

    # --- calling --------------------------------------------------------------------------------
    # check mode: each thread's call being checked (for the minifier)
    _checked_calls = threading.local()

    @property
    def _current_args(self) -> list | None:
        call = getattr(self._checked_calls, "call", None)
        return call[1] if call is not None and call[0] is self else None

    def __call__(self, args: list) -> Any:
        if self.target.device == "cuda":  # kernels' range checks: one read after the call
            return deferred_checks(self._call, args)
        return self._call(args)

    def _call(self, args: list) -> Any:
        if self._check:
            calls = self._checked_calls
            outer = getattr(calls, "call", None)
            calls.call = (self, list(args))
            try:
                return self._dispatch(args)
            finally:
                calls.call = outer
        return self._dispatch(args)

    def _dispatch(self, args: list) -> Any:
        if self._static is not None:
            return self._static(args)
        return self.specialization(args)(args)

    def specialization(self, args: list) -> Specialization:
        """The bound executable for ``args``' sizes (made now if new): what CUDA graphs split."""
        if self._static is not None:
            return self._static
        spec = self._specializations.get(self.binder.call_key(args))
        if spec is None:
            spec = self._specialize(self.binder.key(args))
        return spec

    def _plan_whole_buckets(self, key: tuple) -> None:
        """Plan a signature of each class in each whole-graph bucket of this graph, at the other
        sizes of ``key`` (the one compiled for): a new size in a filled bucket then finds its class
        planned, and its first call plans nothing and generates no code (issue 41: a new length's
        first call within 1 ms of a repeat). Buckets filled for other sizes (another batch) are
        planned when met."""
        values = dict(zip(self.binder.symbols, key))
        for symbol, lo, hi, others in self._classes.whole_buckets:
            if symbol not in values or any(values.get(s) != v for s, v in others.items()):
                continue
            for start in self._classes.starts(symbol, lo, hi):  # (an exact entry inside isolates its size)
                ahead = tuple(start if s == symbol else values[s] for s in self.binder.symbols)
                if self._classes.of(ahead) not in self._by_class:
                    self._specialize(ahead)

    def forward(self, *args: Any) -> Any:
        """Unboxed call, for code that holds the inputs as positional arguments."""
        return self(list(args))

    # --- specialization -------------------------------------------------------------------------
    def _signature(self, key: tuple) -> str:
        return ", ".join(f"{s}={v}" for s, v in zip(self.binder.symbols, key))

    def _specialize(self, key: tuple) -> Specialization:
        """The graph bound for the sizes ``key``: the planner's steps, in order."""
        with self._lock:
            known = self._known(key)
            if known is not None:
                return known
            self.planning.planned += 1
            bindings = self.binder.bindings(key)
            lookups = self._lookups(bindings)
            decisions, runners, calls = self._decide_nodes(bindings, lookups)
            fused, region_decisions = self._decide_regions(bindings, decisions, lookups, calls)
            decisions = [resolve_family(d) for d in decisions]  # misses' families only now: fused nodes are no misses
            pending, verdicts = self._record_misses(decisions + region_decisions, key)
            gm = self._bind(decisions, runners, calls, fused)
            spec = Specialization(gm, decisions, key, self._first_call_hook(gm, decisions, pending),
                                  flat_function(gm, guarded_inputs=self.kind != "backward"))
            spec.regions = region_decisions
            spec.lookups = lookups.witnesses if lookups is not None else {}
            self._specializations[key] = spec
            if not self.binder.is_static:
                self._share(spec, decisions, region_decisions, {n: r for n, (_, r) in calls.items()}, verdicts)
            if len(self._specializations) > 1:
                log.info("%s: new shape signature %s: %d on triton, %d misses", self.name, self._signature(key),
                         sum(d.tier == "triton" for d in decisions), sum(d.miss for d in decisions))
            return spec

    def _known(self, key: tuple) -> Specialization | None:
        """The specialization already serving ``key``: its own, or its shape class's (planned at
        another signature of the class; its misses are counted once per bucket here)."""
        if key in self._specializations:
            return self._specializations[key]
        shared = self._by_class.get(self._classes.of(key)) if self._classes is not None else None
        if shared is None:
            return None
        self._specializations[key] = shared
        self.planning.shared += 1
        if shared.miss_symbols:
            changed = {s for s, a, b in zip(self.binder.symbols, key, shared.key) if a != b}
            for symbols, verdict in shared.miss_symbols:
                self.session.repros.count_unplanned(verdict, bool(symbols & changed))
        return shared

    def _lookups(self, bindings: dict) -> Lookups | None:
        """The cache as the planner looks it up, every lookup kept with its witness (the
        executable cache stores them); a dynamic graph's through its shape buckets, at the sizes
        ``bindings`` give; under CUDA graphs, a node that syncs by its GRAPHED key first
        (graphed_lookups.py). None without a cache."""
        cache = self.session.cache
        if cache is None:
            return None
        lookups = LookupLog(cache)
        if not self.binder.is_static:  # shape buckets: bucket_lookup.py
            if self._buckets is None:
                self._buckets = GraphBuckets(cache, self.session.load_runner, self._dynamic_wholes)
            lookups = self._buckets.lookups(lookups, bindings)
        if self.session.options.cudagraphs:  # a node that syncs: its race as a captured graph serves it
            lookups = GraphedLookups(lookups, torch.device(self.target.device))
        if self.session.set_aside:
            lookups = SetAside(lookups, self.session.set_aside)
        return lookups

    def _decide_nodes(self, bindings: dict, lookups: Lookups | None) -> tuple[list[Decision], dict, dict]:
        """The planner's node rung: each node's decision, the runner of each kernel hit (a hit
        whose entry does not load is downgraded), and the bucket calls of dynamic hits."""
        decisions = self.plan.decide(bindings, lookups, resolve=False)
        runners, calls = {}, {}  # node -> runner; node (or region) -> its bucket's call and its sizes' ranges
        for i, d in enumerate(decisions):
            if d.tier != "triton":
                continue
            call = self._bucket_call(d) if self._buckets is not None else None
            if call is not None:
                calls[d.node] = call
                continue
            runner = self.session.load_runner(d.spec, d.entry)
            if runner is None:
                decisions[i] = downgrade(d, "the cache entry could not be loaded", self.target)
            else:
                runners[d.node] = runner
        return decisions, runners, calls

    def _record_misses(self, decisions: list[Decision], key: tuple) -> tuple[list[Decision], dict]:
        """Check each miss against the reproducer folder: (the misses recorded now, whose first
        call captures their inputs; each checked miss's verdict by its decision's node)."""
        repros, pending, verdicts = self.session.repros, [], {}
        for d in decisions:
            if repros is not None and (d.miss or d.missing) and d.spec is not None:
                verdict = verdicts[d.node] = repros.check(d.spec, self._record_key(d, key))
                if verdict in ("new", "duplicate"):  # (a capped one has no folder to point to)
                    d.repro = str(repros.folder_for(d.spec))
                if verdict == "new":
                    pending.append(d)
        return pending, verdicts

    def _bind(self, decisions: list[Decision], runners: dict, calls: dict, fused: list) -> fx.GraphModule:
        """The graph with each node bound to what runs it: a kernel call, a bucket's call, the
        vendor op, a host fallback; fused regions in place of their nodes."""
        # inference graphs (grad is off): views need no autograd bookkeeping, and no buffer is
        # saved for a backward pass
        passes = (fold_view_chains, reinplace_accumulations) if self.kind == "inference" else ()
        return bind_graph(self.plan.gm, decisions,
                          lambda d: calls[d.node][0] if d.node in calls else
                          self.triton_call(d.spec, runners[d.node], d.entry.key if d.entry else None),
                          lambda d, op: HostFallback(host_implementation(op), d.op, self.target.name, d.repro,
                                                       [m.stride for m in d.spec.outputs] if d.spec else None),
                          fused, passes, guarded_inputs=self.kind != "backward")

    def _first_call_hook(self, gm: fx.GraphModule, decisions: list[Decision],
                         pending: list[Decision]) -> Callable | None:
        """What the first call runs through, where it captures reproducers' inputs or strict mode
        must name the ops left missing; None otherwise. The capturing code is generated here, when
        the graph is bound, not in the call."""
        missing: dict[str, str | None] = {}  # op -> a folder that names it (strict mode's error)
        for d in decisions:
            if d.missing and missing.get(d.op) is None:
                missing[d.op] = d.repro
        strict = self.session.options.strict and missing
        if not (pending or strict):
            return None
        capture = self._capture_code(gm, pending) if pending else None
        return lambda s, args: self._first_call(s, args, pending, missing if strict else None, capture)

    def _capture_code(self, gm: fx.GraphModule, pending: list[Decision]) -> tuple:
        """The bound graph's generated code that also copies the pending misses' inputs (on their
        device), the capture it fills, and how the region inputs view folding removed from the
        bound graph are recovered: replayed from their roots' copies (folded_capture.py), or
        else (``folded``) computed by the planned graph in _capture."""
        regions = [self._region_of[d.spec_key] for d in pending if d.op == "region"]
        wanted = {n.name for r in regions for n in r.inputs}
        bound = {n.name for n in gm.graph.nodes}
        folded = wanted - bound
        replay = folded_capture.plan(self.plan.gm, folded, bound) if folded else None
        if replay is not None and replay.roots <= bound:
            values_of, folded = (wanted - replay.names) | replay.copied_roots(set(self.mutated_inputs)), set()
        else:
            values_of, replay = wanted - folded, None
        capture = ValueCapture({d.node for d in pending if d.op != "region"}, values_of, on_device=True)
        forward = flat_function(gm, guarded_inputs=self.kind != "backward", capture=capture)
        if forward == gm.forward:  # (code not generated for this graph: FX's interpreter captures)
            interp = CapturingInterpreter(gm, capture.inputs_of, capture.values_of, on_device=True)
            forward, capture = interp.run, interp.capture
        return forward, capture, folded, replay

    def _bucket_call(self, d: Decision, tensors: dict[str, list] | None = None,
                     respec: Callable[[tuple[int, ...]], KernelSpec | None] | None = None,
                     outputs_at: Callable[[tuple[int, ...]], tuple | None] | None = None,
                     symbol: Any = None,
                     inputs_at: Callable[[tuple[int, ...]], tuple | None] | None = None
                     ) -> tuple[BucketCall, dict] | None:
        """A bucket hit's kernel as a call that serves any size of the bucket, and the range of
        each symbol it varies in; None for an exact hit, or a bucket whose sizes cannot all be
        read off the node's inputs (then the kernel of the node's sizes is bound). ``tensors``:
        a region's traced values by bucket side (a node's are read off it); ``respec(values)``:
        the region's own spec at those sizes (its vendor path: sizes inside its graph, a view's
        shape, are the size's, not the representative's), None where it cannot say;
        ``outputs_at(values)``: its outputs' metas there (a dim of another size of the bucket's,
        a token count, is no bucket dim), None where they are the bucket dims' alone; ``symbol``:
        a whole graph's varying symbol, what its bucket's one variable is (its dims may hold a
        multiple of it: whole_graph.DynamicWhole); ``inputs_at(values)``: its inputs' metas
        there, as ``outputs_at``'s."""
        entry = d.entry
        bucket = entry.bucket if entry is not None else None
        if bucket is None or not readable(bucket.dims):
            return None
        if tensors is None:
            inputs, outputs = node_tensors(self._nodes[d.node])
            tensors = {"in": inputs, "out": outputs}
        varied = {symbol: bucket.ranges[0]} if symbol is not None else bucket_symbols(tensors, bucket.dims,
                                                                                       bucket.ranges)
        base = self.session.load_runner(entry.spec, entry) if varied is not None else None
        if base is None:
            return None
        resize = Resizer(base.program)

        def make(values: tuple[int, ...]) -> TritonCall:
            """A new size's call: its launch plan from the loaded runner (no code generated, no spec
            made or hashed until something reads it)."""
            metas = (outputs_at(values) if outputs_at is not None else None) or metas_at(entry.spec, bucket.dims, values)
            runner = base.resized(resize(values), metas)
            name = f"triton_{entry.spec.short_name}_bucket_{entry.key[:8]}_{'x'.join(map(str, values))}"
            def spec() -> KernelSpec:
                return (respec(values) if respec is not None else None) or spec_at(entry.spec, bucket.dims, values)
            if self.session.options.check:  # (a checked call runs the vendor op every time: it needs its spec)
                return self.triton_call(spec(), runner, entry.key, name)
            return SizedCall(spec, runner, self.session.kernel_state(entry.key), self._on_kernel_failure, name)
        call = BucketCall(d.spec, bucket.dims, self.session.kernel_state(entry.key), make, bucket.scale)
        if not self.session.options.check:  # (a checked call needs each size's spec)
            outputs = (getattr(outputs_at, "symbolic", None) if outputs_at is not None
                       else metas_at(entry.spec, bucket.dims, SIZES))
            call.generic, why = _bucket_direct(base, resize, outputs, call)
            if why is not None:
                self.planning.per_size[why] += 1
        if base.program.steps and self.session.options.bucket_warm_ms and len(bucket.ranges) == 1:
            _warm_steps(call.__name__, entry, resize, tensors, inputs_at, outputs_at,
                        self.session.options.bucket_warm_ms)
        return call, varied

    def _share(self, spec: Specialization, decisions: list[Decision], regions: list[Decision],
               bucket_ranges: dict[str, dict], verdicts: dict[str, str]) -> None:
        """Let ``spec`` serve every signature of its shape class where each kernel it binds is
        valid over the whole class (shape_classes.py): an exact kernel's and a host fallback's
        symbols at one value, a bucket kernel's inside its bucket."""
        if self._classes is None:
            nodes = [(f.node, f.op) for f in self.plan.facts if f.klass is NodeClass.COMPUTE]
            entries = self._buckets.entries() if self._buckets is not None else ()  # (no cache: no cuts)
            self._classes = shape_classes(self.binder.symbols, nodes, self.regions, entries,
                                          record_buckets=self.session.repros is not None,
                                          wholes=self._dynamic_wholes, bindings=self.binder.bindings(spec.key))
            self.planning.pinned = self._classes.pinned_by
        single: set = set()
        ranges: dict = {}
        covered = set()
        bound: list[tuple[str, set, dict]] = []  # each kernel bound: what it serves, its symbols, the ranges it varies in
        for d in regions:
            if d.tier == "triton":
                # (by its node: identical regions of a model's layers share one spec key)
                region = self._region_at[d.node]
                bound.append((f"region at {d.node}", region_symbols(region), bucket_ranges.get(d.node, {})))
                covered |= region.names
        for d in decisions:
            if d.node not in covered and d.tier in ("triton", "fallback"):
                bound.append((f"{d.op} at {d.node} ({d.tier})", node_symbols(self._nodes[d.node]),
                              bucket_ranges.get(d.node, {})))
        for _, symbols, varied in bound:  # (a bucket's kernel depends on its symbols through its varied sizes)
            single |= symbols - {x for size in varied for x in size.free_symbols}
            for s, (lo, hi) in varied.items():
                was = ranges.get(s, (lo, hi))
                ranges[s] = (max(lo, was[0]), min(hi, was[1]))
        refused = self._classes.refusal(spec.key, single, ranges)
        if refused is not None:
            self._count_unshared(spec.key, *refused, bound, one_value=refused[0] in single)
            return
        spec.miss_symbols = [(frozenset(region_symbols(self._region_at[d.node]) if d.op == "region"
                                        else node_symbols(self._nodes[d.node])), verdicts[d.node])
                             for d in decisions + regions if d.node in verdicts]
        self._by_class.setdefault(self._classes.of(spec.key), spec)

    def _count_unshared(self, key: tuple, size: Any, why: str, bound: list[tuple[str, set, dict]],
                        one_value: bool) -> None:
        """Count (and log once) why a planned signature serves only itself: the size its class
        spans and the first kernel bound that needs it one value (``one_value``) or inside a bucket."""
        def culprit(symbols: set, varied: dict) -> bool:
            return size in symbols and not any(size in v.free_symbols for v in varied) if one_value else size in varied
        by = next((name for name, symbols, varied in bound if culprit(symbols, varied)), None)
        reason = f"{why} ({by})" if by else why
        if reason not in self.planning.unshared:
            log.info("%s: signature %s serves itself alone: %s", self.name, self._signature(key), reason)
        self.planning.unshared[reason] += 1

    @functools.cached_property
    def _nodes(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.plan.gm.graph.nodes}

    def _record_key(self, d: Decision, key: tuple) -> str | None:
        """The key a miss of a dynamic graph is recorded once under per process: its node's (or
        region's) with every size symbol's default shape bucket (buckets.pow2_bucket), so the
        shapes of one bucket leave one reproducer. None (a static graph): its spec's."""
        if self.binder is None or self.binder.is_static:
            return None
        ranges = [pow2_bucket(v) if isinstance(v, int) and v >= 1 else v for v in key]
        return f"{self.name}:{d.node}:{ranges}"

    def _whole_symbol(self, region: Region, bindings: dict, d: Decision) -> Any:
        """The varying symbol of the dynamic whole (``region`` over one size) whose bucket ``d``
        hit; None where the hit is no such bucket's (an exact entry, a fused region)."""
        bucket = d.entry.bucket if d.entry is not None else None
        if bucket is None or not bucket.probes or self._buckets is None:
            return None
        return next((w.symbol for w in self._dynamic_wholes if w.region is region
                     and self._buckets.whole_prefix(w, bindings) == d.entry.key[:PREFIX_LEN]), None)

    def _decide_regions(self, bindings, decisions: list[Decision], cache: Lookups | None, calls: dict[str, tuple]):
        """The planner's region rung (``decide_regions``), each hit bound as a kernel call (a
        bucket's, in ``calls`` by the decision's node, where it serves the region's whole bucket)."""
        fused, region_decisions = [], []
        if cache is None:
            return fused, region_decisions
        for region, d, runner in decide_regions(self.regions, bindings, decisions, cache, self.target,
                                                self.session.load_runner, take_wholes=not self.session.survey):
            self._region_of[d.spec_key] = self._region_at[d.node] = region
            if region.kind == WHOLE:
                # (fill_cache collects them from here, entry or not; the latest lookup of each place)
                # (a whole graph and its first stretch start at one node: a lookup is its node and key)
                self.wholes = [w for w in self.wholes if (w.node, w.spec_key) != (d.node, d.spec_key)] + [d]
                if runner is not None:
                    _vendor_step_tiers(decisions, region, runner.program)
                elif d.entry is None:
                    continue  # no entry: the graph runs as it always did, and the report says nothing of it
            if runner is not None:
                symbol = self._whole_symbol(region, bindings, d)
                inputs_at, outputs_at = ((_region_metas_at(region, bindings, d, symbol, "in"),
                                          _region_metas_at(region, bindings, d, symbol, "out"))
                                         if region.kind == WHOLE else (None, None))
                call = self._bucket_call(d, region_tensors(region), _region_spec_at(region, bindings, d, symbol),
                                         outputs_at, symbol, inputs_at) if self._buckets is not None else None
                if call is not None:
                    calls[d.node] = call
                fused.append((region, call[0] if call is not None else self.triton_call(d.spec, runner)))
            region_decisions.append(d)
        return fused, region_decisions

    def _first_call(self, spec: Specialization, args: list, pending: list[Decision],
                    strict_missing: dict[str, str | None] | None, capture: tuple | None) -> Any:
        """Run once through code that captures the inputs of the repros this process still
        records (claimed now: another graph, or the cap, may have taken them since)."""
        repros = self.session.repros
        pending = [d for d in pending if repros.claim(d.spec, self._record_key(d, spec.key))]
        out = self._capture(spec, args, pending, capture) if pending else spec._forward(*args)
        if strict_missing:
            flush_repros(STRICT_WAIT_S)  # the error names the repro folders: they are there when it is raised
            error = MissingOpsError(self.target.name, strict_missing, self.report.fill_hint)

            def refuse(*_: Any) -> Any:
                raise error
            spec._forward = refuse
            raise error
        return out

    def _capture(self, spec: Specialization, args: list, pending: list[Decision], capture: tuple) -> Any:
        """Run the call through the capturing code (_capture_code), and hand the pending misses'
        inputs to the repro writer."""
        forward, taken, folded, replay = capture
        values: dict[str, torch.Tensor] = {}
        if folded:
            # Region inputs that view folding removed from the bound graph are computed by the
            # planned graph (ATen ops), before the call writes any input (those it writes run on copies).
            written = set(self.mutated_inputs)
            planned = CapturingInterpreter(self.plan.gm, set(), folded, on_device=True)
            planned.run(*[a.clone() if i in written else a for i, a in enumerate(args)])
            values = planned.values
        out = forward(*args)
        values = {**values, **taken.values}
        if replay is not None:
            try:
                values.update(replay.run(args, values))
            except Exception as e:  # (a chain its roots' copies do not take: those repros are not recorded)
                log.debug("could not replay folded region inputs from their roots: %s", e)
        repros = self.session.repros
        for d in pending:
            inputs = None
            if d.op == "region":
                inputs = [values.get(n.name) for n in self._region_of[d.spec_key].inputs]
                inputs = inputs if all(t is not None for t in inputs) else None
            elif d.node in taken.captured:
                inputs = taken.captured[d.node]
            if inputs is None:  # not captured here: a graph that computes it may record it
                repros.release(d.spec, self._record_key(d, spec.key))
            else:
                repros.write(d, inputs, self.target, kind="missing" if d.missing else "miss",
                             bucket_dims=self._buckets.miss_dims.get(d.spec_key) if self._buckets else None)
        return out

    def triton_call(self, spec: KernelSpec, runner: Callable, entry_key: str | None = None,
                    name: str | None = None) -> TritonCall:
        """The call of a loaded kernel in this graph (a checked one in check mode). Its health is
        its entry's (``entry_key``: a shape bucket's kernel that fails is disabled for the bucket)."""
        state = self.session.kernel_state(entry_key or spec.key)
        if not self.session.options.check:
            return TritonCall(spec, runner, state, self._on_kernel_failure, name)
        family = family_for(spec)
        return CheckedTritonCall(spec, runner, state, self._on_kernel_failure,
                                 family.resolve_ties if family is not None else None, name)

    def _on_kernel_failure(self, call: TritonCall, why: str, tensors, kind: str) -> None:
        """A kernel raised (failure) or disagreed with the vendor op (mismatch): leave a repro,
        shrunk in context by the minifier when the graph's inputs allow it."""
        repros = self.session.repros
        if repros is None or not tensors:
            return
        folder = None
        args = self._current_args
        if kind == "mismatch" and args is not None:
            result = minify(self.plan.gm, args, mismatch_predicate(call.spec.key, self.target, self.session.options))
            if result is not None:
                small, small_inputs = result
                folder = repros.write_failure(call.spec, small_inputs, self.target, why, kind=kind, gm=small,
                                              extra={"minified_from": {"graph": self.name,
                                                                       "nodes": len(self.plan.gm.graph.nodes),
                                                                       "to": len(small.graph.nodes)}})
        if folder is None:
            folder = repros.write_failure(call.spec, [t.detach().cpu() for t in tensors], self.target, why, kind=kind)
        if folder is not None:
            log.error("repro of the %s of kernel %s: %s", kind, call.spec.key, folder)


def _region_spec_at(region: Region, bindings: dict, d: Decision,
                    symbol: Any = None) -> Callable[[tuple[int, ...]], KernelSpec | None]:
    """``region``'s spec at a size of the bucket ``d`` hit (None where it cannot say)."""
    def at(values: tuple[int, ...]) -> KernelSpec | None:
        new = _bindings_in_bucket(region, bindings, d, values, symbol)
        return region_spec(region, new) if new is not None else None
    return at


def _bucket_direct(base: Any, resize: Resizer, outputs: tuple | None,
                   call: BucketCall) -> tuple[Callable | None, str | None]:
    """A bucket's program (a node's, a region's, a whole graph's) as one generated call for
    every size of the bucket (ProgramRunner.bucket_direct), ``outputs`` its outputs' metas as
    SizeSources, and None; or None and why not (the report's ``planning``): its outputs' sizes
    are no polynomials of its size (a whole graph's), the runner has no generated call (not
    CUDA, or a program the generation cannot write), which keeps the per-size calls."""
    if outputs is None:
        return None, "outputs' sizes not polynomials of the bucket's"
    try:
        direct = base.bucket_direct(resize.symbolic(), outputs, call.sizes_source, call.per_size)
    except Exception as e:  # (the per-size calls serve it as before)
        log.debug("no generated call for bucket %s: %s", call.__name__, e)
        return None, f"{type(e).__name__}: {str(e)[:120]}"
    return direct, (None if direct is not None or base.backend != "cuda" else
                     "the runner has no generated call (donated outputs, state, checks, or no device input)")


def _warm_steps(name: str, entry: CacheEntry, resize: Resizer, tensors: dict[str, list],
                inputs_at: Callable | None, outputs_at: Callable | None, budget_ms: int) -> None:
    """Run the vendor steps of a bucket's program at the bucket's sizes now, so that a served
    call at a new size does not pay their libraries' first use there (serving/bucket_warm.py)."""
    bucket = entry.bucket
    device = next((t.device for t in tensors["in"] if isinstance(t, torch.Tensor)), None)
    if device is None:
        return

    def at_size(v: int) -> tuple | None:
        values = (v,)
        try:
            ins = inputs_at(values) if inputs_at is not None else metas_at(entry.spec, bucket.dims, values, "in")
            outs = (outputs_at(values) if outputs_at is not None else None) or metas_at(entry.spec, bucket.dims, values)
            return resize(values), ins, outs
        except (ValueError, TypeError, IndexError) as e:  # (a size the program cannot be made at: not warmed)
            log.debug("bucket %s: not warmed at size %d: %s", name, v, e)
            return None
    lo, hi = bucket.ranges[0]
    warm_bucket(name, (entry.key,), lo, hi, at_size, str(device), budget_ms)


def _region_metas_at(region: Region, bindings: dict, d: Decision, symbol: Any = None,
                     side: str = "out") -> Callable[[tuple[int, ...]], tuple | None]:
    """``region``'s outputs' (``side`` "out") or inputs' ("in") metas at a size of the bucket
    ``d`` hit, read off their traced shapes (a stretch's token count is batch x length; a dim
    of the bucket's size alone is what metas_at gives); None where a size is unbound."""
    nodes = region.outputs if side == "out" else region.inputs
    if symbol is not None:  # (a whole graph: its metas as functions of its one variable, made once)
        of_size = [meta_of_size(n.meta["val"], bindings, symbol) for n in nodes]

        def at(values: tuple[int, ...]) -> tuple | None:
            metas = [f(values[0]) for f in of_size]
            return None if any(m is None for m in metas) else tuple(metas)
        # the same as source of the size v[0], for a call generated once (_bucket_direct)
        at.symbolic = (tuple(f(SizeSource("v[0]")) for f in of_size) if all(f.polynomial for f in of_size)
                       else None)
        return at

    def at(values: tuple[int, ...]) -> tuple | None:
        new = _bindings_in_bucket(region, bindings, d, values, symbol)
        metas = [concrete_meta(n.meta["val"], new) for n in nodes] if new is not None else [None]
        return None if any(m is None for m in metas) else tuple(metas)
    return at


def _bindings_in_bucket(region: Region, bindings: dict, d: Decision, values: tuple[int, ...],
                        symbol: Any = None) -> dict | None:
    """The specialization's ``bindings`` with the variables of the bucket ``d`` hit at
    ``values`` (None where a variable is no single symbol); a whole graph's (``symbol``, its
    one variable) with that symbol at its value."""
    if symbol is not None:
        return {**bindings, symbol: int(values[0])}
    sizes = variable_sizes(region_tensors(region), d.entry.bucket.dims)
    new = bindings_at(sizes, values) if sizes is not None else None
    return {**bindings, **new} if new is not None else None


def _vendor_step_tiers(decisions: list[Decision], region: Region, program: Any) -> None:
    """Inside a whole graph's program, a node whose op the program calls as a vendor step (an
    extern GEMM or convolution) is reported on the vendor tier; the others stay triton."""
    ops = step_tier_ops(program)
    names = {n.name for n in region.nodes}
    for i, d in enumerate(decisions):
        if d.node in names and d.tier == "triton" and d.op.rsplit(".", 1)[0] in ops:
            decisions[i] = dataclasses.replace(d, tier="vendor", family_pending=False, reason=d.reason.replace(
                "in fused region", "a vendor call of the whole graph's program", 1))


def lower(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | Options | None = None,
          kind: str = "inference", target: Target | None = None, whole: bool = True) -> LoweredGraph:
    """Lower an ATen FX graph with kernelize's planner and runtime (no Dynamo, no Inductor);
    ``whole``: look the whole graph up first (see LoweredGraph)."""
    opts = options if isinstance(options, Options) else Options.resolve(options)
    return LoweredGraph(gm, example_inputs, Session(opts, target), kind, whole=whole)


# --- minifier predicates: pinned to one failure, they lower the candidate graphs ---------------

def _quiet_for_minify(options: Any) -> Any:
    """The predicate's own lowerings: no check mode, no repros, no report, no strict errors."""
    return dataclasses.replace(options, check=False, repro_dir=None, report=None, strict=False)


def mismatch_predicate(spec_key: str, target: Target, options: Options) -> Callable[[fx.GraphModule, list], bool]:
    """True while lowering the graph puts kernel ``spec_key`` on the triton tier and the
    outputs differ from the graph run by ATen."""
    options = _quiet_for_minify(options)

    def fails(fx_g: fx.GraphModule, inputs: list) -> bool:
        try:
            gm = retrace(fx_g, inputs)
            session = Session(options, target, private_kernel_states=True)
            lowered = LoweredGraph(gm, inputs, session, "minify")
            decisions = lowered.report.decisions + lowered.report.regions
            if not any(d.spec_key == spec_key and d.tier == "triton" for d in decisions):
                return False
            got = tensor_outputs(lowered(list(inputs)))
            want = tensor_outputs(fx_g(*inputs))
            return any(not compare(g, w.to(torch.float64) if w.is_floating_point() else w, None, factor=2.0).ok
                       for g, w in zip(got, want))
        except Exception:
            return False
    return fails


def lowering_error_predicate(error: BaseException, target: Target, options: Options
                             ) -> Callable[[fx.GraphModule, list], bool]:
    """True while lowering the graph raises the same exception type with the same first line."""
    options = _quiet_for_minify(options)
    first_line = str(error).splitlines()[0] if str(error) else ""

    def fails(fx_g: fx.GraphModule, inputs: list) -> bool:
        try:
            gm = retrace(fx_g, inputs)
        except Exception:
            return False
        try:
            LoweredGraph(gm, inputs, Session(options, target, private_kernel_states=True), "minify")
        except Exception as e:
            return type(e) is type(error) and (str(e).splitlines()[0] if str(e) else "") == first_line
        return False
    return fails


def specializations(graphs: Sequence[LoweredGraph]) -> list[tuple[LoweredGraph, Any]]:
    """(LoweredGraph, Specialization) of every bound executable the compile made, each once."""
    seen, out = set(), []
    for g in graphs:
        for s in g.specializations().values():
            if id(s) not in seen:
                seen.add(id(s))
                out.append((g, s))
    return out
