"""The supervisor: owns one run's trainer, records everything, recovers from failures.

Started detached as ``python -m ftlaunch.supervisor RUN_DIR`` (new session, no terminal), or
in-process for ``train --foreground``. The trainer runs in its own process group; its output is
appended to ``train.log``. Signal handlers only record; the main loop acts (supervisor's
SignalReceiver). Decisions come from the pure ``ftlaunch.recovery``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import IO, Any

import yaml

from . import progress as prog
from .config import dump_yaml, read_header
from .errors import BusyError, ExitCode, FtlaunchError
from .launch import find_trainer, redact, trainer_command, trainer_env
from .locks import try_flock
from .memory_store import remember
from .procs import start_time
from .recovery import ZERO3_OFFLOAD, Budget, classify, decide
from .runstore import (
    FailureKind,
    RunStatus,
    append_event,
    home,
    read_state,
    update_state,
    write_text_atomic,
)

STOPPED_EXIT = 130


# ---------------------------------------------------------------- output_dir lock


def lock_path(env: Mapping[str, str], output_dir: str) -> Path:
    digest = hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]
    return home(env) / "locks" / f"{digest}.lock"


def acquire_output_lock(env: Mapping[str, str], output_dir: str, run_id: str) -> IO[str]:
    """Hold an flock for the run's life: the kernel drops it when the holder dies, so no stale lock."""
    got = try_flock(lock_path(env, output_dir), run_id)
    if isinstance(got, str):
        holder = got or "another run"
        raise BusyError(
            f"output_dir {output_dir} is in use by run {holder}",
            hint=f"wait for it, stop it (`ftlaunch stop {holder}`), or set another output_dir",
        )
    return got


def check_output_free(env: Mapping[str, str], output_dir: str) -> None:
    acquire_output_lock(env, output_dir, "check").close()


def offload_config_path() -> str:
    return str(resources.files("ftlaunch").joinpath("data/ds_z3_offload_config.json"))


# ---------------------------------------------------------------- the supervisor


class Supervisor:
    def __init__(
        self,
        run_dir: Path,
        env: Mapping[str, str],
        *,
        echo: bool = False,
        poll: float = 0.5,
        stop_grace: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        spawn: Callable[..., subprocess.Popen] = subprocess.Popen,
    ):
        self.run_dir = run_dir
        self.env = dict(env)
        self.echo = echo
        self.poll = poll
        self.stop_grace = stop_grace
        self.clock = clock
        self.spawn = spawn
        self.stop_signal: int | None = None
        self.trainer: subprocess.Popen | None = None

    # signal handlers record only
    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop_signal = signum

    def _install_signals(self) -> dict[int, Any]:
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _config(self) -> tuple[dict[str, Any], dict[str, Any]]:
        text = (self.run_dir / "config.yaml").read_text()
        return yaml.safe_load(text) or {}, read_header(text)

    def _write_config(self, values: dict[str, Any], header: dict[str, Any]) -> None:
        write_text_atomic(self.run_dir / "config.yaml", dump_yaml(values, header))

    def run(self) -> int:
        state = read_state(self.run_dir)
        if RunStatus(state["status"]) is RunStatus.SUCCEEDED:
            return 0
        values, header = self._config()
        output_dir = str(values.get("output_dir", ""))
        try:
            lock = acquire_output_lock(self.env, output_dir, self.run_dir.name)
        except BusyError as exc:
            update_state(self.run_dir, status=RunStatus.FAILED.value, failure_kind="busy", message=str(exc))
            append_event(self.run_dir, "failed", kind="busy", message=str(exc))
            raise
        previous = self._install_signals()
        update_state(
            self.run_dir,
            status=RunStatus.STARTING.value,
            pid=os.getpid(),
            pid_start=start_time(os.getpid()),
            ended=None,
            exit_code=None,
        )
        try:
            return self._loop(values, header, output_dir)
        finally:
            lock.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self, values: dict[str, Any], header: dict[str, Any], output_dir: str) -> int:
        state = read_state(self.run_dir)
        b = state.get("budget") or {}
        budget = Budget(
            oom_max=int(b.get("oom_max", 4)),
            crash_max=int(b.get("crash_max", 2)),
            oom_used=int(b.get("oom_used", 0)),
            crash_used=int(b.get("crash_used", 0)),
        )
        recover = bool(state.get("recover", True))
        attempt = int(state.get("attempt", 0))
        extra_env = dict(state.get("trainer_env") or {})
        weights_only = bool(values.get("save_only_model"))
        while True:
            attempt += 1
            out = Path(output_dir)
            moved = self._set_aside_incomplete(out, weights_only)
            last = prog.last_complete_checkpoint(out, weights_only)
            resume_from = last[1].name if last else None
            status = RunStatus.RUNNING if attempt == 1 else RunStatus.RECOVERING
            update_state(
                self.run_dir,
                status=status.value,
                attempt=attempt,
                budget=budget.to_dict(),
                micro_batch=values.get("per_device_train_batch_size"),
                accumulation=values.get("gradient_accumulation_steps"),
                resume_from=resume_from,
            )
            append_event(
                self.run_dir,
                "attempt_started",
                attempt=attempt,
                resume_from=resume_from,
                micro_batch=values.get("per_device_train_batch_size"),
                accumulation=values.get("gradient_accumulation_steps"),
                set_aside=moved,
            )
            rc, log_text, ckpt_before, ckpt_after, step = self._attempt(out, attempt, extra_env, weights_only)
            ex = classify(rc, log_text, stop_requested=self.stop_signal is not None)
            if ex.kind is FailureKind.HOST_OOM:
                ex = with_kernel_evidence(ex, read_state(self.run_dir).get("trainer_pid"))
            append_event(
                self.run_dir,
                "exited",
                attempt=attempt,
                code=rc,
                kind=ex.kind.value if ex.kind else "success",
                message=ex.message,
                step=step,
            )
            offload_ok = importlib.util.find_spec("deepspeed") is not None and bool(state.get("gpu_count", 0))
            last = prog.last_complete_checkpoint(out, weights_only)
            d = decide(
                ex,
                values,
                budget,
                recover=recover,
                progressed=ckpt_after > ckpt_before,
                offload_ok=offload_ok,
                step=step,
                resume_from=last[1].name if last else None,
            )
            budget = d.budget
            if d.action == "retry":
                for key, value in d.edits.items():
                    if value == ZERO3_OFFLOAD:
                        value = offload_config_path()
                        extra_env.update({"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1"})
                    values[key] = value
                self._write_config(values, header)
                append_event(self.run_dir, "retry", attempt=attempt, message=d.message, edits=d.edits)
                update_state(
                    self.run_dir,
                    status=RunStatus.RECOVERING.value,
                    message=d.message,
                    budget=budget.to_dict(),
                    trainer_env=extra_env,
                    last_failure=ex.kind.value if ex.kind else None,
                    micro_batch=values.get("per_device_train_batch_size"),
                    accumulation=values.get("gradient_accumulation_steps"),
                    **({"recovered_batch": True} if "per_device_train_batch_size" in d.edits else {}),
                )
                self._say(f"ftlaunch: {d.message}")
                continue
            return self._finish(d.action, ex, rc, d.message, values, budget)

    def _finish(self, action: str, ex: Any, rc: int, message: str, values: dict, budget: Budget) -> int:
        if action == "succeed":
            status, code = RunStatus.SUCCEEDED, 0
        elif action == "stop":
            status, code = RunStatus.STOPPED, STOPPED_EXIT
        else:
            status, code = RunStatus.FAILED, (rc if rc > 0 else int(ExitCode.FAILED))
        state = update_state(
            self.run_dir,
            status=status.value,
            ended=time.time(),
            exit_code=code,
            failure_kind=ex.kind.value if ex.kind else None,
            message=message,
            budget=budget.to_dict(),
            trainer_pid=None,
        )
        append_event(self.run_dir, status.value, message=message, exit_code=code)
        if status is RunStatus.SUCCEEDED and state.get("memory_key") and state.get("recovered_batch"):
            remember(self.env, state["memory_key"], values, reason=f"run {self.run_dir.name}")
        self._say(f"ftlaunch: run {self.run_dir.name} {status.value}: {message}")
        return code

    def _say(self, text: str) -> None:
        with open(self.run_dir / "train.log", "a") as f:
            f.write(text + "\n")
        if self.echo:
            print(text, flush=True)

    def _set_aside_incomplete(self, out: Path, weights_only: bool) -> list[str]:
        """Move incomplete newest checkpoints aside (never delete): llamafactory picks by name."""
        moved = []
        for _step, path in reversed(prog.checkpoint_dirs(out)):
            problems = prog.checkpoint_problems(path, weights_only)
            if not problems:
                break
            target = out / f"incomplete-{path.name}-{int(time.time())}"
            path.rename(target)
            moved.append(f"{path.name} -> {target.name} ({'; '.join(problems)})")
            append_event(self.run_dir, "checkpoint_set_aside", checkpoint=path.name, problems=problems)
        return moved

    def _attempt(
        self, out: Path, attempt: int, extra_env: dict[str, str], weights_only: bool
    ) -> tuple[int, str, int, int, int | None]:
        log_path = self.run_dir / "train.log"
        with open(log_path, "a") as f:
            f.write(f"\n===== ftlaunch attempt {attempt} =====\n")
        log_offset = log_path.stat().st_size
        tlog = out / "trainer_log.jsonl"
        tlog_offset = tlog.stat().st_size if tlog.exists() else 0
        ckpt_before = (prog.last_complete_checkpoint(out, weights_only) or (0, None))[0]
        env = trainer_env(self.env, {}, extra_env)
        try:
            cmd = trainer_command(find_trainer(self.env), self.run_dir / "config.yaml")
            state = read_state(self.run_dir)
            cwd = state.get("base_dir") if Path(state.get("base_dir") or "/nonexistent").is_dir() else None
            self.trainer = self.spawn(
                cmd,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        except (FtlaunchError, OSError) as exc:
            self._say(f"ftlaunch: cannot start the trainer: {exc}")
            return 127, f"FileNotFoundError: cannot start the trainer: {exc}", ckpt_before, ckpt_before, None
        trainer = self.trainer
        update_state(self.run_dir, trainer_pid=trainer.pid, trainer_start=start_time(trainer.pid))
        pump = threading.Thread(target=self._pump, args=(trainer.stdout, log_path), daemon=True)
        pump.start()
        first: tuple[int, float] | None = None
        last_step: int | None = None
        last_ckpt = ckpt_before
        terminating_since: float | None = None
        records: list[dict] = []
        next_update = 0.0
        while True:
            rc = trainer.poll()
            if self.stop_signal is not None and rc is None:
                if terminating_since is None:
                    terminating_since = self.clock()
                    append_event(self.run_dir, "stopping", signal=self.stop_signal)
                    _killpg(trainer.pid, signal.SIGTERM)
                elif self.clock() - terminating_since > self.stop_grace:
                    _killpg(trainer.pid, signal.SIGKILL)
            # progress from the trainer's own log, this attempt's lines only
            if tlog.exists():
                with open(tlog) as f:
                    f.seek(tlog_offset)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                tlog_offset += len(complete.encode())
                new = prog.parse_trainer_log(complete)
                if new:
                    records.extend(new)
                    now = time.time()
                    if first is None:
                        first = (int(new[0]["current_steps"]), now)
                    last_step = int(new[-1]["current_steps"])
                    p = prog.latest_progress(records)
                    rate = None
                    if first and last_step > first[0] and now > first[1]:
                        rate = (last_step - first[0]) / (now - first[1])
                    if self.clock() >= next_update or rc is not None:
                        update_state(
                            self.run_dir,
                            progress=p.to_dict(),
                            steps_per_second=rate,
                            progress_at=now,
                        )
                        next_update = self.clock() + 1.0
            latest = prog.checkpoint_dirs(out)
            if latest and latest[-1][0] > last_ckpt and not prog.checkpoint_problems(latest[-1][1], weights_only):
                last_ckpt = latest[-1][0]
                append_event(self.run_dir, "checkpoint", step=last_ckpt, path=latest[-1][1].name)
                update_state(self.run_dir, last_checkpoint=last_ckpt)
            if rc is not None:
                break
            time.sleep(self.poll)
        if records:  # the last lines may have arrived while updates were throttled
            update_state(self.run_dir, progress=prog.latest_progress(records).to_dict())
        pump.join(timeout=10)
        _killpg(trainer.pid, signal.SIGKILL)  # leave no stray workers of the trainer's group
        with open(log_path, errors="replace") as f:
            f.seek(log_offset)
            log_text = f.read()
        self.trainer = None
        return rc, log_text, ckpt_before, last_ckpt, last_step

    def _pump(self, stream: IO[bytes] | None, log_path: Path) -> None:
        if stream is None:
            return
        secrets_env = self.env
        with open(log_path, "ab") as log:
            for raw in iter(stream.readline, b""):
                line = raw
                text = raw.decode(errors="replace")
                clean = redact(text, secrets_env)
                if clean != text:
                    line = clean.encode()
                log.write(line)
                log.flush()
                if self.echo:
                    try:
                        sys.stdout.buffer.write(line)
                        sys.stdout.buffer.flush()
                    except (OSError, ValueError):
                        self.echo = False  # the terminal went away; keep logging to the file
        stream.close()


def kernel_log() -> str:
    """The kernel ring buffer when this user may read it (often root only); empty otherwise."""
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def with_kernel_evidence(ex: Any, pid: int | None, read: Callable[[], str] = kernel_log) -> Any:
    """Confirm a host OOM from the kernel log ("Out of memory: Killed process PID") when readable."""
    from dataclasses import replace

    text = read()
    if not text or not pid:
        return replace(ex, message=ex.message + " (kernel log not readable to confirm)")
    if re.search(rf"Killed process {pid}\b", text):
        return replace(ex, message=f"the kernel's OOM killer killed the trainer (pid {pid}): host RAM ran out")
    return replace(ex, message=ex.message + " (the kernel log shows no OOM kill of the trainer)")


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ftlaunch.supervisor RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    # Detached: SIGHUP must not kill us even before handlers are installed.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        return Supervisor(run_dir, os.environ).run()
    except FtlaunchError as exc:
        print(f"ftlaunch supervisor: {exc}", file=sys.stderr)
        return int(exc.exit_code)


if __name__ == "__main__":
    sys.exit(main())
