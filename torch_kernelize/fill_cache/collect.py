"""Where fill_cache's work comes from: the KernelSpecs a model needs, or recorded reproducers;
and the checks that turn a wrong argument naming them (or the cache) into one clear UsageError."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from torch_kernelize import flush_repros
from torch_kernelize.core.errors import KernelizeError, machine_error
from torch_kernelize.core.source_module import load_source_module
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.core.targets import Target
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.compiling.whole_graph import CUT, is_whole_graph
from torch_kernelize.serving.graph_split import op_sync_reason
from torch_kernelize.serving.repro_inputs import ReproProblem, read_inputs, read_meta

log = logging.getLogger("torch_kernelize.fill_cache")


class UsageError(KernelizeError):
    """A fill_cache argument is wrong; the message says how to write it."""


@dataclasses.dataclass
class Work:
    spec: KernelSpec
    source: str                         # "model:<ref>" or the repro folder
    kind: str = "miss"                  # miss | missing | mismatch | failure
    captured: list[torch.Tensor] | None = None   # real inputs from a repro, validated on too
    # Per place the spec occurs at when serving (a graph's node or region; one key may occur at
    # many), the region places whose kernel makes serving skip it there: a node's, the regions
    # holding it; a region's, those tried before it that share a node with it (the larger regions
    # holding it, and those a hit of which blocks it). A region's places are named in place_ids.
    places: list[list[str]] = dataclasses.field(default_factory=list)
    place_ids: list[str] = dataclasses.field(default_factory=list)
    covered_by: list[str] = dataclasses.field(default_factory=list)   # the region keys of places
    node: tuple[str, str] | None = None          # (graph, node) a node spec came from first
    members: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # a region's nodes
    candidate: bool = False  # a candidate file is given for it (--candidate): searched even if cached
    mix: bool = False  # only a stretch a whole graph is cut into (whole_graph.CUT): searched at --budget 2 and more
    # a whole graph's integer and boolean inputs as the model's call gave them, by input position
    # (graph_candidates.WholeGraphDomain.pin: validated and captured on those, floats drawn)
    pins: dict[int, torch.Tensor] | None = None
    # a fused region serving tries before the stretches it overlaps: the whole graph (or the region
    # with those stretches) in which it is timed against the parts it keeps from their winners
    # (region_judgment.py), with that unit's integer inputs as the model's call gave them
    judged_in: KernelSpec | None = None
    judged_pins: dict[int, torch.Tensor] | None = None

    @property
    def replace(self) -> bool:
        """A repro that shows a wrong or failing cached kernel, or a spec a candidate file is given
        for: it is searched again and its entry replaced by the winner."""
        return self.kind in ("mismatch", "failure") or self.candidate


@dataclasses.dataclass
class JudgmentUnit:
    """A fused region's judgment unit in one graph (whole_graph.judgment_units), as specs."""
    region_key: str
    spec: KernelSpec
    region: Any  # the unit's compiling.regions.Region (its inputs: index_inputs)


def judgment_units(graph: Any) -> list[JudgmentUnit]:
    """The judgment units of a static LoweredGraph's fused regions (none for a dynamic one)."""
    from torch_kernelize.compiling.regions import region_spec
    from torch_kernelize.compiling.whole_graph import judgment_units as units_of

    if not graph.binder.is_static:
        return []
    found = []
    for region, unit in units_of(graph.plan.gm, graph.regions):
        region_key, unit_spec = region_spec(region, {}), region_spec(unit, {})
        if region_key is not None and unit_spec is not None:
            found.append(JudgmentUnit(region_key.key, unit_spec, unit))
    return found


def check_cache_dir(path: Path) -> None:
    """Raise UsageError unless ``path`` is (or can be made) a folder this process can write."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"--cache-dir {path}: not a folder this process can write ({e.strerror or e}); "
                         "give one it can") from None


def _model_function(ref: str) -> tuple[Any, str, str]:
    """The module a ``--model`` reference names, the function's name, and where it was found."""
    where, _, fn_name = ref.rpartition(":")
    if not where or not fn_name:
        raise UsageError(f"--model {ref!r}: write PATH.py:FN or pkg.module:FN (FN returns model, inputs)")
    if where.endswith(".py"):
        path = Path(where)
        if not path.exists():
            raise UsageError(f"--model {ref!r}: {path} does not exist")
        try:
            module = load_source_module(path, f"kernelize_model_{path.stem}")
        except Exception as e:  # a syntax error, a missing import: the user's file, not ours
            raise UsageError(f"--model {ref!r}: {path} does not import: {one_line(e)}") from e
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise UsageError(f"--model {ref!r}: cannot import {where}: {one_line(e)}") from e
    return module, fn_name, where


def load_model(ref: str) -> tuple[torch.nn.Module, tuple]:
    """``PATH.py:FN`` or ``pkg.module:FN``; FN() returns (model, example_inputs)."""
    module, fn_name, where = _model_function(ref)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--model {ref!r}: {where} has no function {fn_name}")
    try:
        result = fn()
    except Exception as e:
        raise UsageError(f"--model {ref!r}: {fn_name}() raised {one_line(e)}") from e
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], (tuple, list))):
        raise UsageError(f"--model {ref!r}: {fn_name}() must return (model, tuple_of_example_inputs)")
    return result[0], tuple(result[1])


def model_loss(ref: str) -> Callable[[Any], torch.Tensor]:
    """The loss of a training step for a ``--model``: the model file's ``loss(output)`` if it has
    one, else the output's own ``.loss`` (transformers' with labels), else a fixed random
    projection of every floating output (seeded: the same weights for eager and compiled runs;
    not a plain sum, whose constant gradient zeroes softmax's and normalization's backward)."""
    module = _model_function(ref)[0]
    own = getattr(module, "loss", None)
    if callable(own):
        return own

    def project(out: Any) -> torch.Tensor:
        if isinstance(getattr(out, "loss", None), torch.Tensor):
            return out.loss
        gen = torch.Generator().manual_seed(0)
        floats = [t for t in output_tensors(out) if t.is_floating_point() or t.is_complex()]
        if not floats:
            raise UsageError(f"--model {ref!r}: no floating output to take a loss of; give the model file "
                             "a loss(output) function")
        return sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)).real.sum().float()
                   for t in floats)
    return project


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, whatever container it comes in (HF ModelOutput too)."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def training_grads(model: torch.nn.Module, inputs: tuple, loss: torch.Tensor) -> list[torch.Tensor]:
    """d loss / d (every trainable parameter, every input that requires grad), zeros where unused,
    without touching ``.grad``."""
    wrt = [p for p in model.parameters() if p.requires_grad]
    wrt += [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not wrt:
        raise UsageError("--training: the model has no trainable parameter and no floating input")
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, wrt)]


def run_compiled(ref: str, target: Target, cache_dir: Path, repro_dir: Path | None = None,
                 training: bool = False, survey: bool = False) -> tuple[torch.nn.Module, tuple, Any, list[Any]]:
    """Load a ``--model`` reference onto ``target``'s device, compile it with the backend's planner
    and the kernel cache as it is, and run it once: (model, inputs, its output, the LoweredGraphs
    it made). Under no_grad; with ``training``, one training step instead (forward, ``model_loss``,
    backward: its forward and backward graphs), whose output is (output, the gradients). With
    ``survey``, no whole graph's program is taken (Session.survey): every spec is looked up."""
    with served_model(ref, target, cache_dir, repro_dir, training, survey) as (model, inputs, _, out, graphs):
        return model, inputs, out, graphs


@contextlib.contextmanager
def served_model(ref: str, target: Target, cache_dir: Path, repro_dir: Path | None = None, training: bool = False,
                 survey: bool = False):
    """``run_compiled`` that keeps the compiled model callable while the block lasts: yields
    (model, inputs, compiled, its first output, the LoweredGraphs it made)."""
    from torch_kernelize.backend import compile_with_session
    from torch_kernelize.compiling.lower import Session
    from torch_kernelize.core.options import Options

    model, inputs = load_model(ref)
    device = "cuda" if target.device == "cuda" else "cpu"
    session = Session(Options.for_fill(cache_dir, repro_dir), target)
    session.survey = survey
    graphs: list[Any] = []
    torch._dynamo.reset()
    try:
        with running_model(ref, device):
            model = model.to(device)
            inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
            if training:  # floating inputs get gradients too (a model without parameters trains nothing else)
                inputs = tuple(t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point()
                               else t for t in inputs)
            compiled = torch.compile(model, backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
            if training:
                out = compiled(*inputs)
                out = (out, training_grads(model, inputs, model_loss(ref)(out)))
            else:
                with torch.no_grad():
                    out = compiled(*inputs)
        yield model, inputs, compiled, out, graphs
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def running_model(ref: str, device: str) -> Iterator[None]:
    """Make what a --model's own code raises (moved, compiled, run) a UsageError naming it, its
    cause kept for --verbose; a full disk and our own errors pass as they are."""
    try:
        yield
    except Exception as e:
        if machine_error(e) or isinstance(e, KernelizeError):
            raise
        raise UsageError(f"--model {ref!r}: running it on {device} raised {one_line(e)}") from e


def one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (Dynamo appends pages of context to a model's error)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def specs_from_model(ref: str, target: Target, cache_dir: Path,
                     supported: Callable[[KernelSpec], bool] | None = None, training: bool = False) -> list[Work]:
    """Trace the model through the backend's planner on ``target`` (a training step's forward and
    backward graphs with ``training``); collect the specs that a kernel family, or another
    generator of the run (``supported``), can generate (hits included, so --force can re-search
    them)."""
    if supported is None:
        supported = lambda spec: family_for(spec) is not None  # noqa: E731
    from torch_kernelize.fallbacks import expected_fallbacks
    with expected_fallbacks():  # what runs on the host now is what the fill is for
        # a survey: a whole graph's program that hits leaves its stretches, regions and nodes to
        # be seen (a larger budget fills them too); the model, inputs and output are dropped after
        with served_model(ref, target, cache_dir, training=training, survey=True) as (_, inputs, compiled, _, graphs):
            units = {g.name: judgment_units(g) for g in graphs}
            pins = {} if training else index_inputs(compiled, inputs, graphs, units)
    if target.device == "cuda":  # give the model's memory back: validation (in a worker) judges what is free
        torch.cuda.empty_cache()
    regions: dict[str, Work] = {}
    nodes: dict[str, Work] = {}
    wholes: dict[str, Work] = {}  # whole graphs: searched first (see the end)
    for g in graphs:
        tried_first = []  # the whole graph (or its stretches): serving looks them up before every region and node
        for whole in getattr(g, "wholes", ()):
            if whole.spec is not None and supported(whole.spec):
                cut = CUT in whole.shapes
                w = wholes.setdefault(whole.spec.key, Work(whole.spec, f"model:{ref}", "miss", mix=cut,
                                                           pins=pins.get(whole.spec.key)))
                w.mix = w.mix and cut
                place = f"{g.name}/whole/{whole.node}/{whole.spec.key}"
                w.place_ids.append(place)
                w.places.append([])
                tried_first.append((place, set(whole.members), None))
        for n, specialization in enumerate({id(s): s for s in g.specializations().values()}.values()):
            _collect_specialization(f"{g.name}/{n}", specialization, g.regions, f"model:{ref}", supported,
                                    regions, nodes, tried_first)
    # Regions first, in the order serving tries them (largest first): a node inside a region
    # that gets a kernel never runs alone, so its own search is skipped then (see FillRun); it
    # still runs if its region finds no correct kernel. Likewise a region that shares a node with
    # one tried before it (a member of a matmul group, a region inside a graph region, a GEMM's
    # epilogue that a graph region holds) is skipped once that one has a kernel, as is a GEMM
    # group that would wait for one fused before it (regions.closes_cycle). A spec is skipped
    # only where that holds at every place it occurs (one key, many layers).
    work = list(regions.values()) + list(nodes.values())
    for w in work:
        w.covered_by = sorted({p.rsplit("/", 1)[1] for place in w.places for p in place})
    for unit in (u for g in graphs for u in units[g.name]):  # (one unit per region: the first graph's)
        w = regions.get(unit.region_key)
        if w is not None and w.judged_in is None:
            w.judged_in, w.judged_pins = unit.spec, pins.get(unit.spec.key)
    # Whole graphs first: a fill stopped early (a time limit, Ctrl-C) still serves Inductor's
    # whole program where it beats the graph as the cache assembled it then. Their places come
    # before every other place of their graph; a program winner covers the graph's specs at the
    # quick fill's budget only (FillRun._served). At larger budgets the nodes and regions are
    # searched too, and FillRun times the graph again at the end against the assembly they give
    # (FillRun.rejudge_wholes).
    return list(wholes.values()) + work


PIN_BYTES = 16 << 20  # an integer input larger than this is drawn, not carried (a mask of a huge batch)


def index_inputs(compiled: Callable, inputs: Sequence[Any], graphs: Sequence[Any],
                 units: dict[str, list[JudgmentUnit]] | None = None) -> dict[str, dict[int, torch.Tensor]]:
    """Per whole graph, stretch or judgment unit (``units``, by graph name) by spec key, its
    integer and boolean inputs as one more call of the compiled model computes them (host
    copies, by input position): their domain is the model's (Work.pins). An input the bound
    graph does not hold by name (folded aside) is left out, and drawn as before."""
    from torch_kernelize.compiling.lower import specializations
    from torch_kernelize.serving.runtime import CapturingInterpreter

    wanted: dict[str, list[tuple[str, int, str]]] = {}  # graph -> (spec key, input position, node name)
    for g in graphs:
        regions = {tuple(sorted(r.names)): r for r in g.regions}
        keyed = [(whole.spec.key, regions.get(tuple(sorted(whole.members)))) for whole in getattr(g, "wholes", ())
                 if whole.spec is not None]
        keyed += [(u.spec.key, u.region) for u in (units or {}).get(g.name, ())]
        for key, region in keyed:
            for i, n in enumerate(region.inputs if region is not None else ()):
                val = n.meta.get("val")
                if isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex()) \
                        and val.numel() * val.element_size() <= PIN_BYTES:
                    wanted.setdefault(g.name, []).append((key, i, n.name))
    if not wanted:
        return {}
    runs = []
    try:
        with contextlib.ExitStack() as stack:
            for g, s in specializations([g for g in graphs if g.name in wanted]):
                runs.append((g.name, CapturingInterpreter(s.gm, set(), {name for _, _, name in wanted[g.name]})))
                stack.enter_context(s.running(runs[-1][1].run))
            with torch.no_grad():
                compiled(*inputs)
    except Exception as e:  # (a model whose second call differs): its graphs' index inputs are drawn instead
        if machine_error(e):
            raise
        log.warning("the whole graphs' integer inputs could not be kept from a second call of the model (%s: %s); "
                    "they are drawn", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return {}
    pins: dict[str, dict[int, torch.Tensor]] = {}
    for name, run in runs:
        for key, i, node in wanted[name]:
            if node in run.values:
                pins.setdefault(key, {}).setdefault(i, run.values[node])
    return pins


def _collect_specialization(prefix: str, specialization: Any, graph_regions: list[Any], source: str,
                            supported: Callable[[KernelSpec], bool], regions: dict[str, Work],
                            nodes: dict[str, Work], tried_first: Sequence[tuple[str, set[str], Any]] = ()) -> None:
    """Add the specs one specialization of a graph looks up to ``regions`` and ``nodes`` (by
    key), each with the places it occurs at: a node's, the region places holding it; a region's,
    the region places serving tries before it whose kernel keeps it from running fused: those
    that share a node with it, and GEMM groups it would close a cycle with (``Work.places``).
    ``tried_first``: the whole graph's place, looked up before all of them."""
    from torch_kernelize.compiling.regions import closes_cycle

    by_members = {tuple(sorted(r.names)): r for r in graph_regions}
    tried: list[tuple[str, set[str], Any]] = list(tried_first)  # (place, members, Region) looked up so far

    def blocks(members: set[str], region: Any, other: tuple[str, set[str], Any]) -> bool:
        _, theirs, their_region = other
        if theirs & members:
            return True
        groups = region is not None and their_region is not None and region.kind == their_region.kind == "matmul_group"
        return groups and closes_cycle(region, [their_region])  # (only groups can: planner.decide_regions)

    for d in specialization.regions:
        if d.spec is None or is_whole_graph(d.spec):  # whole graphs are collected apart
            continue
        place, members, region = f"{prefix}/{d.node}/{d.spec.key}", set(d.members), by_members.get(d.members)
        if supported(d.spec):
            w = regions.setdefault(d.spec.key, Work(d.spec, source, "miss"))
            w.members = sorted(set(w.members) | {(prefix, m) for m in members})
            w.place_ids.append(place)
            w.places.append([t[0] for t in tried if blocks(members, region, t)])
        tried.append((place, members, region))
    for d in specialization.decisions:
        if d.spec is None or not supported(d.spec):
            continue
        # an op that reads the device on the host as given: its race again, as a CUDA graph serves it
        variants = (d.spec, d.spec.graphed()) if _syncs(d.spec) else (d.spec,)
        for spec in variants:
            w = nodes.setdefault(spec.key, Work(spec, source, "missing" if d.missing else "miss"))
            w.node = w.node or (prefix, d.node)
            w.places.append([p for p, m, _ in tried if d.node in m])


def _syncs(spec: KernelSpec) -> bool:
    """Whether ``spec``'s op, run as given, cuts a CUDA graph (compiling/graphed_lookups.py)."""
    try:
        return spec.graph is None and op_sync_reason(spec.op_overload) is not None
    except KeyError:  # a reproducer's op this process cannot resolve: its own race says why
        return False


def specs_from_repros(folder: Path) -> list[Work]:
    """Every reproducer under ``folder`` (one level deep): its spec and its captured inputs."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"--repros {folder}: no such folder")
    flush_repros()  # the misses this process recorded (tests, notebooks) are written in the background
    work: dict[str, Work] = {}
    # every folder but hidden ones (a repro being written): one without spec.json is skipped, said so
    folders = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    for w in filter(None, map(repro_work, folders)):
        prev = work.get(w.spec.key)
        if prev is None or (not prev.replace and w.kind in ("mismatch", "failure")):
            work[w.spec.key] = w
    if not work and not folders:
        log.warning("no reproducers (*/spec.json) found under %s", folder)
    # a miss of an op that syncs as given: its race as a captured graph serves it, too
    graphed = [dataclasses.replace(w, spec=w.spec.graphed()) for w in work.values()
               if not w.replace and not w.spec.condition and _syncs(w.spec)]
    return list(work.values()) + graphed


def repro_work(repro: Path) -> Work | None:
    """One reproducer folder's spec and captured inputs, read as data (its repro.py is never run);
    None, with one warning, if its files fail their checks."""
    try:
        return read_repro_work(repro)
    except ReproProblem as e:
        log.warning("skipping reproducer %s: %s", repro, e)
        return None


def read_repro_work(repro: Path) -> Work:
    """``repro_work``, raising ReproProblem that says what is wrong with the folder."""
    meta = read_meta(repro)
    try:
        spec = KernelSpec.from_json(meta["spec"])
    except Exception as e:
        raise ReproProblem(f"spec.json holds no kernel spec ({type(e).__name__}: {e})") from None
    return Work(spec, str(repro), meta.get("kind", "miss"), read_inputs(repro, spec))
