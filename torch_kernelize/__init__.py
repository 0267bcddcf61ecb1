"""torch_kernelize: a torch.compile backend that lowers ATen graphs tier by tier onto a chip.

    import torch
    compiled = torch.compile(model, backend="kernelize", options={"target": "interpreter"})
    compiled(x)

The backend is found through the ``torch_dynamo_backends`` entry point: importing this package
is not needed to use it. ``torch_kernelize.aot`` saves a compiled function once and loads it in a
later process without Dynamo's tracing.
"""
from __future__ import annotations

__version__ = "0.1.0"


def flush_repros(timeout: float | None = None) -> bool:
    """Wait until this process's miss reproducers are on disk: they are written in the
    background, and at interpreter exit. False if ``timeout`` seconds passed first."""
    import sys
    recorder = sys.modules.get("torch_kernelize.serving.repro_recorder")
    return True if recorder is None else recorder.flush(timeout)  # (never imported: nothing recorded)
