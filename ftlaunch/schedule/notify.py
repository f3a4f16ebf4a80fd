"""Notifications after a scheduled run: the ``Summary`` sent, the notifier (HTTP POST of JSON, or a
command with it on stdin and in FTLAUNCH_* variables: ftlaunch.run.notify's delivery, which the
supervisor of every run uses too), and a notifier's target as it may be shown.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ftlaunch.run.notify import DEADLINE_S, post_or_run
from ftlaunch.schedule.records import EntryStatus


@dataclass(frozen=True)
class Summary:
    """What a notifier is sent after a scheduled run, success or failure."""

    status: EntryStatus
    run_id: str | None  # None: the run was never created (the config broke since `add`)
    schedule: str
    duration_s: float
    final_loss: float | None
    output_dir: str | None
    exit_code: int | None = None  # set once the run ended
    message: str | None = None  # why it failed

    def __post_init__(self) -> None:
        object.__setattr__(self, "duration_s", round(self.duration_s, 1))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": self.status.value,
            "run_id": self.run_id,
            "schedule": self.schedule,
            "duration_s": self.duration_s,
            "final_loss": self.final_loss,
            "output_dir": self.output_dir,
        }
        if self.exit_code is not None:
            out["exit_code"] = self.exit_code
        if self.message is not None:
            out["message"] = self.message
        return out


# POST or run ``target`` with the summary; None on success, else why it failed.
Notifier = Callable[[str, Mapping[str, Any], Mapping[str, str]], str | None]


def redact_target(target: str | None) -> str | None:
    """A notifier as it may be shown: a webhook's path and query often are its secret."""
    if not target:
        return target
    if target.startswith(("http://", "https://")):
        u = urllib.parse.urlsplit(target)
        return f"{u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}/..."
    words = target.split()
    return f"{words[0]} ..." if words else target


def notify(target: str, data: Mapping[str, Any], env: Mapping[str, str], timeout: float = DEADLINE_S) -> str | None:
    """POST ``data`` as JSON to a URL, or run a command with it on stdin and in FTLAUNCH_* variables:
    the supervisor's own delivery (ftlaunch.run.notify.post_or_run), once, all of it within ``timeout``
    seconds (a command's whole process group killed past it).

    Returns None on success, else why it failed. Never raises: a notifier never fails the run.
    """
    return post_or_run(target, data, env, timeout)
