"""Finding the trainer and building its command line and environment (pure where it can be).

Model: accelerate ``prepare_simple_launcher_cmd_env``: returns (cmd, env), runs nothing.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from ftlaunch.errors import TrainerError

# Variables that carry secrets: passed to the trainer, never written anywhere by ftlaunch.
SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "MODELSCOPE_API_TOKEN")


def find_trainer(env: Mapping[str, str]) -> list[str]:
    """llamafactory-cli: $FTLAUNCH_LLAMAFACTORY_CLI, else PATH, else beside this Python."""
    named = env.get("FTLAUNCH_LLAMAFACTORY_CLI")
    if named:
        exe = shutil.which(named) or (named if Path(named).is_file() else None)
        if exe is None:
            raise TrainerError(
                f"FTLAUNCH_LLAMAFACTORY_CLI={named} is not an executable",
                hint="point it at llamafactory-cli, or unset it to use the one on PATH",
            )
        return [str(Path(exe).absolute())]
    exe = shutil.which("llamafactory-cli", path=env.get("PATH"))
    if exe is None:
        beside = Path(sys.executable).parent / "llamafactory-cli"
        if beside.is_file():
            exe = str(beside)
    if exe is None:
        raise TrainerError(
            "llamafactory-cli is not installed",
            hint="pip install 'ftlaunch[train]' (or set FTLAUNCH_LLAMAFACTORY_CLI)",
        )
    return [str(Path(exe).absolute())]


def trainer_command(cli: list[str], config_path: Path) -> list[str]:
    return [*cli, "train", str(config_path)]


def trainer_env(
    base: Mapping[str, str], plan_env: Mapping[str, str], extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The child's environment: the caller's, plus the plan's, plus run-specific variables."""
    env = dict(base)
    env.update(plan_env)
    env.update(extra or {})
    # The trainer's output goes to a file: unbuffered so `logs -f` sees it as it happens.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def redact(text: str, env: Mapping[str, str], secrets: Iterable[str] = ()) -> str:
    """Remove secret values (of SECRET_ENV variables, and ``secrets``) from text about to be written."""
    values = [env.get(key) for key in SECRET_ENV] + list(secrets)
    for value in values:
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def public_env(env: Mapping[str, str]) -> dict[str, str]:
    """The plan's env as it may be stored: secrets never leave the process."""
    return {k: ("***" if k in SECRET_ENV else v) for k, v in env.items()}
