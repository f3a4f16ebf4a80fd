"""What the supervisor records about a run: its events (events.jsonl), its state (state.json) and the
lines it adds to train.log. One method per thing that happens, so the supervisor's loop reads as
decisions, and every event and state field it writes is listed here.

None of it may end the supervisor (issue 31): a write the run folder refuses (ENOSPC, EROFS, EIO) is
counted in ``Unwritten`` and said in one notice once there is room; the trainer's output goes through
``OutputLog`` and a detached supervisor's own stdout/stderr through ``QuietStream``, both unbuffered.
``LastWord`` is reserved when the supervisor takes a run over: the run's end when state.json cannot
take it, or why the supervisor failed; `status` reads it (``read_last_word``), the next supervisor
writes an end into the state (``RunJournal.settle``).
"""

from __future__ import annotations

import errno
import functools
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import StateError
from ftlaunch.files import now_iso, overwrite_reserved, reserve_file, write_text_atomic
from ftlaunch.run.checkpoints import SetAside
from ftlaunch.run.events import Event
from ftlaunch.run.progress import Progress
from ftlaunch.run.recovery import Decision, Exit
from ftlaunch.run.state import Budget, FailureKind, RunState, RunStatus
from ftlaunch.run.staterecords import ProgressRecord
from ftlaunch.run.store import RunFolder, append_event, read_state, update_state


def _batch(values: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "micro_batch": values.get("per_device_train_batch_size"),
        "accumulation": values.get("gradient_accumulation_steps"),
    }


def _progress(p: Progress, tokens_per_second: float | None) -> ProgressRecord:
    """``state.progress``: the trainer's progress, with its recent tokens/s when measured (`status`
    shows it without reading trainer_log.jsonl)."""
    record = ProgressRecord(p.to_dict())
    return record if tokens_per_second is None else record.with_(tokens_per_second=tokens_per_second)


def _best_effort(method: Callable[..., Any]) -> Callable[..., Any]:
    """A record that cannot be written (FTLAUNCH_HOME full, unwritable or failing: ENOSPC, EROFS, EIO)
    must not end the supervisor: it would take the trainer with it. The failure is counted once, and
    said in one notice once a write goes through again (``Unwritten``)."""

    @functools.wraps(method)
    def wrapper(self: RunJournal, *args: Any, **kwargs: Any) -> Any:
        outer = self._depth == 0
        self._depth += 1
        try:
            result = method(self, *args, **kwargs)
        except OSError as exc:
            if self.unwritten.failed(exc, self.run_dir, records=1):
                quiet_print(
                    f"ftlaunch supervisor: cannot write the run's records: {self.unwritten.reason}; "
                    "the trainer keeps running"
                )
            return None
        finally:
            self._depth -= 1
        if outer:  # a write went through: there may be room for the notice too
            self.say_unwritten()
        return result

    return wrapper


def quiet_print(text: str, stream: IO[str] | None = None) -> None:
    """A line on stderr that may not be written (a detached supervisor's stderr is supervisor.log in
    the run folder, on the filesystem that is full): dropped rather than raised."""
    try:
        print(text, file=stream or sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


@dataclass(frozen=True)
class Spell:
    """What one spell of refused writes cost, as ``Unwritten.take`` hands it over."""

    reason: str  # why its first write failed
    records: int = 0  # state, events, trainer records, train.log lines of ftlaunch's own
    output_bytes: int = 0  # the trainer's output
    log_bytes: int = 0  # the supervisor's own stdout/stderr (supervisor.log)
    torn: bool = False  # a write of trainer output stopped inside a line: the notice starts a new one

    def joined(self, other: Spell) -> Spell:
        return Spell(
            self.reason,
            self.records + other.records,
            self.output_bytes + other.output_bytes,
            self.log_bytes + other.log_bytes,
            self.torn or other.torn,
        )

    def notice(self) -> str:
        """The one line that says what the spell cost. Pure."""
        lost = [f"{self.records} record(s) of the run"] if self.records else []
        if self.output_bytes:
            lost.append(f"{self.output_bytes:,} byte(s) of trainer output")
        if self.log_bytes:
            lost.append(f"{self.log_bytes:,} byte(s) of the supervisor's own log")
        what = " and ".join(lost) or "nothing"
        return (
            ("\n" if self.torn else "")
            + f"ftlaunch: {what} could not be written while its folder refused writes ({self.reason}); "
            "the trainer kept running"
        )


class Unwritten:
    """What the supervisor could not write while its run folder refused writes (a ``Spell``): each
    write counted once, and the spell said in one notice once a write goes through again and there is
    room: never a running total. Thread-safe: the log pump counts output from its own thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spell: Spell | None = None

    @property
    def reason(self) -> str | None:
        """Why the first write of the current spell failed; None: nothing is lost."""
        spell = self._spell
        return None if spell is None else spell.reason

    def failed(
        self,
        exc: OSError,
        where: Path | str,
        *,
        records: int = 0,
        output_bytes: int = 0,
        log_bytes: int = 0,
        torn: bool = False,
    ) -> bool:
        """Count a write that failed; True for the first of a spell (the moment to say so on stderr)."""
        reason = f"{exc.strerror or exc} ({getattr(exc, 'filename', None) or where})"
        with self._lock:
            first = self._spell is None
            self._spell = (self._spell or Spell(reason)).joined(Spell(reason, records, output_bytes, log_bytes, torn))
            return first

    def take(self) -> Spell | None:
        """The spell so far, and the count starts afresh; None when nothing was lost. ``put_back`` it
        when the notice could not be written either."""
        with self._lock:
            spell, self._spell = self._spell, None
            return spell

    def put_back(self, spell: Spell) -> None:
        with self._lock:
            self._spell = spell if self._spell is None else spell.joined(self._spell)


class QuietStream(io.TextIOBase):
    """sys.stdout/sys.stderr of a detached supervisor: unbuffered writes to its file descriptor
    (supervisor.log), where a write the filesystem refuses is counted in ``unwritten`` and dropped.
    A buffered stream would raise at the next flush, inside whatever handler was printing (issue 31)."""

    def __init__(self, fd: int, unwritten: Unwritten):
        self._fd = fd
        self.unwritten = unwritten

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, s: str) -> int:
        data = s.encode(errors="replace")
        _append(self._fd, data, lambda exc, left: self.unwritten.failed(exc, "stderr", log_bytes=left))
        return len(s)

    def flush(self) -> None:
        pass


def quiet_std_streams(unwritten: Unwritten) -> None:
    """Replace this process's stdout and stderr by QuietStreams (the detached supervisor's main)."""
    sys.stdout = QuietStream(1, unwritten)
    sys.stderr = QuietStream(2, unwritten)


def _append(fd: int, data: bytes, failed: Callable[[OSError, int], Any]) -> bool:
    """Write all of ``data`` to ``fd`` (partial writes continued); on an error the bytes left are
    reported to ``failed`` and False returned."""
    view, done = memoryview(data), 0
    while done < len(data):
        try:
            n = os.write(fd, view[done:])
        except OSError as exc:
            failed(exc, len(data) - done)
            return False
        if n <= 0:
            failed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), len(data) - done)
            return False
        done += n
    return True


class OutputLog:
    """The trainer's output appended to train.log by the log pump: one descriptor opened with
    O_APPEND and unbuffered writes, so a refused write is counted (bytes) and dropped, never kept in a
    buffer to be written twice; the notice follows the first write that goes through again."""

    def __init__(self, journal: RunJournal):
        self.journal = journal
        self.path = RunFolder(journal.run_dir).train_log
        self._fd: int | None = None

    def write(self, data: bytes) -> None:
        if not data:
            return

        def failed(exc: OSError, left: int) -> None:  # left < len(data): the file ends inside a line now
            self.journal.unwritten.failed(exc, self.path, output_bytes=left, torn=left < len(data))

        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            failed(exc, len(data))
            return
        if _append(self._fd, data, failed):
            self.journal.say_unwritten()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# Room for a last word: the cause and a short traceback (cut to fit), or how the run ended.
LAST_WORD_BYTES = 8192


def last_word_places(run_dir: Path, output_dir: str | None) -> list[Path]:
    """Where a supervisor's last word may be, in the order it is tried: reserved in the run folder when
    the supervisor took over (it fits even when that filesystem is full), beside the run's output_dir
    (another filesystem, often), the system temp folder. `status` looks in the same places."""
    places = [run_dir / ".last-word.json"]
    if output_dir:
        places.append(Path(output_dir) / f".ftlaunch-last-word-{run_dir.name}.json")
    places.append(Path(tempfile.gettempdir()) / f"ftlaunch-last-word-{os.getuid()}" / f"{run_dir.name}.json")
    return places


@dataclass(frozen=True)
class LastWord:
    """What a supervisor leaves when it can write nothing else: why it died (``cause``), or how the run
    ended when state.json could not take the end (``status``, ``exit_code``, ``message``). Keyed by the
    supervisor's pid and start time, so a later supervisor's run is never told an earlier one's end."""

    run_dir: Path
    pid: int
    pid_start: float | None
    output_dir: str | None

    def reserve(self) -> None:
        """Claim the blocks in the run folder now, while there is room (OSError when there is none)."""
        reserve_file(self._places()[0], json.dumps(self._key()), LAST_WORD_BYTES)

    def leave(self, **fields: Any) -> Path | None:
        """Write the last word in the first place that takes it; None when none does."""
        word = {**self._key(), "t": now_iso(), **fields}
        text = json.dumps(word, default=str)
        if len(text) > LAST_WORD_BYTES - 1 and word.get("traceback"):
            keep = max(0, len(word["traceback"]) - (len(text) - LAST_WORD_BYTES + 64))
            text = json.dumps({**word, "traceback": "..." + word["traceback"][-keep:]}, default=str)
        first, *others = self._places()
        try:
            overwrite_reserved(first, text)
            return first
        except OSError:
            pass
        for place in others:
            try:
                place.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_text_atomic(place, text + "\n")
                return place
            except OSError:
                continue
        return None

    def clear(self) -> None:
        """The run's end is in state.json: nothing to leave."""
        for place in self._places():
            try:
                place.unlink(missing_ok=True)
            except OSError:
                pass

    def _key(self) -> dict[str, Any]:
        return {"pid": self.pid, "pid_start": self.pid_start}

    def _places(self) -> list[Path]:
        return last_word_places(self.run_dir, self.output_dir)


def read_last_word(
    run_dir: Path, output_dir: str | None, pid: int | None, pid_start: float | None
) -> dict[str, Any] | None:
    """The last word the supervisor ``pid`` (started at ``pid_start``) left for this run, with the file
    it was found in (``where``); None when it left none (a SIGKILL, the OOM killer, a reboot)."""
    if not pid:
        return None
    for place in last_word_places(run_dir, output_dir):
        try:
            word = json.loads(place.read_bytes())
        except (OSError, ValueError):
            continue
        if not isinstance(word, dict) or word.get("pid") != pid or not (word.get("cause") or word.get("status")):
            continue
        if pid_start is not None and word.get("pid_start") not in (None, pid_start):
            continue
        return {**word, "where": str(place)}
    return None


# Free space that says the run folder's filesystem has room again (the notice waits for it).
ROOM_BYTES = 256 * 1024


def _has_room(folder: Path) -> bool:
    try:
        st = os.statvfs(folder)
    except OSError:
        return True  # cannot tell: the notice's own write will say
    return st.f_bavail * st.f_frsize >= ROOM_BYTES


# The statuses a last word may end a run with.
_ENDS = {s.value for s in RunStatus if s.is_terminal()}


class RunJournal:
    def __init__(self, run_dir: Path, echo: bool = False):
        self.run_dir = run_dir
        self.echo = echo
        self.unwritten = Unwritten()  # what the run folder refused, until it is said
        self._depth = 0  # journal methods calling journal methods: the notice comes after the outer one
        self.last_word: LastWord | None = None  # reserved when the supervisor takes over the run

    def output_log(self) -> OutputLog:
        """Where the log pump appends the trainer's output (train.log)."""
        return OutputLog(self)

    def say_unwritten(self) -> None:
        """The one notice of a spell of refused writes, once there is room: a write went through and the
        filesystem has ROOM_BYTES free (a notice that cannot be written is not counted: the spell waits
        for the next write that goes through)."""
        if self.unwritten.reason is None or not _has_room(self.run_dir):
            return  # a write into the last block of a file can go through on a full disk: not room yet
        spell = self.unwritten.take()
        if spell is None:
            return
        text = spell.notice()
        try:
            with open(RunFolder(self.run_dir).train_log, "a") as f:
                f.write(text + "\n")
        except OSError:
            self.unwritten.put_back(spell)
            return
        if self.echo:
            quiet_print(text, sys.stdout)
        lost = {"records": spell.records, "output_bytes": spell.output_bytes, "log_bytes": spell.log_bytes}
        try:
            append_event(self.run_dir, Event.UNWRITTEN, reason=spell.reason, **lost)
        except OSError:
            pass  # said in train.log; a notice about the notice would never end

    @_best_effort
    def write(self, fn: Callable[[], Any]) -> Any:
        """Another module's write into the run folder (numeric health's state and events), under the
        same rule as the journal's own: it may fail, counted once; the supervisor and trainer go on."""
        return fn()

    @_best_effort
    def say(self, text: str) -> None:
        """A line of ftlaunch's own in train.log (`ftlaunch logs` shows it), echoed when in the foreground."""
        if self.echo:
            quiet_print(text, sys.stdout)
        with open(RunFolder(self.run_dir).train_log, "a") as f:
            f.write(text + "\n")

    @_best_effort
    def busy(self, message: str) -> None:
        """Another run holds the output_dir: this one never started."""
        update_state(self.run_dir, status=RunStatus.FAILED, failure_kind=FailureKind.BUSY, message=message)
        append_event(self.run_dir, Event.FAILED, kind=FailureKind.BUSY.value, message=message)

    def supervising(self, pid: int, pid_start: float | None) -> None:
        """This supervisor takes over the run; room for its last word is reserved first, while there is room."""
        try:
            output_dir = read_state(self.run_dir).output_dir
        except StateError:
            output_dir = None
        self.last_word = LastWord(self.run_dir, pid, pid_start, output_dir)
        try:
            self.last_word.reserve()
        except OSError:
            pass  # full already: the last word goes beside the output_dir or to the temp folder
        self._supervising(pid, pid_start)

    @_best_effort
    def _supervising(self, pid: int, pid_start: float | None) -> None:
        update_state(self.run_dir, status=RunStatus.STARTING, pid=pid, pid_start=pid_start, ended=None, exit_code=None)

    def settle(self) -> None:
        """An earlier supervisor of this run ended it while state.json could not take the end: its last
        word is written into the state now that there is room (`resume` of such a run finds it ended)."""
        try:
            state = read_state(self.run_dir)
        except StateError:
            return
        if state.status.is_terminal():
            return
        for place in last_word_places(self.run_dir, state.output_dir):
            try:
                word = json.loads(place.read_bytes())
            except (OSError, ValueError):
                continue
            if not isinstance(word, dict) or word.get("status") not in _ENDS:
                continue
            if self._settle(word, place):  # said: nothing left to find (else the word waits for room)
                LastWord(self.run_dir, 0, None, state.output_dir).clear()
            return

    @_best_effort
    def _settle(self, word: Mapping[str, Any], place: Path) -> bool:
        status, message, code = RunStatus(word["status"]), str(word.get("message") or ""), word.get("exit_code")
        kind = word.get("failure_kind")
        update_state(
            self.run_dir,
            status=status,
            exit_code=code,
            message=message,
            ended=word.get("ended"),
            failure_kind=kind if kind in {k.value for k in FailureKind} else None,
            trainer_pid=None,
        )
        append_event(self.run_dir, Event.ended_as(status), message=message, exit_code=code, settled_from=str(place))
        self.say(f"ftlaunch: the run had ended {status.value} while its folder refused writes: {message}")
        return True

    def died(self, exc: BaseException, trainer: subprocess.Popen | None) -> None:
        """The supervisor itself failed (an error of its own, not the trainer's). Its cause is left where
        `status` finds it, and a live trainer is not taken down with it: the log pump keeps copying its
        output until it ends, then its exit code is added to the last word."""
        cause = f"{type(exc).__name__}: {exc}"
        trace = "".join(traceback.format_exception(exc))
        quiet_print(trace.rstrip())
        word = self.last_word or LastWord(self.run_dir, os.getpid(), None, None)
        alive = trainer is not None and trainer.poll() is None
        more = {"trainer_pid": trainer.pid, "trainer": "running"} if alive and trainer else {}
        word.leave(cause=cause, traceback=trace, **more)
        self.say(f"ftlaunch: the supervisor failed: {cause}" + ("; its trainer runs on, unsupervised" if alive else ""))
        if alive and trainer is not None:
            rc = trainer.wait()
            word.leave(cause=cause, traceback=trace, trainer_pid=trainer.pid, trainer_exit_code=rc)

    @_best_effort
    def attempt_started(
        self,
        attempt: int,
        status: RunStatus,
        budget: Budget,
        values: Mapping[str, Any],
        resume_from: str | None,
        set_aside: list[SetAside],
    ) -> None:
        for s in set_aside:
            append_event(self.run_dir, Event.CHECKPOINT_SET_ASIDE, checkpoint=s.name, problems=list(s.problems))
        update_state(
            self.run_dir, status=status, attempt=attempt, budget=budget, resume_from=resume_from, **_batch(values)
        )
        append_event(
            self.run_dir,
            Event.ATTEMPT_STARTED,
            attempt=attempt,
            resume_from=resume_from,
            **_batch(values),
            set_aside=[s.describe() for s in set_aside],
        )

    @_best_effort
    def attempt_header(self, attempt: int) -> None:
        with open(RunFolder(self.run_dir).train_log, "a") as f:
            f.write(f"\n===== ftlaunch attempt {attempt} =====\n")

    @_best_effort
    def trainer_started(self, pid: int, start: float | None) -> None:
        update_state(self.run_dir, trainer_pid=pid, trainer_start=start)

    @_best_effort
    def stopping(self, signum: int | None) -> None:
        append_event(self.run_dir, Event.STOPPING, signal=signum)

    @_best_effort
    def progress(
        self, p: Progress, rate: float | None, at: float, recovered: int | None = None, tokens: float | None = None
    ) -> None:
        """The trainer's progress; ``recovered``: the attempt whose trainer just passed the furthest
        step seen before it (a recovering run is running again); ``tokens``: its recent tokens/s."""
        more: dict[str, Any] = {}
        if recovered is not None:
            more["status"] = RunStatus.RUNNING
            append_event(self.run_dir, Event.RECOVERED, attempt=recovered, step=p.step)
        update_state(self.run_dir, progress=_progress(p, tokens), steps_per_second=rate, progress_at=at, **more)

    @_best_effort
    def last_progress(self, p: Progress, tokens: float | None = None) -> None:
        """The last lines of an attempt may have come while updates were throttled."""
        update_state(self.run_dir, progress=_progress(p, tokens))

    @_best_effort
    def checkpoint(self, step: int, path: Path, best: int) -> None:
        append_event(self.run_dir, Event.CHECKPOINT, step=step, path=path.name)
        update_state(self.run_dir, last_checkpoint=step, best_checkpoint=best)

    @_best_effort
    def watchdog(self, stall: Mapping[str, Any]) -> None:
        """The stall watchdog's view of this attempt (`status` shows the idle seconds and the allowance)."""
        update_state(self.run_dir, stall=dict(stall))

    @_best_effort
    def stalled(self, attempt: int, description: str, dump: str, stall: Mapping[str, Any]) -> None:
        append_event(self.run_dir, Event.STALLED, attempt=attempt, message=description, stacks=dump)
        update_state(self.run_dir, stall=dict(stall))

    @_best_effort
    def partial_removed(self, names: list[str], freed: int) -> None:
        """ENOSPC: the partial folder of the failed save is removed (it can never be resumed)."""
        append_event(self.run_dir, Event.PARTIAL_CHECKPOINT_REMOVED, names=names, bytes=freed)

    @_best_effort
    def gpu_waited(self, message: str, waited_s: float, released: bool) -> None:
        """Clean restarts: how long the next attempt waited for the old trainer's GPU memory."""
        append_event(self.run_dir, Event.GPU_WAIT, message=message, waited_s=waited_s, released=released)
        self.say(f"ftlaunch: {message}")

    @_best_effort
    def observed_peak(self, gib: float) -> None:
        update_state(self.run_dir, observed_peak_gib=round(gib, 3))

    @_best_effort
    def exited(self, attempt: int, rc: int, ex: Exit, step: int | None) -> None:
        kind = ex.kind.value if ex.kind else "success"
        append_event(self.run_dir, Event.EXITED, attempt=attempt, code=rc, kind=kind, message=ex.message, step=step)

    @_best_effort
    def retry(
        self, attempt: int, d: Decision, ex: Exit, values: Mapping[str, Any], trainer_env: Mapping[str, str]
    ) -> None:
        append_event(self.run_dir, Event.RETRY, attempt=attempt, message=d.message, edits=d.edits)
        update_state(
            self.run_dir,
            status=RunStatus.RECOVERING,
            no_progress_attempts=d.no_progress,
            message=d.message,
            budget=d.budget,
            trainer_env=dict(trainer_env),
            last_failure=ex.kind,
            **_batch(values),
            **({"recovered_batch": True} if "per_device_train_batch_size" in d.edits else {}),
        )
        self.say(f"ftlaunch: {d.message}")

    def finished(
        self, status: RunStatus, code: int, ex: Exit, message: str, budget: Budget, no_progress: int | None = None
    ) -> RunState | None:
        """The run's end in state.json and the events; None when state.json refused it: the end is then
        the supervisor's last word, which `status` reads."""
        state = self._finished(status, code, ex, message, budget, no_progress)
        if self.last_word is None:
            return state
        if state is not None:
            self.last_word.clear()
            return state
        self.last_word.leave(
            status=status.value,
            exit_code=code,
            failure_kind=ex.kind.value if ex.kind else None,
            message=message,
            ended=time.time(),
            cause=f"state.json could not be written: {self.unwritten.reason or 'the run folder refused writes'}",
        )
        return None

    @_best_effort
    def _finished(
        self, status: RunStatus, code: int, ex: Exit, message: str, budget: Budget, no_progress: int | None
    ) -> RunState:
        more = {} if no_progress is None else {"no_progress_attempts": no_progress}
        state = update_state(
            self.run_dir,
            **more,
            status=status,
            ended=time.time(),
            exit_code=code,
            failure_kind=ex.kind,
            message=message,
            budget=budget,
            trainer_pid=None,
        )
        try:
            append_event(self.run_dir, Event.ended_as(status), message=message, exit_code=code)
        except OSError as exc:  # the end is in state.json: that is what counts
            self.unwritten.failed(exc, self.run_dir, records=1)
        return state
