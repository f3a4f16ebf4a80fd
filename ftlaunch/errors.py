"""The one error hierarchy of ftlaunch: every error carries an exit code and a hint.

Exit codes are mapped to the process only in the CLI (``ftlaunch.cli.main``). Usage errors stay at 2
(click's own). Each failure kind has its own code so scripts can tell them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # a run failed / generic failure
    USAGE = 2  # click usage errors
    CONFIG = 3  # the YAML, an override or a referenced file is wrong
    HARDWARE = 4  # hardware probe or hardware description failed
    DOES_NOT_FIT = 5  # the memory model finds no configuration that fits
    NOT_FOUND = 6  # no such run / schedule
    BUSY = 7  # output_dir locked by a live run, or a schedule already running
    HUB = 8  # hub refused: repo missing, gated, unauthorised
    NETWORK = 9  # download failed after retries
    VERIFY = 10  # a downloaded file failed verification
    RUNNING = 11  # status: the run is still running
    STATE = 12  # a run's state files are unreadable
    TRAINER = 13  # the trainer executable is missing or cannot start
    DIVERGED = 14  # the loss went non-finite or spiked, and rollbacks did not cure it (or --on-diverge stop)
    STALLED = 15  # the trainer made no progress for longer than the stall timeout, restarts spent
    NO_PROGRESS = 16  # attempts kept failing without a new checkpoint (restart brake); not requeued
    DISK_FULL = 17  # the output_dir's filesystem cannot hold a checkpoint (refused, or ENOSPC while saving)
    ENV_CHANGED = 18  # a package that decides training changed since the checkpoint to resume was made
    NOTIFY_CONFIG = 19  # $FTLAUNCH_HOME/notify.yaml (the notification destinations) is unreadable or wrong
    OUTPUT = 20  # a file the user named to write (bundle -o) cannot be written there (a full disk: DISK_FULL)


class FtlaunchError(Exception):
    """Base error: a message, a hint saying what to do, and an exit code."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, hint: str | None = None, exit_code: ExitCode | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


class ConfigError(FtlaunchError):
    """Every problem found in a config, reported at once."""

    exit_code = ExitCode.CONFIG

    def __init__(self, problems: Sequence[str] | str, hint: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = f"config error: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"config error: {len(self.problems)} problems:\n{lines}"
        super().__init__(message, hint)


class HardwareError(FtlaunchError):
    exit_code = ExitCode.HARDWARE


class DoesNotFitError(FtlaunchError):
    """The model does not fit; ``alternatives`` lists what would (rows of dicts); ``payload`` is the
    plan as far as it got (``hardware``, ``config``, ``memory`` with its verdict), for ``--json``."""

    exit_code = ExitCode.DOES_NOT_FIT

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        alternatives: list[dict] | None = None,
        payload: dict | None = None,
    ):
        super().__init__(message, hint)
        self.alternatives = alternatives or []
        self.payload = payload or {}


class RunNotFoundError(FtlaunchError):
    exit_code = ExitCode.NOT_FOUND


class BusyError(FtlaunchError):
    exit_code = ExitCode.BUSY


class HubError(FtlaunchError):
    exit_code = ExitCode.HUB


class NetworkError(FtlaunchError):
    exit_code = ExitCode.NETWORK


class VerifyError(FtlaunchError):
    exit_code = ExitCode.VERIFY


class StateError(FtlaunchError):
    exit_code = ExitCode.STATE


class StateVersionError(StateError):
    """A state.json this ftlaunch does not know the version of: refused, never rebuilt or overwritten."""


class TrainerError(FtlaunchError):
    exit_code = ExitCode.TRAINER


class DiskFullError(FtlaunchError):
    """The output_dir's filesystem cannot hold what the run will write (checked before it starts)."""

    exit_code = ExitCode.DISK_FULL


class EnvChangedError(FtlaunchError):
    """A resume from a checkpoint across a change of a package that decides training (torch,
    transformers, llamafactory, ...): refused before anything starts, unless --allow-env-change."""

    exit_code = ExitCode.ENV_CHANGED


class NotifyConfigError(FtlaunchError):
    """$FTLAUNCH_HOME/notify.yaml is wrong: every problem, each naming the file and the key (never a
    destination's value: they hold tokens). Raised before a run is created, so nothing is half-written."""

    exit_code = ExitCode.NOTIFY_CONFIG

    def __init__(self, path: str, problems: Sequence[str], hint: str | None = None):
        self.path = path
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = f"{path}: {self.problems[0]}"
        else:
            message = f"{path}: {len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message, hint)


class OutputError(FtlaunchError):
    """A file the user asked for (``bundle -o PATH``) cannot be written at PATH: read-only, not ours,
    no such folder, a block device, a reader gone. Nothing half-written is left at PATH."""

    exit_code = ExitCode.OUTPUT
