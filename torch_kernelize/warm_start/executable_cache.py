"""A persistent cache of bound executables (option ``executable_cache``), one level above the graph cache.

A graph-cache hit skips aot_autograd, but the ATen graph must still be unpickled with its fake
tensors, planned, looked up node by node in the kernel cache, bound, rewritten (view folding,
reinplacing) and compiled to Python code: on the H200 about 0.15 s of the first call of the
4-layer Llama benchmark. This cache keeps the result of that work, for the inference graphs the
graph cache holds:

- the bound graph: ATen ops, cached-kernel calls (by spec key, in place or not, with their stride
  checks), folded views and getitems;
- the decisions it was bound from (the log and the report say what the normal path says);
- a witness of every kernel-cache lookup made while planning it (``KernelCache.witness``): the
  verified entry's folder, file signature and record, or that there was no entry.

A warm process re-checks every witness (a few stat calls per entry and no hashing: the criterion
of the kernel cache's own per-process memo), loads the kernels as the normal path does, rebuilds
the graph and generates its code once. Anything but an exact match (an entry filled, replaced or
removed since, a kernel that does not load, a miss whose repro is wanted again) takes the normal
path, which stores the entry anew: a warm process runs the executable that lowering would bind now.

Not stored, so always lowered anew: check mode (its calls compare against the vendor op and minify
inside the planned graph), graphs with host fallbacks, graphs whose first call captures repros.

An entry is ``<graph cache dir>/<key>.exe``, sealed like the graph cache's entries (a JSON header
with the payload's sha256) and written atomically. The header also lists the executable's vendor
calls, which a hit copies into the program's prewarm index (prewarm.py). The payload is a pickle
whose objects are plain Python values plus named references (nodes, ops, dtypes, devices, kernel
calls, folded views), read back by an unpickler that builds nothing else. A bad entry is ignored
with one warning. The hash guards against corruption, not tampering: like the kernel cache, whose
programs run as they are, the folder must be writable only by those trusted to supply kernels.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import hashlib
import io
import json
import logging
import operator
import os
import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from torch_kernelize.warm_start import prewarm
from torch_kernelize.serving.flat_code import flat_function
from torch_kernelize.kernel_cache.integrity import read_regular, seal, unseal, write_file_atomic
from torch_kernelize.core.targets import op_name, resolve_op
from torch_kernelize.serving.op_bindings import binding_by_name, binding_name
from torch_kernelize.core.decision import Decision
from torch_kernelize.serving.runtime import Specialization, TritonCall
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.serving.view_folding import FoldedView

if TYPE_CHECKING:
    from torch_kernelize.compiling.lower import LoweredGraph, Session

log = logging.getLogger("torch_kernelize.warm_start.executable_cache")

FORMAT = 1
SUFFIX = ".exe"
_MAGIC = b"torch_kernelize executable cache\n"
_PACKAGES = ("torch_kernelize", "torch_kernelize.lowering", "torch_kernelize.fallbacks",
             "torch_kernelize.kernel_cache")
# Globals a payload may name; everything else travels as a persistent reference (see _Pickler).
_GLOBALS = {("_operator", "getitem"), ("builtins", "slice"),
            ("torch.fx.immutable_collections", "immutable_list"),
            ("torch.fx.immutable_collections", "immutable_dict")}

stats: collections.Counter = collections.Counter()  # hit / miss / stale / save / bypass / corrupt, per process
_warned: set[str] = set()


class Stale(Exception):
    """The entry no longer describes what lowering would bind now (the message says why)."""


@functools.cache
def source_hash() -> str:
    """sha256 of every Python source of kernelize's packages: lowering depends on nearly all of them."""
    import importlib
    h = hashlib.sha256()
    roots = sorted({Path(importlib.import_module(name).__file__).parent for name in _PACKAGES})
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = Path(folder, name)
                h.update(f"{path.relative_to(root.parent)}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()


# Options that do not change the bound executable: the report is written from the stored
# decisions and the caches' own switches. (CUDA graphs do: a node that syncs is looked up under its
# GRAPHED key first, compiling/graphed_lookups.py.)
_OPTIONS_NOT_KEYED = frozenset({"report", "graph_cache", "executable_cache", "prewarm"})


def key_for(graph_key: str, session: "Session", kind: str = "inference") -> str:
    """The entry key of one cached graph lowered by ``session`` (its target and options)."""
    cache = session.cache
    options = {k: v for k, v in session.options.as_dict().items() if k not in _OPTIONS_NOT_KEYED}
    material = {"format": FORMAT, "graph": graph_key, "kind": kind, "sources": source_hash(),
                "target": session.target_for(()).describe(),
                "kernel_cache": str(cache.dir) if cache is not None else None, "options": options}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


# --- the payload's references ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _NodeRef:
    name: str


@dataclasses.dataclass(frozen=True)
class _KernelRef:
    key: str
    donating: bool
    layout_checks: tuple


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, fx.Node):
            return ("node", obj.name)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", op_name(obj))
        if isinstance(obj, torch.dtype):
            return ("dtype", str(obj).removeprefix("torch."))
        if isinstance(obj, torch.device):
            return ("device", str(obj))
        if isinstance(obj, (torch.layout, torch.memory_format)):
            return ("torch", str(obj).removeprefix("torch."))
        if type(obj) is TritonCall:
            return ("kernel", obj.spec.key, hasattr(obj, "donated_inputs"), tuple(obj.layout_checks))
        if isinstance(obj, FoldedView):
            return ("view", obj.size, obj.stride, obj.delta, obj.root_stride, obj.chain)
        return None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"an executable cache entry may not name {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        if kind == "node":
            return _NodeRef(*rest)
        if kind == "op":
            return _overload(*rest)
        if kind == "dtype":
            dtype = getattr(torch, rest[0], None)
            if not isinstance(dtype, torch.dtype):
                raise pickle.UnpicklingError(f"{rest[0]!r} is not a dtype")
            return dtype
        if kind == "device":
            return torch.device(*rest)
        if kind == "torch":
            value = getattr(torch, rest[0], None)
            if not isinstance(value, (torch.layout, torch.memory_format)):
                raise pickle.UnpicklingError(f"{rest[0]!r} is not a layout or memory format")
            return value
        if kind == "kernel":
            return _KernelRef(*rest)
        if kind == "view":
            return FoldedView(*rest)
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")


def _overload(name: Any) -> torch._ops.OpOverload:
    """The operator an entry names, which must be an OpOverload: pickle calls what a reference
    resolves to, and other attributes of ``torch.ops`` (``import_module``, ``load_library``, their
    ``__call__``) would run what the entry chose."""
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or not all(p.isidentifier() and not p.startswith("__") for p in parts) \
            or not isinstance(getattr(torch.ops, parts[0], None), torch._ops._OpNamespace):
        raise pickle.UnpicklingError(f"{name!r} is not an operator name")
    op = resolve_op(name)
    if not isinstance(op, torch._ops.OpOverload):
        raise pickle.UnpicklingError(f"{name!r} is not an operator overload")
    return op


def _dumps(data: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(data)
    return buf.getvalue()


def _loads(payload: bytes) -> Any:
    return _Unpickler(io.BytesIO(payload)).load()


def _resolve(a: Any, env: dict[str, fx.Node]) -> Any:
    """Node references of a loaded argument replaced by the rebuilt graph's nodes."""
    if isinstance(a, _NodeRef):
        return env[a.name]
    if isinstance(a, tuple):
        return tuple(_resolve(x, env) for x in a)
    if isinstance(a, list):  # immutable_list too: FX makes its own again
        return [_resolve(x, env) for x in a]
    if isinstance(a, dict):
        return {k: _resolve(v, env) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_resolve(a.start, env), _resolve(a.stop, env), _resolve(a.step, env))
    return a


# --- what may be stored ---------------------------------------------------------------------------

_STORABLE_TARGETS = (torch._ops.OpOverload, FoldedView)


def _unstorable(lowered: "LoweredGraph", first: Specialization | None) -> str:
    """Why this lowered graph's executable may not be stored ("" when it may)."""
    if lowered.kind != "inference":
        return f"a {lowered.kind} graph"
    if lowered.session.options.check:
        return "check mode"
    if first is None:
        return "the graph's shapes are not static"
    if first.has_first_call_work:
        return "its first call captures repros (or refuses missing ops)"
    if any(w is None for w in first.lookups.values()):
        return "a kernel cache entry changed while it was planned, or is invalid"
    if any(lowered.session.runner_failed(key) for key in first.lookups):
        return "a cached kernel did not load (a later process tries again)"
    for node in first.gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        target = node.target
        if node.op != "call_function" or not (
                target is operator.getitem or type(target) is TritonCall or isinstance(target, _STORABLE_TARGETS)):
            return f"node {node.name} calls {getattr(target, '__name__', target)!r}"
    return ""


@dataclasses.dataclass
class Restored:
    """A hit: the executable, and what the runtime wrapper does around it (graph_cache.Loaded's)."""
    lowered: "LoweredGraph"
    version_bumps: list[int]
    returned_inputs: list[list[int]]


class ExecutableCache:
    """The entries under one folder (the graph cache's); made on the first save."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    # --- storing ----------------------------------------------------------------------------------
    def save(self, key: str, lowered: "LoweredGraph", version_bumps: Sequence[int],
             returned_inputs: Sequence[Sequence[int]]) -> bool:
        """Store ``lowered``'s bound executable if it may be; never raises."""
        try:
            first = lowered.static_specialization()
            why = _unstorable(lowered, first)
            if why:
                stats["bypass"] += 1
                log.debug("executable cache: not storing %s: %s", key[:16], why)
                return False
            nodes = [(n.op, n.name, n.target, n.args, n.kwargs) for n in first.gm.graph.nodes]
            bindings = {n.name: binding_name(n.meta.get("binding")) for n in first.gm.graph.nodes}
            data = {
                "nodes": nodes,
                # the public binding the generated code calls for a vendor op (flat_code.py): the
                # restored graph has no traced values to choose it with
                "bindings": {k: v for k, v in bindings.items() if v is not None},
                "decisions": [d.to_json() for d in first.decisions],
                "regions": [d.to_json() for d in first.regions],
                "lookups": first.lookups,
                # a miss's repro is written once; a process that finds it wanted takes the normal path
                "miss_specs": [d.spec.to_json() for d in first.decisions + first.regions if d.repro and d.spec],
                "signature": lowered.report.signature,
                "mutated_inputs": list(lowered.mutated_inputs),
                "version_bumps": [int(i) for i in version_bumps],
                "returned_inputs": [[int(o), int(i)] for o, i in returned_inputs],
            }
            payload = _dumps(data)
            _loads(payload)  # what cannot be read back is not written
            header = {"format": FORMAT, "key": key, "torch": torch.__version__, "created": time.time(),
                      "nodes": len(nodes), "kernels": sum(type(n[2]) is TritonCall for n in nodes),
                      "prewarm": prewarm.section(first)}  # a hit copies it to the program's prewarm index
            self.root.mkdir(parents=True, exist_ok=True)
            write_file_atomic(self.path(key), seal(_MAGIC, header, payload))
            prewarm.note(self.path(key), header["prewarm"], wanted=lowered.session.options.prewarm)
        except Exception as e:
            stats["bypass"] += 1
            log.warning("executable cache: could not store %s under %s: %s: %s", key[:16], self.root,
                        type(e).__name__, e)
            return False
        stats["save"] += 1
        log.debug("executable cache: stored %s (%d nodes)", key[:16], len(nodes))
        return True

    # --- loading ----------------------------------------------------------------------------------
    def load(self, key: str, session: "Session", example_inputs: Sequence[Any]) -> Restored | None:
        """The executable stored under ``key`` if it is still what lowering would bind; else None."""
        path = self.path(key)
        try:
            raw = read_regular(path)
        except FileNotFoundError:
            stats["miss"] += 1
            return None
        except OSError as e:
            return self._corrupt(path, f"unreadable: {e}")
        try:
            header, payload = unseal(raw, _MAGIC)
            if header.get("format") != FORMAT or header.get("key") != key:
                raise ValueError(f"entry is for format {header.get('format')} key {str(header.get('key'))[:16]}")
            data = _loads(payload)
            restored = self._restore(data, session, example_inputs)
        except Stale as e:
            stats["stale"] += 1
            log.info("executable cache entry %s is stale (%s): lowering the graph again", key[:16], e)
            return None
        except Exception as e:
            return self._corrupt(path, f"{type(e).__name__}: {e}")
        stats["hit"] += 1
        log.info("executable cache hit %s (%s): planning and binding skipped", key[:16], path)
        prewarm.note(path, header.get("prewarm"), wanted=session.options.prewarm)
        return restored

    def _restore(self, data: dict, session: "Session", example_inputs: Sequence[Any]) -> Restored:
        from torch_kernelize.compiling.lower import LoweredGraph

        cache = session.cache
        entries = {}
        for key, witness in data["lookups"].items():
            recalled = cache.recall(key, witness) if cache is not None else None
            if recalled is None:
                raise Stale(f"kernel cache entry {key} changed")
            entries[key] = recalled[1]
        repros = session.repros
        miss_specs = [KernelSpec.from_json(s) for s in data["miss_specs"]]
        for spec in miss_specs:
            if repros is not None and repros.wants(spec):
                raise Stale(f"the repro of miss {spec.key} is wanted")
        specs = {s.key: s for s in miss_specs} | {k: e.spec for k, e in entries.items() if e is not None}

        def decision(j: dict) -> Decision:
            d = Decision(**j)
            d.spec, d.entry = specs.get(d.spec_key), entries.get(d.spec_key)
            return d

        def bind(lowered: LoweredGraph) -> Specialization:
            calls: dict[_KernelRef, TritonCall] = {}

            def kernel(ref: _KernelRef) -> TritonCall:
                if ref not in calls:
                    entry = entries.get(ref.key)
                    runner = session.load_runner(entry.spec, entry) if entry is not None else None
                    if runner is None:
                        raise Stale(f"kernel {ref.key} could not be loaded")
                    call = lowered.triton_call(entry.spec, runner)
                    if ref.donating:
                        call = call.donating()
                        if call is None:
                            raise Stale(f"kernel {ref.key} no longer runs in place")
                    if ref.layout_checks:
                        call = copy.copy(call)
                        call.layout_checks = ref.layout_checks
                    calls[ref] = call
                return calls[ref]

            graph = fx.Graph()
            env: dict[str, fx.Node] = {}
            for op, name, target, args, kwargs in data["nodes"]:
                if isinstance(target, _KernelRef):
                    target = kernel(target)
                node = graph.create_node(op, target, _resolve(args, env), _resolve(kwargs, env), name)
                if node.name != name:
                    raise ValueError(f"node {name} came back as {node.name}")
                if name in data.get("bindings", {}):
                    node.meta["binding"] = binding_by_name(data["bindings"][name])
                env[name] = node
            gm = _LazyGraphModule(torch.nn.Module(), graph)  # calls run flat_code's function
            spec = Specialization(gm, [decision(j) for j in data["decisions"]], (), None, flat_function(gm))
            spec.regions = [decision(j) for j in data["regions"]]
            spec.lookups = data["lookups"]
            return spec

        lowered = LoweredGraph.from_bound(session, example_inputs, "inference", bind, data["signature"],
                                          data["mutated_inputs"])
        return Restored(lowered, data["version_bumps"], data["returned_inputs"])

    def _corrupt(self, path: Path, why: str) -> None:
        stats["corrupt"] += 1
        if str(path) not in _warned:
            _warned.add(str(path))
            log.warning("executable cache entry %s is ignored (%s); the graph is lowered again and the "
                        "entry rewritten", path, why)
        return None
