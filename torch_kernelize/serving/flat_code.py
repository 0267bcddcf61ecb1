"""One flat Python function per specialization: the bound graph as straight-line code.

FX's generated code calls each node's target as an object: ``torch.ops.aten.add.Tensor(...)``
(attribute lookups, ``OpOverload.__call__``, schema parsing), a ``FoldedView`` or a ``TritonCall``
(a Python frame each, and their checks). This code does their work inline, as Inductor's output
code does:

- vendor ops call the binding op_bindings.fast_binding chose (eager's own C++ entry where it
  dispatches the same overload, else the overload's ``_op``), bound as globals;
- a cached kernel's call is ``runner(...)`` behind its health check (and the stride checks of
  inputs whose layout is not certain), with the TritonCall's vendor path on failure;
- a folded view re-strides its root directly; its root's stride check stays only where the root
  may arrive in another layout (a vendor op's output; a graph input's is checked once per call);
- values are dropped after their last use, as FX's code does.

The bound graph stays what the report, the executable cache and the repro capture read; only
its code differs. Graphs this cannot render (modules, custom pytree code) keep FX's code.
"""
from __future__ import annotations

import builtins
import keyword
import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from torch_kernelize.serving.bucket_call import BucketCall
from torch_kernelize.serving.op_bindings import fast_binding
from torch_kernelize.serving.runtime import TritonCall, ValueCapture, has_traced_layout
from torch_kernelize.serving.view_folding import FoldedView, reinterpret_tensor


class _Unrendered(Exception):
    """A graph this module does not render: its FX code runs instead."""


class _Writer:
    def __init__(self) -> None:
        self.globals: dict[str, Any] = {"__builtins__": builtins}
        self._ids: dict[int, str] = {}
        self.lines: list[str] = []

    def ref(self, obj: Any, hint: str = "k") -> str:
        """A global name bound to ``obj`` (one per object)."""
        name = self._ids.get(id(obj))
        if name is None:
            base = "".join(c if c.isalnum() else "_" for c in str(hint))[:40].strip("_") or "k"
            name = self._ids[id(obj)] = f"K{len(self._ids)}_{base}"
            self.globals[name] = obj
        return name

    def value(self, a: Any) -> str:
        """Python source for one argument."""
        if isinstance(a, fx.Node):
            return local(a)
        if a is None or isinstance(a, (bool, str)) or type(a) is int:
            return repr(a)
        if type(a) is float:
            return repr(a) if math.isfinite(a) else self.ref(a, "float")
        if isinstance(a, tuple) and not hasattr(a, "_fields"):
            return "(" + "".join(self.value(x) + ", " for x in a) + ")"
        if isinstance(a, list):
            return "[" + ", ".join(self.value(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self.value(v)}" for k, v in a.items()) + "}"
        if any(isinstance(x, fx.Node) for x in torch.utils._pytree.tree_leaves(a)):
            raise _Unrendered(f"graph values inside a {type(a).__name__}")
        return self.ref(a, type(a).__name__)

    def call_args(self, args: tuple, kwargs: dict) -> str:
        for k in kwargs:
            if not k.isidentifier() or keyword.iskeyword(k):
                raise _Unrendered(f"keyword argument {k!r}")
        return ", ".join([self.value(a) for a in args] + [f"{k}={self.value(v)}" for k, v in kwargs.items()])


def local(node: fx.Node) -> str:
    return f"v_{node.name}"


def flat_function(gm: fx.GraphModule, guarded_inputs: bool = True,
                  capture: ValueCapture | None = None) -> Callable[..., Any]:
    """The bound graph ``gm`` as one generated function of the graph's inputs (positional, like
    ``gm.forward``); ``gm.forward`` itself where the graph holds what this does not render.
    ``guarded_inputs``: the graph's inputs have their traced layouts (runtime.has_traced_layout).
    ``capture``: the code also hands it the inputs and values it asks for (a first call that
    records reproducers, at the generated code's speed rather than an interpreter's)."""
    try:
        source, namespace = flat_source(gm, guarded_inputs, capture)
    except _Unrendered:
        return gm.forward
    code = compile(source, f"<kernelize flat code {id(gm):x}>", "exec")
    exec(code, namespace)
    fn = namespace["flat"]
    fn.source = source  # for people reading what a call runs
    return fn


def flat_source(gm: fx.GraphModule, guarded_inputs: bool = True,
                capture: ValueCapture | None = None) -> tuple[str, dict[str, Any]]:
    """The source of ``flat_function`` and the globals it runs with."""
    graph = gm.graph
    if type(graph._codegen) is not fx.graph.CodeGen:
        raise _Unrendered("the graph has its own code generator (pytree inputs or outputs)")
    w = _Writer()
    nodes = list(graph.nodes)
    last_use: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            last_use[a] = n
    dropped_after: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_use.items():
        if user.op != "output":
            dropped_after.setdefault(user, []).append(value)
    params = [local(n) for n in nodes if n.op == "placeholder"]
    checked_inputs: dict[tuple[fx.Node, tuple], str] = {}  # (graph input, strides) -> its check, once a call
    body: list[str] = []
    for n in nodes:
        if n.op == "placeholder":
            if n.args or n.kwargs:  # a default value
                raise _Unrendered("a placeholder with a default")
            if capture is not None and n.name in capture.values_of:
                body.append(f"{w.ref(capture, 'capture')}.value({n.name!r}, {local(n)})")
            continue
        if n.op == "output":
            body.append(f"return {w.value(n.args[0])}")
            break
        if capture is not None and n.name in capture.inputs_of:
            body.append(f"{w.ref(capture, 'capture')}.inputs({n.name!r}, {w.value(tuple(n.args))}, "
                        f"{w.value(dict(n.kwargs))})")
        body += _statement(w, n, guarded_inputs, checked_inputs)
        if capture is not None and n.name in capture.values_of:
            body.append(f"{w.ref(capture, 'capture')}.value({n.name!r}, {local(n)})")
        gone = dropped_after.get(n)
        if gone:
            body.append(" = ".join(local(v) for v in gone) + " = None")
    head = [f"{name} = {local(node)}.stride() == {stride!r}" for (node, stride), name in checked_inputs.items()]
    lines = [f"def flat({', '.join(params)}):"] + ["    " + line for line in head + body]
    return "\n".join(lines) + "\n", w.globals


def _statement(w: _Writer, n: fx.Node, guarded_inputs: bool, checked_inputs: dict) -> list[str]:
    out = local(n)
    if n.op == "get_attr":
        obj = n.graph.owning_module
        for part in n.target.split("."):
            obj = getattr(obj, part)
        return [f"{out} = {w.ref(obj, n.target)}"]
    if n.op == "call_method":
        self_arg, *rest = n.args
        return [f"{out} = {w.value(self_arg)}.{n.target}({w.call_args(tuple(rest), n.kwargs)})"]
    if n.op != "call_function":
        raise _Unrendered(f"a {n.op} node")
    target = n.target
    if target is operator.getitem:
        return [f"{out} = {w.value(n.args[0])}[{w.value(n.args[1])}]"]
    if type(target) is FoldedView:
        return _folded_view(w, n, target, guarded_inputs, checked_inputs)
    if type(target) is TritonCall:
        return _kernel_call(w, n, target)
    if type(target) is BucketCall:  # (each size's TritonCall does the checks)
        return [f"{out} = {w.ref(target, target.__name__)}({w.call_args(n.args, {})})"]
    if isinstance(target, torch._ops.OpOverload):
        fn = n.meta.get("binding")  # chosen before (or restored by the executable cache)
        if fn is None:
            fn = n.meta["binding"] = fast_binding(target, n.args, n.kwargs)
    else:
        fn = target
    return [f"{out} = {w.ref(fn, getattr(target, '__name__', 'fn'))}({w.call_args(n.args, n.kwargs)})"]


def _folded_view(w: _Writer, n: fx.Node, view: FoldedView, guarded_inputs: bool, checked_inputs: dict) -> list[str]:
    (root,) = n.args
    out, src = local(n), w.value(root)
    direct = f"{w.ref(reinterpret_tensor, 'reinterpret')}({src}, {view.size!r}, {view.stride!r}, {view.delta!r})"
    if isinstance(root, fx.Node) and root.op == "placeholder" and guarded_inputs:
        ok = checked_inputs.setdefault((root, view.root_stride), f"layout_ok_{len(checked_inputs)}")
    elif isinstance(root, fx.Node) and root.op != "placeholder" and has_traced_layout(root, guarded_inputs):
        return [f"{out} = {direct}"]  # a kernel's or fallback's output: laid out as traced
    else:
        ok = f"{src}.stride() == {view.root_stride!r}"
    return [f"{out} = {direct} if {ok} else {w.ref(view, 'folded_view')}({src})"]


def _kernel_call(w: _Writer, n: fx.Node, call: TritonCall) -> list[str]:
    if n.kwargs:
        raise _Unrendered("a kernel call with keyword arguments")
    out, args = local(n), w.call_args(n.args, {})
    tensors = "(" + "".join(w.value(a) + ", " for a in n.args) + ")"
    name = w.ref(call, call.__name__)
    guard = f"{w.ref(call.state, 'state')}.disabled is None"
    guard += "".join(f" and {w.value(n.args[i])}.stride() == {stride!r}" for i, stride in call.layout_checks)
    return [f"if {guard}:",
            "    try:",
            f"        {out} = {w.ref(getattr(call.runner, 'direct', None) or call.runner, 'run')}({args})",
            "    except Exception as e:",
            f"        {out} = {name}.failed(e, {tensors})",
            "else:",
            f"    {out} = {name}({args})"]
