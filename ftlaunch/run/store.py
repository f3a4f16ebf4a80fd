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
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ftlaunch.errors import FtlaunchError, RunNotFoundError, StateError, StateVersionError
from ftlaunch.files import home_folder, now_iso, write_json_atomic
from ftlaunch.locks import held
from ftlaunch.run.state import RunState


def runs_root(env: Mapping[str, str]) -> Path:
    """$FTLAUNCH_HOME/runs; StateError (exit 12) when it or FTLAUNCH_HOME is a file."""
    return home_folder(env, "runs")


def new_run_id(t: float | None = None) -> str:
    stamp = datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def append_event(run_dir: Path, event: str, **fields: Any) -> dict[str, Any]:
    rec = {"t": now_iso(), "event": event, **fields}
    # One write() of one line: concurrent appenders (supervisor, stop, resume) never interleave.
    line = (json.dumps(rec, default=str, ensure_ascii=False) + "\n").encode()
    fd = os.open(run_dir / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return rec


_TOLD: set[str] = set()


def say_skipped(path: Path, count: int) -> None:
    """Tell once per file and process that unreadable lines were skipped (readers never raise)."""
    if count and str(path) not in _TOLD:
        _TOLD.add(str(path))
        print(f"ftlaunch: skipped {count} unreadable line(s) in {path}", file=sys.stderr)


def json_lines(data: bytes, keep: Callable[[Any], bool]) -> tuple[list[dict[str, Any]], int]:
    """Records of a JSON-lines byte string that pass ``keep``, and how many lines were not records.

    A torn write (half a multibyte character, half a line) or a foreign line costs that line only."""
    out: list[dict[str, Any]] = []
    skipped = 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
            skipped += 1
            continue
        if isinstance(rec, dict) and keep(rec):
            out.append(rec)
        else:
            skipped += 1
    return out, skipped


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    try:
        data = path.read_bytes()
    except OSError:
        return []
    out, skipped = json_lines(data, lambda rec: isinstance(rec.get("event"), str))
    say_skipped(path, skipped)
    return out


def read_state(run_dir: Path) -> RunState:
    path = run_dir / "state.json"
    hint = f"the run can still be resumed from its output_dir: ftlaunch resume {run_dir.name}"
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise StateError(f"run {run_dir.name}: state.json is missing", hint=hint) from None
    except (OSError, ValueError) as exc:  # a bad byte is a UnicodeDecodeError, a ValueError
        raise StateError(f"run {run_dir.name}: state.json is unreadable ({exc})", hint=hint) from None
    if not isinstance(data, dict):
        raise StateError(f"run {run_dir.name}: state.json does not hold an object", hint=hint)
    try:
        return RunState.from_json(data, where=f"run {run_dir.name}: state.json")
    except StateVersionError:
        raise
    except StateError as exc:
        raise StateError(exc.message, hint=hint) from None


def write_state(run_dir: Path, state: RunState) -> None:
    """Replace state.json with ``state`` (atomically; a run being created writes its first one)."""
    write_json_atomic(run_dir / "state.json", state.to_json())


def state_lock(run_dir: Path) -> AbstractContextManager[None]:
    """Serialise read-modify-write of one run's state across processes (supervisor, stop, resume)."""
    return held(run_dir / ".state.lock")


def update_state(run_dir: Path, **changes: Any) -> RunState:
    """Apply ``changes`` (RunState fields) to state.json atomically, under the state lock; returns the
    new state. A state this ftlaunch cannot read (corrupt, or of another version) is refused with
    StateError, never overwritten: it still holds the status, the output_dir and the retry budget.
    Only a missing state.json is started afresh."""
    with state_lock(run_dir):
        try:
            state = read_state(run_dir)
        except StateError:
            if (run_dir / "state.json").exists():
                raise
            state = RunState(id=run_dir.name)
        state = state.changed(**changes, updated=now_iso())
        write_state(run_dir, state)
    return state


def list_runs(env: Mapping[str, str]) -> list[Path]:
    root = runs_root(env)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=_creation_order)


def _creation_order(run_dir: Path) -> tuple[str, int, str]:
    """Oldest first. Ids carry the second and a random suffix, so runs made within one second are
    ordered by their source.yaml, written once when the run is created (the latest run is the last)."""
    try:
        made = (run_dir / "source.yaml").stat().st_mtime_ns
    except OSError:
        made = 0
    return run_dir.name[: len("YYYYmmdd-HHMMSS")], made, run_dir.name


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
    named = [p for p in runs if run_name(p) == ref]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:  # a name may be reused (every `train` of one config): never guess which
        raise RunNotFoundError(
            f"run name {ref!r} matches {len(named)} runs, oldest first:\n{_started_list(named)}",
            hint=f"name one by its id (or a unique prefix of it), e.g. {named[-1].name} for the latest",
        )
    if len(prefix) > 1:
        raise RunNotFoundError(
            f"run {ref!r} is ambiguous: {', '.join(p.name for p in prefix)}",
            hint="give more characters of the id",
        )
    raise RunNotFoundError(f"no run {ref!r}", hint="`ftlaunch runs` lists them")


def _started_list(run_dirs: list[Path]) -> str:
    """One line per run, oldest first: id, status, start time and output_dir, enough to tell runs of
    one name apart. The status is the one `ftlaunch runs` shows (a dead supervisor's run is lost)."""
    from ftlaunch.run.view import run_view  # view reads the store: imported here, not at the top

    out = []
    for p in run_dirs:
        try:
            v = run_view(p)
        except FtlaunchError:
            out.append(f"  - {p.name}  state unreadable")
            continue
        started = (v["created"] or "?")[:19].replace("T", " ")
        out.append(f"  - {p.name}  {v['status']}, started {started} UTC, output_dir {v['output_dir']}")
    return "\n".join(out)


def run_name(run_dir: Path) -> str | None:
    """A run's name from its state, else from its "created" event (state.json damaged or gone)."""
    try:
        return read_state(run_dir).name
    except StateError:
        pass
    for ev in read_events(run_dir):
        if ev.get("event") == "created" and ev.get("name"):
            return str(ev["name"])
    return None


SECRETS_FILE = "secrets.json"


def write_secrets(run_dir: Path, secrets: Mapping[str, Any]) -> None:
    """Secret config values, readable by this user only (0600 from creation, never wider)."""
    if not secrets:
        return
    path = run_dir / SECRETS_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{SECRETS_FILE}.", dir=run_dir)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dict(secrets), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_secrets(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / SECRETS_FILE).read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
