"""The command cron runs and its systemd units (pure): ``run_argv``, the carried environment (an
allowlist, never a secret), the schedule's log path, the secrets check, the service + timer pair.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ftlaunch.errors import StateError
from ftlaunch.files import home
from ftlaunch.run.procs import python_module
from ftlaunch.run.trainer import SECRET_ENV
from ftlaunch.schedule.cron import Cron, on_calendar

# Environment carried into the cron line: where state and caches live, which trainer and GPUs.
# An allowlist, so that no secret (HF_TOKEN, WANDB_API_KEY, ...) can ever reach the crontab.
CARRY_ENV = (
    "FTLAUNCH_HOME",
    "FTLAUNCH_LLAMAFACTORY_CLI",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "CUDA_VISIBLE_DEVICES",
)


def run_argv(name: str, python: str) -> list[str]:
    """The same Python environment, by absolute path (never resolved: a venv's python is a link), with
    -P: cron starts it in the home folder, where a clone named ftlaunch would shadow the package."""
    return python_module(os.path.abspath(python), "ftlaunch", "schedule", "run", name)


def carried_env(env: Mapping[str, str]) -> dict[str, str]:
    """What the cron line sets: an allowlist, minus anything that looks like a credential."""
    out = {}
    for key in CARRY_ENV:
        value = env.get(key)
        if value is None or "\n" in value:
            continue
        if "@" in urllib.parse.urlsplit(value).netloc:  # user:password@host
            continue
        out[key] = value
    return out


def log_path(env: Mapping[str, str], name: str) -> Path:
    return home(env) / "schedules" / f"{name}.log"


def check_no_secrets(text: str, env: Mapping[str, str], values: Iterable[str] = ()) -> None:
    """Refuse to write a schedule entry that holds a SECRET_ENV value or one of ``values`` (secret overrides)."""
    named = [(key, env.get(key)) for key in SECRET_ENV] + [("a secret override", v) for v in values]
    for key, value in named:
        if value and len(value) >= 4 and value in text:
            raise StateError(f"refusing to write {key} into a schedule entry", hint="this is a bug; please report it")


def _systemd_word(arg: str) -> str:
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not re.search(r"[\s\"'\\;]", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_units(cron: Cron, name: str, argv: Sequence[str], env: Mapping[str, str], log: Path) -> dict[str, str]:
    """A user service + timer pair doing what the cron line does; file name -> text."""
    envs = "".join(f"Environment={_systemd_word(f'{k}={v}')}\n" for k, v in env.items())
    log_s = str(log).replace("%", "%%")
    service = (
        f"[Unit]\nDescription=ftlaunch schedule {name}\n\n"
        f"[Service]\nType=oneshot\n{envs}"
        f"ExecStart={' '.join(_systemd_word(a) for a in argv)}\n"
        f"StandardOutput=append:{log_s}\nStandardError=append:{log_s}\n"
    )
    calendars = "".join(f"OnCalendar={c}\n" for c in on_calendar(cron))
    timer = (
        f"[Unit]\nDescription=ftlaunch schedule {name} ({cron.text})\n\n"
        f"[Timer]\n{calendars}Persistent=true\n\n"
        "[Install]\nWantedBy=timers.target\n"
    )
    return {f"ftlaunch-{name}.service": service, f"ftlaunch-{name}.timer": timer}
