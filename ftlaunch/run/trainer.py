"""Finding the trainer and building its command line and environment (pure where it can be).

Model: accelerate ``prepare_simple_launcher_cmd_env``: returns (cmd, env), runs nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftlaunch.errors import TrainerError

# What is secret is run/secrecy.py's to say; these names stay importable here, where callers met them.
from ftlaunch.run.secrecy import SECRET_ENV as SECRET_ENV
from ftlaunch.run.secrecy import public_env as public_env
from ftlaunch.run.secrecy import redact as redact
from ftlaunch.run.secrecy import supervisor_env

# Secret config keys the trainer gets through its environment, not its config (issue 24): transformers
# pickles TrainingArguments, hub_token included, into training_args.bin in the output_dir and in every
# checkpoint-N. With the key unset, transformers and LLaMA-Factory pass token=None, and huggingface_hub
# then reads HF_TOKEN (utils/_auth.py get_token); LLaMA-Factory calls swanlab.login only for a
# swanlab_api_key it was given, else SwanLab's own login reads SWANLAB_API_KEY. In order: hub_token
# (pickled) has HF_TOKEN first; an hf_hub_token that differs stays in the trainer's 0600 config.
SECRET_KEY_ENV = (("hub_token", "HF_TOKEN"), ("hf_hub_token", "HF_TOKEN"), ("swanlab_api_key", "SWANLAB_API_KEY"))


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
    """The child's environment: the caller's but its notification settings (the supervisor's alone:
    ``secrecy.supervisor_env``), plus the plan's, plus run-specific variables."""
    env = supervisor_env(base)
    env.update(plan_env)
    env.update(extra or {})
    # The trainer's output goes to a file: unbuffered so `logs -f` sees it as it happens.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# Its sitecustomize.py lets several CPU processes load a checkpoint's optimizer.pt (the device cpu:N).
CPU_SITE = Path(__file__).resolve().parent / "cpu_site"


def with_torchrun_beside(env: Mapping[str, str], cli: list[str]) -> dict[str, str]:
    """``env`` with the folder of ``cli`` first on PATH when the plan runs torchrun (FORCE_TORCHRUN)
    and that folder holds the ``torchrun`` of the trainer's environment: LLaMA-Factory's launcher runs
    ``torchrun`` by name from PATH (launcher.py:95-115), which an unactivated virtualenv lacks
    (``FileNotFoundError: 'torchrun'``). With several processes, CPU_SITE goes first on PYTHONPATH:
    transformers resumes them with ``torch.load(map_location=args.device)``, which is ``cpu:N`` on the
    CPU and which torch cannot restore without it (GPU locations are left to torch)."""
    out = dict(env)
    if out.get("FORCE_TORCHRUN") and _count(out.get("NPROC_PER_NODE")) > 1:
        paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(CPU_SITE)]
        out["PYTHONPATH"] = os.pathsep.join([str(CPU_SITE), *paths])
    beside = Path(cli[0]).parent
    if not out.get("FORCE_TORCHRUN") or not (beside / "torchrun").is_file():
        return out
    found = shutil.which("torchrun", path=out.get("PATH"))
    if found is None or Path(found).parent != beside:
        out["PATH"] = os.pathsep.join(p for p in (str(beside), out.get("PATH")) if p)
    return out


def _count(text: str | None) -> int:
    try:
        return int(text or 1)
    except ValueError:
        return 1


def secret_handoff(secrets: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """(environment, config keys): how the trainer gets each secret config key.

    Keys with an environment variable the consuming library reads go there; the rest (ms_hub_token,
    om_hub_token, swanlab_lark_secret: ModelArguments and FinetuningArguments, which nothing pickles)
    stay config keys, which the supervisor writes to a 0600 copy removed after the attempt."""
    env: dict[str, str] = {}
    kept = dict(secrets)
    for key, var in SECRET_KEY_ENV:
        if key in kept and env.get(var, str(kept[key])) == str(kept[key]):
            env[var] = str(kept.pop(key))
    return env, kept
