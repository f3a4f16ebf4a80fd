"""The run store: one directory per run under FTLAUNCH_HOME, versioned JSON state, an event log.

Layout of ``$FTLAUNCH_HOME/runs/<id>/``:
  source.yaml      the config as given (overrides listed in state.json)
  config.yaml      the adapted config of the current attempt
  plan.txt/.json   the plan, for people and for machines
  hardware.json    what the plan was made for
  train.log        trainer stdout+stderr, all attempts appended
  state.json       versioned, replaced atomically (temp file in the same folder, then rename)
  events.jsonl     append-only: started, progress, checkpoint, exited, stopped, resumed, ...
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from .errors import RunNotFoundError, StateError

STATE_VERSION = 1


class RunStatus(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"  # the supervisor died without recording an end (reboot, SIGKILL)

    def is_terminal(self) -> bool:
        return self in {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.LOST}

    def is_failed(self) -> bool:
        return self in {RunStatus.FAILED, RunStatus.LOST}


class FailureKind(StrEnum):
    CONFIG = "config_error"  # deterministic: never retried
    SETUP = "setup_error"  # trainer missing, cannot start
    CUDA_OOM = "cuda_oom"
    EVAL_OOM = "eval_oom"
    HOST_OOM = "host_oom"
    CRASH = "crash"
    STOPPED = "stopped_by_user"


def home(env: Mapping[str, str]) -> Path:
    """FTLAUNCH_HOME, else the XDG state dir (~/.local/state/ftlaunch)."""
    if env.get("FTLAUNCH_HOME"):
        return Path(env["FTLAUNCH_HOME"]).expanduser()
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", "~")) / ".local" / "state")
    return Path(base).expanduser() / "ftlaunch"


def runs_root(env: Mapping[str, str]) -> Path:
    return home(env) / "runs"


def now_iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat(timespec="milliseconds")


def new_run_id(t: float | None = None) -> str:
    stamp = datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that readers see the old or the new file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_event(run_dir: Path, event: str, **fields: Any) -> dict[str, Any]:
    rec = {"t": now_iso(), "event": event, **fields}
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    return rec


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line after a crash: skip it, keep the rest
    return out


def read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "state.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(
            f"run {run_dir.name}: state.json is missing",
            hint=f"the run can still be resumed from its output_dir: ftlaunch resume {run_dir.name}",
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise StateError(
            f"run {run_dir.name}: state.json is unreadable ({exc})",
            hint=f"the run can still be resumed from its output_dir: ftlaunch resume {run_dir.name}",
        ) from None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise StateError(
            f"run {run_dir.name}: state.json has version {data.get('version') if isinstance(data, dict) else '?'}, "
            f"this ftlaunch reads version {STATE_VERSION}",
            hint="use the ftlaunch version that made the run, or resume it to rewrite its state",
        )
    return data


def update_state(run_dir: Path, **fields: Any) -> dict[str, Any]:
    try:
        state = read_state(run_dir)
    except StateError:
        state = {"version": STATE_VERSION, "id": run_dir.name}
    state.update(fields)
    state["updated"] = now_iso()
    write_json_atomic(run_dir / "state.json", state)
    return state


def list_runs(env: Mapping[str, str]) -> list[Path]:
    root = runs_root(env)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def find_run(env: Mapping[str, str], ref: str | None) -> Path:
    """RUN is an id, a unique id prefix or a name; None means the latest run."""
    runs = list_runs(env)
    if not runs:
        raise RunNotFoundError(f"no runs under {runs_root(env)}", hint="start one with `ftlaunch train CONFIG.yaml`")
    if ref is None:
        return runs[-1]
    exact = [p for p in runs if p.name == ref]
    if exact:
        return exact[0]
    prefix = [p for p in runs if p.name.startswith(ref)]
    if len(prefix) == 1:
        return prefix[0]
    named = []
    for p in runs:
        try:
            if read_state(p).get("name") == ref:
                named.append(p)
        except StateError:
            continue
    if named:
        return named[-1]  # a name may be reused; the latest run of that name
    if len(prefix) > 1:
        raise RunNotFoundError(
            f"run {ref!r} is ambiguous: {', '.join(p.name for p in prefix)}",
            hint="give more characters of the id",
        )
    raise RunNotFoundError(f"no run {ref!r}", hint="`ftlaunch runs` lists them")
