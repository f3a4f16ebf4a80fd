"""The environment check for real (issue 25): a scratch venv whose package is upgraded with pip between
two starts of a run, and a lock file of the tiny demo run that pip installs into a fresh venv.

Both install from the package registry (pip's cache is used where it has the files). The trainer of
the first test is the scripted one (tests/fake_trainer.py) started from a llamafactory-cli whose
shebang is the scratch venv's Python: the environment read is that venv's, as for a real install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import ROOT, tiny_config, venv_bin, write_yaml
from ..fake_trainer import write_config

pytestmark = pytest.mark.e2e


def ftl(*args: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def pip(python: Path, *args: str, timeout: int = 600) -> None:
    r = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode != 0:
        pytest.skip(f"pip cannot install from the registry here: {r.stderr.strip().splitlines()[-1:]}")


def test_resume_after_pip_upgraded_a_deciding_package_in_the_trainer_venv(tmp_path):
    scratch = tmp_path / "scratch"
    subprocess.run([sys.executable, "-m", "venv", str(scratch)], check=True, timeout=300)
    py = scratch / "bin" / "python"
    pip(py, "--no-deps", "accelerate==1.3.0")
    cli = tmp_path / "llamafactory-cli"  # runs under the scratch venv's Python, hands over to the script
    script = str(ROOT / "tests" / "fake_trainer.py")
    cli.write_text(
        f"#!{py}\nimport os, sys\nos.execv({sys.executable!r}, [{sys.executable!r}, {script!r}, *sys.argv[1:]])\n"
    )
    cli.chmod(0o755)
    env = {
        **os.environ,
        "FTLAUNCH_LLAMAFACTORY_CLI": str(cli),
        "FAKE_TRAINER_COUNTER": str(tmp_path / "counter"),
        "FAKE_TRAINER_SCRIPT": json.dumps(
            [{"train": True, "steps": 8, "save_steps": 4, "crash_after_saves": 1}, {"config_error": "Undefined x"}]
        ),
    }
    r = ftl("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", "--name", "scratch", env=env)
    assert r.returncode == 1, r.stderr
    run_dir = Path(json.loads(ftl("status", "scratch", "--json", env=env).stdout)["run_dir"])
    first = json.loads((run_dir / "environment" / "attempt-1.json").read_text())
    assert first["python"] == str(py) and first["packages"]["accelerate"] == "1.3.0"
    assert "torch" not in first["packages"]  # the scratch venv's, not ftlaunch's own

    before = (tmp_path / "counter").read_text()
    pip(py, "--no-deps", "accelerate==1.4.0")
    env["FAKE_TRAINER_SCRIPT"] = json.dumps([{"train": True, "steps": 8, "save_steps": 4}])
    r = ftl("resume", "scratch", "--foreground", env=env)
    assert r.returncode == 18, r.stdout + r.stderr
    assert ["accelerate", "1.3.0", "1.4.0"] in [line.split() for line in r.stderr.splitlines()]
    assert "--allow-env-change" in " ".join(r.stderr.split()) and (tmp_path / "counter").read_text() == before

    r = ftl("resume", "scratch", "--foreground", "--allow-env-change", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert int((tmp_path / "counter").read_text()) == int(before) + 1
    status = json.loads(ftl("status", "scratch", "--json", env=env).stdout)
    assert status["status"] == "succeeded"
    line = f"environment changed at attempt {int(before) + 1} (accelerate 1.3.0 -> 1.4.0)"
    assert status["environment_changed"] == line


def test_lock_of_the_tiny_demo_run_recreates_a_venv_that_runs_llamafactory(tiny, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FTLAUNCH_LLAMAFACTORY_CLI"}
    env["PATH"] = f"{venv_bin()}{os.pathsep}{env.get('PATH', '')}"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, tmp_path / "out", max_steps=2, save_steps=2))
    r = ftl("train", str(cfg), "--gpu", "none", "--foreground", "--name", "tiny", env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lock = tmp_path / "requirements.txt"
    assert ftl("env", "--lock", "tiny", "-o", str(lock), env=env).returncode == 0
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=300)
    try:  # ~6.6 GB (torch): pip's cache or the machine's wheel folders make it minutes (128 s here)
        t0 = time.monotonic()
        r = subprocess.run(
            [str(fresh / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(lock)],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        print(f"pip install -r lock: {time.monotonic() - t0:.0f} s")
        assert r.returncode == 0, r.stderr[-3000:]
        v = subprocess.run(
            [str(fresh / "bin" / "llamafactory-cli"), "version"], capture_output=True, text=True, timeout=300
        )
        assert v.returncode == 0 and "0.9" in v.stdout + v.stderr
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # never leave gigabytes in the test's temp folder
