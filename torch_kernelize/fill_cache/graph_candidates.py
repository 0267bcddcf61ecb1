"""Graphs compete as wholes: the candidates of a whole graph's spec (compiling/whole_graph.py),
and the evidence its cache entry keeps of who won.

The candidates, measured through the same harness as any spec's (built, validated at the graph
level against the float64 reference on random and edge inputs with poisoned outputs, timed):
  * Inductor's complete output, captured as a program (inductor_program.py), per mode: default,
    and max-autotune where the graph holds a GEMM or convolution on a GPU (inductor.py);
  * kernelize's own assembly: the graph as the planner serves it from the cache being filled
    (nodes and regions on their tiers, the whole-graph lookup off). It is the baseline the
    others are timed against, in the vendor's place: "vendor wins" for a whole graph means "own
    assembly wins", stored like any vendor verdict, so the graph is no miss and serving runs it
    as before.
A mix (one of our kernels in place of one of Inductor's where faster on that region) would be
a third generator here: see docs/design.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from torch_kernelize.core.spec import KernelSpec
from torch_kernelize.core.targets import Target

ASSEMBLY = "assembly"   # the candidate name of kernelize's own assembly in the evidence


def assembly_runner(spec: KernelSpec, target: Target, cache_dir: Path) -> Callable[[Sequence[Any]], Any]:
    """A function of the spec's inputs that runs the graph as kernelize serves it today from
    ``cache_dir`` (without its own whole-graph entry): the planner's ladder, regions, families."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from torch_kernelize.compiling.lower import lower
    from torch_kernelize.core.options import Options
    from torch_kernelize.core.region_graph import region_graph_module

    gm = region_graph_module(spec)
    device = "cuda" if target.device == "cuda" else "cpu"
    examples = [m.empty(device) for m in spec.inputs]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) for t in examples])
    options = Options(target=None, cache_dir=Path(cache_dir), repro_dir=None, report=None)
    lowered = lower(gm, examples, options, "inference", target, whole=False)
    return lambda inputs: lowered(list(inputs))


def candidate_name(config: dict[str, Any]) -> str:
    """``inductor default``, ``inductor max-autotune``; a family's config written out."""
    if "mode" in config:
        return f"{config.get('generator', 'inductor')} {config['mode']}"
    return " ".join(f"{k}={v}" for k, v in sorted(config.items()))


def graph_evidence(evaluated: Sequence[dict[str, Any]], winner: str, assembly_ms: float | None,
                   best: dict[str, Any] | None) -> dict[str, Any]:
    """Who competed for a whole graph, their times and the winner, as its entry and the fill
    summary keep it: each evaluation of the search, then the own assembly."""
    candidates = []
    for r in evaluated:
        ms = r.get("candidate_ms")
        if best is not None and r.get("config") == best.get("config"):
            ms = best.get("candidate_ms", ms)
        candidates.append({"name": candidate_name(r["config"]), "ms": ms, "correct": bool(r["correct"]),
                           **({"error": r["error"][:200]} if r.get("error") else {})})
    candidates.append({"name": ASSEMBLY, "ms": assembly_ms, "correct": True})
    if winner == "vendor":
        name = ASSEMBLY
    elif best is not None:
        name = candidate_name(best["config"])
    else:
        name = ASSEMBLY
    return {"candidates": candidates, "winner": name}
