"""The supervisor: owns one run's trainer, records everything, recovers from failures.

Started detached as ``python -m ftlaunch.run.supervisor RUN_DIR`` (new session, no terminal), or
in-process for ``train --foreground``. The trainer runs in its own process group; its output is
appended to ``train.log``. Signal handlers only record; the main loop acts (supervisor's
SignalReceiver). Decisions come from the pure ``ftlaunch.run.recovery``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import FtlaunchError, StateError
from ftlaunch.files import tree_bytes
from ftlaunch.plan.disk import DiskForecast, enough_for_save
from ftlaunch.plan.memory.store import remember, remember_observed
from ftlaunch.plan.offload import materialize, refusal
from ftlaunch.probe.usage import gpu_peak_of
from ftlaunch.run import environment
from ftlaunch.run import progress as prog
from ftlaunch.run import records as run_records
from ftlaunch.run.checkpoints import CheckpointWatch, set_aside_incomplete
from ftlaunch.run.disk import (
    DISK_HINT,
    disk_message,
    enospc_in,
    enospc_line,
    free_for_next_save,
    remove_partial,
)
from ftlaunch.run.gpuwait import GpuWait, nvml_probes, wait_gpu_released
from ftlaunch.run.health import Response
from ftlaunch.run.journal import OutputLog, RunJournal, quiet_print, quiet_std_streams
from ftlaunch.run.notify import NOTIFY_KEY, Notifier
from ftlaunch.run.orphans import refuse_if_alive, runs_of_output_dir
from ftlaunch.run.outdir import OutputDirBusy, acquire_output_lock, adopt_lock
from ftlaunch.run.procs import GroupStop, signal_group, start_time
from ftlaunch.run.recovery import Action, Exit, classify, decide, without_steps
from ftlaunch.run.rollback import HealthWatch
from ftlaunch.run.stacks import StackDump, dump_stacks, find_py_spy
from ftlaunch.run.stall import EVAL_MARK, SAVE_MARK, StallPolicy, Watchdog
from ftlaunch.run.state import Budget, FailureKind, RunState, RunStatus
from ftlaunch.run.store import (
    RunFolder,
    drop_trainer_config,
    read_config,
    read_secrets,
    read_state,
    write_config,
    write_trainer_config,
)
from ftlaunch.run.tail import Tail
from ftlaunch.run.trainer import (
    find_trainer,
    redact,
    secret_handoff,
    trainer_command,
    trainer_env,
    with_torchrun_beside,
)

# How a recovery decision that is not a retry ends the run.
_ENDS = {Action.SUCCEED: RunStatus.SUCCEEDED, Action.STOP: RunStatus.STOPPED, Action.FAIL: RunStatus.FAILED}


class Supervisor:
    """One run's loop: start an attempt, watch it, classify its end, decide (retry, roll back, finish).

    What it records goes through its journal (events, state, train.log lines); what it reads of the
    trainer comes from tails of its logs and a checkpoint watch. Seams: ``clock`` (monotonic), ``wall``
    (epoch seconds), ``sleep``, ``spawn``,
    ``read_kernel_log``, ``gpu_sampler``."""

    def __init__(
        self,
        run_dir: Path,
        env: Mapping[str, str],
        *,
        echo: bool = False,
        poll: float = 0.5,
        stop_grace: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        spawn: Callable[..., subprocess.Popen] = subprocess.Popen,
        lock: IO[str] | None = None,
        read_kernel_log: Callable[[], str] | None = None,
        gpu_sampler: Callable[[set[int]], float | None] | None = None,
        sample_every: float = 5.0,
        stall_policy: StallPolicy | None = None,
        stack_dumper: Callable[[int, Path], StackDump] | None = None,
        gpu_wait: Callable[..., GpuWait] = wait_gpu_released,
        gpu_probes: Callable[
            [set[int], str | None], tuple[Callable[[], bool], Callable[[], float | None]]
        ] = nvml_probes,
        notifier: Notifier | None = None,
    ):
        self.run_dir = run_dir
        self.env = dict(env)
        self.journal = RunJournal(run_dir, echo=echo)
        # Notifications (ftlaunch.run.notify): queued here, delivered by its own thread; never blocks.
        self.notifier = notifier if notifier is not None else Notifier.for_run(run_dir, self.env)
        self.poll = poll
        self.stop_grace = stop_grace
        self.clock = clock
        self.wall = wall
        self.sleep = sleep
        self.spawn = spawn
        self.stop_signal: int | None = None
        self.trainer: subprocess.Popen | None = None
        self.watch: HealthWatch | None = None  # numeric health (ftlaunch.run.health), set per run
        # The output_dir lock, when the process that started this run took it (train/resume): the
        # run is then never without it, so no second start can slip in between (races, issue 13).
        self.lock = lock
        self.read_kernel_log = read_kernel_log or kernel_log
        # GPU memory the trainer's processes really use (NVML), beside the plan's prediction.
        self.gpu_sampler = gpu_sampler or gpu_peak_of
        self.sample_every = sample_every
        self.observed_peak: float | None = None
        # The stall watchdog (ftlaunch.run.stall): None takes --stall-timeout from the run's state.
        self.stall_policy = stall_policy
        self.stack_dumper = stack_dumper or self._dump_stacks
        # What the output pump saw, for the watchdog: (clock, save or eval mark or "") per chunk.
        self._console: deque[tuple[float, str]] = deque(maxlen=10000)
        # Clean restarts on a GPU (ftlaunch.run.gpuwait): the memory in use before the first attempt,
        # and the processes of the last trainer, waited for before the next attempt starts.
        self.gpu_wait = gpu_wait
        self.gpu_probes = gpu_probes
        self.gpu_baseline_mib: float | None = None
        self._trainer_pids: set[int] = set()

    @property
    def echo(self) -> bool:
        return self.journal.echo

    # signal handlers record only
    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum

    def _install_signals(self) -> dict[int, Any]:
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def run(self) -> int:
        previous = self._install_signals()  # from the start: a stop that comes early is not lost
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.notifier.close()  # a moment for the last message; the rest goes on in a detached child

    def _run(self) -> int:
        self.journal.settle()  # an end an earlier supervisor could only leave as its last word
        if read_state(self.run_dir).status is RunStatus.SUCCEEDED:
            if self.lock is not None:
                self.lock.close()
            return 0
        values, header = read_config(self.run_dir)
        output_dir = str(values.get("output_dir", ""))
        try:
            lock = self.lock if self.lock is not None else acquire_output_lock(self.env, output_dir, self.run_dir.name)
        except OutputDirBusy as exc:
            # Held under this run's own id: another supervisor of this very run is live; its state is
            # not ours to touch. Held by another run: this one never started.
            if exc.holder != self.run_dir.name:
                self.journal.busy(str(exc))
            raise
        if self.lock is None:  # started on its own (a Slurm job's first step): no orphan trainer beside it
            try:
                refuse_if_alive(output_dir, runs_of_output_dir(self.env, output_dir))
            except FtlaunchError:
                lock.close()
                raise
        self.journal.supervising(os.getpid(), start_time(os.getpid()))
        try:
            return self._loop(values, header, output_dir)
        finally:
            lock.close()

    def _loop(self, values: dict[str, Any], header: dict[str, Any], output_dir: str) -> int:
        state = read_state(self.run_dir)
        budget = state.budget
        attempt = state.attempt
        extra_env = dict(state.trainer_env or {})
        weights_only = bool(values.get("save_only_model"))
        self.watch = HealthWatch(self.run_dir, values, self.env, self.journal.say, self.journal.write)
        out = Path(output_dir)
        visible = {**self.env, **extra_env}.get("CUDA_VISIBLE_DEVICES")
        if state.gpu_count:
            self.gpu_baseline_mib = self.gpu_probes(set(), visible)[1]()
        started_here = False
        started_here_told = False
        while True:
            if started_here and state.gpu_count:
                self._wait_for_gpu(visible)
            started_here = True
            if self.stop_signal is not None:  # stopped before (or between) attempts: start nothing
                stopped = Exit(FailureKind.STOPPED, "stopped by the user")
                return self._finish(
                    RunStatus.STOPPED, stopped, 0, "stopped by the user; resume with `ftlaunch resume`", values, budget
                )
            attempt += 1
            moved = set_aside_incomplete(out, weights_only)
            last = prog.last_complete_checkpoint(out, weights_only)
            # The trainer's environment, recorded and compared before anything of the attempt starts.
            refused = environment.at_attempt_start(
                self.run_dir, attempt, self.env, resuming=last is not None, say=self.journal.say
            )
            if refused is not None:
                ex = Exit(FailureKind.ENV_CHANGED, refused)
                return self._finish(RunStatus.ENV_CHANGED, ex, 0, refused, values, budget)
            status = RunStatus.RUNNING if attempt == 1 else RunStatus.RECOVERING
            # A later attempt is "recovering" until the trainer passes the furthest step seen before.
            recover_until = prog.furthest_step(dict(read_state(self.run_dir).progress or {}))
            self.journal.attempt_started(attempt, status, budget, values, last[1].name if last else None, moved)
            resumed = last[1].name if last else None
            if not started_here_told:
                started_here_told = True
                self.notifier.event("started", attempt=attempt, resume_from=resumed)
            run_records.mark_attempt(self.run_dir, attempt, resumed, self.journal.unwritten)  # plot: a run's own steps
            self.watch.start()
            rc, log_text, checkpoints, step, stalled, disk_full = self._attempt(
                out, attempt, extra_env, weights_only, recover_until if status is RunStatus.RECOVERING else None
            )
            # Numeric health first: a diverged trainer was halted by us, whatever its exit code says.
            # A trainer that finished on its own is judged at its end too (the records' tail, the saved weights).
            done = rc == 0 and stalled is None and disk_full is None and self.stop_signal is None
            health = None if self.stop_signal is not None else self.watch.after(out, values, weights_only, done=done)
            if health is not None and health.action is Response.ROLLBACK:
                self._apply(values, health.edits.items(), extra_env, state.gpu_count or 1)
                write_config(self.run_dir, values, header)
                self.notifier.event("diverged", message=health.message, rolled_back=True, edits=dict(health.edits))
                continue
            if health is not None:
                ex = Exit(FailureKind.DIVERGED, health.message)
                return self._finish(RunStatus.DIVERGED, ex, rc, health.message, values, budget)
            ended = read_state(self.run_dir)  # once: what the attempt recorded
            ex = self._why_it_ended(rc, log_text, step, stalled, disk_full, ended, out, weights_only)
            self.journal.exited(attempt, rc, ex, step)
            # ZeRO-3 offload only where the trainer can run it and LLaMA-Factory accepts it for this config
            offload_ok = (
                importlib.util.find_spec("deepspeed") is not None and bool(state.gpu_count) and refusal(values) is None
            )
            last = prog.last_complete_checkpoint(out, weights_only)
            d = decide(
                ex,
                values,
                budget,
                recover=state.recover,
                progressed=checkpoints.progressed,
                offload_ok=offload_ok,
                step=step,
                resume_from=last[1].name if last else None,
                no_progress=ended.no_progress_attempts,
            )
            budget = d.budget
            if d.action is Action.RETRY:
                self._apply(values, ((c.key, c.new) for c in d.changes), extra_env, state.gpu_count or 1)
                write_config(self.run_dir, values, header)
                self.journal.retry(attempt, d, ex, values, extra_env)
                micro = [c for c in d.changes if c.key in ("per_device_train_batch_size", "micro_batch_size")]
                if micro or ex.kind in (FailureKind.CUDA_OOM, FailureKind.EVAL_OOM, FailureKind.HOST_OOM):
                    batch = {c.key: f"{c.old} -> {c.new}" for c in d.changes}
                    self.notifier.event("oom_recovered", attempt=attempt, message=d.message, changes=batch)
                continue
            ends = d.ends or _ENDS[d.action]
            return self._finish(ends, ex, rc, d.message, values, budget, no_progress=d.no_progress)

    @staticmethod
    def _apply(
        values: dict[str, Any], edits: Iterable[tuple[str, Any]], extra_env: dict[str, str], world_size: int
    ) -> None:
        """The one way a decision's edits reach the next attempt's config, numeric health's rollback
        (learning rate, ...) and recovery's retry (micro-batch, ZeRO-3 offload, ...) alike: the offload
        placeholder becomes the bundled config, launched as the plan's processes per node (never one:
        the plan's world stays)."""
        for key, new in edits:
            values[key], launch_env = materialize(new, world_size=world_size)
            extra_env.update(launch_env)

    def _finish(
        self,
        status: RunStatus,
        ex: Exit,
        rc: int,
        message: str,
        values: dict,
        budget: Budget,
        no_progress: int | None = None,
    ) -> int:
        code = status.exit_code(trainer_rc=rc)  # the one table (ftlaunch.run.state), as the supervisor exits
        state = self.journal.finished(status, code, ex, message, budget, no_progress)
        kind = ex.kind.value if ex.kind else None
        self.notifier.event(status.value, exit_code=code, failure_kind=kind, message=message)
        if state is None:  # the run folder refuses writes: the end is said on stderr (supervisor.log)
            print(f"ftlaunch supervisor: run {self.run_dir.name} {status.value}: {message}", file=sys.stderr)
            return code
        try:
            self._learn(status, state, values)
        except (StateError, OSError) as exc:  # learned.json of another version, torn, or a full home
            self.journal.say(f"ftlaunch: what this run learned about the card was not kept: {exc}")
        self.journal.say(f"ftlaunch: run {self.run_dir.name} {status.value}: {message}")
        return code

    def _learn(self, status: RunStatus, state: Any, values: dict) -> None:
        """What worked on this card (learned.json): a recovered micro-batch, the memory really used."""
        if status is RunStatus.SUCCEEDED and state.memory_key and state.recovered_batch:
            remember(self.env, state.memory_key, values, reason=f"run {self.run_dir.name}")
        if state.memory_key and state.observed_peak_gib and state.predicted_peak_gib:
            remember_observed(
                self.env,
                state.memory_key,
                observed_peak_gib=float(state.observed_peak_gib),
                predicted_peak_gib=float(state.predicted_peak_gib),
                micro_batch=int(values.get("per_device_train_batch_size") or 1),
            )

    def _wait_for_gpu(self, visible: str | None) -> None:
        """Before the next attempt: the old trainer's processes gone from NVML, the memory back near
        the start figure (bounded); how long it took is said in train.log and the events."""
        gone, used = self.gpu_probes(set(self._trainer_pids), visible)
        w = self.gpu_wait(gone, used, self.gpu_baseline_mib, clock=self.clock, sleep=self.sleep)
        if not w.skipped:
            self.journal.gpu_waited(w.message, round(w.waited_s, 2), w.released)

    def _sample_gpu(self, pid: int) -> None:
        """Keep the largest GPU memory the trainer's process tree was seen to use (per GPU)."""
        try:
            import psutil

            pids = {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
        except Exception:
            pids = {pid}
        self._trainer_pids |= pids
        used = self.gpu_sampler(pids)
        if used is not None and (self.observed_peak is None or used > self.observed_peak):
            self.observed_peak = used
            self.journal.observed_peak(used)

    def _start_trainer(self, extra_env: dict[str, str], config_path: Path, base_dir: str | None) -> subprocess.Popen:
        """The trainer in its own process group, its output on a pipe (the pump logs it)."""
        cli = find_trainer(self.env)
        cmd = trainer_command(cli, config_path)
        env = trainer_env(self.env, {}, {**extra_env, **secret_handoff(self._secrets())[0]})
        return self.spawn(
            cmd,
            env=with_torchrun_beside(env, cli),
            cwd=base_dir if base_dir and Path(base_dir).is_dir() else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            process_group=0,
        )

    def _attempt(
        self, out: Path, attempt: int, extra_env: dict[str, str], weights_only: bool, recover_until: int | None = None
    ) -> tuple[int, str, CheckpointWatch, int | None, str | None, str | None]:
        """Run one attempt to its end: (exit code, its train.log text, its checkpoints, last step, and
        why it was stopped: as stalled, or before a save the disk cannot hold)."""
        log_path = RunFolder(self.run_dir).train_log
        self.journal.attempt_header(attempt)
        console = Tail.from_end(log_path)
        tlog = Tail.from_end(out / "trainer_log.jsonl")
        state = read_state(self.run_dir)
        checkpoints = CheckpointWatch(out, weights_only, best=state.best_checkpoint or 0)
        config_path = self._trainer_config()
        try:
            self.trainer = trainer = self._start_trainer(extra_env, config_path, state.base_dir)
        except (FtlaunchError, OSError) as exc:
            drop_trainer_config(config_path)
            self.journal.say(f"ftlaunch: cannot start the trainer: {exc}")
            return 127, f"FileNotFoundError: cannot start the trainer: {exc}", checkpoints, None, None, None
        self.journal.trainer_started(trainer.pid, start_time(trainer.pid))
        self._trainer_pids = {trainer.pid}
        self._console.clear()
        dog = Watchdog.begin(self._policy(state), self.clock(), earlier=dict(state.stall or {}))
        pump = threading.Thread(target=self._pump, args=(trainer.stdout, log_path), daemon=True)
        pump.start()
        stop = GroupStop(trainer.pid, self.stop_grace, self.clock)
        rate = prog.StepRate()
        last_step: int | None = None
        stalled: str | None = None
        disk_full: str | None = None
        forecast = DiskForecast.from_dict(state.disk) if state.disk else None
        records: list[dict] = []
        next_update = 0.0
        # Recovering, until the trainer logs a step: progress is the resume point, refreshed (its ETA is
        # the earlier rate's from there, never counted down to 0m00s while the trainer loads).
        last = prog.last_complete_checkpoint(out, weights_only) if recover_until is not None else None
        resumed = prog.resume_point(dict(state.progress or {}), last[0] if last else 0)
        next_watchdog = 0.0
        next_sample = self.clock() + min(1.0, self.sample_every)
        on_gpu = bool(state.gpu_count)  # the plan's machine: NVML is asked only when it has GPUs
        while True:
            rc = trainer.poll()
            halt = (
                stalled is not None
                or disk_full is not None
                or self.stop_signal is not None
                or (self.watch is not None and self.watch.halt)
            )
            if halt and rc is None:
                first = stop.since is None
                stop.tick(lambda: self.journal.stopping(self.stop_signal))
                if first:  # a SIGSTOPped (or traced) trainer acts on SIGTERM only once it runs again
                    signal_group(trainer.pid, signal.SIGCONT)
            # progress from the trainer's own log, this attempt's lines only
            raw = tlog.lines()
            run_records.keep(self.run_dir, raw, self.journal.unwritten)  # this run's own copy (ftlaunch.run.records)
            new = prog.parse_trainer_log(raw)
            if new:
                records.extend(new)
                if self.watch is not None:
                    self.watch.feed(new)  # a divergence sets watch.halt: the trainer is stopped above
                now = self.wall()
                last_step = int(new[-1]["current_steps"])
                dog = dog.steps(last_step, self.clock())
                steps_per_second = rate.update(int(new[0]["current_steps"]), last_step, now)
                caught_up = recover_until is not None and last_step > recover_until
                if self.clock() >= next_update or rc is not None or caught_up:
                    p = prog.latest_progress(records, furthest=None if caught_up else recover_until)
                    self.journal.progress(p, steps_per_second, now, recovered=attempt if caught_up else None)
                    recover_until = None if caught_up else recover_until
                    next_update = self.clock() + 1.0
            # Console after the step records: HF logs step N, then evaluates and saves; a mark read in the
            # same poll as step N's record opens its phase instead of being closed by that record.
            dog = self._drain_console(dog)
            if on_gpu and self.clock() >= next_sample and rc is None:
                self._sample_gpu(trainer.pid)
                next_sample = self.clock() + self.sample_every
            dog = self._watch_checkpoints(checkpoints, dog)
            if rc is not None:
                break
            if recover_until is not None and not records and self.clock() >= next_update:
                self.journal.progress(resumed, state.steps_per_second, self.wall())
                next_update = self.clock() + 1.0
            if self.clock() >= next_watchdog:
                self.journal.watchdog(dog.to_dict(self.clock(), self.wall()))
                next_watchdog = self.clock() + 5.0
            if stalled is None and not halt and dog.stalled(self.clock()):
                stalled = self._on_stall(attempt, trainer.pid, dog)
                continue  # stop it now, not a poll later
            if forecast is not None and new and not halt:  # a statvfs per new step record: microseconds
                disk_full = self._before_save(out, forecast, last_step or 0, rate.rate)
                if disk_full is not None:
                    continue
            self.sleep(self.poll)
        if records:  # the last lines may have arrived while updates were throttled
            self.journal.last_progress(prog.latest_progress(records, furthest=recover_until))
        pump.join(timeout=10)
        signal_group(trainer.pid, signal.SIGKILL)  # leave no stray workers of the trainer's group
        self._watch_checkpoints(checkpoints, dog)  # a save that completed just before the exit
        self.journal.watchdog(dog.to_dict(self.clock(), self.wall()))
        drop_trainer_config(config_path)
        self.trainer = None
        return rc, console.rest(), checkpoints, last_step, stalled, disk_full

    def _before_save(self, out: Path, fc: DiskForecast, step: int, steps_per_second: float | None) -> str | None:
        """Free space before an expected save: when the next save is close (within ~10 s at the
        current rate, else the next step) and the filesystem cannot hold one more checkpoint, stop
        the trainer now rather than let it write a partial one."""
        nxt = fc.next_save_after(step)
        if nxt is None or nxt - step > max(1, round((steps_per_second or 0.0) * 10)):
            return None
        try:
            free = free_for_next_save(out, fc, step, nxt)  # a save under way counted as it will end
        except OSError:
            return None
        if enough_for_save(fc, free):
            return None
        why = f"the save at step {nxt} cannot fit: {disk_message(out, fc.checkpoint_bytes, free)}"
        self.journal.say(f"ftlaunch: {why}; stopping the trainer before it writes a partial checkpoint")
        return why

    def _why_it_ended(
        self,
        rc: int,
        log_text: str,
        step: int | None,
        stalled: str | None,
        disk_full: str | None,
        ended: RunState,
        out: Path,
        weights_only: bool,
    ) -> Exit:
        """What ended the attempt: a stall or the disk check (ours), else the trainer's exit and log,
        with a zero-step success, an ENOSPC and a bare SIGKILL told apart."""
        stopped = self.stop_signal is not None
        if stalled is not None and not stopped:
            return Exit(FailureKind.STALLED, stalled)
        if disk_full is not None and not stopped:
            ex = Exit(FailureKind.DISK_FULL, disk_full)
        else:
            ex = classify(rc, log_text, stop_requested=stopped)
            stepped = step is not None or bool((ended.progress or {}).get("step")) or bool(ended.best_checkpoint)
            ex = without_steps(ex, stepped or prog.last_complete_checkpoint(out, weights_only) is not None)
            if ex.kind in (FailureKind.CRASH, FailureKind.CONFIG) and enospc_in(log_text):
                ex = Exit(FailureKind.DISK_FULL, f"a save ran out of space: {enospc_line(log_text)}")
        if ex.kind is FailureKind.DISK_FULL:
            return self._after_disk_full(ex, out, weights_only, ended.disk)
        if ex.kind is FailureKind.HOST_OOM:
            return with_kernel_evidence(ex, ended.trainer_pid, self.read_kernel_log)
        return ex

    def _after_disk_full(self, ex: Exit, out: Path, weights_only: bool, fc: Mapping[str, Any] | None) -> Exit:
        """ENOSPC (or the check before a save): remove only the partial folder of the failed save (it
        can never be resumed), keep every complete checkpoint, and say where the space went."""
        removed = remove_partial(out, weights_only)
        size = DiskForecast.from_dict(fc).checkpoint_bytes if fc else None
        last = prog.last_complete_checkpoint(out, weights_only)
        parts = [ex.message] if ex.message else []
        if not ex.message.startswith("the save at step"):
            parts.append(disk_message(out, size))
        if removed.names:
            parts.append(f"removed the partial {', '.join(removed.names)} ({removed.bytes_freed} bytes)")
        parts.append(f"kept every complete checkpoint (last: {last[1].name})" if last else "no complete checkpoint yet")
        if removed.names:
            self.journal.partial_removed(list(removed.names), removed.bytes_freed)
        return Exit(FailureKind.DISK_FULL, "; ".join(parts) + f"; {DISK_HINT}")

    def _policy(self, state: Any) -> StallPolicy:
        if self.stall_policy is not None:
            return self.stall_policy
        size = DiskForecast.from_dict(state.disk).checkpoint_bytes if state.disk else None
        return StallPolicy(timeout=state.stall_timeout, checkpoint_bytes=size)  # size: the first save's limit

    def _drain_console(self, dog: Watchdog) -> Watchdog:
        while self._console:
            at, mark = self._console.popleft()
            dog = dog.console(mark, at)
        return dog

    def _watch_checkpoints(self, checkpoints: CheckpointWatch, dog: Watchdog) -> Watchdog:
        """Record every checkpoint that landed (each once); a save in progress is progress too."""
        for step, path in checkpoints.landed_all():
            self.journal.checkpoint(step, path, max(checkpoints.best, checkpoints.last))
            dog = dog.checkpoint_done(self.clock(), size=tree_bytes(path))  # its write speed: the next limit
        if checkpoints.growth():
            dog = dog.checkpoint_grew(self.clock())
        return dog

    def _on_stall(self, attempt: int, pid: int, dog: Watchdog) -> str:
        """No progress within the allowance: dump every trainer process's stacks, then stop the group."""
        description = dog.describe(self.clock())
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.wall()))
        dump = self.stack_dumper(pid, RunFolder(self.run_dir).stacks_of(attempt, stamp))
        self.journal.say(f"ftlaunch: stalled: {description}; stacks: {dump.describe()}; stopping the trainer")
        self.journal.stalled(attempt, description, str(dump.path), dog.to_dict(self.clock(), self.wall()))
        self.notifier.event("stalled", attempt=attempt, message=description, stacks=str(dump.path))
        return f"{description}; stacks in {dump.path}"

    def _dump_stacks(self, pid: int, path: Path) -> StackDump:
        try:
            trainer = find_trainer(self.env)
        except FtlaunchError:
            trainer = None
        return dump_stacks(pid, path, find_py_spy(self.env, trainer))

    def _secrets(self) -> dict[str, Any]:
        """Secret config keys (hub_token, ...): kept out of config.yaml, in a 0600 file of the run."""
        return {k: v for k, v in read_secrets(self.run_dir).items() if k != NOTIFY_KEY}  # never the trainer's

    def _trainer_config(self) -> Path:
        """The config the trainer reads: config.yaml, or with secrets that have no environment
        variable (ms_hub_token, ...) a 0600 copy that includes them, removed when the attempt ends.
        The others go through the trainer's environment (secret_handoff): never into a pickle."""
        kept = secret_handoff(self._secrets())[1]
        if not kept:
            return RunFolder(self.run_dir).config
        values, header = read_config(self.run_dir)
        return write_trainer_config(self.run_dir, {**values, **kept}, header)

    def _pump(self, stream: IO[bytes] | None, log_path: Path) -> None:
        """Copy the trainer's output into train.log (redacted), chunk by chunk: a progress bar's ``\\r``
        updates count as activity for the watchdog. A full or unwritable run folder drops output
        (counted, said later) but never stops reading: a blocked pipe would hang the trainer."""
        if stream is None:
            return
        secret_values = [str(v) for v in self._secrets().values()] + self.notifier.secret_values()
        pending = b""
        log = self.journal.output_log()  # appends to train.log; what it cannot write is counted there
        for chunk in iter(lambda: stream.read1(65536), b""):
            pending += chunk
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r"))
            if cut < 0 and len(pending) < 1 << 20:
                self._console.append((self.clock(), ""))
                continue
            done, pending = (pending[: cut + 1], pending[cut + 1 :]) if cut >= 0 else (pending, b"")
            self._emit(done, log, secret_values)
        if pending:
            self._emit(pending, log, secret_values)
        log.close()
        stream.close()

    def _emit(self, data: bytes, log: OutputLog, secret_values: list[str]) -> None:
        text = data.decode(errors="replace")
        mark = SAVE_MARK if SAVE_MARK in text else EVAL_MARK if EVAL_MARK in text else ""
        self._console.append((self.clock(), mark))
        if self.watch is not None:
            for line in text.splitlines(keepends=True):
                self.watch.console(line)  # grad_norm is only in the console (numeric health)
        clean = redact(text, self.env, secret_values)
        line = clean.encode() if clean != text else data
        log.write(line)
        if self.journal.echo:
            try:
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
            except (OSError, ValueError):
                self.journal.echo = False  # the terminal went away; keep logging to the file


def kernel_log() -> str:
    """The kernel ring buffer when this user may read it (often root only); empty otherwise."""
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def with_kernel_evidence(ex: Any, pid: int | None, read: Callable[[], str] = kernel_log) -> Any:
    """Say only what the kernel log shows about a SIGKILL with no traceback (issue 11).

    Shows an OOM kill of the trainer: a host OOM. Readable but shows none: not the OOM killer, a
    crash retried as such. Unreadable: the cause is unknown, and the message says so."""
    from dataclasses import replace

    text = read()
    if not text or not pid:
        return replace(
            ex,
            message=ex.message + ": cause unknown (the kernel log is not readable here to tell whether the "
            "host's OOM killer did it; `sudo dmesg` / `journalctl -k` would show it)",
        )
    if re.search(rf"Killed process {pid}\b", text):
        return replace(ex, message=f"the kernel's OOM killer killed the trainer (pid {pid}): host RAM ran out")
    return replace(
        ex,
        kind=FailureKind.CRASH,
        message=ex.message + f": not the host's OOM killer (the kernel log shows no OOM kill of pid {pid}); "
        "another process or a person sent SIGKILL",
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    lock_fd = None
    if len(args) == 3 and args[1] == "--lock-fd" and args[2].isdigit():
        lock_fd, args = int(args[2]), args[:1]
    if len(args) != 1:
        print("usage: python -m ftlaunch.run.supervisor RUN_DIR [--lock-fd N]", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    # Detached: SIGHUP must not kill us even before handlers are installed.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    supervisor = None
    try:
        lock = adopt_lock(lock_fd) if lock_fd is not None else None
        supervisor = Supervisor(run_dir, os.environ, lock=lock)
        # Its stdout/stderr is supervisor.log, on the filesystem that may fill: never raise from there.
        quiet_std_streams(supervisor.journal.unwritten)
        return supervisor.run()
    except Exception as exc:
        if supervisor is None or supervisor.journal.last_word is None:  # it never took the run over
            if not isinstance(exc, FtlaunchError):
                raise
            quiet_print(f"ftlaunch supervisor: {exc}")
            return int(exc.exit_code)
        # Its own failure: the cause is left where `status` finds it, and the trainer runs on.
        supervisor.journal.died(exc, supervisor.trainer)
        return int(exc.exit_code) if isinstance(exc, FtlaunchError) else 1


if __name__ == "__main__":
    sys.exit(main())
