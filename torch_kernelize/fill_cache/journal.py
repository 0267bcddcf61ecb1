"""The search journal: one JSON line per evaluated candidate, appended and fsynced before the
next candidate starts. It is the checkpoint: a run killed at any moment (SIGKILL included)
resumes from it without repeating or losing an evaluation. A torn last line is ignored, and so is
a line that parses but is not an evaluation record (the file is the user's to edit, or to break).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_record(r: Any) -> bool:
    """Whether ``r`` has the shape of an evaluation (measure.Evaluation.to_json()) that the search
    and --resume read: a config object, a verdict, a fitness, the rest optional but typed."""
    if not (isinstance(r, dict) and isinstance(r.get("config"), dict) and isinstance(r.get("correct"), bool)
            and _number(r.get("fitness"))):
        return False
    if not all(isinstance(k, str) for k in r["config"]):
        return False
    return (isinstance(r.get("error", ""), str) and isinstance(r.get("validation"), (dict, type(None)))
            and all(isinstance(r.get(k, False), bool) for k in ("fault", "contained", "measured"))
            and all(r.get(k) is None or _number(r[k]) for k in ("candidate_ms", "vendor_ms")))


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill mid-write: that evaluation is simply redone
            if is_record(record):  # else skipped like a torn line: that evaluation is redone
                out.append(record)
        return out

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(record, sort_keys=True, default=str) + "\n"
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():  # after a torn write the file may not end in a newline: start a fresh line
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    data = "\n" + data
            f.write(data.encode())
            f.flush()
            os.fsync(f.fileno())

    def archive(self) -> Path | None:
        """Move an old journal aside (a fresh search that does not resume keeps it for reading)."""
        if not self.path.exists():
            return None
        dest = self.path.with_name(f"{self.path.stem}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}.jsonl.old")
        os.replace(self.path, dest)
        return dest
