"""Reading a growing log incrementally: the new complete lines since the last read.

One implementation for everything that follows a file another process appends to: the supervisor
(trainer_log.jsonl for progress and numeric health, train.log for the attempt's text) and the
throughput probe (ftlaunch.estimate.probe, trainer_log.jsonl). Bytes, not text: a multibyte
character or a line torn by a write in progress waits for the line's end, and never raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftlaunch.run.progress import parse_trainer_log


class Tail:
    """The part of ``path`` after ``offset``, read a complete line at a time."""

    def __init__(self, path: Path, offset: int = 0):
        self.path = path
        self.offset = offset

    @classmethod
    def from_end(cls, path: Path) -> Tail:
        """Only what is appended from now on (a missing file starts at 0)."""
        try:
            return cls(path, path.stat().st_size)
        except OSError:
            return cls(path, 0)

    def lines(self) -> bytes:
        """The complete lines appended since the last call (a partial last line is left for later)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return b""
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete

    def records(self) -> list[dict[str, Any]]:
        """The new step records of a trainer_log.jsonl (torn and foreign lines skipped)."""
        return parse_trainer_log(self.lines())

    def rest(self) -> str:
        """Everything from the offset to the end, a partial last line included (the file is done)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""
