"""The run store, and the one owner of a run folder's files: their names (``RunFolder``), how each is
read and written (atomically, through ftlaunch.files), the state lock and the state's version.

Layout of ``$FTLAUNCH_HOME/runs/<id>/``:
  source.yaml          the config as given (overrides listed in state.json), secrets redacted (secrecy.scrub)
  config.yaml          the adapted config of the current attempt
  .trainer-config.yaml a 0600 copy of config.yaml with the secrets that have no variable, per attempt
  secrets.json         secret config values, 0600
  plan.txt/.json       the plan, for people and for machines
  hardware.json        what the plan was made for
  train.log            trainer stdout+stderr, all attempts appended
  state.json           versioned, replaced atomically (temp file in the same folder, then rename)
  .state.lock          the flock of one read-modify-write of state.json
  events.jsonl         append-only, named by ftlaunch.run.events.Event: attempt_started, checkpoint, exited, ...
  trainer_records.jsonl the trainer's own records, as it logs them (ftlaunch.run.records)
  environment/         attempt-N.json: the trainer's environment per attempt (ftlaunch.run.environment)
  stacks/              attempt-N-<UTC>.txt: stacks of a stalled trainer
  supervisor.log       the detached supervisor's own stderr
  job.sbatch, srun-trainer.sh   a Slurm run's batch script and trainer wrapper
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from ftlaunch.errors import StateError, StateVersionError
from ftlaunch.files import (
    JSON_LIMIT,
    home_folder,
    now_iso,
    read_user_bytes,
    read_user_text,
    to_json,
    value_error,
    write_json_atomic,
    write_text_atomic,
)
from ftlaunch.locks import held
from ftlaunch.plan.config import dump_yaml, read_header
from ftlaunch.run.events import Event
from ftlaunch.run.secrecy import keep_notify_env, scrub
from ftlaunch.run.state import RunState

SECRETS_FILE = "secrets.json"


@dataclass(frozen=True)
class RunFolder:
    """One run's folder and the path of each of its files; every module names them through it."""

    path: Path

    @property
    def source(self) -> Path:
        return self.path / "source.yaml"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def trainer_config(self) -> Path:
        """The 0600 per-attempt copy of config.yaml that holds secrets with no variable."""
        return self.path / ".trainer-config.yaml"

    @property
    def secrets(self) -> Path:
        return self.path / SECRETS_FILE

    @property
    def plan_text(self) -> Path:
        return self.path / "plan.txt"

    @property
    def plan(self) -> Path:
        return self.path / "plan.json"

    @property
    def hardware(self) -> Path:
        return self.path / "hardware.json"

    @property
    def train_log(self) -> Path:
        return self.path / "train.log"

    @property
    def supervisor_log(self) -> Path:
        return self.path / "supervisor.log"

    @property
    def state(self) -> Path:
        return self.path / "state.json"

    @property
    def state_lock(self) -> Path:
        return self.path / ".state.lock"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def records(self) -> Path:
        return self.path / "trainer_records.jsonl"

    @property
    def environment(self) -> Path:
        return self.path / "environment"

    def environment_of(self, attempt: int) -> Path:
        return self.environment / f"attempt-{attempt}.json"

    @property
    def stacks(self) -> Path:
        return self.path / "stacks"

    def stacks_of(self, attempt: int, stamp: str) -> Path:
        return self.stacks / f"attempt-{attempt}-{stamp}.txt"

    @property
    def job_script(self) -> Path:
        return self.path / "job.sbatch"

    @property
    def srun_trainer(self) -> Path:
        return self.path / "srun-trainer.sh"

    @property
    def progress_png(self) -> Path:
        return self.path / "progress.png"

    def trainer_configs(self) -> tuple[Path, Path]:
        """The files a supervisor hands its trainer: what a trainer's command line ends with."""
        return self.config, self.trainer_config


# ---------------------------------------------------------------- a new run's folder


@dataclass(frozen=True)
class NewRun:
    """Everything a new run's folder holds when it becomes visible, as text or JSON values."""

    source: str  # the config as given, secrets redacted
    config: str  # config.yaml (dump_yaml of the plan's config and header)
    plan_text: str
    plan: Mapping[str, Any]  # plan.json, strict JSON (files.to_json)
    hardware: Mapping[str, Any]
    state: RunState
    secrets: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, Any] = field(default_factory=dict)  # the plan's own files: name -> JSON value


def create_folder(root: Path, run_id: str, new: NewRun) -> Path:
    """Write a run folder completely under a hidden name, then make it visible with one rename (no
    half runs): ``root/<run_id>``. Something already there is never replaced: StateError (exit 12)."""
    tmp = RunFolder(root / f".{run_id}.tmp")
    tmp.path.mkdir()
    try:
        for name, content in new.files.items():
            (tmp.path / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
        tmp.source.write_bytes(scrub(new.source.encode(), ()))  # a `# db password: ...` comment too
        write_secrets(tmp.path, new.secrets)
        tmp.config.write_text(new.config)
        tmp.plan_text.write_text(new.plan_text)
        tmp.plan.write_text(to_json(new.plan))
        tmp.hardware.write_text(to_json(new.hardware))
        tmp.train_log.touch()
        write_state(tmp.path, new.state)
        tmp.events.write_text("")
        _rename_into_view(tmp.path, root / run_id)
    except BaseException:
        shutil.rmtree(tmp.path, ignore_errors=True)
        raise
    return root / run_id


def _rename_into_view(tmp: Path, dest: Path) -> None:
    """The one rename that makes a new run visible, never over what is there: os.replace would take the
    place of an empty folder, and fails on a full one (ENOTEMPTY) with no word on why. Only an empty
    folder made between the check and the rename could still be replaced (rename(2) has no
    no-replace flag in Python): nothing is lost then."""
    try:
        if not os.path.lexists(dest):
            os.rename(tmp, dest)
            return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
    try:
        found = sorted(p.name for p in dest.iterdir())
    except OSError:
        found = []
    held = f" (it holds {', '.join(found[:5])}{' ...' if len(found) > 5 else ''})" if found else ""
    raise StateError(
        f"run folder {dest} already exists{held}: a new run never replaces one, so this run was not created",
        hint="train again (a new run gets a new id); what is in that folder was left as it is",
    )


# ---------------------------------------------------------------- config, plan, secrets


def read_config(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.yaml: its values and its header (the plan's notes on top). OSError when it is missing;
    StateError when it is no regular file or over JSON_LIMIT (someone else's, not the one ftlaunch wrote)."""
    path = RunFolder(run_dir).config
    text = read_user_text(path, limit=JSON_LIMIT, what=f"run {run_dir.name}: {path.name}", error=StateError)
    return yaml.safe_load(text) or {}, read_header(text)


def write_config(run_dir: Path, values: Mapping[str, Any], header: Mapping[str, Any] | None) -> None:
    """Replace config.yaml (atomically): the trainer of the next attempt reads it."""
    write_text_atomic(RunFolder(run_dir).config, dump_yaml(values, header))


def write_trainer_config(run_dir: Path, values: Mapping[str, Any], header: Mapping[str, Any] | None) -> Path:
    """The 0600 per-attempt copy of the config (secrets with no variable included), made afresh:
    readable by this user only from its creation. Removed with ``drop_trainer_config``."""
    path = RunFolder(run_dir).trainer_config
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(dump_yaml(values, header))
    return path


def drop_trainer_config(path: Path) -> None:
    """Remove the per-attempt copy; config.yaml itself is never removed."""
    if path.name == RunFolder(path.parent).trainer_config.name:
        path.unlink(missing_ok=True)


def read_plan(run_dir: Path) -> dict[str, Any]:
    """plan.json as written at creation; {} when it is missing or unreadable."""
    return _json_object(RunFolder(run_dir).plan)


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object a file holds; {} when it is missing, unreadable or holds no object."""
    try:
        data = json.loads(read_user_bytes(path, limit=JSON_LIMIT, what=str(path), error=value_error))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def runs_root(env: Mapping[str, str]) -> Path:
    """$FTLAUNCH_HOME/runs; StateError (exit 12) when it or FTLAUNCH_HOME is a file."""
    return home_folder(env, "runs")


def new_run_id(t: float | None = None) -> str:
    stamp = datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def append_event(run_dir: Path, event: str, **fields: Any) -> dict[str, Any]:
    """Append one event. Only the journal calls it (ftlaunch.run.journal, ftlaunch.run.transitions:
    tests/run/test_one_writer.py); ``event`` is an ``Event``."""
    rec = {"t": now_iso(), "event": event, **fields}
    # One write() of one line: concurrent appenders (supervisor, stop, resume) never interleave.
    line = (json.dumps(rec, default=str, ensure_ascii=False) + "\n").encode()
    fd = os.open(RunFolder(run_dir).events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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
    path = RunFolder(run_dir).events
    try:
        data = path.read_bytes()
    except OSError:
        return []
    out, skipped = json_lines(data, lambda rec: isinstance(rec.get("event"), str))
    say_skipped(path, skipped)
    return out


def read_state(run_dir: Path) -> RunState:
    path = RunFolder(run_dir).state
    hint = f"the run can still be resumed from its output_dir: ftlaunch resume {run_dir.name}"
    try:  # a foreign state.json (a FIFO, /dev/zero, a huge file) is refused, never read without end
        what = f"run {run_dir.name}: state.json"
        data = json.loads(read_user_bytes(path, limit=JSON_LIMIT, what=what, error=StateError, hint=hint))
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
    write_json_atomic(RunFolder(run_dir).state, state.to_json())


def set_aside_state(run_dir: Path, t: float | None = None) -> None:
    """Keep a corrupt state.json beside the run as ``state.json.corrupt-<epoch>`` (never deleted)."""
    bad = RunFolder(run_dir).state
    if bad.exists():
        bad.rename(bad.with_name(f"{bad.name}.corrupt-{int(time.time() if t is None else t)}"))


def state_lock(run_dir: Path) -> AbstractContextManager[None]:
    """Serialise read-modify-write of one run's state across processes (supervisor, stop, resume)."""
    return held(RunFolder(run_dir).state_lock)


def update_state(run_dir: Path, **changes: Any) -> RunState:
    """Apply ``changes`` (RunState fields) to state.json atomically, under the state lock; returns the
    new state. A state this ftlaunch cannot read (corrupt, or of another version) is refused with
    StateError, never overwritten: it still holds the status, the output_dir and the retry budget.
    Only a missing state.json is started afresh. Only the journal calls it (ftlaunch.run.journal,
    ftlaunch.run.transitions)."""
    with state_lock(run_dir):
        try:
            state = read_state(run_dir)
        except StateError:
            if RunFolder(run_dir).state.exists():
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
        made = RunFolder(run_dir).source.stat().st_mtime_ns
    except OSError:
        made = 0
    return run_dir.name[: len("YYYYmmdd-HHMMSS")], made, run_dir.name


def run_name(run_dir: Path) -> str | None:
    """A run's name from its state, else from its "created" event (state.json damaged or gone)."""
    try:
        return read_state(run_dir).name
    except StateError:
        pass
    for ev in read_events(run_dir):
        if ev.get("event") == Event.CREATED and ev.get("name"):
            return str(ev["name"])
    return None


def write_secrets(run_dir: Path, secrets: Mapping[str, Any]) -> None:
    """Secret config values, readable by this user only: the atomic write's temp file is made 0600
    (mkstemp) and renamed, so the file is never wider."""
    if not secrets:
        return
    write_text_atomic(RunFolder(run_dir).secrets, json.dumps(dict(secrets)))


def read_secrets(run_dir: Path) -> dict[str, Any]:
    return _json_object(RunFolder(run_dir).secrets)


def keep_notify_secrets(run_dir: Path, env: Mapping[str, str]) -> None:
    """Before a job is submitted (Ray, Slurm): ``env``'s FTLAUNCH_NOTIFY into the run's secrets.json,
    where the job's supervisor reads it (secrecy.keep_notify_env), never the job's environment."""
    secrets = read_secrets(run_dir)
    kept = keep_notify_env(secrets, env)
    if kept != secrets:
        write_secrets(run_dir, kept)
