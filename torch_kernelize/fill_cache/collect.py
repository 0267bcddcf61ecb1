"""Where fill_cache's work comes from: the KernelSpecs a model needs, or recorded reproducers;
and the checks that turn a wrong argument naming them (or the cache) into one clear UsageError."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from torch_kernelize import flush_repros
from torch_kernelize.core.errors import KernelizeError
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.core.targets import Target
from torch_kernelize.core.spec import KernelSpec

log = logging.getLogger("torch_kernelize.fill_cache")


class UsageError(KernelizeError):
    """A fill_cache argument is wrong; the message says how to write it."""


@dataclasses.dataclass
class Work:
    spec: KernelSpec
    source: str                         # "model:<ref>" or the repro folder
    kind: str = "miss"                  # miss | missing | mismatch | failure
    captured: list[torch.Tensor] | None = None   # real inputs from a repro, validated on too
    # a node's: the region specs holding it; a region's: those tried before it at serving that
    # share a node with it (the larger regions holding it, and those a hit of which blocks it)
    covered_by: list[str] = dataclasses.field(default_factory=list)
    node: tuple[str, str] | None = None          # (graph, node) a node spec came from
    members: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # a region's nodes
    candidate: bool = False  # a candidate file is given for it (--candidate): searched even if cached

    @property
    def replace(self) -> bool:
        """A repro that shows a wrong or failing cached kernel, or a spec a candidate file is given
        for: it is searched again and its entry replaced by the winner."""
        return self.kind in ("mismatch", "failure") or self.candidate


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


def load_model(ref: str) -> tuple[torch.nn.Module, tuple]:
    """``PATH.py:FN`` or ``pkg.module:FN``; FN() returns (model, example_inputs)."""
    where, _, fn_name = ref.rpartition(":")
    if not where or not fn_name:
        raise UsageError(f"--model {ref!r}: write PATH.py:FN or pkg.module:FN (FN returns model, inputs)")
    if where.endswith(".py"):
        path = Path(where)
        if not path.exists():
            raise UsageError(f"--model {ref!r}: {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"kernelize_model_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # a syntax error, a missing import: the user's file, not ours
            raise UsageError(f"--model {ref!r}: {path} does not import: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise UsageError(f"--model {ref!r}: cannot import {where}: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--model {ref!r}: {where} has no function {fn_name}")
    try:
        result = fn()
    except Exception as e:
        raise UsageError(f"--model {ref!r}: {fn_name}() raised {type(e).__name__}: {e}") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], (tuple, list))):
        raise UsageError(f"--model {ref!r}: {fn_name}() must return (model, tuple_of_example_inputs)")
    return result[0], tuple(result[1])


def run_compiled(ref: str, target: Target, cache_dir: Path, repro_dir: Path | None = None
                 ) -> tuple[torch.nn.Module, tuple, Any, list[Any]]:
    """Load a ``--model`` reference onto ``target``'s device, compile it with the backend's planner
    and the kernel cache as it is, and run it once under no_grad: (model, inputs, its output,
    the LoweredGraphs it made)."""
    from torch_kernelize.backend import compile_with_session
    from torch_kernelize.compiling.lower import Session
    from torch_kernelize.core.options import Options

    model, inputs = load_model(ref)
    device = "cuda" if target.device == "cuda" else "cpu"
    model = model.to(device)
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    session = Session(Options(target=None, cache_dir=Path(cache_dir), repro_dir=repro_dir), target)
    graphs: list[Any] = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, ex: compile_with_session(gm, ex, session, graphs.append))
    with torch.no_grad():
        out = compiled(*inputs)
    torch._dynamo.reset()
    return model, inputs, out, graphs


def specs_from_model(ref: str, target: Target, cache_dir: Path,
                     supported: Callable[[KernelSpec], bool] | None = None) -> list[Work]:
    """Trace the model through the backend's planner on ``target``; collect the specs that a
    kernel family, or another generator of the run (``supported``), can generate (hits
    included, so --force can re-search them)."""
    if supported is None:
        supported = lambda spec: family_for(spec) is not None  # noqa: E731
    _, _, _, graphs = run_compiled(ref, target, cache_dir)  # the model, inputs and output are dropped
    if target.device == "cuda":  # give the model's memory back: validation (in a worker) judges what is free
        torch.cuda.empty_cache()
    regions: dict[str, Work] = {}
    nodes: dict[str, Work] = {}
    for g in graphs:
        for specialization in g._specializations.values():
            for d in specialization.regions:
                if d.spec is not None and d.spec.key not in regions and supported(d.spec):
                    regions[d.spec.key] = Work(d.spec, f"model:{ref}", "miss")
                    members = {n.name for n in g._region_of[d.spec.key].nodes}
                    regions[d.spec.key].members = [(g.name, m) for m in members]
            for d in specialization.decisions:
                if d.spec is not None and d.spec.key not in nodes and supported(d.spec):
                    nodes[d.spec.key] = Work(d.spec, f"model:{ref}", "missing" if d.missing else "miss")
                    nodes[d.spec.key].node = (g.name, d.node)
    # Regions first, in the order serving tries them (largest first): a node inside a region
    # that gets a kernel never runs alone, so its own search is skipped then (see FillRun); it
    # still runs if its region finds no correct kernel. Likewise a region that shares a node with
    # one tried before it (a member of a matmul group, a region inside a graph region, a GEMM's
    # epilogue that a graph region holds) is skipped once that one has a kernel.
    ordered = list(regions.values())
    for i, w in enumerate(ordered):
        for member in w.members:
            for n in nodes.values():
                if n.node == member:
                    n.covered_by.append(w.spec.key)
        mine = set(w.members)
        w.covered_by.extend(r.spec.key for r in ordered[:i] if mine & set(r.members))
    return ordered + list(nodes.values())


def specs_from_repros(folder: Path) -> list[Work]:
    """Every reproducer under ``folder`` (one level deep): its spec and its captured inputs."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"--repros {folder}: no such folder")
    flush_repros()  # the misses this process recorded (tests, notebooks) are written in the background
    work: dict[str, Work] = {}
    for meta_path in sorted(folder.glob("*/spec.json")):
        w = repro_work(meta_path.parent)
        if w is None:
            continue
        prev = work.get(w.spec.key)
        if prev is None or (not prev.replace and w.kind in ("mismatch", "failure")):
            work[w.spec.key] = w
    if not work:
        log.warning("no reproducers (*/spec.json) found under %s", folder)
    return list(work.values())


def repro_work(repro: Path) -> Work | None:
    """One reproducer folder's spec and captured inputs; None (with a warning) if its spec.json is
    unreadable."""
    from torch_kernelize.serving.repro_writer import load_inputs

    try:
        meta = json.loads((repro / "spec.json").read_text())
        spec = KernelSpec.from_json(meta["spec"])
    except Exception as e:
        log.warning("skipping %s: unreadable spec.json (%s)", repro, e)
        return None
    captured = None
    try:
        mod_spec = importlib.util.spec_from_file_location(f"kernelize_repro_{spec.key}", repro / "repro.py")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        captured = load_inputs(module.load_args, repro)
    except Exception as e:
        log.warning("%s: captured inputs not loaded (%s); validating on random inputs only", repro, e)
    return Work(spec, str(repro), meta.get("kind", "miss"), captured)
