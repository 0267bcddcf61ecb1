"""Paths kernelize cannot use (a report it cannot write, a cache_dir that is a file): one warning
that names the path and why, and the compile still succeeds."""
from __future__ import annotations

import logging

import torch

from torch_kernelize.kernel_cache import clear_memo


def _compile_twice(options: dict) -> None:
    """Two graphs (two compiles) through the backend, each checked against eager."""
    for fn in (lambda x: torch.relu(x) + 1, lambda x: torch.sigmoid(x) * 2):
        torch._dynamo.reset()
        x = torch.randn(4, 8)
        out = torch.compile(fn, backend="kernelize", options=options)(x)
        torch.testing.assert_close(out, fn(x))


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_unwritable_report_warns_once_and_the_compile_succeeds(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the report's folder should be")
    report = blocker / "report.json"
    with caplog.at_level(logging.WARNING, logger="torch_kernelize"):
        _compile_twice({"target": "cpu", "report": str(report), "graph_cache": "off"})
    warned = _warnings(caplog, "coverage report")
    assert len(warned) == 1, warned
    assert f"to {report} (FileExistsError" in warned[0] and f"'{blocker}'" in warned[0]


def test_cache_dir_that_is_a_file_warns_once_naming_it(tmp_path, caplog):
    clear_memo()
    bad = tmp_path / "kc"
    bad.write_text("not a cache")
    with caplog.at_level(logging.WARNING, logger="torch_kernelize"):
        _compile_twice({"target": "interpreter", "cache_dir": str(bad), "graph_cache": "off"})
    warned = _warnings(caplog, "cannot be used")
    assert len(warned) == 1, warned
    assert f"cache_dir {bad} cannot be used" in warned[0] and "is not a folder" in warned[0]
    clear_memo()


def test_missing_cache_dir_is_an_empty_cache_not_a_fault(tmp_path, caplog):
    clear_memo()
    with caplog.at_level(logging.WARNING, logger="torch_kernelize"):
        _compile_twice({"target": "interpreter", "cache_dir": str(tmp_path / "new"), "graph_cache": "off"})
    assert _warnings(caplog, "cannot be used") == []
    clear_memo()
