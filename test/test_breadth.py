"""The breadth suite's CI slice (benchmarks/breadth.py --ops ci): a dozen OpInfo ops, each one
graph on a chip whose vendor runs nothing, before and after one fill on the Triton interpreter."""
from __future__ import annotations

import json
from pathlib import Path

from torch_kernelize.serving.launch import import_source

BREADTH = Path(__file__).resolve().parent.parent / "benchmarks" / "breadth.py"


def test_the_ci_slice_runs_on_the_chip_after_one_fill(tmp_path):
    breadth = import_source(BREADTH, "bench_breadth")
    assert breadth.main(["--out", str(tmp_path), "--ops", "ci"]) == 0  # nothing wrong, nothing crashed
    rows = {r["op"]: r for r in json.loads((tmp_path / "breadth.json").read_text())["rows"]}
    assert set(rows) == set(breadth.CI_SLICE)
    # before the fill every compute node is on the host (the vendor runs nothing) ...
    assert all(r["status_before"] in ("host", "eager") for r in rows.values()), rows
    # ... after it, everything but the data-dependent nonzero runs on the chip
    assert {op for op, r in rows.items() if r["status"] != "chip"} == {"nonzero"}, rows
    assert rows["flip"]["after"]["tiers"].get("fallback") is None and rows["remainder"]["after"]["tiers"]["triton"]
    table = (tmp_path / "breadth.md").read_text()
    assert "| after fill | 11 | 0 | 0 | 0 |" in table, table


def test_outputs_are_compared_exactly_for_integers():
    import torch
    breadth = import_source(BREADTH, "bench_breadth")
    assert breadth.outputs_differ((torch.tensor([1, 2]),), (torch.tensor([1, 3]),)).startswith("output 0 (torch.int64)")
    assert breadth.outputs_differ(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")])) == ""
    assert "eager torch.int32" in breadth.outputs_differ(torch.tensor([1]), torch.tensor([1], dtype=torch.int32))
