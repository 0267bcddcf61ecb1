"""Breadth suite: every op with an OpInfo float32 sample, one graph each, on a chip whose vendor
runs nothing (``supported = []``), before and after one ``fill_cache --model``.

    python benchmarks/breadth.py --out /tmp/breadth                  # every op (long: see README)
    python benchmarks/breadth.py --out /tmp/breadth --ops add,sum,flip --budget 1
    python benchmarks/breadth.py --out /tmp/breadth --first 120       # the first 120 ops of op_db

For each op (the first sample of ``op_db`` whose input is a tensor), the graph is compiled with
kernelize on the chip, run beside eager, then filled and compiled again. Per op it records whether
every output matches eager (integers and bools exactly, floats within fp32 tolerance, complex as
complex), which tier each compute node took, and for each node left on the host why: the family's
own reason for declining it, or the decomposition's. Writes ``breadth.json`` (one row per op,
written as it goes; ``--resume`` skips the ops already there) and ``breadth.md`` (the counts of ops
on the chip / on the host / wrong / crash, and the host list grouped by reason).

Exit codes: 0 no op wrong or crashed; 1 some op wrong or crashed; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import io
import json
import logging
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

REPO = Path(__file__).resolve().parent.parent
# a fast slice for CI: ops that a family or a decomposition puts on the chip, and one that stays
CI_SLICE = ("abs", "add", "mul", "exp", "sum", "amax", "clamp", "where", "flip", "remainder", "nonzero", "cumsum")
COMPARE_TOL = dict(rtol=1.3e-6 * 100, atol=1e-5)  # fp32 sums in another order: a hundred ulps
# ops whose outputs' values are undefined (uninitialized memory): only shapes and dtypes compare
UNDEFINED_VALUES = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


def _op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def op_key(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _sample(op: Any) -> Any | None:
    """The first float32 CPU sample whose input is a tensor (seeded: the same on every call)."""
    torch.manual_seed(0)
    try:
        for s in op.sample_inputs("cpu", torch.float32):
            if isinstance(s.input, torch.Tensor):
                return s
    except Exception:  # an OpInfo whose sample generator needs what this machine lacks
        return None
    return None


class OpGraph(torch.nn.Module):
    """One op applied to its sample: the sample's tensors are the inputs, the rest constants."""

    def __init__(self, op: Any, sample: Any):
        super().__init__()
        self.fn = op.op
        leaves, self.tree = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.is_input = [isinstance(v, torch.Tensor) for v in leaves]
        self.consts = [None if t else v for v, t in zip(leaves, self.is_input)]
        self.inputs = tuple(v.detach().clone() for v in leaves if isinstance(v, torch.Tensor))

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t else c for c, t in zip(self.consts, self.is_input)]
        x, args, kwargs = pytree.tree_unflatten(leaves, self.tree)
        return self.fn(x, *args, **kwargs)


def op_model(key: str) -> tuple[torch.nn.Module, tuple]:
    """``fill_cache --model`` entry: (the op's graph, its sample's tensors)."""
    op = next(o for o in _op_db() if op_key(o) == key)
    model = OpGraph(op, _sample(op))
    return model, model.inputs


def cases(names: list[str] | None = None, first: int | None = None) -> list[Any]:
    """op_db entries with a float32 CPU dtype, in op_db order (``names``: those keys only)."""
    ops = [o for o in _op_db() if torch.float32 in o.supported_dtypes("cpu")]
    if names is not None:
        wanted = set(names)
        ops = [o for o in ops if op_key(o) in wanted or o.name in wanted]
    return ops[:first] if first is not None else ops


def outputs_differ(got: Any, want: Any, values: bool = True) -> str:
    """'' when every output matches: exact for integers and bools, fp32 tolerance for fp32 and
    complex64, torch's default tolerance for other floats (a 16-bit rounding is one ulp apart);
    only shapes and dtypes when not ``values``."""
    gots = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    wants = [t for t in pytree.tree_leaves(want) if isinstance(t, torch.Tensor)]
    if len(gots) != len(wants):
        return f"{len(gots)} tensor outputs, eager {len(wants)}"
    for i, (g, w) in enumerate(zip(gots, wants)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {i}: {g.dtype}{list(g.shape)}, eager {w.dtype}{list(w.shape)}"
        if not values:
            continue
        try:
            if g.is_floating_point() or g.is_complex():
                tol = COMPARE_TOL if g.dtype in (torch.float32, torch.complex64) else {}
                torch.testing.assert_close(g, w, equal_nan=True, **tol)
            elif not torch.equal(g, w):
                return f"output {i} ({g.dtype}): {int((g != w).sum())} of {g.numel()} elements differ"
        except AssertionError as e:
            return f"output {i}: " + str(e).strip().splitlines()[0]
    return ""


def host_reason(d: Any) -> str:
    """Why a node stayed on the host: the family's own reason for declining its spec, else the
    Triton tier's rejection, with the decomposition's."""
    from torch_kernelize.lowering.kernels import family_for_op
    triton = d.rejected.get("triton", "")
    family = family_for_op(d.op)
    if family is not None and d.spec is not None and triton.startswith("no Triton generator"):
        triton = f"{family.name} family declines: {family.supports(d.spec)}"
    elif triton.startswith("cache miss"):
        triton = f"{d.family} family: the fill stored no kernel"
    elif triton.startswith("no Triton generator"):
        triton = "no family generates it"
    return f"{triton} / decompose: {d.rejected.get('decompose', '')}"


def _plan_summary(graphs: list[Any]) -> dict[str, Any]:
    """Tiers of the compute nodes (views, allocations and decomposed nodes left out)."""
    tiers: collections.Counter = collections.Counter()
    host = []
    for g in graphs:
        for d in g.report.decisions:
            if d.tier == "decompose" or (d.tier == "vendor" and "the target's vendor" not in d.reason):
                continue
            tiers[d.tier] += 1
            if d.tier == "fallback":
                host.append({"op": d.op, "why": host_reason(d)})
    return {"tiers": dict(tiers), "host": host}


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    def fire(*_):
        raise _Timeout(f"over {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _compiled_step(key: str, ref: str, target: Any, cache_dir: Path) -> dict[str, Any]:
    from torch_kernelize.fill_cache.collect import run_compiled
    model, inputs, got, graphs = run_compiled(ref, target, cache_dir, None)
    want = model(*inputs)
    row = _plan_summary(graphs)
    row["graphs"] = len(graphs)
    row["differs"] = outputs_differ(got, want, key.split(".")[0] not in UNDEFINED_VALUES)
    return row


def _status(step: dict[str, Any]) -> str:
    if "crash" in step:
        return "crash"
    if step["differs"]:
        return "wrong"
    if not step["graphs"]:
        return "eager"  # Dynamo ran the op in eager (a graph break): nothing was compiled
    if not sum(step["tiers"].values()):
        return "free"  # views and allocations only
    return "host" if step["tiers"].get("fallback") else "chip"


def run_op(op: Any, workdir: Path, chip: Path, cache_dir: Path, budget: int, timeout: int) -> dict[str, Any]:
    """One op: compiled before the fill, filled once, compiled after."""
    from torch_kernelize.core.targets import load_target_file
    from torch_kernelize.fill_cache import cli as fill_cli
    key = op_key(op)
    row: dict[str, Any] = {"op": key}
    sample = _sample(op)
    if sample is None:
        row["status"] = "no sample"
        return row
    try:  # an op eager itself cannot run here (a CUDA-only one) says nothing about the backend
        OpGraph(op, sample)(*OpGraph(op, sample).inputs)
    except Exception as e:  # noqa: BLE001
        row["status"] = "eager fails"
        row["why"] = traceback.format_exception_only(type(e), e)[-1].strip()[:200]
        return row
    model_file = workdir / "models" / f"{key.replace('.', '_')}.py"
    model_file.parent.mkdir(parents=True, exist_ok=True)
    model_file.write_text(f"import importlib.util, sys\nspec = importlib.util.spec_from_file_location("
                          f"'kernelize_breadth', {str(Path(__file__).resolve())!r})\n"
                          "breadth = importlib.util.module_from_spec(spec); spec.loader.exec_module(breadth)\n"
                          f"def make():\n    return breadth.op_model({key!r})\n")
    ref, target = f"{model_file}:make", load_target_file(chip)
    start = time.perf_counter()
    for phase in ("before", "fill", "after"):
        try:
            with _deadline(timeout), contextlib.redirect_stdout(io.StringIO()):
                if phase == "fill":
                    row["fill_exit"] = fill_cli.main(["--model", ref, "--target", str(chip), "--cache-dir",
                                                      str(cache_dir), "--quiet", "--budget", str(budget)])
                else:
                    row[phase] = _compiled_step(key, ref, target, cache_dir)
        except Exception as e:  # noqa: BLE001 - a crash is a result of the sweep, recorded per op
            lines = traceback.format_exception_only(type(e), e)
            row[phase] = {"crash": lines[-1].strip()[:300]} if phase != "fill" else None
            if phase == "fill":
                row["fill_exit"] = f"crash: {lines[-1].strip()[:300]}"
        finally:
            torch._dynamo.reset()
    row["seconds"] = round(time.perf_counter() - start, 1)
    row["status_before"], row["status"] = _status(row["before"]), _status(row["after"])
    return row


def summarize(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown table: ops per status before and after the fill; host list grouped by reason."""
    statuses = ("chip", "host", "wrong", "crash", "free", "eager", "no sample", "eager fails")
    before = collections.Counter(r.get("status_before", r["status"]) for r in rows)
    after = collections.Counter(r["status"] for r in rows)
    out = [f"# Breadth sweep, {meta['date']}", "",
           f"commit {meta.get('commit', '?')}, torch {meta['torch']}, triton {meta['triton']}, target `supported = []` on the Triton interpreter, "
           f"fill budget {meta['budget']}, {len(rows)} ops ({meta['selection']}), {meta['seconds']:.0f} s.", "",
           *([meta["note"], ""] if meta.get("note") else []),
           "chip: every compute node on the chip; host: some node on the host fallback; free: views and "
           "allocations only; eager: Dynamo did not compile the op (graph break); eager fails: the op "
           "does not run in eager on this machine (CUDA-only).", "",
           "| | " + " | ".join(statuses) + " |", "|---" * (len(statuses) + 1) + "|",
           "| before fill | " + " | ".join(str(before.get(s, 0)) for s in statuses) + " |",
           "| after fill | " + " | ".join(str(after.get(s, 0)) for s in statuses) + " |", ""]
    for label, keep in (("every op", lambda op: True),
                        ("ops outside linalg.*, fft.*, special.*",
                         lambda op: not op.startswith(("linalg.", "fft.", "special.")))):
        computing = [r for r in rows if keep(r["op"]) and r["status"] in ("chip", "host", "wrong", "crash")]
        on_chip = sum(r["status"] == "chip" for r in computing)
        out.append(f"- {label}: {on_chip} of the {len(computing)} that compute entirely on the chip after the fill "
                   f"({100 * on_chip / max(len(computing), 1):.0f}%)")
    out.append("")
    grouped: dict[str, set[str]] = collections.defaultdict(set)
    for r in rows:
        for h in (r.get("after") or {}).get("host", []):
            grouped[h["why"]].add(f"{r['op']} ({h['op'].removeprefix('aten.')})")
    if grouped:
        out += ["## Left on the host after the fill, by reason", ""]
        for why, ops in sorted(grouped.items(), key=lambda kv: -len(kv[1])):
            out.append(f"- **{why}**: {', '.join(sorted(ops))}")
    bad = [r for r in rows if r["status"] in ("wrong", "crash")]
    if bad:
        out += ["", "## Wrong or crashed", ""]
        out += [f"- {r['op']}: {(r.get('after') or {}).get('differs') or (r.get('after') or {}).get('crash')}"
                for r in bad]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/breadth.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for breadth.json, breadth.md and the cache")
    p.add_argument("--ops", default=None, help="comma-separated op names (default: every op); 'ci' for the CI slice")
    p.add_argument("--first", type=int, default=None, help="only the first N ops of op_db")
    p.add_argument("--budget", type=int, default=1, help="candidates per spec for the fill")
    p.add_argument("--timeout", type=int, default=300, help="seconds per op and phase")
    p.add_argument("--resume", action="store_true", help="keep the rows of breadth.json, run the other ops")
    p.add_argument("--report-only", action="store_true", help="rewrite breadth.md from breadth.json (a cut run)")
    args = p.parse_args(argv)
    if args.report_only:
        data = json.loads((args.out / "breadth.json").read_text())
        (args.out / "breadth.md").write_text(summarize(data["rows"], data["meta"]))
        return 1 if any(r["status"] in ("wrong", "crash") for r in data["rows"]) else 0
    logging.basicConfig(level=logging.ERROR)
    names = list(CI_SLICE) if args.ops == "ci" else args.ops.split(",") if args.ops else None
    ops = cases(names, args.first)
    if not ops:
        print("breadth: error: no OpInfo op matches --ops", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    chip = args.out / "chip.toml"
    chip.write_text('name = "nothing"\ndevice = "cpu"\ntriton = "interpreter"\n[ops]\nsupported = []\n')
    json_path = args.out / "breadth.json"
    done = {r["op"]: r for r in json.loads(json_path.read_text())["rows"]} if args.resume and json_path.exists() else {}
    import triton
    import subprocess
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit,
            "budget": args.budget, "selection": (args.ops if args.ops and len(args.ops) < 80 else
                                                 f"{len(ops)} named by --ops" if args.ops else
                                                 f"first {args.first}" if args.first else "all")}
    start, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as work:
        for i, op in enumerate(ops):
            row = done.get(op_key(op)) or run_op(op, Path(work), chip, args.out / "kernel_cache", args.budget,
                                                 args.timeout)
            rows.append(row)
            print(f"[{i + 1}/{len(ops)}] {row['op']}: {row.get('status_before', '-')} -> {row['status']}", flush=True)
            meta["seconds"] = time.perf_counter() - start
            json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "breadth.md").write_text(summarize(rows, meta))
    print(f"wrote {json_path} and {args.out / 'breadth.md'}")
    return 1 if any(r["status"] in ("wrong", "crash") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
