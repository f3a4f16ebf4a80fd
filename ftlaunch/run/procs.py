"""Process shell: liveness by (pid, start time), detached spawning, group signalling.

Liveness fails closed (SkyPilot controller_liveness): UNKNOWN means "possibly alive", and nothing
is restarted or cleaned up on UNKNOWN.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path

import psutil


class Liveness(StrEnum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


def start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def liveness(pid: int | None, started: float | None) -> Liveness:
    if not pid:
        return Liveness.DEAD
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return Liveness.DEAD
        created = proc.create_time()
    except psutil.NoSuchProcess:
        return Liveness.DEAD
    except (psutil.AccessDenied, OSError):
        return Liveness.UNKNOWN
    if started is None:
        return Liveness.UNKNOWN
    # create_time has ~10 ms resolution from /proc; a reused pid starts much later.
    return Liveness.ALIVE if abs(created - started) < 1.0 else Liveness.DEAD


def python_module(python: str, module: str, *args: str) -> list[str]:
    """``python -P -m module args``: a child of ftlaunch's own Python that the folder it starts in
    cannot shadow. ``python -m`` puts the working folder first on sys.path, so a folder named
    ``ftlaunch`` there (a clone's parent, a home with the clone in it) would be imported instead of
    the package (issue 40); ``-P`` leaves it out. Every Python that can run ftlaunch knows ``-P``: the
    package requires 3.11, which added it."""
    return [python, "-P", "-m", module, *args]


def spawn_detached(
    cmd: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path | None = None, pass_fds: Sequence[int] = ()
) -> subprocess.Popen:
    """Start ``cmd`` in a new session: no controlling terminal, immune to the shell's SIGHUP.
    ``pass_fds``: descriptors the child inherits (an output_dir lock handed over)."""
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            list(cmd),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
    finally:
        log.close()


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when it is gone (or not ours to signal)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def terminate_group(pgid: int, grace: float = 30.0, poll: float = 0.1) -> bool:
    """SIGTERM the process group, wait up to ``grace`` s, then SIGKILL. True if it is gone."""
    if not signal_group(pgid, signal.SIGTERM):
        return True
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(poll)
    signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(poll)
    return not group_alive(pgid)


class GroupStop:
    """Stopping a process group from a polling loop: SIGTERM once, SIGKILL once ``grace`` s have passed.

    Driven by the loop's ``tick`` (signal handlers only record; the loop acts), so the stop never blocks
    the loop that keeps logging the trainer's last words."""

    def __init__(self, pgid: int, grace: float, clock: Callable[[], float] = time.monotonic):
        self.pgid = pgid
        self.grace = grace
        self.clock = clock
        self.since: float | None = None

    def tick(self, before_term: Callable[[], None] = lambda: None) -> None:
        """Advance the stop; ``before_term`` runs once, just before SIGTERM (to record the stop)."""
        if self.since is None:
            self.since = self.clock()
            before_term()
            signal_group(self.pgid, signal.SIGTERM)
        elif self.clock() - self.since > self.grace:
            signal_group(self.pgid, signal.SIGKILL)


def group_members(pgid: int) -> tuple[int, ...]:
    """The live processes of a process group (zombies left out: they hold nothing and end with their
    reaper); the group's leader may be gone while its children live on (a torchrun worker)."""
    found = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                continue
        except (ProcessLookupError, psutil.Error, OSError):
            continue  # gone meanwhile
        found.append(pid)
    return tuple(found)


def end_group(
    pgid: int,
    grace: float = 30.0,
    poll: float = 0.1,
    *,
    members: Callable[[int], tuple[int, ...]] = group_members,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """SIGTERM a process group, wait up to ``grace`` s until none of its processes is left, then
    SIGKILL and wait 5 s more. True when the group is gone. Unlike ``terminate_group`` it counts
    processes, not the group id: zombies nobody reaps yet do not keep it waiting, and a leader
    gone before its workers does not end the wait early."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if not members(pgid):
            return True
        signal_group(pgid, sig)
        deadline = clock() + wait
        while clock() < deadline:
            if not members(pgid):
                return True
            sleep(poll)
    return not members(pgid)
