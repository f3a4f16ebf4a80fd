"""One attempt of a run: the trainer started in its own process group (no shell, secrets through its
environment or a 0600 config copy), its output pumped into train.log (redacted) and read by the
watchdog and numeric health, and the watches (``ftlaunch.run.watch``) ticked each poll until it exits.
An attempt ends in one ``AttemptEnd``; what happens next is the supervisor's (``ftlaunch.run.supervisor``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import FtlaunchError
from ftlaunch.plan.disk import DiskForecast
from ftlaunch.probe.usage import gpu_peak_of
from ftlaunch.run import progress as prog
from ftlaunch.run.checkpoints import CheckpointWatch
from ftlaunch.run.gpuwait import GpuWait, nvml_probes, wait_gpu_released
from ftlaunch.run.journal import OutputLog, RunJournal
from ftlaunch.run.notify import NOTIFY_KEY, Notifier
from ftlaunch.run.procs import GroupStop, signal_group, start_time
from ftlaunch.run.recovery import AttemptEnd, Halt
from ftlaunch.run.rollback import HealthWatch
from ftlaunch.run.secrecy import env_secret_values
from ftlaunch.run.stacks import StackDump, dump_stacks, find_py_spy
from ftlaunch.run.stall import EVAL_MARK, SAVE_MARK, StallPolicy
from ftlaunch.run.state import RunState
from ftlaunch.run.store import (
    RunFolder,
    drop_trainer_config,
    read_config,
    read_secrets,
    read_state,
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
from ftlaunch.run.watch.disk import DiskWatch
from ftlaunch.run.watch.gpu import GpuWatch
from ftlaunch.run.watch.health import HealthHalt
from ftlaunch.run.watch.progress import ProgressWatch
from ftlaunch.run.watch.stall import StallWatch


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


class Attempts:
    """A run's attempts, one at a time: ``run`` starts the trainer, pumps its output and ticks the
    watches until it exits. ``stop_signal``: the signal a stop was asked with (None: none), read each
    poll; ``health``: the run's numeric health (set by the supervisor); ``gpu`` spans attempts (the peak
    seen, the last trainer's pids)."""

    def __init__(
        self,
        run_dir: Path,
        env: dict[str, str],
        journal: RunJournal,
        notifier: Notifier,
        seams: Seams,
        stop_signal: Callable[[], int | None],
    ):
        self.run_dir, self.env, self.journal, self.notifier = run_dir, env, journal, notifier
        self.seams, self.stop_signal = seams, stop_signal
        self.clock, self.wall = seams.clock, seams.wall
        self.trainer: subprocess.Popen | None = None
        self.health: HealthWatch | None = None
        # GPU memory the trainer's processes really use (NVML), beside the plan's prediction.
        self.gpu = GpuWatch(journal, seams.gpu_sampler or gpu_peak_of, seams.sample_every, self.clock)
        self.stack_dumper = seams.stack_dumper or self._dump_stacks
        # What the output pump saw, for the watchdog: (clock, save or eval mark or "") per chunk.
        self._console: deque[tuple[float, str]] = deque(maxlen=10000)

    def run(
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
        policy = self.seams.stall_policy or StallPolicy(
            timeout=state.stall_timeout,
            checkpoint_bytes=DiskForecast.from_dict(state.disk).checkpoint_bytes if state.disk else None,
        )  # the checkpoint's size: the first save's limit
        clocks = (self.clock, self.wall)
        stall = StallWatch(
            self.journal, self.notifier, attempt, policy, state.stall or {}, self._console, self.stack_dumper, clocks
        )
        watchers: list[Watcher] = [progress]
        watchers += [HealthHalt(self.health)] if self.health is not None else []
        watchers += [self.gpu] if state.gpu_count else []
        watchers += [checkpoints, stall]
        watchers += [DiskWatch(self.journal, out, DiskForecast.from_dict(state.disk))] if state.disk else []
        return watchers, progress, checkpoints

    def _poll_until_exit(self, trainer: subprocess.Popen, watchers: list[Watcher]) -> tuple[int, list[Halt]]:
        """Each poll: stop the trainer while a halt or a stop is under way, then tick every watch; a
        new halt polls again at once (the stop starts now, not a poll later)."""
        stop = GroupStop(trainer.pid, self.seams.stop_grace, self.clock)
        halts: list[Halt] = []
        while True:
            rc = trainer.poll()
            seen = Seen(rc, halting=bool(halts) or self.stop_signal() is not None)
            if seen.halting and rc is None:
                first = stop.since is None
                stop.tick(lambda: self.journal.stopping(self.stop_signal()))
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
                self.seams.sleep(self.seams.poll)

    def _start_trainer(self, extra_env: dict[str, str], config_path: Path, base_dir: str | None) -> subprocess.Popen:
        """The trainer in its own process group, its output on a pipe (the pump logs it)."""
        cli = find_trainer(self.env)
        cmd = trainer_command(cli, config_path)
        env = trainer_env(self.env, {}, {**extra_env, **secret_handoff(self._secrets())[0]})
        return self.seams.spawn(
            cmd,
            env=with_torchrun_beside(env, cli),
            cwd=base_dir if base_dir and Path(base_dir).is_dir() else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            process_group=0,
        )

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
        # Found once: finding the environment's secrets costs ~0.6 ms, a chunk's redaction ~5 µs.
        secret_values = [str(v) for v in self._secrets().values()] + self.notifier.secret_values()
        secret_values += env_secret_values(self.env)
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
        if self.health is not None:
            for line in text.splitlines(keepends=True):
                self.health.console(line)  # grad_norm is only in the console (numeric health)
        clean = redact(text, {}, secret_values)
        line = clean.encode() if clean != text else data
        log.write(line)
        if self.journal.echo:
            try:
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
            except (OSError, ValueError):
                self.journal.echo = False  # the terminal went away; keep logging to the file
