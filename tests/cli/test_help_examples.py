"""Every example in every command's --help runs, as written, in a sandbox and exits 0.

The sandbox is what a user's project looks like: `cfg.yaml` (the tiny local model), the upstream
`examples/` folder, a run named `nightly`. The trainer is the scripted fake (tests/fake_trainer.py),
except for `estimate`, which tokenizes and probes with the real llamafactory-cli. The hub is a real
HTTP server (tests/fakehub.py) that HF_ENDPOINT points at; Slurm is tests/slurm/fakeslurm.py. The
only rewrites of an example are the ones that would reach the internet (`--mirror hf-mirror`) or
name a run id that cannot exist here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from ftlaunch.cli.main import main

from ..conftest import EXAMPLES, ROOT, tiny_config, venv_bin, write_yaml
from ..fakehub import FakeHub
from .test_docs import all_commands

pytestmark = pytest.mark.e2e
SLURM = ROOT / "tests" / "slurm" / "fakeslurm.py"

# Commands in the order a user meets them (examples of later ones refer to runs made by earlier ones).
ORDER = [
    "env",
    "plan",
    "train",
    "runs",
    "status",
    "logs",
    "stop",
    "resume",
    "schedule",
    "schedule add",
    "schedule list",
    "schedule run",
    "schedule remove",
    "estimate",
    "plot",
    "bundle",
    "download",
    "api",
    "chat",
    "eval",
    "export",
    "webchat",
    "webui",
    "version",
]


def examples_of(cmd: click.Command) -> list[str]:
    """The `ftlaunch ...` lines of a command's help (after "Example:" or "Examples:")."""
    out = []
    for line in (cmd.help or "").splitlines():
        m = re.search(r"(?:^|Examples?:\s*)(ftlaunch\s.*)$", line.strip())
        if m:
            out.append(m.group(1))
    return out


def test_order_lists_every_command_and_every_command_has_an_example():
    names = [n for n, _ in all_commands(main)]
    assert sorted(names) == sorted(ORDER)
    assert all(examples_of(c) for _, c in all_commands(main)), [n for n, c in all_commands(main) if not examples_of(c)]


@pytest.fixture
def sandbox(tiny, tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    shutil.copytree(EXAMPLES / "examples", root / "examples")
    write_yaml(
        root / "cfg.yaml",
        tiny_config(tiny, Path("saves/qwen3-sft"), per_device_train_batch_size=4, gradient_accumulation_steps=2),
    )
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "fake-llamafactory-cli"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "fake_trainer.py"} "$@"\n')
    fake.chmod(0o755)
    tab = tmp_path / "crontab.txt"
    crontab = bindir / "crontab"
    crontab.write_text(
        f'#!/bin/sh\ncase "$1" in\n  -l) cat "{tab}" 2>/dev/null'
        ' || { echo "no crontab for $(id -un)" >&2; exit 1; } ;;\n'
        f'  -) cat > "{tab}" ;;\nesac\n'
    )
    crontab.chmod(0o755)
    for name in ("sbatch", "srun", "squeue", "sacct", "scancel", "scontrol"):  # Slurm stand-ins
        f = bindir / name
        f.write_text(f'#!/bin/sh\nFAKE_SLURM_COMMAND={name} exec {sys.executable} {SLURM} "$@"\n')
        f.chmod(0o755)
    model = {p.name: p.read_bytes() for p in (tiny / "model").iterdir() if p.is_file()}
    data = {"data/train.json": (tiny / "data" / "alpaca_tiny.json").read_bytes()}
    with FakeHub(repos={"Qwen/Qwen2.5-1.5B-Instruct": model}, datasets={"tatsu-lab/alpaca": data}) as hub:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
        env.update(
            PATH=f"{venv_bin()}{os.pathsep}{bindir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
            HF_ENDPOINT=hub.url,
            HF_HOME=str(tmp_path / "hf"),
            FTLAUNCH_LLAMAFACTORY_CLI=str(fake),
            FAKE_TRAINER_COUNTER=str(tmp_path / "counter"),
            FAKE_TRAINER_SCRIPT=json.dumps([{"ok": True, "steps": 4}]),
            FAKE_SLURM_DIR=str(tmp_path / "slurm-jobs"),
            FAKE_SLURM_QUEUE_SECONDS="0.2",
        )
        yield {"root": root, "env": env, "hub": hub}


def sh(line: str, box: dict, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", line], cwd=box["root"], env=env or box["env"], capture_output=True, text=True, timeout=timeout
    )


def wait_idle(box: dict, deadline_s: float = 120) -> None:
    """Detached examples: wait until the latest run is no longer running (status exit 11)."""
    end = time.monotonic() + deadline_s
    while sh("ftlaunch status --json > /dev/null", box).returncode == 11:
        assert time.monotonic() < end, "a run did not end"
        time.sleep(0.3)


def test_every_help_example_runs_and_exits_0(sandbox):
    box = sandbox
    setup = sh("ftlaunch train cfg.yaml --name nightly --foreground", box)
    assert setup.returncode == 0, setup.stderr
    first_id = json.loads(sh("ftlaunch status nightly --json", box).stdout)["id"]
    commands = dict(all_commands(main))
    ran = 0
    for name in ORDER:
        for example in examples_of(commands[name]):
            line = example.replace("--mirror hf-mirror", f"--mirror {box['hub'].url}")
            line = line.replace("20261130-1200", first_id)  # a prefix of an id that exists here
            env = dict(box["env"])
            if name == "estimate":  # tokenizes and probes with the real trainer
                env.pop("FTLAUNCH_LLAMAFACTORY_CLI")
            r = sh(line, box, env)
            assert r.returncode == 0, f"{line}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
            assert "Traceback" not in r.stdout + r.stderr, line
            wait_idle(box)
            ran += 1
    assert ran >= 35
