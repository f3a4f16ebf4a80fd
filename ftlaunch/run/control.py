"""Acting on an existing run from any shell: `stop` (its engine first: scancel a Slurm job; else signal
its supervisor, fail closed on an unknown pid), `resume` (its engine first: sbatch a Slurm run again;
else re-attach to a live run, or restart a dead one from its last
complete checkpoint under the output_dir lock, after optional config edits) and rebuilding a lost
state.json from the run's config.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import BusyError, ConfigError, StateError, StateVersionError
from ftlaunch.plan.config import split_secrets
from ftlaunch.run import progress as prog
from ftlaunch.run import transitions as journal
from ftlaunch.run.engines import Resumed, ResumeOutcome, of_state
from ftlaunch.run.environment import refuse_resume
from ftlaunch.run.events import Event
from ftlaunch.run.launch import supervise
from ftlaunch.run.orphans import LiveTrainer, TrainerAlive, live_trainers, runs_of_output_dir, stop_trainer
from ftlaunch.run.procs import Liveness, liveness
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import (
    RunFolder,
    read_config,
    read_events,
    read_plan,
    read_secrets,
    read_state,
    write_config,
    write_secrets,
)
from ftlaunch.run.trainer import find_trainer


def stop_run(run_dir: Path, env: Mapping[str, str], grace: float = 30.0) -> str:
    """SIGTERM the supervisor (it stops the trainer's group once and records it); clean up if it is gone.

    Liveness decides, and a live supervisor is always the one told: a trainer signalled behind its
    supervisor's back would count as a crash and be restarted."""
    state = _wait_while_starting(run_dir, read_state(run_dir), env)
    said = of_state(state).stop(run_dir, state, env, grace)  # where the engine holds it (Slurm: scancel)
    if said:
        return said
    status = state.status
    pid, started = state.pid, state.pid_start
    live = liveness(pid, started)
    if status.is_terminal() and (live is not Liveness.DEAD or state.trainer_pid is None):
        # A terminal status is the supervisor's last write: nothing of the run is left to stop
        # (a foreground supervisor's process may live on; it is not ours to signal).
        return f"run {run_dir.name} already {status.value}"
    if live is Liveness.UNKNOWN:
        return f"run {run_dir.name}: cannot tell whether pid {pid} is ours; not touching it"
    if live is Liveness.ALIVE and pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + 10
        while liveness(pid, started) is Liveness.ALIVE:
            if _status_now(run_dir).is_terminal():
                return f"run {run_dir.name} stopped"
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.1)
    # The supervisor is gone; its trainer may be an orphan still holding the GPU (or, its leader gone,
    # workers of its process group). The state again: the supervisor may have started another attempt.
    state = _state_or_none(run_dir) or state
    for orphan in live_trainers([(run_dir, state)]):
        if orphan.verdict is not Liveness.ALIVE:
            return f"{orphan.describe()}; not touching it"
        if not stop_trainer(orphan, grace=grace):
            return f"run {run_dir.name}: its trainer's process group {orphan.pgid} is still alive after SIGKILL"
        _orphan_stopped(run_dir, orphan)
    if not _status_now(run_dir).is_terminal():
        journal.stopped(run_dir, "stopped by the user", message="supervisor was gone; trainer stopped directly")
    return f"run {run_dir.name} stopped"


def _wait_while_starting(run_dir: Path, state: RunState, env: Mapping[str, str], wait: float = 60.0) -> RunState:
    """A run whose starter holds its output_dir lock but whose supervisor has not written its pid yet
    (between `train`/`resume` and "started"): wait for the pid, so the stop reaches the supervisor
    instead of being recorded and then overwritten by it."""
    from ftlaunch.run.outdir import OutputDirBusy, acquire_output_lock

    deadline = time.monotonic() + wait
    while state.status is RunStatus.STARTING and not state.pid and time.monotonic() < deadline:
        try:
            lock = acquire_output_lock(env, state.output_dir or "", "stop")
        except OutputDirBusy:
            time.sleep(0.1)
            state = _state_or_none(run_dir) or state
            continue
        try:
            # Nobody is starting it now. The state in hand may have been read just before its supervisor
            # wrote its pid and then let go of the lock (its run ended): read it again, under the lock.
            return _state_or_none(run_dir) or state
        finally:
            lock.close()
    return state


def _state_or_none(run_dir: Path) -> RunState | None:
    try:
        return read_state(run_dir)
    except StateError:
        return None


def _status_now(run_dir: Path) -> RunStatus:
    """The recorded status, LOST while state.json cannot be read (a stop polls it)."""
    state = _state_or_none(run_dir)
    return state.status if state is not None else RunStatus.LOST


def resume_run(
    run_dir: Path,
    env: Mapping[str, str],
    *,
    foreground: bool = False,
    overrides: tuple[str, ...] = (),
    allow_global_batch_change: bool = False,
    allow_env_change: bool = False,
    cwd: str | Path | None = None,
    hardware: Any = None,
) -> Resumed:
    """Re-attach if alive; restart from the last complete checkpoint if the run died.

    A restart from a checkpoint across a change of a package that decides training (torch,
    transformers, llamafactory, ...) is refused (exit 18) before anything is touched, unless
    ``allow_env_change``.

    ``overrides`` (key=value) edit the run's adapted config first; refused while the run is alive.
    ``hardware``: re-plan the run's config for it first (``preview_replan``: the global batch kept).
    ``cwd``: the caller's working directory (read at the edge), the PWD of a Slurm job submitted again;
    without it the job gets ``env``'s PWD.
    The restart happens under the output_dir lock, taken before any state changes and handed to
    the new supervisor: of two concurrent resumes one restarts the run, the other exits 7 (or
    re-attaches) and touches nothing."""
    state = _read_or_rebuild(run_dir)
    if hardware is not None:
        _refuse_slurm_replan(run_dir, state)
    edits = overrides if hardware is None else (*overrides, "--gpu")  # a live run's config never changes
    resumed = _engine_resume(
        run_dir, state, env, overrides, allow_global_batch_change, allow_env_change, cwd, hardware=hardware
    )
    if resumed is not None:
        return resumed
    verdict = _resume_verdict(run_dir, state, edits)
    if verdict is not None:
        return verdict
    output_dir = state.output_dir or ""
    lock = _lock_output_dir(run_dir, env, output_dir)
    try:
        verdict = _prepare_restart(
            run_dir,
            env,
            output_dir,
            edits,
            overrides=overrides,
            allow_global_batch_change=allow_global_batch_change,
            allow_env_change=allow_env_change,
            hardware=hardware,
        )
        if verdict is not None:
            return verdict
    except BaseException:
        lock.close()
        raise
    started = supervise(run_dir, env, lock, foreground=foreground)
    if foreground:
        return Resumed(ResumeOutcome.FOREGROUND, exit_code=started.exit_code)
    return Resumed(ResumeOutcome.RESTARTED, pid=started.pid)


def _engine_resume(
    run_dir: Path,
    state: RunState,
    env: Mapping[str, str],
    overrides: tuple[str, ...],
    allow_global_batch_change: bool,
    allow_env_change: bool,
    cwd: str | Path | None,
    *,
    hardware: Any = None,
) -> Resumed | None:
    """A run its engine resumes (a Slurm run trains only inside its own job: from anywhere else, resume
    means sbatch again; a Ray run's next attempt is a new job); None: restart it here.

    ``hardware``: the re-plan the user was shown is applied by ``edit()`` (config, launch variables and
    the state's figures, from which the engine takes the job's resources), planned again at that moment
    so what runs is what was checked; the engine sees it as a change (refused while the run is alive)."""

    def edit() -> None:
        if hardware is not None:
            _apply_replan(run_dir, preview_replan(run_dir, hardware))
        if overrides:
            edit_run_config(run_dir, overrides, allow_global_batch_change=allow_global_batch_change)

    edits = overrides if hardware is None else (*overrides, "--gpu")
    return of_state(state).resume(
        run_dir, state, env, edit=edit, overrides=edits, cwd=cwd, allow_env_change=allow_env_change
    )


def _read_or_rebuild(run_dir: Path) -> RunState:
    """The run's state; a damaged one is rebuilt, another ftlaunch's version is not ours to touch."""
    try:
        return read_state(run_dir)
    except StateVersionError:
        raise  # another ftlaunch's state: not ours to rebuild over
    except StateError:
        return rebuild_state(run_dir)


def _lock_output_dir(run_dir: Path, env: Mapping[str, str], output_dir: str) -> IO[str]:
    """The output_dir lock for a restart; this run's own holder means another resume is starting it."""
    from ftlaunch.run.outdir import OutputDirBusy, acquire_output_lock

    try:
        return acquire_output_lock(env, output_dir, run_dir.name)
    except OutputDirBusy as exc:
        if exc.holder == run_dir.name:
            raise BusyError(
                f"run {run_dir.name} is being started by another process right now",
                hint=f"`ftlaunch status {run_dir.name}` shows it in a moment",
            ) from None
        raise


def _prepare_restart(
    run_dir: Path,
    env: Mapping[str, str],
    output_dir: str,
    edits: tuple[str, ...],
    *,
    overrides: tuple[str, ...],
    allow_global_batch_change: bool,
    allow_env_change: bool,
    hardware: Any,
) -> Resumed | None:
    """Holding the output_dir lock: check again, edit the config, mark the run restarting; a verdict when
    another resume came first."""
    state = read_state(run_dir)  # again, under the lock: another resume may have come first
    verdict = _resume_verdict(run_dir, state, edits)
    if verdict is not None:
        return verdict
    if not allow_env_change:
        resumes = prog.last_complete_checkpoint(Path(output_dir))
        refuse_resume(run_dir, env, state, resumes[1].name if resumes else None)
    _end_orphans(run_dir, env, output_dir, state)
    if hardware is not None:
        _apply_replan(run_dir, preview_replan(run_dir, hardware))
    if overrides:
        edit_run_config(run_dir, overrides, allow_global_batch_change=allow_global_batch_change)
    out = Path(state.output_dir or "")
    last = prog.last_complete_checkpoint(out)
    if overrides and last is not None:
        _rewrite_checkpoint_lr(run_dir, env, out, last[1].name, overrides)
    # A run that gave up gets a fresh budget: the user changed something, or wants another go.
    journal.resumed(
        run_dir,
        state,
        allow_env_change=allow_env_change,
        from_checkpoint=last[1].name if last else None,
    )
    return None


def _end_orphans(run_dir: Path, env: Mapping[str, str], output_dir: str, state: RunState, grace: float = 30.0) -> None:
    """Before a restart, holding the output_dir lock: this run's trainer that outlived its supervisor
    is stopped (the user asked for the restart), and waited for until no process of its group is
    left. A trainer of another run into this output_dir, or one that may be alive (UNKNOWN), refuses
    the restart (exit 7): neither is ours to end."""
    others = [(d, st) for d, st in runs_of_output_dir(env, output_dir) if d.name != run_dir.name]
    found = live_trainers([(run_dir, state), *others])
    if refused := [t for t in found if t.run_id != run_dir.name or t.verdict is not Liveness.ALIVE]:
        raise TrainerAlive(f"output_dir {output_dir}", refused)
    for orphan in found:
        if not stop_trainer(orphan, grace=grace):
            raise BusyError(
                f"run {run_dir.name}: its trainer's process group {orphan.pgid} is still alive after SIGKILL",
                hint=f"see what is left with `ps -o pid,stat,args -g {orphan.pgid}`",
            )
        _orphan_stopped(run_dir, orphan)


def _orphan_stopped(run_dir: Path, orphan: LiveTrainer) -> None:
    journal.note(run_dir, Event.ORPHAN_STOPPED, pgid=orphan.pgid, pids=list(orphan.pids), how=orphan.how)


def _rewrite_checkpoint_lr(
    run_dir: Path, env: Mapping[str, str], out: Path, checkpoint: str, overrides: tuple[str, ...]
) -> None:
    """`resume RUN learning_rate=X`: llamafactory restores the lr from the checkpoint's optimizer.pt
    and scheduler.pt on resume (a new YAML value is silently ignored), so write it there too; the
    original checkpoint is kept as rolledback-<name>-<time> (weights hard-linked)."""
    from ftlaunch.plan.config import parse_overrides
    from ftlaunch.run import rollback

    lr = parse_overrides(overrides)[0].get("learning_rate")
    if lr is None:
        return
    err = rollback.scale_lr(out, checkpoint, float(lr), rollback.python_of(find_trainer(env)[0]), rollback.now_stamp())
    journal.note(run_dir, Event.CHECKPOINT_LR_REWRITTEN, checkpoint=checkpoint, learning_rate=float(lr), error=err)
    if err:
        raise ConfigError(
            f"learning_rate={lr} could not be written into {checkpoint} (a resume restores the old lr from it): {err}",
            hint="resume without the learning_rate override, or start afresh with --fresh",
        )


def _resume_verdict(run_dir: Path, state: RunState, overrides: tuple[str, ...]) -> Resumed | None:
    """Alive or finished when there is nothing to restart; None to restart."""
    status = state.status
    live = liveness(state.pid, state.pid_start)
    # A terminal status is written by the supervisor as its last act: its pid no longer matters
    # (a foreground run's "supervisor" was the ftlaunch process itself, which may live on).
    if not status.is_terminal() and live in (Liveness.ALIVE, Liveness.UNKNOWN):
        if overrides:
            raise BusyError(
                f"run {run_dir.name} is alive: its config cannot change under it",
                hint=f"stop it first (`ftlaunch stop {run_dir.name}`), then resume with the change",
            )
        return Resumed(ResumeOutcome.ALIVE, pid=int(state.pid or 0))
    if status is RunStatus.SUCCEEDED:
        return Resumed(ResumeOutcome.FINISHED, exit_code=0)
    return None


# Variables of a launch that a world size decides (rules.launch_env): replaced as a whole on a re-plan.
LAUNCH_KEYS = ("FORCE_TORCHRUN", "NNODES", "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES", "NCCL_P2P_DISABLE", "USE_KT")


@dataclass(frozen=True)
class Replan:
    """`resume RUN --gpu ...`: the run's adapted config planned again for the hardware at hand, the
    global batch kept exactly. ``changes`` include the devices and the launch variables; ``notes`` say
    what the checkpoint keeps and what it cannot (per-rank RNG states)."""

    plan: Any
    changes: tuple[Any, ...]
    world_before: int
    world_after: int
    checkpoint: str | None
    notes: tuple[str, ...]
    trainer_env: Mapping[str, str]
    warnings: tuple[str, ...] = ()  # where the rows after the checkpoint are not an uninterrupted run's


_EXAMPLES = re.compile(r"Num examples = ([\d,]+)")


def examples_in_log(lines: Iterable[str]) -> int | None:
    """The rows the trainer trains per epoch, as transformers logs them ("Num examples = 1,024") at each
    start; the last one wins. None when no attempt got that far. Pure."""
    found = None
    for line in lines:
        if m := _EXAMPLES.search(line):
            found = int(m.group(1).replace(",", ""))
    return found


def data_order_warnings(
    before: Mapping[str, Any], after: Mapping[str, Any], world: tuple[int, int], examples: int | None
) -> list[str]:
    """Why the rows trained after a resume on another world size would not be those of an uninterrupted
    run, else []. ``before``/``after``: the adapted configs, ``world``: (before, after) processes,
    ``examples``: rows per epoch (None: unknown). With the global batch G kept, step k trains rows
    [kG, (k+1)G) of the epoch's permutation whatever the world size (measured, tests/run/
    test_e2e_resume_anywhere.py), except where something groups or pads by the per-process batch. Pure."""
    if world[0] == world[1]:
        return []

    def per_process(c: Mapping[str, Any]) -> int:
        return int(c.get("per_device_train_batch_size") or 1) * int(c.get("gradient_accumulation_steps") or 1)

    out = []
    if after.get("train_sampling_strategy") == "group_by_length" and per_process(before) != per_process(after):
        out.append(
            f"data order not kept: train_sampling_strategy group_by_length, micro-batch x accumulation per "
            f"process {per_process(before)} -> {per_process(after)}: transformers' LengthGroupedSampler forms "
            "its groups from that number, so the rows after the checkpoint are not the ones an uninterrupted "
            f"run trains (some twice, some not this epoch); resume on {world[0]} process(es) to keep them"
        )
    if after.get("streaming"):
        out.append(
            f"data order not verified: streaming: true on {world[0]} -> {world[1]} process(es): an iterable "
            "dataset is split across processes by accelerate, not by a seeded sampler; ftlaunch has measured "
            "the order only for map-style datasets"
        )
    g = per_process(after) * world[1]
    if examples and g and examples % g:
        out.append(
            f"data order: the last step of each epoch differs: {examples} rows = {examples // g} x global batch "
            f"{g} + {examples % g}; with several processes accelerate fills that short batch with rows from "
            f"the epoch's start (even_batches), with one it trains {examples % g} rows ({world[0]} -> "
            f"{world[1]} process(es)); every other step trains the same rows"
        )
    return out


def rng_state_notes(names: set[str], world_after: int) -> list[str]:
    """What transformers' ``Trainer._load_rng_state`` will do with the RNG files of a checkpoint
    (``names``: its file names) on ``world_after`` processes: rank r reads rng_state_{r}.pth when
    several, rng_state.pth when one, and goes on without when its file is missing. Pure."""
    wanted = {f"rng_state_{r}.pth" for r in range(world_after)} if world_after > 1 else {"rng_state.pth"}
    present = {n for n in names if n.startswith("rng_state") and n.endswith(".pth")}
    missing, unused = sorted(wanted - present), sorted(present - wanted)
    writers = sum(1 for n in present if n != "rng_state.pth") or 1
    notes = []
    if missing:
        notes.append(
            f"RNG states missing for the new world size {world_after}: {', '.join(missing)} "
            f"(the checkpoint was written by {writers} process(es)): those ranks go on with the RNG `seed` "
            "set (the data order does not depend on them: the sampler is seeded by `seed`)"
        )
    if unused:
        notes.append(f"RNG states unused on {world_after} process(es): {', '.join(unused)}")
    return notes


# Keys ftlaunch sets for a machine's sake (the CPU's gloo) that a re-plan for another one takes back.
MACHINE_KEYS = ("ddp_backend",)


def own_values(plan_changes: list[Mapping[str, Any]], events: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Key -> the user's own value (None: unset) of each MACHINE_KEYS key that ftlaunch has since set
    for a machine, from the run's plan.json changes and its events in order (``replanned`` changes are
    ftlaunch's; a ``config_edited`` value is the user's and stands). Pure."""
    own: dict[str, Any] = {}
    steps = [("plan", c) for c in plan_changes]
    for e in events:
        if e.get("event") == Event.REPLANNED:
            steps += [("plan", c) for c in e.get("changes") or []]
        elif e.get("event") == Event.CONFIG_EDITED:
            steps += [("user", {"key": k}) for k in e.get("after") or {}]
    for who, c in steps:
        key = c.get("key")
        if key not in MACHINE_KEYS:
            continue
        if who == "user":
            own.pop(key, None)
        elif key not in own:
            own[key] = c.get("old")
    return own


def _deepspeed_layout(checkpoint: Path) -> bool:
    """A DeepSpeed checkpoint: its optimizer states are per-rank shards in global_stepN/."""
    return any(p.name.startswith("global_step") and p.is_dir() for p in checkpoint.iterdir())


def _names(folder: Path) -> set[str]:
    return {f.name for f in folder.iterdir()}


def preview_replan(run_dir: Path, hardware: Any) -> Replan:
    """What `resume RUN --gpu ...` would change (reads the run's config, state and last checkpoint;
    writes nothing). ConfigError (exit 3) when the global batch cannot be kept, or when the
    checkpoint's per-rank optimizer shards (DeepSpeed) would change data-parallel size."""
    from ftlaunch.plan.change import Change
    from ftlaunch.plan.planner import plan

    config, header = read_config(run_dir)
    state = read_state(run_dir)
    _refuse_slurm_replan(run_dir, state)
    world_before = int(state.world_size or header.get("world_size") or 1)
    g_before = int(state.global_batch or header.get("global_batch") or 0)
    own = own_values(read_plan(run_dir).get("changes") or [], read_events(run_dir))
    p = plan(config, hardware, meta={**header, "world_size": world_before, "own_values": own})
    problems = []
    if g_before and p.global_batch_target != g_before:
        problems.append(
            f"global batch {g_before} cannot be kept on {hardware.describe()} "
            f"({p.micro_batch} x {p.accumulation} x {p.world_size} = {p.global_batch_target})"
        )
    last = prog.last_complete_checkpoint(Path(state.output_dir or ""))
    if last is not None and p.world_size != world_before and _deepspeed_layout(last[1]):
        problems.append(
            f"{last[1].name} is a DeepSpeed checkpoint (per-rank optimizer shards in global_step*/) written by "
            f"{world_before} process(es); the trainer cannot load it on {p.world_size}: resume on the original "
            f"layout ({world_before} devices)"
        )
    if problems:
        raise ConfigError(problems)
    changes = list(p.changes)
    old_env = dict(state.trainer_env or {})
    new_env = {**{k: v for k, v in old_env.items() if k not in LAUNCH_KEYS}, **p.env}
    shown = {c.key for c in changes}
    why = f"resumed on {hardware.describe()}: global batch {p.global_batch_target} kept"
    for key in LAUNCH_KEYS:
        if old_env.get(key) != new_env.get(key) and key not in shown:
            changes.append(Change(key, old_env.get(key), new_env.get(key), why))
    if p.world_size != world_before:
        changes.insert(0, Change("devices", world_before, p.world_size, why))
    notes = rng_state_notes(_names(last[1]), p.world_size) if last else []
    warnings = data_order_warnings(config, p.config, (world_before, p.world_size), _examples(run_dir))
    return Replan(
        p, tuple(changes), world_before, p.world_size, last[1].name if last else None, tuple(notes), new_env,
        tuple(warnings),
    )  # fmt: skip


def _examples(run_dir: Path) -> int | None:
    try:
        with RunFolder(run_dir).train_log.open(errors="replace") as f:
            return examples_in_log(f)
    except OSError:
        return None


def _refuse_slurm_replan(run_dir: Path, state: RunState) -> None:
    if state.job.submitted:
        raise ConfigError(
            f"run {run_dir.name} is a Slurm job: --gpu/--hardware does not re-plan it",
            hint="resume it as it was planned (its job.sbatch names its nodes)",
        )


def _apply_replan(run_dir: Path, r: Replan) -> None:
    """Write the re-planned config and the state's launch figures; the change is an event."""
    p = r.plan
    write_config(run_dir, p.config, p.header)
    figures = {
        "gpu_model": p.hardware.gpu_model,
        "gpu_count": p.hardware.gpu_count,
        "world_size": p.world_size,
        "micro_batch": p.micro_batch,
        "accumulation": p.accumulation,
        "global_batch": p.global_batch_target,
        "trainer_env": dict(r.trainer_env),
    }
    journal.replanned(
        run_dir,
        figures,
        hardware=p.hardware.describe(),
        world_before=r.world_before,
        world_after=r.world_after,
        checkpoint=r.checkpoint,
        changes=[c.to_dict() for c in r.changes],
        notes=list(r.notes),
        warnings=list(r.warnings),
    )


def global_batch_change(
    config: Mapping[str, Any], values: Mapping[str, Any], world_size: int
) -> tuple[int, int] | None:
    """Pure: (before, after) when ``values`` change micro-batch x accumulation x world size."""

    def g(c: Mapping[str, Any]) -> int:
        return (
            int(c.get("per_device_train_batch_size") or 1) * int(c.get("gradient_accumulation_steps") or 1) * world_size
        )

    before, after = g(config), g({**config, **values})
    return (before, after) if before != after else None


def preview_run_edit(run_dir: Path, overrides: tuple[str, ...]) -> list[tuple[str, Any, Any, str]]:
    """What `resume RUN key=value` would change: (key, before, after, note) rows, the global batch
    included when it moves. Validates like any config (ConfigError, exit 3)."""
    from ftlaunch.plan.config import is_secret_key, parse_overrides, validate_keys, validate_values

    values, problems = parse_overrides(overrides)
    problems += validate_keys(values) + validate_values(values)
    if problems:
        raise ConfigError(problems)
    config = read_config(run_dir)[0]
    rows = [
        (k, "***" if is_secret_key(k) else config.get(k), "***" if is_secret_key(k) else v, "")
        for k, v in values.items()
    ]
    state = _state_or_none(run_dir)
    world = int((state.world_size if state else None) or 1)
    if moved := global_batch_change(config, values, world):
        rows.append(("global batch", moved[0], moved[1], "micro-batch x accumulation x world size"))
    return rows


def edit_run_config(
    run_dir: Path, overrides: tuple[str, ...], *, allow_global_batch_change: bool = False
) -> dict[str, Any]:
    """Apply key=value overrides to a run's adapted config (validated; written atomically).

    A change of the global batch is refused (exit 3) unless allowed: it changes what is trained."""
    from ftlaunch.plan.config import parse_overrides

    rows = preview_run_edit(run_dir, overrides)
    moved = [r for r in rows if r[0] == "global batch"]
    if moved and not allow_global_batch_change:
        _, before, after, _ = moved[0]
        raise ConfigError(
            f"these overrides change the global batch from {before} to {after}",
            hint="pass --allow-global-batch-change to accept that, or keep micro-batch x accumulation at "
            f"{before} (e.g. set gradient_accumulation_steps too)",
        )
    values = parse_overrides(overrides)[0]
    public, secrets = split_secrets(values)
    write_secrets(run_dir, {**read_secrets(run_dir), **secrets})
    config, header = read_config(run_dir)
    before = {k: config.get(k) for k in public}
    config.update(public)
    write_config(run_dir, config, header)
    fields: dict[str, Any] = {}
    if "per_device_train_batch_size" in values:
        fields["micro_batch"] = values["per_device_train_batch_size"]
    if "gradient_accumulation_steps" in values:
        fields["accumulation"] = values["gradient_accumulation_steps"]
    if moved:
        fields["global_batch"] = moved[0][2]
    journal.config_edited(run_dir, fields, before=before, after=public, secrets=sorted(secrets))
    return config


def rebuild_state(run_dir: Path) -> RunState:
    """state.json lost or corrupt: rebuild enough of it from config.yaml to resume."""
    if not RunFolder(run_dir).config.exists():
        raise StateError(f"run {run_dir.name}: neither state.json nor config.yaml is readable")
    values = read_config(run_dir)[0]
    output_dir = values.get("output_dir")
    state = RunState(
        id=run_dir.name,
        name=Path(str(values.get("output_dir", run_dir.name))).name,
        status=RunStatus.LOST,
        attempt=0,
        output_dir=None if output_dir is None else str(output_dir),
        run_dir=str(run_dir),
        recover=True,
    )
    return journal.rebuilt(run_dir, state)
