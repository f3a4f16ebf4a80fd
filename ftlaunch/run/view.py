"""A run as `status` and `runs` show it: the shell that looks. It reads the state, asks the run's engine
what the run is now (ftlaunch.run.engines: whether a local supervisor lives, failing closed; for a
Slurm run, Slurm), whether the trainer lives; reads the GPU memory in use
and the cost from the run's own records, and a dead supervisor's last word; ``view_of`` in
ftlaunch.run.runview (pure) decides from that what ``RunView`` shows (re-exported here). ``find_run``
turns a RUN argument (an id, a unique id prefix, a name; the latest run by default) into its folder,
here and not in the store because a name several runs share is refused with a list of them and the
status each has now (a view of each).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftlaunch.errors import FtlaunchError, RunNotFoundError, StateError
from ftlaunch.probe.usage import gpu_memory_of
from ftlaunch.run.engines import of_state
from ftlaunch.run.journal import read_last_word
from ftlaunch.run.procs import Liveness, liveness
from ftlaunch.run.runview import CostView, RunView, Seen, batch_step_death, is_live, view_of, wants_last_word
from ftlaunch.run.runview import StallView as StallView  # re-exported with RunView and CostView
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import RunFolder, list_runs, read_events, read_state, run_name, runs_root


def run_view(
    run_dir: Path,
    now: float | None = None,
    env: Mapping[str, str] | None = None,
    state: RunState | None = None,
    events: list[dict[str, Any]] | None = None,
) -> RunView:
    """One run as `status --json` shows it. Liveness decides running vs lost (fails closed); for a
    Slurm run, Slurm decides (its supervisor runs on another host: queued, starting, or the state).
    This shell looks (state, processes, Slurm, GPU, records); ftlaunch.run.runview.view_of decides.
    ``state``, ``events``: the run's state and events as the caller read them (the live view keeps
    them while their files stay as they were), else read here."""
    state = read_state(run_dir) if state is None else state
    live = liveness(state.pid, state.pid_start)
    trainer_live = liveness(state.trainer_pid, state.trainer_start)
    # Its engine says what it is now: a local run's supervisor liveness, a Slurm run's job in Slurm.
    now_seen = of_state(state).status(state, os.environ if env is None else env)
    status, slurm_state = now_seen.status, now_seen.job_state
    p = state.progress or {}
    gpu_gib = None
    if trainer_live is Liveness.ALIVE and state.gpu_count and state.trainer_pid:
        gpu_gib = gpu_memory_of(_process_tree(state.trainer_pid))
    events = read_events(run_dir) if events is None else events
    cost = _cost(run_dir, state, events, status, p.get("step"), p.get("total_steps"), state.steps_per_second, now)
    last_word = None
    if wants_last_word(state, status):
        # A supervisor that could not write its end, or died of an error of its own, left a last word.
        last_word = read_last_word(run_dir, state.output_dir, state.pid, state.pid_start)
    elif status is RunStatus.LOST and state.job.submitted:
        last_word = batch_step_death(_tail(RunFolder(run_dir).train_log))  # a step that died at import
    seen = Seen(status, slurm_state, live, trainer_live, gpu_gib, cost, last_word)
    return view_of(state, run_dir, seen, now, time.time())


def _tail(path: Path, limit: int = 1 << 16) -> str:
    """The last ``limit`` bytes of a log, as text; empty when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _cost(run_dir: Path, state: RunState, events: list, status: RunStatus, step, total, rate, now) -> CostView:
    """tokens/s of this attempt (as its supervisor stored it) and GPU-hours so far / projected, from the
    run's own records."""
    from ftlaunch.run import accounting as acc

    gpus = int(state.gpu_count or 0)
    live = is_live(status)
    # A lost run's last attempt ended at its last sign of life, not at 0 s (nor now).
    end = (now or time.time()) if live else _last_sign_of_life(run_dir, state)
    spans = acc.attempt_spans(events, now=end)
    busy = acc.busy_seconds(spans)
    so_far = acc.gpu_hours(busy, gpus)
    left = acc.projected_hours(step, total, rate) if live else 0.0
    # What the supervisor measured and stored (ftlaunch.run.watch.progress): trainer_log.jsonl, as long
    # as the run, is never read here.
    tokens_per_second = state.progress.tokens_per_second if live and state.progress else None
    return CostView(
        tokens_per_second=tokens_per_second,
        wall_seconds=round(busy, 1),
        gpu_hours=round(so_far, 4),
        gpu_hours_projected=None if left is None else round(so_far + left * gpus, 4),
        gpus=state.gpu_count,
    )


def _last_sign_of_life(run_dir: Path, state: RunState) -> float | None:
    """When a run last wrote anything: its log, events, state, or the trainer's log."""
    folder = RunFolder(run_dir)
    paths = [folder.train_log, folder.events, folder.state]
    if state.output_dir:
        paths.append(Path(state.output_dir) / "trainer_log.jsonl")
    times = []
    for p in paths:
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=None)


def _process_tree(pid: int) -> set[int]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return {pid, *(c.pid for c in proc.children(recursive=True))}
    except psutil.Error:
        return {pid}


def all_runs(env: Mapping[str, str]) -> list[RunView]:
    """Every run; one whose state cannot be read says so (status unreadable)."""
    out: list[RunView] = []
    for run_dir in list_runs(env):
        try:
            out.append(run_view(run_dir))
        except StateError as exc:
            out.append(RunView.unreadable(run_dir, exc.message))
    return out


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
    out = []
    for p in run_dirs:
        try:
            v = run_view(p)
        except FtlaunchError:
            out.append(f"  - {p.name}  state unreadable")
            continue
        started = (v.created or "?")[:19].replace("T", " ")
        out.append(f"  - {p.name}  {v.status.value}, started {started} UTC, output_dir {v.output_dir}")
    return "\n".join(out)
