"""The fill's log file: what Inductor, Triton and warnings say while candidates are generated.

Inductor discarding an autotuning config logs a traceback ("No valid triton configs.
OutOfMemoryError: out of resource: triton_mm ..."): that is the generator's own search, not a
fault of the fill, and on a terminal it buried the fill's lines. During a fill, the loggers of
torch (Inductor, Dynamo), Triton and Python's warnings write to ``runs/<search id>.log`` in the
cache (beside the run's summary and the journals) instead of the terminal, each line tagged with
the spec being searched; fill_cache's own lines go there too, with the tracebacks of failed specs.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

# loggers whose records are the generators' and compilers' business, not the fill's; DETAILS is
# fill_cache's own for the file alone (a failed spec's traceback)
CAPTURED = ("torch", "triton", "py.warnings", "torch_kernelize.fill_cache.details")
OURS = "torch_kernelize"
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(spec)s]: %(message)s"


class _SpecTag(logging.Filter):
    """Tags each record with the spec being searched (``current``), '-' between specs."""

    def __init__(self) -> None:
        super().__init__()
        self.current = "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.spec = self.current
        return True


def _captured_loggers() -> list[str]:
    """CAPTURED and every logger made so far below them."""
    below = [n for n, lg in logging.root.manager.loggerDict.items()
             if isinstance(lg, logging.Logger) and any(n.startswith(c + ".") for c in CAPTURED)]
    return list(CAPTURED) + below


class RunLog:
    """The run's log file; ``spec(name)`` tags the lines logged while that spec is searched."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._tag = _SpecTag()

    def spec(self, name: str) -> None:
        self._tag.current = name

    @contextlib.contextmanager
    def captured(self) -> Iterator["RunLog"]:
        """Route the CAPTURED loggers to the file only, and copy fill_cache's own records there;
        everything is put back on exit."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.path, delay=True)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(self._tag)
        saved = {}
        for name in _captured_loggers():
            lg = logging.getLogger(name)
            saved[name] = (lg.handlers[:], lg.propagate)
            # the top of each hierarchy writes to the file alone; below it, torch's loggers lose
            # their own handlers (torch._logging gives Dynamo and Inductor theirs) and pass up
            lg.handlers, lg.propagate = ([handler], False) if name in CAPTURED else ([], True)
        ours = logging.getLogger(OURS)
        ours.addHandler(handler)
        logging.captureWarnings(True)
        try:
            yield self
        finally:
            logging.captureWarnings(False)
            ours.removeHandler(handler)
            for name, (handlers, propagate) in saved.items():
                lg = logging.getLogger(name)
                lg.handlers, lg.propagate = handlers, propagate
            handler.close()
