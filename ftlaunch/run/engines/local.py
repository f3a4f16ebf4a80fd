"""The local engine: the run's supervisor on this machine, detached in a new session
(``start_detached``) or in this process until the run ends (``Local(foreground=True)``).

Its status is the recorded one, but lost when the supervisor is dead before a terminal status
(liveness fails closed); stop and resume are `run/control.py`'s own path (they return None here).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar

from ftlaunch.errors import BusyError, StateError
from ftlaunch.run.engines.base import Created, EngineStatus, Resumed, Started
from ftlaunch.run.procs import liveness, python_module, spawn_detached
from ftlaunch.run.runview import local_status
from ftlaunch.run.store import RunFolder, read_state
from ftlaunch.run.trainer import find_trainer

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan
    from ftlaunch.run.prepare import PlanRequest
    from ftlaunch.run.state import RunState


# (run_dir, env, the output_dir lock, echo, poll) -> the run's exit code, the supervisor run in this process.
RunHere = Callable[[Path, Mapping[str, str], "IO[str] | None", bool, "float | None"], int]


def supervisor_command(run_dir: Path, lock_fd: int | None = None) -> list[str]:
    cmd = python_module(sys.executable, "ftlaunch.run.supervisor", str(run_dir))
    return cmd if lock_fd is None else [*cmd, "--lock-fd", str(lock_fd)]


def start_detached(run_dir: Path, env: Mapping[str, str], wait: float = 60.0, lock: IO[str] | None = None) -> int:
    """Spawn the supervisor in a new session; return its pid once it has taken over the run.

    ``lock``: the output_dir lock this process holds; the supervisor inherits it (same open file,
    so the lock never lapses) and this process lets go of its copy. Without it, a supervisor that
    finds the output_dir busy exits 7, and so does this call."""
    try:
        find_trainer(env)  # fail now, in the user's shell, rather than in the background
        fd = lock.fileno() if lock is not None else None
        log = RunFolder(run_dir).supervisor_log
        proc = spawn_detached(supervisor_command(run_dir, fd), env, log, cwd=run_dir, pass_fds=(fd,) if fd else ())
    finally:
        if lock is not None:
            lock.close()
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            pid = read_state(run_dir).pid
        except StateError:
            pid = None
        if pid == proc.pid:
            break
        if proc.poll() is not None:
            if proc.returncode == 0:
                break  # already done (a finished run)
            tail = RunFolder(run_dir).supervisor_log.read_text(errors="replace").strip().splitlines()[-1:]
            why = tail[0] if tail else f"exit {proc.returncode}"
            if proc.returncode == int(BusyError.exit_code):
                raise BusyError(why.removeprefix("ftlaunch supervisor: "))
            raise StateError(f"the supervisor of run {run_dir.name} did not start: {why}")
        time.sleep(0.05)
    return proc.pid


@dataclass(frozen=True)
class Local:
    """The supervisor on this machine: detached, or here (``foreground``) with its output echoed."""

    foreground: bool = False
    echo: bool = True
    poll: float | None = None
    # Runs the supervisor in this process until the run ends, returning its exit code: `start_run`
    # passes run/launch.py's (this module never imports the supervisor, which reads run views that
    # ask the engines: the registry would import itself).
    here: RunHere | None = None
    name: ClassVar[str] = "local"

    def request(self, req: PlanRequest) -> PlanRequest:
        return req

    def adapt(self, p: Plan) -> Plan:
        return p

    def launch(self, created: Created, env: Mapping[str, str]) -> Started:
        """Detached in a new session (the supervisor's pid once it took over), or here until the end."""
        if not self.foreground:
            return Started(created.run_dir, pid=start_detached(created.run_dir, env, lock=created.lock))
        if self.here is None:
            raise ValueError("Local(foreground=True) runs the supervisor here: start it through start_run")
        return Started(created.run_dir, exit_code=self.here(created.run_dir, env, created.lock, self.echo, self.poll))

    def status(self, state: RunState, env: Mapping[str, str]) -> EngineStatus:
        return EngineStatus(local_status(state, liveness(state.pid, state.pid_start)))

    def stop(self, run_dir: Path, state: RunState, env: Mapping[str, str], grace: float) -> str | None:
        return None

    def resume(
        self,
        run_dir: Path,
        state: RunState,
        env: Mapping[str, str],
        *,
        edit: Callable[[], None],
        overrides: tuple[str, ...],
        cwd: str | Path | None,
        allow_env_change: bool,
    ) -> Resumed | None:
        return None
