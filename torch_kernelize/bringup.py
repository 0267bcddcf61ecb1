"""Bring a model up on a chip in one command: fill the kernel cache for it, compile it, report.

    python -m torch_kernelize.bringup --target chip.toml --model torch_kernelize.model_zoo:make_hf_llama
    python -m torch_kernelize.bringup --target chip.toml --model a.py:make --model b.py:make --budget 2
    python -m torch_kernelize.bringup --target chip.toml --model a.py:make --training

For each model: ``fill_cache --model`` on the target (its progress bar on stderr), then
``torch.compile(model, backend="kernelize")`` run once under no_grad beside eager; with
``--training``, one training step instead (forward, loss, backward: both graphs filled and
compiled), its gradients compared with eager's. Every output is compared: floating and complex
ones within a tolerance, integer and bool ones exactly. The summary gives, per model (and graph
kind), the nodes per tier (views and factories apart from vendor kernels), the share that runs on
the target (report.coverage: the figure the coverage report prints) and the largest difference
from eager; each missing op and shape left on the host with its reproducer folder and the command
that fills it; then, per op, the nodes of every model in each tier.

Exit codes: 0 every node of every model runs on the target and matches eager; 1 some node still
runs on the host, or a model's output (or gradient) differs from eager; 2 bad input (target
file, model reference, arguments).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torch_kernelize.compiling.report import COLUMNS, column, coverage, missing_lines, op_table
from torch_kernelize.core.errors import KernelizeError
from torch_kernelize.fill_cache.collect import output_tensors as flat_tensors  # (benchmarks/bringup_gpu.py)

if TYPE_CHECKING:
    from torch_kernelize.core.targets import Target

log = logging.getLogger("torch_kernelize.bringup")
SHOWN = tuple(c for c in COLUMNS if c != "decompose")  # a decomposed node's own nodes are counted instead


@dataclasses.dataclass
class ModelResult:
    model: str
    fill_exit: int
    tiers: dict[str, int]                # per column (SHOWN), every graph of the model
    max_err: float
    matches: bool
    fallbacks: list[str]                 # report.missing_lines: one per missing op and shape
    on_target_pct: float = 100.0
    kinds: dict[str, float] = dataclasses.field(default_factory=dict)  # graph kind -> its coverage_pct
    differs: str = ""                    # the first output (or gradient) that differs from eager, and how
    per_op: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    missing_ops: list[str] = dataclasses.field(default_factory=list)

    @property
    def nodes(self) -> int:
        return sum(self.tiers.values())


def output_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, str]:
    """How far ``got`` is from eager's ``want``: (error relative to max(1, max|want|), why it is
    wrong or ""). Integer and bool outputs must be equal; complex ones are compared as complex."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf"), f"{got.dtype}{list(got.shape)} where eager gives {want.dtype}{list(want.shape)}"
    if got.numel() == 0:
        return 0.0, ""
    g, w = got.detach().cpu(), want.detach().cpu()
    if not (w.is_floating_point() or w.is_complex()):
        bad = int((g != w).sum())
        return (0.0, "") if bad == 0 else (float("inf"), f"{bad} of {w.numel()} elements differ (compared exactly)")
    wide = torch.complex128 if w.is_complex() else torch.float64
    g, w = g.to(wide), w.to(wide)
    same = (g == w) | (g.isnan() & w.isnan())
    diff = torch.where(same, torch.zeros((), dtype=torch.float64), (g - w).abs().nan_to_num(nan=float("inf")))
    finite = w[w.isfinite()]
    err = float(diff.max()) / max(1.0, float(finite.abs().max()) if finite.numel() else 1.0)
    tol = 1e-2 if want.dtype.to_real() in (torch.float16, torch.bfloat16) else 1e-4
    return err, "" if err <= tol else f"max error {err:.3g} (tolerance {tol:g})"


def compare_outputs(got: Any, want: Any, what: str = "output") -> tuple[float, str]:
    """Every tensor of ``got`` against eager's ``want``: (largest error, the first difference or "")."""
    gots, wants = flat_tensors(got), flat_tensors(want)
    if len(gots) != len(wants):
        return float("inf"), f"{len(gots)} {what} tensors where eager gives {len(wants)}"
    worst, first = 0.0, ""
    for i, (g, w) in enumerate(zip(gots, wants)):
        err, why = output_error(g, w)
        worst = max(worst, err)
        if why and not first:
            first = f"{what} {i} ({w.dtype}{list(w.shape)}): {why}"
    return worst, first


def _eager(ref: str, model: torch.nn.Module, inputs: tuple, training: bool) -> Any:
    """Eager's output for the run ``run_compiled`` made (a training step's: output, gradients)."""
    from torch_kernelize.fill_cache.collect import model_loss, training_grads
    if not training:
        with torch.no_grad():
            return model(*inputs)
    out = model(*inputs)
    return out, training_grads(model, inputs, model_loss(ref)(out))


def compile_and_report(ref: str, target: Target, cache_dir: Path, repro_dir: Path | None,
                       training: bool = False) -> ModelResult:
    """Compile one model for ``target`` with the kernel cache as it is, run it once (a training
    step with ``training``) beside eager, and collect the plans of its graphs."""
    from torch_kernelize.fill_cache.collect import run_compiled

    model, inputs, got, graphs = run_compiled(ref, target, cache_dir, repro_dir, training=training)
    want = _eager(ref, model, inputs, training)
    if training:
        err, differs = compare_outputs(got[0], want[0])
        gerr, gdiffers = compare_outputs(got[1], want[1], "gradient")
        err, differs = max(err, gerr), differs or gdiffers
    else:
        err, differs = compare_outputs(got, want)
    decisions = [d for g in graphs for d in g.report.decisions]
    per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for d in decisions:
        per_op[d.op][column(d)] += 1
    tiers = sum(per_op.values(), collections.Counter())  # (decompose is not shown: its nodes are)
    by_kind: dict[str, list] = collections.defaultdict(list)
    for g in graphs:
        by_kind[g.kind] += g.report.decisions
    return ModelResult(ref, 0, {c: tiers.get(c, 0) for c in SHOWN}, err, not differs, missing_lines(decisions),
                       coverage(decisions)["coverage_pct"],
                       {k: coverage(ds)["coverage_pct"] for k, ds in by_kind.items()}, differs,
                       {op: dict(c) for op, c in per_op.items()}, sorted({d.op for d in decisions if d.missing}))


def format_summary(results: list[ModelResult], target_name: str, fill_hint: str = "") -> str:
    width = max([len("model"), *(len(r.model) for r in results)]) + 2
    lines = [f"bring-up on target {target_name!r}",
             f"  {'model':<{width}}{'nodes':>7}" + "".join(f"{t:>10}" for t in SHOWN)
             + f"{'on target':>11}{'max err':>10}  fill"]
    for r in results:
        lines.append(f"  {r.model:<{width}}{r.nodes:>7}" + "".join(f"{r.tiers[t]:>10}" for t in SHOWN)
                     + f"{r.on_target_pct:>10.1f}%{r.max_err:>10.1e}  {'ok' if r.fill_exit == 0 else r.fill_exit}"
                     + ("" if r.matches else f"  DIFFERS FROM EAGER: {r.differs}"))
        if len(r.kinds) > 1:
            lines.append(f"  {'':<{width}}" + ", ".join(f"{k} {pct:.1f}%" for k, pct in sorted(r.kinds.items())))
    left = [(r.model, line) for r in results for line in r.fallbacks]
    if left:
        lines.append(f"  host fallbacks left (fill them: {fill_hint or 'python -m torch_kernelize.fill_cache --repros <folder>'}):")
        for model, line in left:
            lines.append(f"    {model}: {line}")
        lines.append("  missing ops across all models: " + ", ".join(sorted({op for r in results for op in r.missing_ops})))
    else:
        lines.append("  every node runs on the target: no host fallback left")
    per_op = collections.defaultdict(collections.Counter)
    for r in results:
        for op, counts in r.per_op.items():
            per_op[op].update(counts)
    lines.append("  nodes per op and tier, all models ('view': views and factories, no kernel):")
    lines += op_table(per_op, indent="    ")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torch_kernelize.bringup", description=__doc__.split("\n\n")[0],
                                epilog="exit codes: 0 all on the target and matching eager, 1 host fallbacks left "
                                       "or an output differs, 2 bad input")
    p.add_argument("--target", required=True, help="target name or TOML file of the chip")
    p.add_argument("--model", action="append", required=True, metavar="PATH.py:FN|pkg.module:FN",
                   help="a function returning (model, example_inputs); may be repeated")
    p.add_argument("--training", action="store_true",
                   help="a training step (forward, loss, backward) instead of inference: the loss is the model "
                        "file's loss(output) if it has one, else the output's .loss, else a fixed random "
                        "projection of the floating outputs")
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
    for i, ref in enumerate(args.model):
        fill_exit = 0
        if not args.no_fill and target.has_triton:
            print(f"bringup: filling the cache for {ref} ({i + 1} of {len(args.model)})", file=sys.stderr, flush=True)
            fill_args = ["--model", ref, "--target", args.target, "--cache-dir", str(cache_dir)]
            fill_exit = fill_cli.main(fill_args + (["--budget", str(args.budget)] if args.budget else [])
                                      + (["--training"] if args.training else []))
            if fill_exit == 2:
                return 2  # fill_cache said what was wrong with the input
        try:
            result = compile_and_report(ref, target, cache_dir, args.repro_dir, args.training)
        except (UsageError, KernelizeError) as e:
            print(f"bringup: error: {e}", file=sys.stderr)
            return 2
        result.fill_exit = fill_exit
        results.append(result)
    hint = shlex.join(["python", "-m", "torch_kernelize.fill_cache", "--repros", str(args.repro_dir),
                       "--target", args.target, "--cache-dir", str(cache_dir)])
    print(format_summary(results, target.name, hint))
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 0 if all(r.on_target_pct == 100.0 and r.matches for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
