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


def _environ(folder: Path) -> dict[str, str]:
    """A process's environment from /proc (empty when it cannot be read: gone, or not ours)."""
    try:
        raw = (folder / "environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _is_python(folder: Path) -> bool:
    try:
        arg0 = (folder / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return False
    return Path(arg0).name.startswith("python")


def slurm_task_pids(root: int, skip: set[int], proc: Path = Path("/proc")) -> tuple[list[int], str]:
    """In a Slurm job, the trainer (srun-trainer.sh, an srun client) does not parent its ranks: srun
    asks slurmstepd to start them. So: the Python processes on this node whose environment has the
    trainer's SLURM_JOB_ID and a SLURM_STEP_ID (torchrun and its ranks in the srun step), but for
    ``skip`` (the supervisor's own line). Returns (pids, a note when other nodes' ranks are not seen
    from here); ([], "") outside a Slurm job."""
    job_env = _environ(proc / str(root))
    job = job_env.get("SLURM_JOB_ID")
    if not job:
        return [], ""
    found = []
    for folder in proc.iterdir():
        if not folder.name.isdigit() or int(folder.name) in skip:
            continue
        env = _environ(folder)
        if env.get("SLURM_JOB_ID") == job and "SLURM_STEP_ID" in env and _is_python(folder):
            found.append(int(folder.name))
    nodes = int(job_env.get("SLURM_NNODES") or job_env.get("SLURM_JOB_NUM_NODES") or 1)
    note = f"Slurm job {job}: the ranks running on this host; a rank on another of its {nodes} nodes is not dumped"
    return sorted(found), note if nodes > 1 else ""


def _own_line() -> set[int]:
    """This process and its ancestors (the supervisor, the batch step): never dumped as a rank."""
    try:
        me = psutil.Process()
        return {me.pid, *(p.pid for p in me.parents())}
    except psutil.Error:
        return {os.getpid()}


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
    """Write every trainer process's stacks to ``path`` (never raises; the note says what failed). In a
    Slurm job, the ranks srun started on this node too (``slurm_task_pids``)."""
    pids = trainer_pids(root)
    notes: list[str] = []
    tasks, where = slurm_task_pids(root, {*pids, *_own_line()})
    pids = sorted({*pids, *tasks})
    if where:
        notes.append(where)
    parts: list[str] = []
    dumped = 0
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
