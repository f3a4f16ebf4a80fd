"""A run's support bundle: one tar.gz holding what an upstream bug report needs, with no secret.

What goes in (under ``ftlaunch-bundle-<id>/``): the plan (plan.txt with its change table, plan.json),
the config as given and as adapted, hardware.json and the trainer's environment per attempt, state.json,
events.jsonl, the tails of train.log, supervisor.log and trainer_records.jsonl, stacks/, the
trainer_state.json of the last checkpoint, and SUMMARY.md / summary.json (status, failure class,
cause, the last lines of the log, this machine). MANIFEST.txt lists every member and what was left
out. Never in it: secrets.json, the 0600 per-attempt trainer config, checkpoints' weights or pickles.

Every member is redacted the way the supervisor redacts train.log (``run.trainer.redact``: the values
of the secret variables in the environment, and every value of the run's secrets.json, notification
destinations included), plus Hugging Face token shapes and secret-looking keys' values in YAML/JSON
lines, so a secret a file picked up some other way is masked too (ftlaunch.run.secrecy). ``members``
reads the folder into (name, redacted bytes); ``write_bundle`` writes the archive
(ftlaunch.outfile: atomically to a file, through a FIFO or device, or to stdout).
"""

from __future__ import annotations

import io
import json
import os
import platform
import sys
import tarfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ftlaunch import __version__
from ftlaunch.errors import StateError
from ftlaunch.outfile import write_out
from ftlaunch.run.notify import shared_secret_values
from ftlaunch.run.progress import checkpoint_dirs, last_complete_checkpoint
from ftlaunch.run.secrecy import scrub, secret_values
from ftlaunch.run.store import RunFolder, read_events, read_secrets

LOG_TAIL_BYTES = 256 * 1024
SUPERVISOR_TAIL_BYTES = 64 * 1024
RECORDS_TAIL_BYTES = 64 * 1024
SUMMARY_LOG_LINES = 60
SUMMARY_EVENTS = 30
LEFT_OUT = (
    "secrets.json (the run's secret values, notification destinations included)",
    ".trainer-config.yaml (the 0600 per-attempt config with secrets)",
    "checkpoints' weights, optimizer state and training_args.bin (large; pickles may hold tokens)",
)


@dataclass(frozen=True)
class Bundle:
    """What ``write_bundle`` wrote: the archive, its size and its members' names."""

    path: str  # as given, or "stdout"
    size: int
    members: tuple[str, ...]
    how: str = "created"  # ftlaunch.outfile.Written.how: created, replaced, through a FIFO, streamed...


def tail(data: bytes, limit: int) -> tuple[bytes, bool]:
    """The last ``limit`` bytes of ``data`` from a line start (a cut line could hold half a secret,
    which no redaction would find), and whether anything was cut."""
    if len(data) <= limit:
        return data, False
    cut = data[-limit:]
    nl = cut.find(b"\n")
    return (cut[nl + 1 :] if nl >= 0 else b""), True


def _read(path: Path, limit: int | None = None) -> tuple[bytes | None, bool]:
    """A file's bytes (its tail when ``limit``); None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            if limit is None:
                return f.read(), False
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - limit - 4096)  # a little more: tail() starts at a line
            f.seek(start)
            data, cut = tail(f.read(), limit)
            return data, cut or start > 0
    except OSError:
        return None, False


def summary(run_dir: Path, log_tail: bytes, env: Mapping[str, str]) -> dict[str, Any]:
    """The failure summary: the run as `status --json` shows it, the cause, the log's last lines,
    the last events and this machine (ftlaunch, Python, OS)."""
    from ftlaunch.run.view import RunView, run_view

    try:
        view = run_view(run_dir, env=env).to_json()
    except StateError as exc:
        view = RunView.unreadable(run_dir, exc.message).to_json()
    lines = log_tail.decode("utf-8", errors="replace").replace("\r", "\n").splitlines()
    return {
        "run": view,
        "failure": {
            "status": view.get("status"),
            "failure_kind": view.get("failure_kind"),
            "exit_code": view.get("exit_code"),
            "message": view.get("message"),
            "last_checkpoint": view.get("last_checkpoint"),
        },
        "log_last_lines": [ln for ln in lines if ln.strip()][-SUMMARY_LOG_LINES:],
        "last_events": read_events(run_dir)[-SUMMARY_EVENTS:],
        "machine": {
            "ftlaunch": __version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "machine": platform.machine(),
        },
    }


def summary_text(s: Mapping[str, Any]) -> str:
    """SUMMARY.md: what to paste at the top of an issue."""
    run, fail, mach = s["run"], s["failure"], s["machine"]
    out = [
        f"# ftlaunch run {run.get('id')} ({run.get('name') or 'unnamed'})",
        "",
        f"- status: {fail['status']}" + (f" ({fail['failure_kind']})" if fail.get("failure_kind") else ""),
        f"- exit code: {fail.get('exit_code')}",
        f"- message: {fail.get('message') or '-'}",
        f"- attempt: {run.get('attempt')}, step {run.get('step')}/{run.get('total_steps')}, loss {run.get('loss')}",
        f"- last complete checkpoint: {fail.get('last_checkpoint')}",
        f"- ftlaunch {mach['ftlaunch']}, Python {mach['python']}, {mach['platform']}",
        "",
        "## Last events",
        "",
        "```",
        *(json.dumps(e, ensure_ascii=False, default=str) for e in s["last_events"]),
        "```",
        "",
        "## Last lines of train.log",
        "",
        "```",
        *s["log_last_lines"],
        "```",
        "",
    ]
    return "\n".join(out)


def members(run_dir: Path, env: Mapping[str, str]) -> tuple[list[tuple[str, bytes]], list[str]]:
    """(name, redacted bytes) of every member, and notes on what was cut or missing."""
    folder = RunFolder(run_dir)
    secrets = sorted({*secret_values(read_secrets(run_dir), env), *shared_secret_values(env)}, key=len, reverse=True)
    out: list[tuple[str, bytes]] = []
    notes: list[str] = []

    def add(name: str, path: Path, limit: int | None = None) -> bytes | None:
        data, cut = _read(path, limit)
        if data is None:
            notes.append(f"{name}: missing or unreadable")
            return None
        if cut:
            notes.append(f"{name}: the last {len(data):,} bytes only")
        clean = scrub(data, secrets)
        out.append((name, clean))
        return clean

    for path in (folder.plan_text, folder.plan, folder.source, folder.config, folder.hardware, folder.state):
        add(path.name, path)
    add(folder.events.name, folder.events)
    log = add(folder.train_log.name, folder.train_log, LOG_TAIL_BYTES) or b""
    add(folder.supervisor_log.name, folder.supervisor_log, SUPERVISOR_TAIL_BYTES)
    add(folder.records.name, folder.records, RECORDS_TAIL_BYTES)
    for sub in (folder.environment, folder.stacks):
        for path in sorted(sub.glob("*")) if sub.is_dir() else []:
            if path.is_file():
                add(f"{sub.name}/{path.name}", path)
    _add_trainer_state(run_dir, add, notes)
    s = summary(run_dir, log, env)
    out.append(("summary.json", scrub(json.dumps(s, indent=2, default=str).encode() + b"\n", secrets)))
    out.append(("SUMMARY.md", scrub(summary_text(s).encode(), secrets)))
    return out, notes


def _add_trainer_state(run_dir: Path, add: Any, notes: list[str]) -> None:
    """trainer_state.json of the last complete checkpoint (else of the newest one that has it)."""
    from ftlaunch.run.store import read_state

    try:
        output_dir = read_state(run_dir).output_dir
    except StateError:
        output_dir = None
    if not output_dir or not Path(output_dir).is_dir():
        notes.append("trainer_state.json: no output_dir with checkpoints")
        return
    out = Path(output_dir)
    found = last_complete_checkpoint(out)
    candidates = [found[1]] if found else []
    candidates += [p for _, p in reversed(checkpoint_dirs(out))]
    for ckpt in candidates:
        if (ckpt / "trainer_state.json").is_file():
            add(f"checkpoint/{ckpt.name}/trainer_state.json", ckpt / "trainer_state.json")
            return
    notes.append("trainer_state.json: no checkpoint holds one")


def manifest(names: Iterable[str], notes: Iterable[str]) -> bytes:
    lines = ["Members:", *(f"  {n}" for n in names), "", "Notes:", *(f"  {n}" for n in notes)]
    lines += ["", "Never included:", *(f"  {n}" for n in LEFT_OUT), ""]
    return "\n".join(lines).encode()


def write_bundle(
    run_dir: Path, out: str, env: Mapping[str, str], now: float | None = None, stdout: BinaryIO | None = None
) -> Bundle:
    """Write the tar.gz to ``out`` (ftlaunch.outfile.write_out: ``-`` is stdout; a regular file is
    replaced atomically, a FIFO or character device written through, a symlink followed; an OS error
    is an OutputError or a DiskFullError naming ``out``). Every member is read before a byte is written."""
    files, notes = members(run_dir, env)
    files.append(("MANIFEST.txt", manifest([n for n, _ in files] + ["MANIFEST.txt"], notes)))
    top = f"ftlaunch-bundle-{run_dir.name}"
    mtime = int(time.time() if now is None else now)

    def produce(f: BinaryIO) -> None:
        # stream mode ("w|gz"): tarfile only writes, so a FIFO or a pipe takes it as well as a file
        with tarfile.open(fileobj=f, mode="w|gz") as tar:
            for name, data in files:
                info = tarfile.TarInfo(f"{top}/{name}")
                info.size, info.mtime, info.mode = len(data), mtime, 0o644
                tar.addfile(info, io.BytesIO(data))

    written = write_out(out, produce, stdout=stdout)
    return Bundle(path=written.where, size=written.size, members=tuple(f"{top}/{n}" for n, _ in files), how=written.how)
