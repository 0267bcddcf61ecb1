"""The fill's log file: what Inductor, Triton and warnings say while candidates are generated.

Inductor discarding an autotuning config logs a traceback ("No valid triton configs.
OutOfMemoryError: out of resource: triton_mm ..."): that is the generator's own search, not a
fault of the fill, and on a terminal it buried the fill's lines. During a fill, the loggers of
torch (Inductor, Dynamo), Triton and Python's warnings write to ``runs/<search id>.log`` in the
cache (beside the run's summary and the journals) instead of the terminal, each line tagged with
the spec it concerns (the one searched, or one whose candidates are generated ahead); fill_cache's
own lines go there too, with the tracebacks of failed specs. The generators' lines about a spec
are also kept for its journal: the next evaluation of that spec records them (``take``).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

KEEP = 50  # a spec's generator lines kept for its journal, the last ones

# loggers whose records are the generators' and compilers' business, not the fill's; DETAILS is
# fill_cache's own for the file alone (a failed spec's traceback)
CAPTURED = ("torch", "triton", "py.warnings", "torch_kernelize.fill_cache.details")
OURS = "torch_kernelize"
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(spec)s]: %(message)s"


class _SpecTag(logging.Filter):
    """Tags each record with the spec it concerns (``current``: (key, name); '-' between specs)."""

    def __init__(self) -> None:
        super().__init__()
        self.current: tuple[str | None, str] = (None, "-")

    def filter(self, record: logging.LogRecord) -> bool:
        record.spec_key, record.spec = self.current
        return True


class _ForJournal(logging.Handler):
    """Keeps the generators' lines per spec key until the spec's next evaluation takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[str, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = getattr(record, "spec_key", None)
        if key is not None and not record.name.startswith(OURS):
            kept = self.lines.setdefault(key, [])
            kept.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:2000])
            del kept[:-KEEP]


def _captured_loggers() -> list[str]:
    """CAPTURED and every logger made so far below them."""
    below = [n for n, lg in logging.root.manager.loggerDict.items()
             if isinstance(lg, logging.Logger) and any(n.startswith(c + ".") for c in CAPTURED)]
    return list(CAPTURED) + below


class RunLog:
    """The run's log file; ``spec`` tags the lines logged from then on with the spec they concern."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._tag = _SpecTag()
        self._journal = _ForJournal()
        self._journal.addFilter(self._tag)

    def spec(self, key: str | None, name: str = "-") -> None:
        self._tag.current = (key, name)

    @contextlib.contextmanager
    def about(self, key: str, name: str) -> Iterator[None]:
        """Tag the block's lines with another spec (candidates generated ahead), then as before."""
        before = self._tag.current
        self.spec(key, name)
        try:
            yield
        finally:
            self._tag.current = before

    def take(self, key: str) -> list[str]:
        """The generators' lines about spec ``key`` since the last take (for its journal)."""
        return self._journal.lines.pop(key, [])

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
            lg.handlers, lg.propagate = ([handler, self._journal], False) if name in CAPTURED else ([], True)
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
