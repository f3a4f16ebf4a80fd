"""Trainers that outlived their supervisor (a kill -9 of it, a killed `train --foreground`): finding
them, so that `train`, `resume` and `schedule run` never start a trainer beside one, and ending them.

One rule says which runs' trainers live in an output_dir (``runs_of_output_dir``): the runs into it, and
the runs of the same base output_dir. A scheduled run trains into ``<base>/<name>-<UTC time>``, its
config's own output_dir being the base: so a `train` of that config (into the base) and every
schedule's run under it share one place, and none starts a trainer beside a live one of another
(issue 31: `schedule run` started one beside the orphan of a plain `train` of the same config).

A trainer runs in its own process group, whose id is its pid (spawned with process_group=0), and
state.json records that pid with its start time. The trainer is alive when liveness(pid, start) is
ALIVE or UNKNOWN (fails closed), or, its leader gone, while any process is still in its group (a
torchrun worker can outlive its parent). A pid that another process now holds cannot be the group's
any more: Linux hands out no pid that is still some group's id. A trainer whose pid was never
recorded (the supervisor died right after spawning it, or could not write its state) is found by
its command line, ``... train RUN_DIR/config.yaml``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from ftlaunch.errors import BusyError, StateError
from ftlaunch.run.procs import Liveness, end_group, group_members, liveness
from ftlaunch.run.state import RunState
from ftlaunch.run.store import RunFolder, list_runs, read_state


@dataclass(frozen=True)
class LiveTrainer:
    """A trainer of a run that is (or may be: UNKNOWN) alive, and how it was found."""

    run_id: str
    pgid: int  # its process group, = the trainer's pid
    pids: tuple[int, ...]  # the processes still in it (the leader first when it lives)
    verdict: Liveness  # ALIVE, or UNKNOWN: cannot tell, treated as alive
    how: str
    supervised: bool = False  # its run's supervisor is alive (a run of the same base, with its own lock)

    def describe(self) -> str:
        pids = ", ".join(map(str, self.pids[:5])) + (" ..." if len(self.pids) > 5 else "")
        if self.verdict is Liveness.UNKNOWN:
            return f"pid {self.pgid}, the trainer of run {self.run_id}, may still be alive ({self.how})"
        if self.supervised:
            return f"run {self.run_id} is training there (process group {self.pgid}: pid {pids}; {self.how})"
        return f"the trainer of run {self.run_id} is still alive (process group {self.pgid}: pid {pids}; {self.how})"


def group_verdict(leader: Liveness, pid_taken: bool, members: Sequence[int]) -> Liveness:
    """Pure: is a trainer's process group alive? ``leader``: liveness(pid, start) of the recorded
    trainer; ``pid_taken``: that pid is now another (live, later-started) process; ``members``: the
    live processes whose group id is the recorded pid."""
    if leader is not Liveness.DEAD:
        return leader  # ALIVE, or UNKNOWN: fails closed
    if pid_taken:
        return Liveness.DEAD  # the pid was reused, so the old group is gone and these are another's
    return Liveness.ALIVE if members else Liveness.DEAD


def _pid_taken(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True  # someone's, and not the trainer's own (liveness said DEAD)


def recorded_trainer(
    run_id: str, state: RunState, members: Callable[[int], tuple[int, ...]] = group_members
) -> LiveTrainer | None:
    """The trainer state.json records for a run, if it (or its group) is alive."""
    pid, started = state.trainer_pid, state.trainer_start
    if not pid:
        return None
    leader = liveness(pid, started)
    taken = leader is Liveness.DEAD and _pid_taken(pid)
    group = members(pid) if leader is not Liveness.UNKNOWN and not taken else ()
    verdict = group_verdict(leader, taken, group)
    if verdict is Liveness.DEAD:
        return None
    if verdict is Liveness.UNKNOWN:
        why = "its start time was not recorded" if started is None else "its owner cannot be read"
        return LiveTrainer(run_id, pid, (pid,), verdict, f"cannot tell: {why}")
    if leader is Liveness.ALIVE:
        pids = (pid, *(p for p in group if p != pid))
        return LiveTrainer(run_id, pid, pids, verdict, "its pid and start time match")
    return LiveTrainer(run_id, pid, group, verdict, f"the trainer {pid} is gone; its group lives on")


def trainers_by_command(run_dirs: Iterable[Path], me: int | None = None) -> dict[str, tuple[int, ...]]:
    """Processes whose command line ends ``train RUN_DIR/config.yaml`` (what a supervisor starts),
    by run id: a trainer whose pid never reached state.json. ftlaunch's own `train` of such a file
    and this process are left out."""
    wanted = {str(path): d.name for d in run_dirs for path in RunFolder(d).trainer_configs()}
    if not wanted:
        return {}
    me = os.getpid() if me is None else me
    found: dict[str, list[int]] = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if proc.pid == me or len(cmd) < 2 or cmd[-2] != "train" or cmd[-1] not in wanted:
            continue
        if any(Path(a).name == "ftlaunch" or a.startswith("ftlaunch.") for a in cmd[:-2]):
            continue
        found.setdefault(wanted[cmd[-1]], []).append(proc.pid)
    return {run: tuple(pids) for run, pids in found.items()}


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _supervised(st: RunState) -> bool:
    """Whether the run's own supervisor (state's pid and its start time) is alive; unknown: no."""
    return bool(st.pid) and st.pid != os.getpid() and liveness(st.pid, st.pid_start) is Liveness.ALIVE


def live_trainers(runs: Sequence[tuple[Path, RunState]]) -> list[LiveTrainer]:
    """The live trainers of these runs (run dir, state): by recorded process group, else by command line."""
    found = [t for run_dir, st in runs if (t := recorded_trainer(run_dir.name, st)) is not None]
    states = {run_dir.name: st for run_dir, st in runs}
    found = [replace(t, supervised=_supervised(states[t.run_id])) for t in found]
    known = {p for t in found for p in t.pids}
    mine = os.getpgrp()
    for run_id, pids in trainers_by_command([d for d, _ in runs]).items():
        for pid in (p for p in pids if p not in known):
            pgid = _group_of(pid)
            if pgid is None or pgid == mine:
                continue
            group = group_members(pgid) or (pid,)
            known.update(group)
            sup = _supervised(states[run_id])
            found.append(LiveTrainer(run_id, pgid, group, Liveness.ALIVE, "found by its command line", sup))
    return found


def runs_where(env: Mapping[str, str], keep: Callable[[RunState], bool]) -> list[tuple[Path, RunState]]:
    """The runs whose readable state ``keep`` keeps, oldest first, with their states."""
    runs = []
    for run_dir in list_runs(env):
        try:
            st = read_state(run_dir)
        except StateError:
            continue
        if keep(st):
            runs.append((run_dir, st))
    return runs


def base_of(st: RunState) -> str | None:
    """The base output_dir of a run (absolute): its output_dir, or for a scheduled run the folder its
    version dir ``<base>/<name>-<UTC time>`` is in (the config's own output_dir)."""
    if not st.output_dir:
        return None
    out = os.path.abspath(st.output_dir)
    return os.path.dirname(out) if st.schedule else out


def runs_of_output_dir(
    env: Mapping[str, str], output_dir: str, *, scheduled: bool = False
) -> list[tuple[Path, RunState]]:
    """The one rule for "a trainer lives in this output_dir" (train, resume, schedule run, a Slurm job's
    supervisor): every run into it, and every run of the same base output_dir (``base_of``), oldest
    first. ``output_dir`` is a schedule's version dir when ``scheduled``, or when a run into it was
    started by a schedule: then its base is its parent. Paths are compared as absolute paths."""
    want = os.path.abspath(output_dir)
    runs = runs_where(env, lambda st: bool(st.output_dir))
    same = [(d, st) for d, st in runs if os.path.abspath(st.output_dir or "") == want]
    bases = {want} | ({os.path.dirname(want)} if scheduled or any(st.schedule for _, st in same) else set())
    return [(d, st) for d, st in runs if os.path.abspath(st.output_dir or "") == want or base_of(st) in bases]


class TrainerAlive(BusyError):
    """A trainer of this output_dir (or schedule: ``where``) is alive, without its supervisor or (a run
    of the same base output_dir, under its own lock) with it: no second one starts beside it."""

    def __init__(self, where: str, found: Sequence[LiveTrainer]):
        self.found = tuple(found)
        first = self.found[0]
        lines = "; ".join(t.describe() for t in self.found)
        if first.supervised and first.verdict is Liveness.ALIVE:
            super().__init__(
                f"{where}: {lines}; no second trainer starts beside it",
                hint=f"wait for it to end, or stop it with `ftlaunch stop {first.run_id}`; or set another output_dir",
            )
            return
        if first.verdict is Liveness.UNKNOWN:
            hint = (
                f"look at it (`ps -o pid,pgid,lstart,args -p {first.pgid}`); if it is that trainer, end it "
                f"with `kill -TERM -- -{first.pgid}`, then start again"
            )
        else:
            hint = (
                f"end it with `ftlaunch stop {first.run_id}` (stops its process group), or restart that run "
                f"from its last checkpoint with `ftlaunch resume {first.run_id}`"
            )
        super().__init__(
            f"{where}: {lines}, and its supervisor is gone; no second trainer starts beside it",
            hint=hint,
        )


def refuse_if_alive(output_dir: str, runs: Sequence[tuple[Path, RunState]]) -> None:
    """Exit 7 (TrainerAlive) when a trainer of these runs of ``output_dir`` is alive. Call it holding
    the output_dir lock, so that no other shell starts one in between."""
    if found := live_trainers(runs):
        raise TrainerAlive(f"output_dir {output_dir}", found)


def stop_trainer(trainer: LiveTrainer, grace: float = 30.0) -> bool:
    """End a live trainer's process group (SIGTERM, ``grace`` s, SIGKILL) and wait until none of its
    processes is left. Never on UNKNOWN: a pid that may be another's is not signalled (False)."""
    if trainer.verdict is not Liveness.ALIVE or trainer.pgid == os.getpgrp():
        return False
    return end_group(trainer.pgid, grace=grace)
