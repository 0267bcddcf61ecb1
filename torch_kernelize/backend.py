"""The ``kernelize`` torch.compile backend (entry point group ``torch_dynamo_backends``).

    torch.compile(model, backend="kernelize", options={"target": "interpreter"})

Dynamo's FX graph goes through aot_autograd (functional ATen, torch's core decompositions;
inference, forward and backward graphs), and each ATen graph is lowered by ``lower.LoweredGraph``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from torch_kernelize.options import Options


def _aten_decompositions() -> dict:
    from torch._decomp import core_aten_decompositions
    return core_aten_decompositions()


def kernelize(gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
              options: Mapping[str, Any] | None = None):
    """Backend entry: Dynamo calls it with its FX graph and example inputs."""
    from torch._dynamo.backends.common import aot_autograd

    from torch_kernelize.lower import LoweredGraph, Session

    opts = Options.resolve(options, mode)
    session = Session(opts)
    session.target_for(example_inputs)  # resolve (and validate) the target before tracing

    def compiler(kind: str):
        def compile_graph(aten_gm: fx.GraphModule, aten_inputs: Sequence[Any]):
            lowered = LoweredGraph(aten_gm, aten_inputs, session, kind)
            run = lowered
            if opts.cudagraphs:
                from torch_kernelize.cudagraphs import wrap_cudagraphs
                run = wrap_cudagraphs(lowered, aten_inputs, kind)

            def boxed(args: list) -> Any:
                return run(args)
            # aot_autograd passes one list of arguments to functions marked this way; a plain
            # function keeps the mark through the wrappers aot_autograd puts around it.
            boxed._boxed_call = True
            boxed.lowered = lowered
            return boxed
        return compile_graph

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=_aten_decompositions(),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)
