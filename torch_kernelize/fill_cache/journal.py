"""The search journal: one JSON line per evaluated candidate, appended and fsynced before the
next candidate starts. It is the checkpoint: a run killed at any moment (SIGKILL included)
resumes from it without repeating or losing an evaluation. A torn last line is ignored.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a kill mid-write: that evaluation is simply redone
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
