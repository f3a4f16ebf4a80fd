"""Dumping the Python stacks of a stalled trainer's processes into the run directory (py-spy).

py-spy (the train extra) reads a process's memory without stopping it (``--nonblocking``), so it works
on a process that is hung in a collective, sleeping or even SIGSTOPped. When py-spy is missing or not
allowed to attach (ptrace), the file says so and holds what /proc shows (state, wchan, kernel stack).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from ftlaunch.run.procs import group_members


@dataclass(frozen=True)
class StackDump:
    path: Path
    pids: tuple[int, ...]
    dumped: int  # processes py-spy could read
    note: str  # what went wrong, if anything

    def describe(self) -> str:
        got = f"{self.dumped}/{len(self.pids)} process(es) dumped"
        return f"{self.path} ({got}{'; ' + self.note if self.note else ''})"


def find_py_spy(env: Mapping[str, str], trainer: list[str] | None = None) -> str | None:
    """py-spy beside the trainer's executable, beside this Python, or on PATH."""
    folders = [Path(trainer[0]).parent] if trainer else []
    folders.append(Path(sys.executable).parent)
    for folder in folders:
        candidate = folder / "py-spy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("py-spy", path=env.get("PATH"))


def trainer_pids(root: int) -> list[int]:
    """The trainer and every process below it, or in its process group (workers can outlive a parent)."""
    pids = {root, *group_members(root)}
    try:
        pids.update(c.pid for c in psutil.Process(root).children(recursive=True))
    except psutil.Error:
        pass
    return sorted(pids)


def _proc_facts(pid: int) -> str:
    lines = []
    for name in ("status", "wchan", "stack"):
        try:
            text = Path(f"/proc/{pid}/{name}").read_text(errors="replace")
        except OSError as exc:
            text = f"(unreadable: {exc.strerror or exc})"
        if name == "status":
            text = "".join(ln + "\n" for ln in text.splitlines() if ln.startswith(("Name:", "State:", "Threads:")))
        lines.append(f"--- /proc/{pid}/{name}\n{text.rstrip()}")
    return "\n".join(lines)


def dump_stacks(root: int, path: Path, py_spy: str | None, timeout: float = 20.0) -> StackDump:
    """Write every trainer process's stacks to ``path`` (never raises; the note says what failed)."""
    pids = trainer_pids(root)
    parts: list[str] = []
    dumped = 0
    notes: list[str] = []
    if py_spy is None:
        notes.append("py-spy not found (pip install py-spy, part of ftlaunch[train]); /proc facts only")
    for pid in pids:
        try:
            cmdline = " ".join(psutil.Process(pid).cmdline())[:300]
        except psutil.Error:
            cmdline = "?"
        parts.append(f"===== pid {pid}: {cmdline}")
        if py_spy is not None:
            try:
                res = subprocess.run(
                    [py_spy, "dump", "--pid", str(pid), "--nonblocking"],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
                if res.returncode == 0 and res.stdout.strip():
                    dumped += 1
                    parts.append(res.stdout.rstrip())
                else:
                    parts.append(f"(py-spy exit {res.returncode}: {(res.stderr or res.stdout).strip()[:500]})")
            except (OSError, subprocess.SubprocessError) as exc:
                parts.append(f"(py-spy failed: {exc})")
        parts.append(_proc_facts(pid))
    if py_spy is not None and dumped < len(pids):
        notes.append(f"py-spy could not read {len(pids) - dumped} process(es), see the file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(parts) + "\n")
    except OSError as exc:
        notes.append(f"could not write the dump: {exc.strerror or exc}")
    return StackDump(path, tuple(pids), dumped, "; ".join(notes))
