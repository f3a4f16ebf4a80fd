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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import FtlaunchError, StateError
from ftlaunch.plan.disk import DiskForecast
from ftlaunch.plan.memory.store import remember, remember_observed
from ftlaunch.plan.offload import materialize, refusal
from ftlaunch.probe.usage import gpu_peak_of
from ftlaunch.run import environment
from ftlaunch.run import progress as prog
from ftlaunch.run import records as run_records
from ftlaunch.run.checkpoints import CheckpointWatch, set_aside_incomplete
from ftlaunch.run.disk import enospc_line
from ftlaunch.run.gpuwait import GpuWait, nvml_probes, wait_gpu_released
from ftlaunch.run.health import Response
from ftlaunch.run.journal import OutputLog, RunJournal, quiet_print, quiet_std_streams
from ftlaunch.run.notify import NOTIFY_KEY, Notifier
from ftlaunch.run.orphans import refuse_if_alive, runs_of_output_dir
from ftlaunch.run.outdir import OutputDirBusy, acquire_output_lock, adopt_lock
from ftlaunch.run.procs import GroupStop, signal_group, start_time
from ftlaunch.run.recovery import Action, AttemptEnd, Decision, Exit, Halt, decide, why_it_ended
from ftlaunch.run.rollback import HealthWatch
from ftlaunch.run.stacks import StackDump, dump_stacks, find_py_spy
from ftlaunch.run.stall import EVAL_MARK, SAVE_MARK, StallPolicy
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
from ftlaunch.run.watch import Seen, Watcher
from ftlaunch.run.watch.checkpoints import CheckpointsWatch
from ftlaunch.run.watch.disk import DiskWatch, after_disk_full
from ftlaunch.run.watch.gpu import GpuWatch
from ftlaunch.run.watch.health import HealthHalt
from ftlaunch.run.watch.progress import ProgressWatch
from ftlaunch.run.watch.stall import StallWatch

# How a recovery decision that is not a retry ends the run.
_ENDS = {Action.SUCCEED: RunStatus.SUCCEEDED, Action.STOP: RunStatus.STOPPED, Action.FAIL: RunStatus.FAILED}


@dataclass(frozen=True)
class Seams:
    """The supervisor's settings and test seams (STYLE rule 12), each keyword of ``Supervisor`` with its
    default: ``clock`` (monotonic), ``wall`` (epoch seconds), ``sleep``, ``spawn``, ``read_kernel_log``,
    ``gpu_sampler`` (NVML), ``stack_dumper`` (py-spy), ``gpu_wait``/``gpu_probes`` (clean restarts),
    ``notifier``; ``stall_policy`` None takes --stall-timeout from the run's state."""

    poll: float = 0.5
    stop_grace: float = 30.0
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    spawn: Callable[..., subprocess.Popen] = subprocess.Popen
    read_kernel_log: Callable[[], str] | None = None
    gpu_sampler: Callable[[set[int]], float | None] | None = None
    sample_every: float = 5.0
    stall_policy: StallPolicy | None = None
    stack_dumper: Callable[[int, Path], StackDump] | None = None
    gpu_wait: Callable[..., GpuWait] = wait_gpu_released
    gpu_probes: Callable[[set[int], str | None], tuple[Callable[[], bool], Callable[[], float | None]]] = nvml_probes
    notifier: Notifier | None = None


@dataclass
class _Run:
    """What the loop carries from one attempt to the next."""

    values: dict[str, Any]
    header: dict[str, Any]
    out: Path
    extra_env: dict[str, str]
    budget: Budget
    attempt: int
    gpus: int  # the plan's machine: NVML is asked only when it has GPUs
    recover: bool

    @property
    def weights_only(self) -> bool:
        return bool(self.values.get("save_only_model"))


class Supervisor:
    """One run's loop: start an attempt, watch it, classify its end, decide (retry, roll back, finish).

    What it records goes through its journal (events, state, train.log lines); what it reads of the
    trainer comes from its watches (ftlaunch.run.watch), ticked in order each poll. ``seams``: the
    keywords of ``Seams``."""

    def __init__(
        self, run_dir: Path, env: Mapping[str, str], *, echo: bool = False, lock: IO[str] | None = None, **seams: Any
    ):
        s = Seams(**seams)
        self.run_dir = run_dir
        self.env = dict(env)
        self.journal = RunJournal(run_dir, echo=echo)
        # Notifications (ftlaunch.run.notify): queued here, delivered by its own thread; never blocks.
        self.notifier = s.notifier if s.notifier is not None else Notifier.for_run(run_dir, self.env)
        self.poll, self.stop_grace, self.clock, self.wall, self.sleep = s.poll, s.stop_grace, s.clock, s.wall, s.sleep
        self.spawn = s.spawn
        self.stop_signal: int | None = None
        self.trainer: subprocess.Popen | None = None
        self.watch: HealthWatch | None = None  # numeric health (ftlaunch.run.health), set per run
        # The output_dir lock, when the process that started this run took it (train/resume): the
        # run is then never without it, so no second start can slip in between (races, issue 13).
        self.lock = lock
        self.read_kernel_log = s.read_kernel_log or kernel_log
        # GPU memory the trainer's processes really use (NVML), beside the plan's prediction.
        self.gpu = GpuWatch(self.journal, s.gpu_sampler or gpu_peak_of, s.sample_every, self.clock)
        self.stall_policy = s.stall_policy
        self.stack_dumper = s.stack_dumper or self._dump_stacks
        # What the output pump saw, for the watchdog: (clock, save or eval mark or "") per chunk.
        self._console: deque[tuple[float, str]] = deque(maxlen=10000)
        # Clean restarts on a GPU (ftlaunch.run.gpuwait): the memory in use before the first attempt,
        # and the processes of the last trainer, waited for before the next attempt starts.
        self.gpu_wait, self.gpu_probes = s.gpu_wait, s.gpu_probes
        self.gpu_baseline_mib: float | None = None

    @property
    def observed_peak(self) -> float | None:
        return self.gpu.observed_peak

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
        extra_env = dict(state.trainer_env or {})
        run = _Run(
            values,
            header,
            Path(output_dir),
            extra_env,
            state.budget,
            state.attempt,
            state.gpu_count or 0,
            state.recover,
        )
        self.watch = HealthWatch(self.run_dir, values, self.env, self.journal.say, self.journal.write)
        visible = {**self.env, **extra_env}.get("CUDA_VISIBLE_DEVICES")
        if run.gpus:
            self.gpu_baseline_mib = self.gpu_probes(set(), visible)[1]()
        first = True
        while True:
            if not first and run.gpus:
                self._wait_for_gpu(visible)
            code = self._next_attempt(run, first)
            first = False
            if code is not None:
                return code

    def _next_attempt(self, run: _Run, first: bool) -> int | None:
        """One attempt, from the checks before it to the decision after it: the run's exit code once it
        ends, None to go on."""
        if self.stop_signal is not None:  # stopped before (or between) attempts: start nothing
            stopped = Exit(FailureKind.STOPPED, "stopped by the user")
            return self._finish(
                RunStatus.STOPPED, stopped, 0, "stopped by the user; resume with `ftlaunch resume`", run
            )
        run.attempt += 1
        moved = set_aside_incomplete(run.out, run.weights_only)
        last = prog.last_complete_checkpoint(run.out, run.weights_only)
        # The trainer's environment, recorded and compared before anything of the attempt starts.
        refused = environment.at_attempt_start(
            self.run_dir, run.attempt, self.env, resuming=last is not None, say=self.journal.say
        )
        if refused is not None:
            return self._finish(RunStatus.ENV_CHANGED, Exit(FailureKind.ENV_CHANGED, refused), 0, refused, run)
        status = RunStatus.RUNNING if run.attempt == 1 else RunStatus.RECOVERING
        # A later attempt is "recovering" until the trainer passes the furthest step seen before.
        recover_until = prog.furthest_step(dict(read_state(self.run_dir).progress or {}))
        resumed = last[1].name if last else None
        self.journal.attempt_started(run.attempt, status, run.budget, run.values, resumed, moved)
        if first:
            self.notifier.event("started", attempt=run.attempt, resume_from=resumed)
        run_records.mark_attempt(self.run_dir, run.attempt, resumed, self.journal.unwritten)  # plot: a run's own steps
        assert self.watch is not None
        self.watch.start()
        end = self._attempt(
            run.out, run.attempt, run.extra_env, run.weights_only, recover_until if run.attempt > 1 else None
        )
        return self._judge(run, end)

    def _judge(self, run: _Run, end: AttemptEnd) -> int | None:
        """Numeric health first: a diverged trainer was halted by us, whatever its exit code says. A
        trainer that finished on its own is judged at its end too (the records' tail, the saved weights).
        Then why it ended, and recovery's decision."""
        assert self.watch is not None
        ours = end.halted(FailureKind.STALLED) is not None or end.halted(FailureKind.DISK_FULL) is not None
        done = end.rc == 0 and not ours and self.stop_signal is None
        health = (
            None if self.stop_signal is not None else self.watch.after(run.out, run.values, run.weights_only, done=done)
        )
        if health is not None and health.action is Response.ROLLBACK:
            self._apply(run.values, health.edits.items(), run.extra_env, run.gpus or 1)
            write_config(self.run_dir, run.values, run.header)
            self.notifier.event("diverged", message=health.message, rolled_back=True, edits=dict(health.edits))
            return None
        if health is not None:
            ex = Exit(FailureKind.DIVERGED, health.message)
            return self._finish(RunStatus.DIVERGED, ex, end.rc, health.message, run)
        ended = read_state(self.run_dir)  # once: what the attempt recorded
        ex = self._why_it_ended(end, ended, run.out, run.weights_only)
        self.journal.exited(run.attempt, end.rc, ex, end.last_step)
        # ZeRO-3 offload only where the trainer can run it and LLaMA-Factory accepts it for this config
        offload_ok = (
            importlib.util.find_spec("deepspeed") is not None and bool(run.gpus) and refusal(run.values) is None
        )
        last = prog.last_complete_checkpoint(run.out, run.weights_only)
        d = decide(
            ex,
            run.values,
            run.budget,
            recover=run.recover,
            progressed=end.progressed,
            offload_ok=offload_ok,
            step=end.last_step,
            resume_from=last[1].name if last else None,
            no_progress=ended.no_progress_attempts,
        )
        run.budget = d.budget
        if d.action is not Action.RETRY:
            return self._finish(d.ends or _ENDS[d.action], ex, end.rc, d.message, run, no_progress=d.no_progress)
        self._retry(run, d, ex)
        return None

    def _retry(self, run: _Run, d: Decision, ex: Exit) -> None:
        self._apply(run.values, ((c.key, c.new) for c in d.changes), run.extra_env, run.gpus or 1)
        write_config(self.run_dir, run.values, run.header)
        self.journal.retry(run.attempt, d, ex, run.values, run.extra_env)
        micro = [c for c in d.changes if c.key in ("per_device_train_batch_size", "micro_batch_size")]
        if micro or ex.kind in (FailureKind.CUDA_OOM, FailureKind.EVAL_OOM, FailureKind.HOST_OOM):
            batch = {c.key: f"{c.old} -> {c.new}" for c in d.changes}
            self.notifier.event("oom_recovered", attempt=run.attempt, message=d.message, changes=batch)

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
        self, status: RunStatus, ex: Exit, rc: int, message: str, run: _Run, no_progress: int | None = None
    ) -> int:
        values = run.values
        code = status.exit_code(trainer_rc=rc)  # the one table (ftlaunch.run.state), as the supervisor exits
        state = self.journal.finished(status, code, ex, message, run.budget, no_progress)
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
        gone, used = self.gpu_probes(set(self.gpu.pids), visible)
        w = self.gpu_wait(gone, used, self.gpu_baseline_mib, clock=self.clock, sleep=self.sleep)
        if not w.skipped:
            self.journal.gpu_waited(w.message, round(w.waited_s, 2), w.released)

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
    ) -> AttemptEnd:
        """Run one attempt to its end, its watches ticked each poll; ``recover_until``: the furthest
        step seen before (recovering until the trainer passes it)."""
        log_path = RunFolder(self.run_dir).train_log
        self.journal.attempt_header(attempt)
        console = Tail.from_end(log_path)
        state = read_state(self.run_dir)
        watchers, progress, checkpoints = self._watchers(state, out, attempt, weights_only, recover_until)
        config_path = self._trainer_config()
        try:
            self.trainer = trainer = self._start_trainer(extra_env, config_path, state.base_dir)
        except (FtlaunchError, OSError) as exc:
            drop_trainer_config(config_path)
            self.journal.say(f"ftlaunch: cannot start the trainer: {exc}")
            return AttemptEnd(127, f"FileNotFoundError: cannot start the trainer: {exc}")
        self.journal.trainer_started(trainer.pid, start_time(trainer.pid))
        self._console.clear()
        for w in watchers:
            w.start(trainer.pid)
        pump = threading.Thread(target=self._pump, args=(trainer.stdout, log_path), daemon=True)
        pump.start()
        rc, halts = self._poll_until_exit(trainer, watchers)
        pump.join(timeout=10)
        signal_group(trainer.pid, signal.SIGKILL)  # leave no stray workers of the trainer's group
        final = Seen(rc, halting=True)
        for w in watchers:
            w.after(final)  # the last lines, a save that completed just before the exit
        drop_trainer_config(config_path)
        self.trainer = None
        return AttemptEnd(rc, console.rest(), progress.last_step, checkpoints.progressed, tuple(halts))

    def _watchers(
        self, state: RunState, out: Path, attempt: int, weights_only: bool, recover_until: int | None
    ) -> tuple[list[Watcher], ProgressWatch, CheckpointsWatch]:
        """This attempt's watches, in the order they tick: progress, health, GPU memory, checkpoints,
        stall (after the others: it learns from their steps, marks and saves), disk."""
        # Recovering, until the trainer logs a step: progress is the resume point, refreshed (its ETA is
        # the earlier rate's from there, never counted down to 0m00s while the trainer loads).
        last = prog.last_complete_checkpoint(out, weights_only) if recover_until is not None else None
        before = prog.resume_point(dict(state.progress or {}), last[0] if last else 0)
        progress = ProgressWatch(
            self.journal, out, attempt, recover_until, before, state.steps_per_second, self.clock, self.wall
        )
        found = CheckpointWatch(out, weights_only, best=state.best_checkpoint or 0)
        checkpoints = CheckpointsWatch(self.journal, found, self.clock)
        policy = self.stall_policy or StallPolicy(
            timeout=state.stall_timeout,
            checkpoint_bytes=DiskForecast.from_dict(state.disk).checkpoint_bytes if state.disk else None,
        )  # the checkpoint's size: the first save's limit
        clocks = (self.clock, self.wall)
        stall = StallWatch(
            self.journal, self.notifier, attempt, policy, state.stall or {}, self._console, self.stack_dumper, clocks
        )
        watchers: list[Watcher] = [progress]
        watchers += [HealthHalt(self.watch)] if self.watch is not None else []
        watchers += [self.gpu] if state.gpu_count else []
        watchers += [checkpoints, stall]
        watchers += [DiskWatch(self.journal, out, DiskForecast.from_dict(state.disk))] if state.disk else []
        return watchers, progress, checkpoints

    def _poll_until_exit(self, trainer: subprocess.Popen, watchers: list[Watcher]) -> tuple[int, list[Halt]]:
        """Each poll: stop the trainer while a halt or a stop is under way, then tick every watch; a
        new halt polls again at once (the stop starts now, not a poll later)."""
        stop = GroupStop(trainer.pid, self.stop_grace, self.clock)
        halts: list[Halt] = []
        while True:
            rc = trainer.poll()
            seen = Seen(rc, halting=bool(halts) or self.stop_signal is not None)
            if seen.halting and rc is None:
                first = stop.since is None
                stop.tick(lambda: self.journal.stopping(self.stop_signal))
                if first:  # a SIGSTOPped (or traced) trainer acts on SIGTERM only once it runs again
                    signal_group(trainer.pid, signal.SIGCONT)
            fresh = False
            for w in watchers:
                halt = w.tick(seen)
                if halt is not None:
                    halts.append(halt)
                    seen.halting = fresh = True
            if rc is not None:
                return rc, halts
            if not fresh:
                self.sleep(self.poll)

    def _why_it_ended(self, end: AttemptEnd, ended: RunState, out: Path, weights_only: bool) -> Exit:
        """Why it ended (the pure ``recovery.why_it_ended``), then what only the world shows: an ENOSPC's
        partial folder removed, a bare SIGKILL told apart by the kernel log."""

        def stepped() -> bool:  # in any attempt: a step recorded or a checkpoint saved
            progressed = bool((ended.progress or {}).get("step")) or bool(ended.best_checkpoint)
            return progressed or prog.last_complete_checkpoint(out, weights_only) is not None

        ex = why_it_ended(end, stopped=self.stop_signal is not None, stepped=stepped, enospc=enospc_line)
        if ex.kind is FailureKind.DISK_FULL:
            return after_disk_full(ex, out, weights_only, ended.disk, self.journal)
        if ex.kind is FailureKind.HOST_OOM:
            return with_kernel_evidence(ex, ended.trainer_pid, self.read_kernel_log)
        return ex

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
