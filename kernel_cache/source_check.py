"""Static checks of a program's Python source from an untrusted archive, before any of it runs.

Re-validating an archived kernel means running it, and on the interpreter target that imports its
kernel.py and runs its @triton.jit bodies as Python. So before that, the source is parsed (``ast``,
never imported) and must have the shape of a generated kernel file: imports of triton.language and
math only, literal constants, and @triton.jit functions whose defaults are literals and whose bodies
name only their own locals, the file's own functions and constants, a few builtins, and public
names of triton.language (attributes on values: the public API of Triton's tensors and types).
Anything else (a top-level call, ``open``, ``__import__``, a dunder, another module) is refused
with the line that holds it. A compiled kernel (the CUDA target) runs its stored binary; that the
binary computes the right thing is what validation itself checks.
"""
from __future__ import annotations

import ast
import functools
import types
from typing import Any

ALLOWED_IMPORTS = ("triton", "triton.language", "math")   # and submodules of triton.language
ALLOWED_MODULE_PREFIXES = ("triton.language", "math")      # modules whose public names a body may use
TRITON_ROOT_NAMES = frozenset({"language", "jit", "cdiv", "next_power_of_2"})  # of the triton package
SAFE_BUILTINS = frozenset({"range", "min", "max", "len", "int", "float", "bool", "abs", "tuple", "list",
                           "zip", "enumerate", "isinstance"})
FORBIDDEN_IN_BODIES = (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.ClassDef, ast.FunctionDef,
                       ast.AsyncFunctionDef, ast.Lambda, ast.Await, ast.Yield, ast.YieldFrom, ast.AsyncFor,
                       ast.AsyncWith, ast.With, ast.Try, ast.Delete, ast.ListComp, ast.SetComp, ast.DictComp,
                       ast.GeneratorExp)


@functools.lru_cache(maxsize=1)
def _value_attributes() -> frozenset[str]:
    """Public attributes of Triton's tensors, types and constexprs (never ``handle``, which is the
    interpreter's numpy array)."""
    import triton.language as tl
    names: set[str] = set()
    for cls in (tl.tensor, tl.dtype, tl.constexpr, getattr(tl, "pointer_type", None), getattr(tl, "block_type", None)):
        if cls is not None:
            names |= {n for n in dir(cls) if not n.startswith("_")}
    # and what their instances set (``ptr.dtype.element_ty``, ``x.shape``)
    samples = [tl.float32, tl.pointer_type(tl.float32), tl.block_type(tl.float32, [1]), tl.tensor(None, tl.float32)]
    names |= {n for x in samples for n in vars(x) if not n.startswith("_")}
    return frozenset(names - {"handle"})


def _allowed_module(module: types.ModuleType) -> bool:
    name = module.__name__
    return any(name == p or name.startswith(p + ".") for p in ALLOWED_MODULE_PREFIXES)


def _import(name: str) -> Any:
    import importlib
    return importlib.import_module(name)  # an installed module of the allowed list, never archive code


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


class _Checker:
    def __init__(self, filename: str):
        self.filename = filename
        self.problems: list[str] = []
        self.imported: dict[str, Any] = {}   # alias -> the installed module or object it names
        self.defined: set[str] = set()       # the file's own functions and constants

    def problem(self, node: ast.AST, what: str) -> None:
        self.problems.append(f"{self.filename} line {getattr(node, 'lineno', '?')}: {what}")

    # --- top level ----------------------------------------------------------------------------------
    def module(self, tree: ast.Module) -> None:
        for node in tree.body:  # names first: functions may call functions defined below them
            if isinstance(node, ast.FunctionDef):
                self.defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.defined |= {t.id for t in targets if isinstance(t, ast.Name)}
        for node in tree.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # a docstring or a bare constant
            if isinstance(node, ast.Import):
                self.import_(node)
            elif isinstance(node, ast.ImportFrom):
                self.import_from(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                self.constant(node)
            elif isinstance(node, ast.FunctionDef):
                self.function(node)
            else:
                self.problem(node, f"a top-level {type(node).__name__} statement (a kernel file holds only "
                                   "imports of triton and math, literal constants and @triton.jit functions)")

    def import_(self, node: ast.Import) -> None:
        for alias in node.names:
            if not self._importable(alias.name):
                self.problem(node, f"import of {alias.name} (only {', '.join(ALLOWED_IMPORTS)} may be imported)")
                continue
            if alias.asname:
                self.imported[alias.asname] = _import(alias.name)
            else:
                top = alias.name.split(".")[0]
                self.imported[top] = _import(top)

    def import_from(self, node: ast.ImportFrom) -> None:
        if node.module == "__future__" and node.level == 0:
            return
        if node.level or node.module is None or not self._importable(node.module):
            self.problem(node, f"import from {'.' * node.level}{node.module or ''} "
                               f"(only {', '.join(ALLOWED_IMPORTS)} may be imported)")
            return
        base = _import(node.module)
        for alias in node.names:
            if alias.name == "*" or alias.name.startswith("_"):
                self.problem(node, f"'from {node.module} import {alias.name}'")
                continue
            value = getattr(base, alias.name, None)
            if value is None:
                full = f"{node.module}.{alias.name}"
                value = _import(full) if self._importable(full) else None
            if value is None or (isinstance(value, types.ModuleType) and not _allowed_module(value)):
                self.problem(node, f"'from {node.module} import {alias.name}' names no allowed module or object")
                continue
            self.imported[alias.asname or alias.name] = value

    @staticmethod
    def _importable(name: str) -> bool:
        return name in ALLOWED_IMPORTS or name.startswith("triton.language.")

    def constant(self, node: ast.Assign | ast.AnnAssign) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not all(isinstance(t, ast.Name) for t in targets):
            self.problem(node, "an assignment to something other than a plain name")
        value = node.value
        if value is None or _is_literal(value):
            return
        if (isinstance(value, ast.Call) and self.resolves_to(value.func, "constexpr") and not value.keywords
                and len(value.args) == 1 and _is_literal(value.args[0])):
            return  # NAME = tl.constexpr(<literal>)
        self.problem(node, "a top-level assignment of something other than a literal or tl.constexpr(<literal>)")

    def resolves_to(self, node: ast.AST, name: str) -> bool:
        """Whether ``node`` is a name or attribute chain naming triton's ``name`` (jit, constexpr)."""
        import triton
        import triton.language as tl
        wanted = {getattr(triton, name, None), getattr(tl, name, None)} - {None}
        return self.resolve(node) in wanted

    def resolve(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            return self.imported.get(node.id)
        if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
            base = self.resolve(node.value)
            return None if base is None else getattr(base, node.attr, None)
        return None

    def function(self, node: ast.FunctionDef) -> None:
        if not node.decorator_list:
            self.problem(node, f"function {node.name} is not a @triton.jit function")
        for deco in node.decorator_list:
            call = deco if isinstance(deco, ast.Call) else None
            func = call.func if call is not None else deco
            literal_args = call is None or all(_is_literal(a) for a in [*call.args, *(k.value for k in call.keywords)])
            if not self.resolves_to(func, "jit") or not literal_args:
                self.problem(deco, f"function {node.name} has a decorator other than @triton.jit")
        args = node.args
        for default in [*args.defaults, *(d for d in args.kw_defaults if d is not None)]:
            if not _is_literal(default):
                self.problem(default, f"function {node.name} has a default argument that is not a literal")
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]
        for ann in [*(a.annotation for a in params), node.returns]:
            if ann is not None:
                self.expression(ann, set(), calls=False)
        local = {a.arg for a in params}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                local.add(sub.id)
        for stmt in node.body:
            for sub in ast.walk(stmt):
                if isinstance(sub, FORBIDDEN_IN_BODIES):
                    self.problem(sub, f"function {node.name} holds a {type(sub).__name__}, which kernels do not use")
            self.expression(stmt, local, calls=True)

    # --- expressions ------------------------------------------------------------------------------
    def expression(self, root: ast.AST, local: set[str], calls: bool) -> None:
        for node in ast.walk(root):
            if isinstance(node, ast.Call) and not calls:
                self.problem(node, "a call where only a type may be named")
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if not (node.id in local or node.id in self.defined or node.id in self.imported
                        or node.id in SAFE_BUILTINS):
                    self.problem(node, f"the name {node.id!r}, which is neither a local, a name of this file, "
                                       "an allowed import nor one of " + ", ".join(sorted(SAFE_BUILTINS)))
            elif isinstance(node, ast.Attribute):
                self.attribute(node)

    def attribute(self, node: ast.Attribute) -> None:
        if node.attr.startswith("_"):
            self.problem(node, f"the private attribute .{node.attr}")
            return
        chain: list[str] = []
        base: ast.AST = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in self.imported:
            if node.attr not in _value_attributes():
                self.problem(node, f"the attribute .{node.attr}, which is not part of a Triton tensor's or type's API")
            return
        value, path = self.imported[base.id], base.id
        for attr in reversed(chain):
            if not isinstance(value, types.ModuleType):
                if attr not in _value_attributes():
                    self.problem(node, f"the attribute {path}.{attr}")
                return
            if value.__name__ == "triton" and attr not in TRITON_ROOT_NAMES:
                self.problem(node, f"triton.{attr} (a kernel uses triton.language, triton.jit, triton.cdiv)")
                return
            nxt = getattr(value, attr, None)
            path = f"{path}.{attr}"
            if nxt is None:
                self.problem(node, f"{path}, which does not exist")
                return
            if isinstance(nxt, types.ModuleType) and not _allowed_module(nxt):
                self.problem(node, f"{path}, the module {nxt.__name__}, which a kernel may not use")
                return
            value = nxt


def source_problems(source: str | bytes, filename: str = "kernel.py") -> list[str]:
    """Everything in ``source`` outside the shape of a kernel file (empty: it may be imported to be
    validated). Parses only; nothing of ``source`` runs."""
    try:
        tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError) as e:
        return [f"{filename} does not parse: {e}"]
    checker = _Checker(filename)
    checker.module(tree)
    return list(dict.fromkeys(checker.problems))  # an attribute chain is walked once per link
