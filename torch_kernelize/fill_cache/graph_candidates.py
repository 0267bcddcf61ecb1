"""Graphs compete as wholes: the candidates of a whole graph's spec (compiling/whole_graph.py),
the input domain they are validated on, and the evidence its cache entry keeps of who won.

The candidates, measured through the same harness as any spec's (built, validated at the graph
level against the float64 reference on random and edge inputs with poisoned outputs, timed):
  * Inductor's complete output, captured as a program (inductor_program.py), per mode: default,
    and max-autotune where the graph holds a GEMM or convolution on a GPU, above budget 1 (inductor.py);
  * kernelize's own assembly: the graph as the planner serves it from the cache being filled
    (nodes and regions on their tiers, the whole-graph lookup off). It is the baseline the
    others are timed against, in the vendor's place: "vendor wins" for a whole graph means "own
    assembly wins", stored like any vendor verdict, so the graph is no miss and serving runs it
    as before.
A mix (one of our kernels in place of one of Inductor's where faster on that region) would be
a third generator here: see docs/design.md.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torch_kernelize.compiling.whole_graph import is_whole_graph
from torch_kernelize.core.devices import to_device
from torch_kernelize.core.region_graph import node_ref, region_graph
from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target, resolve_op
from torch_kernelize.lowering.kernels import KernelFamily
from torch_kernelize.lowering.kernels.base import sample_generator, sample_tensor

ASSEMBLY = "assembly"   # the candidate name of kernelize's own assembly in the evidence
# ops that index a dim of a tensor with an integer tensor: op -> (indexed arg, its dim (an arg
# position, or a fixed dim as a negative number -1 - dim), index arg)
INDEXING = {"aten.embedding.default": (0, -1, 1), "aten.index_select.default": (0, 1, 2),
            "aten.gather.default": (0, 1, 2)}


class WholeGraphDomain(KernelFamily):
    """A whole graph's inputs. Its integer and boolean inputs as the model's own call gave them,
    where the fill captured them (``pin``: token ids, routing indices, masks: their domain is the
    model's, which no rule here knows; Mixtral's stretches hit device-side asserts on drawn ones);
    else an integer input that indexes a dim directly (token ids into an embedding,
    index_select/gather indices, through views) is drawn in [0, that size); one that scatters
    into every row of a buffer its length (``index_put`` of one index, not accumulating: a sort's
    inverse permutation, as an MoE router computes it) is drawn as a permutation, the one domain
    where that op writes each row once, in any order; any other integer
    input is zeros, the one value that is in range wherever arithmetic the graph does on it (a
    cumsum of a mask, an offset added to positions) ends up indexing. Floating inputs are drawn
    as any spec's (random and edge values). An index out of range is a device-side assert on
    CUDA, which ends the process."""

    name = "whole-graph"

    def __init__(self) -> None:
        self.pins: dict[str, dict[int, torch.Tensor]] = {}  # spec key -> input position -> its value (host)

    def pin(self, key: str, values: dict[int, torch.Tensor] | None) -> None:
        """Take the inputs at these positions of the graph ``key`` as given, whatever the trial;
        None: draw them all (what an earlier run pinned for the key is dropped: a worker serves
        one run after another)."""
        if values:
            self.pins[key] = dict(values)
        else:
            self.pins.pop(key, None)

    def supports(self, spec: KernelSpec) -> str | None:
        return None if is_whole_graph(spec) else "whole graphs only"

    def sample_inputs(self, spec: KernelSpec, seed: int, kind: str = "random",
                      device: str | torch.device = "cpu") -> list[torch.Tensor]:
        g = sample_generator(seed, device)
        bounds, permuted = index_bounds(spec), permutation_inputs(spec)
        pins = self.pins.get(spec.key, {})

        def draw(i: int, m: Any) -> torch.Tensor:
            if i in pins:
                return torch.empty_strided(m.shape, m.stride, dtype=m.torch_dtype).copy_(pins[i])
            if i in permuted:
                order = torch.randperm(m.numel, generator=g, device=g.device).to(m.torch_dtype).reshape(m.shape)
                return torch.empty_strided(m.shape, m.stride, dtype=m.torch_dtype, device=g.device).copy_(order)
            if m.torch_dtype.is_floating_point or m.torch_dtype.is_complex or m.dtype == "bool":
                return sample_tensor(m, g, kind)
            return sample_tensor(m, g, kind if i in bounds else "zeros", 0, bounds.get(i, 1))
        return [to_device(draw(i, m), device) for i, m in enumerate(spec.inputs)]


WHOLE_GRAPH_DOMAIN = WholeGraphDomain()


def index_bounds(spec: KernelSpec) -> dict[int, int]:
    """Spec input -> the smallest size it indexes (through views), for the integer inputs that do."""
    graph = region_graph(spec)
    nodes = graph["nodes"]

    def source(a: Any) -> int | None:  # the spec input an argument is, or a view of
        while (r := node_ref(a)) is not None:
            if r[0] == "input":
                return r[1]
            n = nodes[r[1]]
            if n["op"] == "getitem" or not resolve_op(n["op"]).is_view:
                return None
            a = n["args"][0]
        return None

    def size(a: Any, dim: int) -> int | None:
        r = node_ref(a)
        if r is None:
            return None
        shape = spec.inputs[r[1]].shape if r[0] == "input" else (nodes[r[1]]["meta"] or {}).get("shape")
        return shape[dim] if shape and -len(shape) <= dim < len(shape) else None

    bounds: dict[int, int] = {}
    for n in nodes:
        if n["op"] not in INDEXING:
            continue
        table, dim_at, index_at = INDEXING[n["op"]]
        args = n["args"]
        dim = -1 - dim_at if dim_at < 0 else (args[dim_at] if len(args) > dim_at else None)
        i = source(args[index_at]) if len(args) > index_at else None
        bound = size(args[table], dim) if isinstance(dim, int) else None
        if i is not None and bound:
            bounds[i] = min(bound, bounds.get(i, bound))
    return bounds


def permutation_inputs(spec: KernelSpec) -> set[int]:
    """The integer spec inputs that are the one index of a non-accumulating ``index_put`` into a
    dim as long as they are (each row written once: a permutation is their domain)."""
    nodes = region_graph(spec)["nodes"]
    found = set()
    for n in nodes:
        if n["op"] not in ("aten.index_put.default", "aten.index_put_.default"):
            continue
        args = n["args"]
        accumulate = args[3] if len(args) > 3 else n["kwargs"].get("accumulate", False)
        indices = args[1] if len(args) > 1 and isinstance(args[1], list) else []
        refs = [node_ref(a) for a in indices]
        if accumulate or len(refs) != 1 or refs[0] is None or refs[0][0] != "input":
            continue
        target = node_ref(args[0])
        shape = spec.inputs[target[1]].shape if target and target[0] == "input" else \
            (nodes[target[1]]["meta"] or {}).get("shape") if target else None
        meta = spec.inputs[refs[0][1]]
        integer = not (meta.torch_dtype.is_floating_point or meta.torch_dtype.is_complex or meta.dtype == "bool")
        if integer and shape and len(meta.shape) == 1 and meta.shape[0] == shape[0]:  # (a bool mask selects)
            found.add(refs[0][1])
    return found


def assembly_runner(spec: KernelSpec, target: Target, cache_dir: Path,
                    set_aside: frozenset[str] = frozenset()) -> Callable[[Sequence[Any]], Any]:
    """A function of the spec's inputs that runs the graph as kernelize serves it today from
    ``cache_dir`` (without its own whole-graph entry): the planner's ladder, regions, families;
    the entries of ``set_aside`` taken as "vendor wins" (compiling/set_aside.py; such a lowering
    neither reads nor writes the graph and executable caches: it is not what serving runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from torch_kernelize.compiling.lower import LoweredGraph, Session
    from torch_kernelize.core.options import Options
    from torch_kernelize.core.region_graph import region_graph_module

    gm = region_graph_module(spec)
    device = "cuda" if target.device == "cuda" else "cpu"
    examples = [m.empty(device) for m in spec.inputs]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) for t in examples])
    options = Options.for_fill(cache_dir)
    if set_aside:
        options = dataclasses.replace(options, graph_cache=None, executable_cache=False)
    session = Session(options, target)
    session.set_aside = frozenset(set_aside)
    lowered = LoweredGraph(gm, examples, session, "inference", whole=False)

    def run(inputs: Sequence[Any]) -> Any:
        return lowered(list(inputs))
    run.lowered = lowered  # (what it planned: its report)
    return run


def candidate_name(config: dict[str, Any]) -> str:
    """``inductor default``, ``inductor max-autotune``, ``inductor default patch-conv`` (over the
    graph rewritten so); a family's config written out."""
    if "mode" in config:
        rewrite = f" {config['rewrite']}" if config.get("rewrite") else ""
        return f"{config.get('generator', 'inductor')} {config['mode']}{rewrite}"
    return " ".join(f"{k}={v}" for k, v in sorted(config.items()))


def graph_evidence(evaluated: Sequence[dict[str, Any]], winner: str, timings: dict[str, Any],
                   best: dict[str, Any] | None) -> dict[str, Any]:
    """Who competed for a whole graph, their times and the winner, as its entry and the fill
    summary keep it: each evaluation of the search, then the own assembly. ``timings``: the
    entry's (fill_run._confirmed): where the best and the assembly were timed again, alternately,
    those times decided, so those are the times both show (``confirmed``); the others keep the
    search's."""
    confirmed = {"confirmed": True} if timings.get("confirmed") else {}
    candidates = []
    for r in evaluated:
        ms, extra = r.get("candidate_ms"), {}
        if best is not None and r.get("config") == best.get("config"):
            ms, extra = timings.get("candidate_ms", ms), confirmed
        candidates.append({"name": candidate_name(r["config"]), "ms": ms, "correct": bool(r["correct"]), **extra,
                           **({"error": r["error"][:200]} if r.get("error") else {})})
    candidates.append({"name": ASSEMBLY, "ms": timings.get("vendor_ms"), "correct": True, **confirmed})
    if winner == "vendor":
        name = ASSEMBLY
    elif best is not None:
        name = candidate_name(best["config"])
    else:
        name = ASSEMBLY
    return {"candidates": candidates, "winner": name}


def rejudged_evidence(evidence: dict[str, Any], assembly_ms: float, program_ms: float) -> dict[str, Any]:
    """``evidence`` after the winning program and the own assembly were timed again at the end of
    the run (fill_run.FillRun.rejudge_wholes) and the assembly won."""
    candidates = [dict(c, ms=program_ms, rejudged=True) if c["name"] == evidence["winner"] else
                  dict(c, ms=assembly_ms, rejudged=True) if c["name"] == ASSEMBLY else c
                  for c in evidence["candidates"]]
    return {"candidates": candidates, "winner": ASSEMBLY}
