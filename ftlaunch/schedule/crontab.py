"""The user's crontab: the line ftlaunch writes into it, editing its text, the ``crontab`` executable.

Pure core:
  ``cron_line`` formats one schedule's line, ending with the marker ``# ftlaunch-schedule:<name>``;
  ``entry_name``, ``entries``, ``add_entry``, ``remove_entry`` find, append and drop marked lines,
  every other byte of the table untouched.
Shell:
  ``Crontab`` / ``find_crontab``: the table read and replaced through ``crontab -l`` / ``crontab -``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftlaunch.errors import ExitCode, FtlaunchError
from ftlaunch.schedule.cron import Cron, ScheduleError

MARK = "ftlaunch-schedule:"
MARK_RE = re.compile(r"(?:^|\s)#\s?" + re.escape(MARK) + r"(?P<name>[A-Za-z0-9_.-]+)\s*$")


class CrontabError(FtlaunchError):
    """The crontab executable is missing or refused the new table."""

    exit_code = ExitCode.FAILED


# ---------------------------------------------------------------- the line (pure)


def cron_line(cron: Cron, name: str, argv: Sequence[str], env: Mapping[str, str], log: Path) -> str:
    """One crontab line: ``<when> K=V ... <argv> >> <log> 2>&1 # ftlaunch-schedule:<name>``."""
    words = [f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv]
    command = " ".join(words) + f" >> {shlex.quote(str(log))} 2>&1"
    command = command.replace("%", "\\%")  # cron turns a bare % into a newline
    return f"{cron.text} {command} # {MARK}{name}"


# ---------------------------------------------------------------- crontab text (pure)


def _lines(text: str) -> list[str]:
    """Split keeping every byte: joining the result gives ``text`` back exactly."""
    parts = text.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def entry_name(line: str) -> str | None:
    """The schedule a crontab line belongs to, from its trailing marker; None for foreign lines."""
    if line.lstrip().startswith("#"):
        return None  # a comment (perhaps a disabled copy of ours) belongs to the user
    m = MARK_RE.search(line.rstrip("\n"))
    return m.group("name") if m else None


def entries(text: str) -> dict[str, str]:
    return {n: line for line in _lines(text) if (n := entry_name(line))}


def add_entry(text: str, name: str, line: str) -> str:
    """Append one marked line. A missing final newline is added first (cron needs it)."""
    if name in entries(text):
        raise ScheduleError(
            f"the crontab already has an entry for schedule {name!r}",
            hint=f"`ftlaunch schedule remove {name}` removes it",
        )
    if entry_name(line) != name or "\n" in line:
        raise ValueError("a schedule entry is one line ending with its marker")
    if text and not text.endswith("\n"):
        text += "\n"
    return text + line + "\n"


def remove_entry(text: str, name: str) -> tuple[str, int]:
    """Drop the lines marked for ``name``; every other line stays byte for byte."""
    kept, removed = [], 0
    for line in _lines(text):
        if entry_name(line) == name:
            removed += 1
        else:
            kept.append(line)
    return "".join(kept), removed


# ---------------------------------------------------------------- crontab executable (shell)


@dataclass(frozen=True)
class Crontab:
    """The user's crontab through the real interface: ``crontab -l`` and ``crontab -``."""

    exe: str
    env: Mapping[str, str]

    def read(self) -> str:
        r = subprocess.run([self.exe, "-l"], env=dict(self.env), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            if "no crontab" in (r.stderr + r.stdout).lower():
                return ""
            raise CrontabError(f"`crontab -l` failed ({r.returncode}): {r.stderr.strip()}", hint=_PRINT_HINT)
        return r.stdout

    def write(self, text: str) -> None:
        r = subprocess.run([self.exe, "-"], input=text, env=dict(self.env), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise CrontabError(f"`crontab -` refused the table ({r.returncode}): {r.stderr.strip()}", hint=_PRINT_HINT)


_PRINT_HINT = "`ftlaunch schedule add ... --print` prints the line and systemd units to install yourself"


def find_crontab(env: Mapping[str, str]) -> Crontab:
    exe = shutil.which("crontab", path=env.get("PATH"))
    if exe is None:
        raise CrontabError("no `crontab` executable on PATH (is cron installed?)", hint=_PRINT_HINT)
    return Crontab(os.path.abspath(exe), env)
