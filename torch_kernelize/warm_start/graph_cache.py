"""A persistent cache of the ATen graphs aot_autograd makes out of Dynamo graphs (option ``graph_cache``).

Inductor's warm processes skip aot_autograd through its AOTAutogradCache, but that cache stores
Inductor's compiled output (an ``OutputCode`` found in the FX graph cache) and keys on Inductor's
configuration: it has no place for another compiler's artifact. So this cache stores the ATen
graph, pickled with torch's own ``GraphPickler`` (fake-tensor metadata included). A warm process
loads it and lowers it as usual, skipping aot_autograd's trace, the decomposition table and the
imports they pull in. kernelize's bound executable is kept beside each entry by the executable
cache (executable_cache.py), which a warm process asks first: it holds loaded kernels' keys, not
the kernels, and is trusted only while the kernel-cache lookups it was planned from still hold.

Only graphs for which aot_autograd's runtime wrapper does no more than switch grad off, bump the
version counters of inputs the graph writes in place and hand back inputs that are returned as
they are, are stored: inference graphs of static shapes whose inputs are plain dense tensors,
that write inputs only inside the graph (the ``copy_`` nodes of keep_inference_input_mutations),
return no views of inputs, use no effect tokens, functionalized RNG or autocast, and made
aot_autograd add no guard. Every other graph
takes the normal path (the reason is logged at DEBUG).

An entry is ``<dir>/<key>.graph``: one JSON header line (format, key, sha256 of the payload,
versions), then the payload. Entries are written atomically (temp file + os.replace); one that
fails a check is ignored with one warning, and the normal path writes it anew.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib
import json
import logging
import operator
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from torch_kernelize.kernel_cache.integrity import read_regular, seal, unseal, write_file_atomic

log = logging.getLogger("torch_kernelize.warm_start.graph_cache")

FORMAT = 1
SUFFIX = ".graph"
_MAGIC = b"torch_kernelize graph cache\n"
# The ATen graph depends on these modules' code: the aot_autograd call, the trace-time
# decomposition table, and this file (entry format, runtime wrapper).
_SOURCES = ("torch_kernelize.backend", "torch_kernelize.warm_start.graph_cache",
            "torch_kernelize.compiling.decompositions", "torch_kernelize.compiling.neutral_attention")
_SAFE_OP_NAMESPACES = ("aten", "prims")  # registered whenever torch is imported: loadable anywhere
_SAFE_FUNCTION_MODULES = ("torch", "math", "operator", "_operator", "builtins")

stats: collections.Counter = collections.Counter()  # hit / miss / save / bypass / corrupt, per process
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Probe:
    """What is known about one Dynamo graph before it is compiled: its key, or why it has none."""
    key: str | None
    reason: str = ""
    aot_guards: int = 0      # guards aot_autograd had asked Dynamo for so far (a new one: not cacheable)
    shape_guards: int = 0


def _fail(reason: str) -> Probe:
    stats["bypass"] += 1
    log.debug("graph cache bypassed: %s", reason)
    return Probe(None, reason)


def _tracing_context():
    return torch._guards.TracingContext.try_get()


def _guard_counts() -> tuple[int, int]:
    ctx = _tracing_context()
    if ctx is None:
        return 0, 0
    shape_env = getattr(ctx.fake_mode, "shape_env", None)
    return (len(ctx.guards_context.aotautograd_guards),
            len(shape_env.guards) if shape_env is not None else 0)


def _is_symbolic(v: Any) -> bool:
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _static_tensor(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and not any(map(_is_symbolic, (*t.shape, *t.stride())))
            and not _is_symbolic(t.storage_offset()))


def _safe_target(target: Any) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in _SAFE_OP_NAMESPACES
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0] in _SAFE_OP_NAMESPACES
    if isinstance(target, torch._ops.OperatorBase):  # higher-order ops, custom namespaces
        return False
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in _SAFE_FUNCTION_MODULES


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    return h.hexdigest()


def _code(gm: fx.GraphModule) -> str:
    """``gm.code`` without compiling it where Dynamo's module is still lazy (a warm process never
    runs that module: the key is all it is asked for)."""
    if isinstance(gm, _LazyGraphModule) and gm._needs_recompile():
        return gm.graph.python_code(root_module="self").src
    return gm.code


def probe(gm: fx.GraphModule, example_inputs: Sequence[Any], trace_rewrites: Sequence[str] = ()) -> Probe:
    """The cache key of a Dynamo graph: its code, its inputs' metadata and everything else that
    shapes the ATen graph aot_autograd makes of it (global state, configs, versions, the ops the
    target's trace rewrites)."""
    try:
        return _probe(gm, example_inputs, trace_rewrites)
    except Exception as e:  # the cache must never stop a compile
        return _fail(f"could not key the graph: {type(e).__name__}: {e}")


def _probe(gm: fx.GraphModule, example_inputs: Sequence[Any], trace_rewrites: Sequence[str] = ()) -> Probe:
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            return _fail(f"the graph has a {node.op} node ({node.target})")
        if node.op == "call_function" and not _safe_target(node.target):
            return _fail(f"the graph calls {node.target!r}, whose code is not part of the key")
        if node.op == "placeholder":
            val = node.meta.get("example_value", node.meta.get("val"))
            if not _static_tensor(val):
                return _fail(f"input {node.name} is not a tensor of static shape")
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        return _fail("the graph module holds parameters or buffers")
    storages: dict[int, int] = {}
    inputs = []
    for a in example_inputs:
        if type(a) not in (torch.Tensor, torch.nn.Parameter) or a.layout != torch.strided or a.is_meta:
            return _fail(f"an input is a {type(a).__name__} ({getattr(a, 'layout', '')}), not a dense tensor")
        group = storages.setdefault(a.untyped_storage()._cdata, len(storages))
        inputs.append([list(a.shape), list(a.stride()), a.storage_offset(), str(a.dtype), str(a.device),
                       a.requires_grad, a.is_leaf, a.is_inference(), group])
    if torch._C._is_any_autocast_enabled():
        return _fail("autocast is enabled")
    material = {
        "format": FORMAT,
        "code": _code(gm),
        "inputs": inputs,
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "functorch_config": hashlib.sha256(torch._functorch.config.save_config()).hexdigest(),
        "torch": [torch.__version__, torch.version.git_version],
        "python": list(sys.version_info[:2]),
        "kernelize_sources": _source_hash(),
        "trace_rewrites": list(trace_rewrites),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return Probe(key, "", *_guard_counts())


def _unsafe_result(probe: Probe, aten_gm: fx.GraphModule, n_inputs: int) -> str:
    """Why the inference graph just compiled may not be cached ("" when it may)."""
    ctx = _tracing_context()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        return "aot_autograd's metadata is not available"
    try:
        from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta
        if meta.num_mutated_inp_runtime_indices or any(
                i.mutates_metadata or getattr(i, "mutates_storage_metadata", False) for i in meta.input_info):
            return "an input is written outside the graph (by aot_autograd's runtime wrapper)"
        list(meta.mutated_graph_handled_indices_seen_by_autograd)  # what _wrapper_work reads
        if any(o.output_type not in (OutputType.non_alias, OutputType.is_input) or o.dynamic_dims
               for o in meta.output_info):
            return "an output is a view of an input or of an intermediate, or has dynamic dims"
        if (meta.num_intermediate_bases or meta.tokens or meta.is_rng_op_functionalized
                or meta.grad_enabled_mutation is not None
                or any(isinstance(m, SubclassCreationMeta)
                       for m in [*(meta.subclass_inp_meta or []), *(meta.subclass_fw_graph_out_meta or [])])):
            return "the runtime wrapper has work to do (intermediate bases, tokens, RNG, grad mode or subclasses)"
    except AttributeError as e:  # a torch whose metadata we do not know: do not guess
        return f"unknown aot_autograd metadata ({e})"
    if _guard_counts() != (probe.aot_guards, probe.shape_guards):
        return "compiling added guards"
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != n_inputs:
        return f"the ATen graph takes {len(placeholders)} inputs, Dynamo's {n_inputs}"
    for node in aten_gm.graph.nodes:
        if node.op == "get_attr":
            return f"the ATen graph holds a constant ({node.target})"
        if node.op == "call_function" and not (node.target is operator.getitem or (
                isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in _SAFE_OP_NAMESPACES)):
            return f"the ATen graph calls {node.target}"
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (tuple, list)) else (vals,):
            if _is_symbolic(v) or (isinstance(v, torch.Tensor) and not _static_tensor(v)):
                return f"node {node.name} has a symbolic size"
    return ""


def _wrapper_work() -> dict[str, list]:
    """What aot_autograd's runtime wrapper does around this graph, for cached_runtime to do the same:
    bump the version counters of inputs written in the graph (the writes autograd sees), and return
    the caller's input object for outputs that are an input itself ([output index, input index])."""
    from torch._functorch._aot_autograd.schemas import OutputType

    meta = _tracing_context().fw_metadata
    return {"version_bumps": [int(i) for i in meta.mutated_graph_handled_indices_seen_by_autograd],
            "returned_inputs": [[i, int(o.base_idx)] for i, o in enumerate(meta.output_info)
                                if o.output_type == OutputType.is_input]}


def _dumps(gm: fx.GraphModule) -> bytes:
    """GraphPickler's bytes of ``gm`` keeping only the metadata the planner reads (node.meta['val'])."""
    from torch.fx._graph_pickler import GraphPickler, Options

    nodes = list(gm.graph.nodes)
    saved = [n.meta for n in nodes], gm.meta
    try:
        for n in nodes:
            n.meta = {"val": n.meta["val"]} if "val" in n.meta else {}
        gm.meta = {}
        return GraphPickler.dumps(gm, Options(ops_filter=None))  # our own filter ran before
    finally:
        for n, m in zip(nodes, saved[0]):
            n.meta = m
        gm.meta = saved[1]


@dataclasses.dataclass
class Loaded:
    """A cache hit: the ATen graph and what the runtime wrapper must do around it."""
    gm: fx.GraphModule
    version_bumps: list[int]
    returned_inputs: list[list[int]]


def _index(i: Any, n: int) -> bool:
    return isinstance(i, int) and 0 <= i < n


class GraphCache:
    """The entries under one folder; cheap to construct, the folder is made on the first save."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def gc(self, max_age_s: float) -> int:
        """Remove the temp files of writers killed mid-write (graph and executable entries alike,
        older than ``max_age_s``); returns how many."""
        count, now = 0, time.time()
        for path in self.root.glob(".*.tmp-*"):
            try:
                if now - path.lstat().st_mtime >= max_age_s:
                    path.unlink()
                    count += 1
            except OSError as e:
                log.warning("graph cache: gc could not remove %s: %s", path, e)
        return count

    def load(self, probe: Probe, example_inputs: Sequence[Any]) -> Loaded | None:
        """The cached ATen graph for ``probe``'s key, checked against the inputs; None on a miss."""
        path = self.path(probe.key)
        try:
            data = read_regular(path)
        except FileNotFoundError:
            stats["miss"] += 1
            log.debug("graph cache miss %s", probe.key[:16])
            return None
        except OSError as e:
            return self._corrupt(path, f"unreadable: {e}")
        try:
            loaded = self._parse(data, probe.key, example_inputs)
        except Exception as e:
            return self._corrupt(path, f"{type(e).__name__}: {e}")
        stats["hit"] += 1
        log.info("graph cache hit %s (%s): aot_autograd skipped", probe.key[:16], path)
        return loaded

    def _parse(self, data: bytes, key: str, example_inputs: Sequence[Any]) -> Loaded:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler

        header, payload = unseal(data, _MAGIC)
        if header.get("format") != FORMAT or header.get("key") != key:
            raise ValueError(f"entry is for format {header.get('format')} key {str(header.get('key'))[:16]}")
        ctx = _tracing_context()
        gm = GraphPickler.loads(payload, ctx.fake_mode if ctx is not None else FakeTensorMode())
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise ValueError(f"graph takes {len(placeholders)} inputs, not {len(example_inputs)}")
        for n, a in zip(placeholders, example_inputs):
            v = n.meta.get("val")
            if not (_static_tensor(v) and v.shape == a.shape and v.stride() == a.stride()
                    and v.dtype == a.dtype and v.device == a.device):
                raise ValueError(f"input {n.name} does not match the call's")
        bumps, returned = header.get("version_bumps"), header.get("returned_inputs")
        n_out = len(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])
        if not (isinstance(bumps, list) and all(_index(i, len(example_inputs)) for i in bumps)
                and isinstance(returned, list) and all(isinstance(p, list) and len(p) == 2 and _index(p[0], n_out)
                                                      and _index(p[1], len(example_inputs)) for p in returned)):
            raise ValueError(f"bad wrapper work {bumps!r} {returned!r}")
        # Lowering only reads this graph; the repro tools that run it get its code generated then.
        return Loaded(_LazyGraphModule(gm, gm.graph), bumps, returned)

    def _corrupt(self, path: Path, why: str) -> None:
        stats["corrupt"] += 1
        if str(path) not in _warned:
            _warned.add(str(path))
            log.warning("graph cache entry %s is ignored (%s); it is compiled again and rewritten", path, why)
        return None

    def save(self, probe: Probe, aten_gm: fx.GraphModule, n_inputs: int) -> dict[str, list] | None:
        """Store ``aten_gm`` (the inference graph aot_autograd just gave us) if it is safe to reuse;
        returns the runtime wrapper's work around it (see Loaded) when stored, else None.
        Never raises: a failure to store only costs the next process the normal path."""
        try:
            why = _unsafe_result(probe, aten_gm, n_inputs)
            if why:
                stats["bypass"] += 1
                log.debug("graph cache: not storing %s: %s", probe.key[:16], why)
                return None
            payload = _dumps(aten_gm)
            work = _wrapper_work()
            header = {"format": FORMAT, "key": probe.key, **work, "torch": torch.__version__,
                      "created": time.time(), "nodes": len(aten_gm.graph.nodes)}
            self.root.mkdir(parents=True, exist_ok=True)
            write_file_atomic(self.path(probe.key), seal(_MAGIC, header, payload))
        except Exception as e:
            stats["bypass"] += 1
            log.warning("graph cache: could not store %s under %s: %s: %s", probe.key[:16], self.root,
                        type(e).__name__, e)
            return None
        stats["save"] += 1
        log.debug("graph cache: stored %s (%d nodes)", probe.key[:16], len(aten_gm.graph.nodes))
        return work


def cached_runtime(run: Callable[[list], Any], version_bumps: Sequence[int] = (),
                   returned_inputs: Sequence[Sequence[int]] = ()) -> Callable[..., Any]:
    """What aot_autograd's runtime wrapper does for the graphs this cache holds: bump the version
    counters of inputs written in the graph, run with grad off (an inference graph may get inputs
    that require grad), return the outputs as a list, an input returned as is being the caller's
    own object."""
    def forward(*args: Any) -> Any:
        for i in version_bumps:
            torch.autograd.graph.increment_version(args[i])
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            out = run(list(args))
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
        out = list(out)
        for o, i in returned_inputs:
            out[o] = args[i]
        return out
    return torch._dynamo.disable(forward)
