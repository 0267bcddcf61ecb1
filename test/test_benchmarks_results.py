"""benchmarks/results: every committed file is one run named by date, GPU and suite, and every file
that benchmarks/README.md or CHANGELOG.md cites is there (a rename must carry its references)."""
from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCH / "results"
# DATE-GPU-SUITE[-WORKLOADS][-N].ext; table.md is report.py's copy of the README table.
NAME = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9]+-[a-z][a-z0-9_-]*\.(json|log|md|png)")  # (png: a ledger's chart)
CITED = re.compile(r"\d{4}-\d{2}-\d{2}-[\w.{},-]+?\.(?:json|log|md|\{[a-z,]+\})")


def _expand(name: str) -> list[str]:
    """Brace alternatives: `x-{a,b}.json` -> [x-a.json, x-b.json]; `x.{json,md}` likewise."""
    m = re.fullmatch(r"(.*?)\{([\w,]+)\}(.*)", name)
    return [n for v in m[2].split(",") for n in _expand(m[1] + v + m[3])] if m else [name]


def test_every_results_file_is_named_by_date_gpu_and_suite():
    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "table.md")
    assert files
    bad = [f for f in files if not NAME.fullmatch(f) or "session" in f]
    assert not bad, f"results files not named DATE-GPU-SUITE[-WORKLOADS][-N]: {bad}"


def test_every_results_file_the_readme_cites_exists():
    text = (BENCH / "README.md").read_text() + (RESULTS / "table.md").read_text()
    cited = {n for token in CITED.findall(text) for n in _expand(token)}
    assert cited
    missing = sorted(n for n in cited if not (RESULTS / n).is_file())
    assert not missing, f"benchmarks/README.md cites missing results files: {missing}"


def test_every_results_file_the_changelog_cites_exists():
    # Cited without their DATE-GPU- prefix: `seeds-1.json`, `ab-prewarm-{1,2,3}.json`.
    tokens = re.findall(r"`([a-z][\w.{},-]*\.(?:json|log|md|\{[a-z,]+\}))`", (BENCH / "CHANGELOG.md").read_text())
    names = {n for token in tokens for n in _expand(token)}
    assert names
    existing = [p.name for p in RESULTS.iterdir()]
    missing = sorted(n for n in names
                     if not any(re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9]+-" + re.escape(n), f) for f in existing))
    assert not missing, f"benchmarks/CHANGELOG.md cites missing results files: {missing}"
