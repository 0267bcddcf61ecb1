"""The bottleneck ledger of a served model: its slowest kernels against the chip's floor, the
worst turned into performance reproducers.

    python -m torch_kernelize.bottlenecks --model torch_kernelize.model_zoo:make_hf_llama --target cuda --top 5

The model runs as it is served (``torch.compile(backend="kernelize")``, the kernel cache as
``fill_cache`` left it); a few calls are profiled (torch.profiler on CUDA, wall time per node on
the host) and every node is mapped to its graph, spec and the generator of its cache entry. The
table ranks the specs by time per model call, with their share, launches, floor (bytes and FLOPs
at the chip's ceilings), distance to the floor and the best alternative the fill measured; the
line above it gives the time per call, the host's time to issue it and the launches, so that a
host-bound model is named as such. The ``--top`` slowest above their floor become performance
reproducers in ``--repro-dir`` (task.md: what to beat, check_candidate.py --time, fill_cache
--candidate). Each run is kept in a history beside the cache: the next run, after a candidate or
a new fill, prints the time per call before and after. JSON and a PNG chart go to ``--out``.

Exit codes: 0 the ledger was written; 2 bad input (model reference, target, cache dir).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from torch_kernelize.core.errors import KernelizeError

log = logging.getLogger("torch_kernelize.ledger")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from torch_kernelize.core.options import OPTIONS, default_cache_dir
    from torch_kernelize.fill_cache.cli import _Parser

    p = _Parser(prog="python -m torch_kernelize.bottlenecks", description=__doc__.split("\n\n")[0],
                epilog="exit codes: 0 the ledger was written, 2 bad input")
    p.add_argument("--model", required=True, metavar="PATH.py:FN|pkg.module:FN",
                   help="a function returning (model, example_inputs)")
    p.add_argument("--target", default=os.environ.get(OPTIONS["target"].env),
                   help="target name or TOML file (default: $KERNELIZE_TARGET, else cuda if available)")
    p.add_argument("--cache-dir", type=Path, default=os.environ.get(OPTIONS["cache_dir"].env) or default_cache_dir())
    p.add_argument("--repro-dir", type=Path, default=Path("kernelize_repros"),
                   help="where the performance reproducers go (default ./kernelize_repros)")
    p.add_argument("--top", type=int, default=3, help="reproducers for the N slowest above their floor (default 3)")
    p.add_argument("--calls", type=int, default=3, help="profiled calls (default 3)")
    p.add_argument("--out", type=Path, default=Path("kernelize_ledger"),
                   help="folder for the ledger's JSON and PNG chart (default ./kernelize_ledger)")
    args = p.parse_args(argv)
    if args.top < 0 or args.calls < 1:
        p.error("--top must be 0 or more and --calls at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    import torch

    from torch_kernelize.core.targets import get_target
    from torch_kernelize.fill_cache.collect import check_cache_dir, served_model
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.ledger import history, output
    from torch_kernelize.ledger.floors import ceilings_for
    from torch_kernelize.ledger.perf_repro import write_perf_repro
    from torch_kernelize.ledger.profile import capture_inputs, profile_model
    from torch_kernelize.ledger.rank import fusions, rank, worth_a_reproducer

    try:
        target = get_target(args.target or ("cuda" if torch.cuda.is_available() else None))
        check_cache_dir(args.cache_dir)
        cache = KernelCache.for_target(args.cache_dir, target)
        with served_model(args.model, target, args.cache_dir) as (_, inputs, compiled, _, graphs):
            profile = profile_model(compiled, inputs, graphs, cuda=target.device == "cuda", calls=args.calls)
            ceilings = ceilings_for(target, args.cache_dir)
            rows, fused = rank(profile, cache, ceilings), fusions(profile, ceilings)
            slow = worth_a_reproducer(rows, args.top) + worth_a_reproducer(fused, args.top)
            captured = capture_inputs(compiled, inputs, graphs, {p for r in slow for p in r.capture_points()})
    except KernelizeError as e:
        print(f"bottlenecks: error: {e}", file=sys.stderr)
        return 2
    print(f"bottleneck ledger of {args.model} on target {target.name!r} (ceilings: {ceilings.source})")
    print(cache_line(cache, args))
    print(output.table(rows, profile))
    print(output.fusion_table(fused))
    folders = []
    for r in slow:
        inputs_of = r.inputs_from(captured)
        if inputs_of is None or len(inputs_of) != len(r.spec.inputs):
            log.warning("%s: its inputs were not captured; no reproducer", r.op)
            continue
        folders.append(write_perf_repro(args.repro_dir, r, inputs_of, target, args.cache_dir, ceilings, args.model))
    for f in folders:
        print(f"performance reproducer: {f}  (task: {f / 'task.md'})")
    path = history.history_path(cache)
    before = history.last_run(path, args.model)
    record = history.run_record(args.model, target.name, profile, rows)
    history.append(path, record)
    print(history.compare(before, record))
    where, _, fn = args.model.rpartition(":")
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", f"{Path(where).stem if where.endswith('.py') else where}_{fn}")
    ledger = args.out / f"{name}-{target.name}.json"
    output.write_json(ledger, output.ledger_json(
        rows, profile, {"model": args.model, "target": target.name, "ceilings": ceilings.to_json(),
                        "reproducers": [str(f) for f in folders], "before": before}, fused))
    print(f"ledger: {ledger}")
    print(output.chart(rows, ledger.with_suffix(".png"), f"{args.model} on {target.name}: time per call vs floor"))
    return 0


def cache_line(cache: Any, args: argparse.Namespace) -> str:
    """Which cache served the model, and how many entries it holds: an empty one (a fill into
    another folder, or on another machine) serves every node on the vendor, which the table alone
    would show as a model of misses."""
    n = len(cache.keys())
    line = f"cache: {cache.dir} ({n} entries)"
    if n == 0:
        line += (f"\nWARNING: the cache is empty: every node runs as a vendor miss. Fill it first: python -m "
                 f"torch_kernelize.fill_cache --model {args.model} --target {args.target or 'cuda'} "
                 f"--cache-dir {args.cache_dir}")
    return line


if __name__ == "__main__":
    sys.exit(main())
