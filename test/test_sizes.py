"""A newcomer can read any room in one sitting: no product function or method over 120 lines and
no product module over 900 (issue 40), checked as test_layers checks the import direction. A
failure names the file, the function and its length: split it by what it does (analysis, rules,
emitters; the planner's steps), not by line count."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("torch_kernelize", "lowering", "fallbacks", "kernel_cache", "tools")
MAX_FUNCTION_LINES = 120
MAX_MODULE_LINES = 900


def _modules() -> list[Path]:
    return sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if p.is_file())


def test_the_product_has_modules_to_check():
    assert len(_modules()) > 50


def test_no_function_is_over_120_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "functions over 120 lines:\n" + "\n".join(long)


def test_no_module_is_over_900_lines():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, "modules over 900 lines:\n" + "\n".join(big)
