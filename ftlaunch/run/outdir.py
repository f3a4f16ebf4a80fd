"""Who owns an output_dir: its lock (held by the live run writing checkpoints there, handed from the
starting process to the supervisor), and what a new run does with checkpoints it finds there
(use, continue, adopt with --resume-existing, or move aside with --fresh).
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO

from ftlaunch.errors import BusyError, ConfigError, StateError
from ftlaunch.files import file_in_the_way, home
from ftlaunch.locks import flock_open, try_flock
from ftlaunch.plan.planner import Plan
from ftlaunch.run import progress as prog
from ftlaunch.run.orphans import refuse_if_alive, runs_of_output_dir
from ftlaunch.run.state import RunState, RunStatus, StartFacts
from ftlaunch.run.store import runs_root


class Existing(StrEnum):
    """What `train` may do with checkpoints it finds in the output_dir."""

    REFUSE = "refuse"  # default: only an unfinished ftlaunch run of this config may be continued
    RESUME = "resume"  # --resume-existing: continue them, recorded as such
    FRESH = "fresh"  # --fresh: move the old content aside into <output_dir>.old-<UTC>


class DirUse(StrEnum):
    """What a new run does with its output_dir."""

    USE = "use"  # nothing to resume there
    CONTINUE = "continue"  # an unfinished ftlaunch run of this config left checkpoints: go on from them
    ADOPT = "adopt"  # --resume-existing: go on from whatever checkpoints are there
    FRESH = "fresh"  # --fresh: move the old content aside


@dataclass(frozen=True)
class OutputDirVerdict:
    use: DirUse
    why: str


def output_dir_verdict(
    output_dir: str, checkpoints: list[str], owners: list[RunState], key: str, mode: Existing
) -> OutputDirVerdict:
    """Pure: what a new run does with an output_dir (use, continue, adopt, fresh), and why.

    ``owners``: the states of earlier ftlaunch runs into this output_dir, latest last. Raises
    BusyError (exit 7) for checkpoints that no unfinished ftlaunch run of this config left: the
    trainer would resume them (overwrite_output_dir is off so ftlaunch's restarts resume), and a
    fresh run would silently train nothing, or on top of another run."""
    if mode is Existing.FRESH:
        return OutputDirVerdict(DirUse.FRESH, "--fresh: the old content is moved aside")
    if not checkpoints:
        return OutputDirVerdict(DirUse.USE, "no checkpoints there")
    if mode is Existing.RESUME:
        return OutputDirVerdict(DirUse.ADOPT, f"--resume-existing: continuing {checkpoints[-1]}")
    mine = owners[-1] if owners else None
    if mine and mine.memory_key == key and mine.status is not RunStatus.SUCCEEDED:
        return OutputDirVerdict(DirUse.CONTINUE, f"continuing run {mine.id} of this config from {checkpoints[-1]}")
    if mine and mine.memory_key == key:
        why = f"run {mine.id} of this config already succeeded there"
    elif mine:
        why = f"run {mine.id} of another config left them"
    else:
        why = "no ftlaunch run left them"
    raise BusyError(
        f"output_dir {output_dir} holds {', '.join(checkpoints[-3:])}"
        f"{' ...' if len(checkpoints) > 3 else ''}: {why}; the trainer would resume from them",
        hint="pass --resume-existing to continue those checkpoints, --fresh to move them aside into "
        f"{output_dir}.old-<UTC time> (nothing is deleted), or set another output_dir",
    )


def home_problem(env: Mapping[str, str]) -> None:
    """FTLAUNCH_HOME must be a directory this user can write (exit 12, like `schedule add`)."""
    root = runs_root(env)
    if problem := not_writable(root):
        raise StateError(f"FTLAUNCH_HOME: {problem}", hint="set FTLAUNCH_HOME to a writable directory")


def not_writable(path: Path) -> str | None:
    """Why files cannot be created in ``path`` (made if missing), or None. A real probe: os.access
    says yes to root on a read-only mount."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        if trouble := link_trouble(path):
            return trouble
        if blocker := file_in_the_way(path):
            return f"{path} is not writable: {'it' if blocker == path else blocker} is a file, not a folder"
        return f"{path} is not writable ({exc.strerror or exc})"
    return None


def link_trouble(path: Path) -> str | None:
    """Why ``path`` cannot be a folder because of a symlink on the way to it, or None: a symlink loop
    (``a -> b -> a``) or a link to nothing (mkdir says "File exists" for both)."""
    where = Path(os.path.abspath(path))
    for cur in [*reversed(where.parents), where]:  # from the root down: the first broken link is the one
        if not cur.is_symlink():
            if not os.path.lexists(cur):
                return None  # missing from here on: mkdir makes it
            continue
        try:
            os.stat(cur)
            continue  # a working link
        except OSError as exc:
            broken = exc.errno
        chain = [cur]
        while len(chain) < 12:
            try:
                nxt = Path(os.path.normpath(chain[-1].parent / os.readlink(chain[-1])))
            except OSError:
                break
            chain.append(nxt)
            if nxt in chain[:-1]:
                break
        shown = " -> ".join(str(c) for c in chain)
        at = f"{where} cannot be made: {cur}" if cur != where else str(where)
        if broken == errno.ELOOP:
            return f"{at} is a symlink loop ({shown})"
        if broken == errno.ENOENT:
            return f"{at} is a symlink to {chain[-1]}, which does not exist ({shown})"
        return None
    return None


def claim_output_dir(
    env: Mapping[str, str], p: Plan, existing: Existing = Existing.REFUSE
) -> tuple[IO[str], StartFacts]:
    """Before a new run exists: check FTLAUNCH_HOME and the output_dir, take the output_dir's lock
    (exit 7 when a live run holds it) and decide about old checkpoints under it.

    Exit 7 too when a trainer of an earlier run into this output_dir outlived its supervisor: that
    check runs under the lock, so no other shell can start a trainer in between.

    Returns the held lock (hand it to `start_detached` or the Supervisor) and what was found, as the
    state fields that record it. ``p`` is a final plan (``run.prepare.make_plan``): its config key tells
    whether earlier runs into the output_dir were of this config."""
    if p.memory_key is None:
        raise ValueError("claim_output_dir: the plan has no config key (plan it with ftlaunch.run.prepare.make_plan)")
    home_problem(env)
    output_dir = str(p.config.get("output_dir") or "")
    if not output_dir:
        raise ConfigError("key 'output_dir' is missing: the run needs a directory for its checkpoints")
    if problem := not_writable(Path(output_dir)):
        raise ConfigError(f"output_dir {problem}", hint="point output_dir at a real folder you can write")
    lock = acquire_output_lock(env, output_dir, f"{NEW_RUN} (pid {os.getpid()})")
    try:
        runs = runs_of_output_dir(env, output_dir)  # into it, or of its base (a schedule's runs under it)
        refuse_if_alive(output_dir, runs)  # before the checkpoints: an orphan may be writing them
        out = Path(output_dir)
        checkpoints = [path.name for _, path in prog.checkpoint_dirs(out)]
        mine = [st for _, st in runs if os.path.abspath(st.output_dir or "") == os.path.abspath(output_dir)]
        owners = sorted(mine, key=lambda st: st.created or "")  # ids of one second sort at random
        verdict = output_dir_verdict(output_dir, checkpoints, owners, p.memory_key, existing)
        found = StartFacts()
        if verdict.use is DirUse.FRESH and out.is_dir() and any(out.iterdir()):
            aside = Path(f"{output_dir}.old-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
            out.rename(aside)
            out.mkdir()
            found = StartFacts(output_dir_moved_to=str(aside))
        elif verdict.use in (DirUse.ADOPT, DirUse.CONTINUE):
            found = StartFacts(adopted_checkpoint=checkpoints[-1], adopted_because=verdict.why)
        return lock, found
    except BaseException:
        lock.close()
        raise


def lock_path(env: Mapping[str, str], output_dir: str) -> Path:
    digest = hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]
    return home(env) / "locks" / f"{digest}.lock"


class OutputDirBusy(BusyError):
    """The output_dir lock is held; ``holder`` is what its holder wrote (a run id)."""

    def __init__(self, output_dir: str, holder: str):
        self.holder = holder
        if holder.startswith(NEW_RUN):  # a `train` between taking the lock and creating its run
            super().__init__(
                f"output_dir {output_dir} is in use by {holder}",
                hint="`ftlaunch runs` shows that run once it has started; or set another output_dir",
            )
            return
        if holder.startswith(SCHEDULED_RUN):  # `schedule run` holds its base output_dir for its run's life
            super().__init__(
                f"output_dir {output_dir} is in use by {holder} (it trains into a folder under it)",
                hint="`ftlaunch runs` shows that run; wait for it or stop it; or set another output_dir",
            )
            return
        who = holder or "another run"
        super().__init__(
            f"output_dir {output_dir} is in use by run {who}",
            hint=f"wait for it, stop it (`ftlaunch stop {who}`), or set another output_dir",
        )


NEW_RUN = "a new run being started"
SCHEDULED_RUN = "schedule "  # "schedule NAME's run (pid N)": the holder of a schedule's base output_dir


def acquire_output_lock(env: Mapping[str, str], output_dir: str, run_id: str) -> IO[str]:
    """Hold an flock for the run's life: the kernel drops it when the holder dies, so no stale lock."""
    got = try_flock(lock_path(env, output_dir), run_id)
    if isinstance(got, str):
        raise OutputDirBusy(output_dir, got)
    return got


def adopt_lock(fd: int) -> IO[str]:
    """The output_dir lock handed down by the process that started us (``--lock-fd``).

    flock belongs to the open file, which parent and child now share: re-locking it succeeds only
    if it is really held by that file, so a stray fd number fails here rather than racing later."""
    f = os.fdopen(fd, "a+")
    try:
        ok = flock_open(f)
    except OSError:
        ok = False
    if not ok:
        f.close()
        raise BusyError("the output_dir lock handed to the supervisor is not held")
    return f
