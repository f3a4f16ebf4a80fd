"""Notifications after a scheduled run: the ``Summary`` sent, the notifier (HTTP POST of JSON, or a
command with it on stdin and in FTLAUNCH_* variables), and a notifier's target as it may be shown.
"""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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


def notify(target: str, data: Mapping[str, Any], env: Mapping[str, str], timeout: float = 10.0) -> str | None:
    """POST ``data`` as JSON to a URL, or run a command with it on stdin and in FTLAUNCH_* variables.

    Returns None on success, else why it failed. Never raises: a notifier never fails the run.
    """
    body = json.dumps(data, default=str)
    try:
        if target.startswith(("http://", "https://")):
            req = urllib.request.Request(
                target, data=body.encode(), headers={"Content-Type": "application/json"}, method="POST"
            )
            with _opener(target, env).open(req, timeout=timeout) as resp:
                resp.read(1 << 16)
            return None
        child = dict(env)
        child.update(
            FTLAUNCH_SUMMARY=body,
            FTLAUNCH_STATUS=str(data.get("status")),
            FTLAUNCH_RUN_ID=str(data.get("run_id") or ""),
            FTLAUNCH_SCHEDULE=str(data.get("schedule")),
            FTLAUNCH_OUTPUT_DIR=str(data.get("output_dir") or ""),
        )
        r = subprocess.run(
            ["/bin/sh", "-c", target],
            input=body,
            env=child,
            capture_output=True,
            text=True,
            timeout=timeout * 6,
            start_new_session=True,
        )
        if r.returncode != 0:
            return f"notify command exited {r.returncode}: {r.stderr.strip()[-300:]}"
        return None
    except Exception as exc:  # whatever the notifier does, the run's result stands
        return f"{type(exc).__name__}: {exc}"


def _opener(url: str, env: Mapping[str, str]) -> urllib.request.OpenerDirector:
    """Proxies from ``env`` (not os.environ), never for loopback or no_proxy hosts."""
    host = urllib.parse.urlsplit(url).hostname or ""
    no_proxy = env.get("no_proxy") or env.get("NO_PROXY") or ""
    proxies: dict[str, str] = {}
    if host not in ("localhost", "127.0.0.1", "::1") and not urllib.request.proxy_bypass_environment(
        host, {"no": no_proxy}
    ):
        for scheme in ("http", "https"):
            value = env.get(f"{scheme}_proxy") or env.get(f"{scheme.upper()}_PROXY")
            if value:
                proxies[scheme] = value
    return urllib.request.build_opener(urllib.request.ProxyHandler(proxies))
