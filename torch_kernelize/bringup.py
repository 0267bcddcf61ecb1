"""Bring a model up on a chip in one command: fill the kernel cache for it, compile it, report.

    python -m torch_kernelize.bringup --target chip.toml --model torch_kernelize.model_zoo:make_hf_llama
    python -m torch_kernelize.bringup --target chip.toml --model a.py:make --model b.py:make --budget 2

For each model: ``fill_cache --model`` on the target, then ``torch.compile(model, backend="kernelize")``
run once under no_grad beside eager. The summary gives, per model, the nodes per tier, the share
that runs on the target (every tier but the host fallback) and the largest difference from eager;
then each host fallback left with its reproducer folder, and the missing ops across all models.

Exit codes: 0 every node of every model runs on the target and matches eager; 1 some node still
runs on the host, or a model's output differs from eager; 2 bad input (target file, model
reference, arguments).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from torch_kernelize.core.errors import KernelizeError
from torch_kernelize.core.decision import TIERS

log = logging.getLogger("torch_kernelize.bringup")


@dataclasses.dataclass
class ModelResult:
    model: str
    fill_exit: int
    tiers: dict[str, int]
    max_err: float
    matches: bool
    fallbacks: list[tuple[str, str | None]]  # (op, repro folder)

    @property
    def nodes(self) -> int:
        return sum(self.tiers.values())

    @property
    def on_target_pct(self) -> float:
        return 100.0 * (self.nodes - self.tiers["fallback"]) / self.nodes if self.nodes else 100.0


def flat_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, whatever container it comes in (HF ModelOutput too)."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _max_err(got: Any, want: Any) -> float:
    gots, wants = flat_tensors(got), flat_tensors(want)
    if len(gots) != len(wants):
        return float("inf")
    errs = [float((g.detach().double().cpu() - w.detach().double().cpu()).abs().max()) if g.numel() else 0.0
            for g, w in zip(gots, wants) if g.is_floating_point()]
    return max(errs, default=0.0)


def compile_and_report(ref: str, target: Any, cache_dir: Path, repro_dir: Path | None) -> ModelResult:
    """Compile one model for ``target`` with the kernel cache as it is, run it once, and collect
    the plans of its graphs."""
    from torch_kernelize.fill_cache.collect import run_compiled

    model, inputs, got, graphs = run_compiled(ref, target, cache_dir, repro_dir)
    with torch.no_grad():
        want = model(*inputs)
    tiers: collections.Counter = collections.Counter()
    fallbacks = []
    for g in graphs:
        for d in g.report.decisions:
            if d.tier == "decompose":
                continue  # the node was replaced; its decomposition's nodes are counted instead
            tiers[d.tier] += 1
            if d.tier == "fallback":
                fallbacks.append((d.op, d.repro))
    err = _max_err(got, want)
    tol = 1e-2 if any(t.dtype in (torch.float16, torch.bfloat16) for t in flat_tensors(want)) else 1e-4
    scale = max([float(t.detach().abs().max()) for t in flat_tensors(want) if t.numel() and t.is_floating_point()],
                default=1.0)
    return ModelResult(ref, 0, {t: tiers.get(t, 0) for t in TIERS if t != "decompose"}, err,
                       err <= tol * max(1.0, scale), fallbacks)


def format_summary(results: list[ModelResult], target_name: str) -> str:
    lines = [f"bring-up on target {target_name!r}",
             f"  {'model':<44}{'nodes':>7}" + "".join(f"{t:>10}" for t in TIERS if t != "decompose")
             + f"{'on target':>11}{'max err':>10}  fill"]
    for r in results:
        lines.append(f"  {r.model:<44}{r.nodes:>7}" + "".join(f"{r.tiers[t]:>10}" for t in r.tiers)
                     + f"{r.on_target_pct:>10.1f}%{r.max_err:>10.1e}  {'ok' if r.fill_exit == 0 else r.fill_exit}"
                     + ("" if r.matches else "  DIFFERS FROM EAGER"))
    left = [(r.model, op, repro) for r in results for op, repro in r.fallbacks]
    if left:
        lines.append("  host fallbacks left (fill them: python -m torch_kernelize.fill_cache --repros <folder>):")
        for model, op, repro in left:
            lines.append(f"    {model}: {op}  repro: {repro or '(dumping off)'}")
        lines.append("  missing ops across all models: " + ", ".join(sorted({op for _, op, _ in left})))
    else:
        lines.append("  every node runs on the target: no host fallback left")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_kernelize.bringup", description=__doc__.split("\n\n")[0],
                                epilog="exit codes: 0 all on the target and matching eager, 1 host fallbacks left "
                                       "or an output differs, 2 bad input")
    p.add_argument("--target", required=True, help="target name or TOML file of the chip")
    p.add_argument("--model", action="append", required=True, metavar="PATH.py:FN|pkg.module:FN",
                   help="a function returning (model, example_inputs); may be repeated")
    p.add_argument("--cache-dir", type=Path, default=None, help="kernel cache (default: the fill_cache default)")
    p.add_argument("--repro-dir", type=Path, default=Path("kernelize_repros"),
                   help="where the reproducers of what is left go (default ./kernelize_repros)")
    p.add_argument("--budget", type=int, default=None, help="candidates per spec for fill_cache")
    p.add_argument("--no-fill", action="store_true", help="report with the cache as it is")
    p.add_argument("--json", type=Path, default=None, help="write the summary as JSON too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from torch_kernelize.fill_cache import cli as fill_cli
    from torch_kernelize.fill_cache.collect import UsageError
    from torch_kernelize.core.targets import get_target
    from torch_kernelize.core.options import default_cache_dir

    cache_dir = args.cache_dir or default_cache_dir()
    try:
        target = get_target(args.target)
    except KernelizeError as e:
        print(f"bringup: error: {e}", file=sys.stderr)
        return 2
    results = []
    for ref in args.model:
        fill_exit = 0
        if not args.no_fill and target.has_triton:
            fill_args = ["--model", ref, "--target", args.target, "--cache-dir", str(cache_dir), "--quiet"]
            fill_exit = fill_cli.main(fill_args + (["--budget", str(args.budget)] if args.budget else []))
            if fill_exit == 2:
                return 2  # fill_cache said what was wrong with the input
        try:
            result = compile_and_report(ref, target, cache_dir, args.repro_dir)
        except (UsageError, KernelizeError) as e:
            print(f"bringup: error: {e}", file=sys.stderr)
            return 2
        result.fill_exit = fill_exit
        results.append(result)
    print(format_summary(results, target.name))
    if args.json is not None:
        args.json.write_text(json.dumps([dict(dataclasses.asdict(r), on_target_pct=r.on_target_pct)
                                         for r in results], indent=1))
    return 0 if all(r.on_target_pct == 100.0 and r.matches for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
