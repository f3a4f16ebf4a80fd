"""The supervisor: owns one run's trainer, records everything, recovers from failures.

Started detached as ``python -m ftlaunch.run.supervisor RUN_DIR`` (new session, no terminal), or
in-process for ``train --foreground``. One attempt (the trainer in its own process group, its output
in ``train.log``, the watches ticked each poll) is ``ftlaunch.run.attempt``'s; this loop runs attempts
and decides between them. Signal handlers only record; the main loop acts (supervisor's
SignalReceiver). Decisions come from the pure ``ftlaunch.run.recovery``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import FtlaunchError, StateError
from ftlaunch.plan.memory.store import remember, remember_observed
from ftlaunch.plan.offload import materialize, refusal
from ftlaunch.run import environment
from ftlaunch.run import progress as prog
from ftlaunch.run import records as run_records
from ftlaunch.run.attempt import Attempts, Seams
from ftlaunch.run.checkpoints import set_aside_incomplete
from ftlaunch.run.ending import explain, kernel_log
from ftlaunch.run.ending import with_kernel_evidence as with_kernel_evidence  # tests take it from here
from ftlaunch.run.health import Response
from ftlaunch.run.journal import RunJournal, quiet_print, quiet_std_streams
from ftlaunch.run.notify import Notifier
from ftlaunch.run.orphans import refuse_if_alive, runs_of_output_dir
from ftlaunch.run.outdir import OutputDirBusy, acquire_output_lock, adopt_lock
from ftlaunch.run.procs import start_time
from ftlaunch.run.recovery import SLURM_STOP, Action, AttemptEnd, Decision, Exit, decide, for_slurm
from ftlaunch.run.rollback import HealthWatch
from ftlaunch.run.state import Budget, FailureKind, RunStatus
from ftlaunch.run.store import read_config, read_state, write_config

# How a recovery decision that is not a retry ends the run.
_ENDS = {Action.SUCCEED: RunStatus.SUCCEEDED, Action.STOP: RunStatus.STOPPED, Action.FAIL: RunStatus.FAILED}


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
        self.clock, self.sleep = s.clock, s.sleep
        self.stop_signal: int | None = None
        self.watch: HealthWatch | None = None  # numeric health (ftlaunch.run.health), set per run
        # The output_dir lock, when the process that started this run took it (train/resume): the
        # run is then never without it, so no second start can slip in between (races, issue 13).
        self.lock = lock
        self.read_kernel_log = s.read_kernel_log or kernel_log
        self.attempts = Attempts(run_dir, self.env, self.journal, self.notifier, s, lambda: self.stop_signal)
        # Clean restarts on a GPU (ftlaunch.run.gpuwait): the memory in use before the first attempt,
        # and the processes of the last trainer, waited for before the next attempt starts.
        self.gpu_wait, self.gpu_probes = s.gpu_wait, s.gpu_probes
        self.gpu_baseline_mib: float | None = None

    @property
    def trainer(self) -> subprocess.Popen | None:
        """The trainer of the attempt under way (None between attempts)."""
        return self.attempts.trainer

    @property
    def echo(self) -> bool:
        return self.journal.echo

    # signal handlers record only
    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum

    def _install_signals(self) -> dict[int, Any]:
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):  # USR2: Slurm's (slurm/job.py)
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
        extra_env, out = dict(state.trainer_env or {}), Path(output_dir)
        run = _Run(values, header, out, extra_env, state.budget, state.attempt, state.gpu_count or 0, state.recover)
        self.watch = self.attempts.health = HealthWatch(
            self.run_dir, values, self.env, self.journal.say, self.journal.write
        )
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
        for aside in moved:  # said where `logs` and a foreground start show it, not only in the events
            self.journal.say(f"ftlaunch: set aside {aside.describe()}")
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
        stopped = self.stop_signal is not None
        ex = explain(end, ended, run.out, run.weights_only, stopped, self.journal, self.read_kernel_log)
        ex = for_slurm(ex, self.stop_signal)  # a stop Slurm asked for is never journaled as the user's
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
        ex = for_slurm(ex, self.stop_signal)
        message = SLURM_STOP if ex.message == SLURM_STOP else message  # Slurm's stop: never the user's
        state = self.journal.finished(status, code, ex, message, run.budget, no_progress)
        kind = ex.kind.value if ex.kind else None
        if message != SLURM_STOP:  # a requeue is no end to notify: the batch step records what it was
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

    def _attempt(
        self, out: Path, attempt: int, extra_env: dict[str, str], weights_only: bool, recover_until: int | None = None
    ) -> AttemptEnd:
        return self.attempts.run(out, attempt, extra_env, weights_only, recover_until)

    def _wait_for_gpu(self, visible: str | None) -> None:
        """Before the next attempt: the old trainer's processes gone from NVML, the memory back near
        the start figure (bounded); how long it took is said in train.log and the events."""
        gone, used = self.gpu_probes(set(self.attempts.gpu.pids), visible)
        w = self.gpu_wait(gone, used, self.gpu_baseline_mib, clock=self.clock, sleep=self.sleep)
        if not w.skipped:
            self.journal.gpu_waited(w.message, round(w.waited_s, 2), w.released)


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
