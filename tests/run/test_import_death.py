"""Issue 40 items 2 and 8: an attempt that dies for want of a package (``use_unsloth: true`` without
unsloth: the trainer's ModuleNotFoundError, or LLaMA-Factory's own check_version refusing it) is a
setup error: the run ends at once, one attempt, never retried as a crash, and `ftlaunch status` says
the real error, not "exit code 1".

The trainer is a stand-in set through FTLAUNCH_LLAMAFACTORY_CLI (a shell wrapper, as
tests/fake_trainer.py's): a real Python that really fails the import, or really runs LLaMA-Factory's
check_version. The classification rows themselves are tested on captured text below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftlaunch.run.policy import Budget
from ftlaunch.run.recovery import Action, classify, decide
from ftlaunch.run.state import FailureKind

from ..conftest import venv_bin
from ..fake_trainer import write_config
from ..helpers import said, wait_for
from .test_e2e_slurm import cluster as cluster  # the Slurm stand-ins' fixture (tests/slurm/fakeslurm.py)

UNSLOTH = "import unsloth  # use_unsloth: true, unsloth not installed\n"
LLAMAFACTORY_CHECK = (
    "from llamafactory.extras.misc import check_version\n"
    'check_version("unsloth", mandatory=True)  # what LLaMA-Factory runs for use_unsloth\n'
)


def stand_in(folder: Path, body: str) -> Path:
    """A llamafactory-cli whose `train` runs ``body`` in a real Python, counting its starts."""
    script = folder / "trainer.py"
    script.write_text(
        "import pathlib, sys\n"
        f"counter = pathlib.Path({str(folder / 'starts')!r})\n"
        "counter.write_text(str(int(counter.read_text()) + 1 if counter.exists() else 1))\n"
        "if sys.argv[1:2] != ['train']:\n"
        "    print('stand-in llamafactory-cli'); sys.exit(0)\n"
        "print('loading the model', flush=True)\n" + body
    )
    wrapper = folder / "llamafactory-cli"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def ftl(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("body", "error"),
    [(UNSLOTH, "No module named 'unsloth'"), (LLAMAFACTORY_CHECK, "The 'unsloth' distribution was not found")],
    ids=["ModuleNotFoundError", "llamafactory-check_version"],
)
def test_a_missing_package_ends_the_run_at_once_and_status_says_it(tmp_path, body, error):
    env = {**os.environ, "FTLAUNCH_HOME": str(tmp_path / "home")}
    env["FTLAUNCH_LLAMAFACTORY_CLI"] = str(stand_in(tmp_path, body))
    cfg = write_config(tmp_path, use_unsloth=True)
    r = ftl(env, "train", str(cfg), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)

    def ended() -> dict | None:
        s = json.loads(ftl(env, "status", run["id"], "--json").stdout)
        return s if s["status"] in ("failed", "succeeded", "lost", "no_progress") else None

    final = wait_for(ended, "the run's end", timeout=180)
    assert final["status"] == "failed" and final["failure_kind"] == "setup_error", final
    assert error in final["message"] and "not retried" in final["message"], final["message"]
    assert not final["message"].startswith("exit code"), final["message"]
    assert (tmp_path / "starts").read_text() == "1"  # one attempt, not the crash budget's three
    events = [json.loads(x) for x in (Path(run["run_dir"]) / "events.jsonl").read_text().splitlines() if x.strip()]
    assert not [e for e in events if e["event"] == "retry"], events
    shown = ftl(env, "status", run["id"])
    assert said(error, shown.stdout) and shown.returncode != 0, shown.stdout + shown.stderr


# ---------------------------------------------------------------- the rows, on captured text

TORCHRUN = """[rank0]: Traceback (most recent call last):
[rank0]:   File "/v/lib/python3.11/site-packages/llamafactory/model/model_utils/unsloth.py", line 55
[rank0]:     from unsloth import FastLanguageModel
[rank0]: ModuleNotFoundError: No module named 'unsloth'
E1207 19:00:00 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
launcher.py FAILED
"""


@pytest.mark.parametrize(
    ("log", "error"),
    [
        (TORCHRUN, "No module named 'unsloth'"),
        (
            "Traceback (most recent call last):\nimportlib.metadata.PackageNotFoundError: No package metadata was "
            "found for The 'unsloth' distribution was not found and is required by this application. "
            "To fix: run `pip install unsloth`.\n",
            "pip install unsloth",
        ),
        ("Traceback (most recent call last):\nImportError: mcore_adapter is missing. Please install it\n", "mcore"),
        ("Traceback (most recent call last):\nRuntimeError: liger-kernel is not installed\n", "liger-kernel"),
        (
            "/v/bin/python: Error while finding module specification for 'ftlaunch.run.supervisor' "
            "(ModuleNotFoundError: No module named 'ftlaunch.run')\n",
            "No module named 'ftlaunch.run'",
        ),
    ],
    ids=["torchrun", "PackageNotFoundError", "ImportError-please-install", "not-installed", "python-m"],
)
def test_a_missing_package_is_a_setup_error_never_retried(log, error):
    ex = classify(1, log)
    assert ex.kind is FailureKind.SETUP and error in ex.message, ex
    d = decide(ex, {}, Budget())
    assert d.action is Action.FAIL and error in d.message and "not retried" in d.message


def test_other_failures_keep_their_rows():
    """An import error printed before the real end (a warning's traceback) does not make it a setup
    error; a crash stays a crash; an attempt that printed nothing says so instead of a bare code."""
    earlier = "Traceback (most recent call last):\nImportError: no flash_attn, using sdpa\nstep 3\n"
    crash = earlier + "Traceback (most recent call last):\nRuntimeError: NCCL timeout\n"
    assert classify(1, crash).kind is FailureKind.CRASH
    assert classify(1, "Traceback (most recent call last):\nValueError: Undefined dataset x\n").kind is (
        FailureKind.CONFIG
    )
    assert classify(1, "").message == "exit code 1: (it printed nothing)"


RAY_SAID = "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"


@pytest.mark.parametrize(
    ("logs", "step", "error"),
    [
        (
            "/v/bin/python: Error while finding module specification for 'ftlaunch.__main__' "
            "(ModuleNotFoundError: No module named 'ftlaunch.__main__')\n",
            "done",
            "No module named 'ftlaunch.__main__'",
        ),
        ("Traceback (most recent call last):\nRuntimeError: the node lost its disk\n", "resubmit", "lost its disk"),
        ("step 7\n", "resubmit", "exit code 1"),
    ],
    ids=["import-death", "crash", "no-traceback"],
)
def test_a_ray_driver_that_died_says_why_and_an_import_death_is_not_resubmitted(logs, step, error):
    """A Ray job's driver that died before recording an end: the follower reads what it printed last
    (Ray keeps it in the job's message). An import that fails fails at every start: the run ends
    failed with the error, not resubmitted until the restart brake with only "exit code 1"."""
    from ftlaunch.run.ray.follow import next_step
    from ftlaunch.run.ray.jobs import JobInfo
    from ftlaunch.run.state import RunStatus

    job = JobInfo("FAILED", RAY_SAID + logs, driver_exit_code=1)
    n = next_step(job, RunStatus.RUNNING, submission_id="s-2", stop_requested=False, progressed=False, no_progress=0)
    assert n.step == step and error in (n.message or ""), n
    if step == "done":
        assert n.status is RunStatus.FAILED and "not retried" in n.message


def test_a_ray_driver_killed_by_a_signal_is_resubmitted_whatever_it_printed_before():
    """A kill -9 mid-run: an earlier attempt's traceback in the driver's output is not why it died."""
    from ftlaunch.run.ray.follow import next_step
    from ftlaunch.run.ray.jobs import JobInfo
    from ftlaunch.run.state import RunStatus

    said = RAY_SAID.replace("exit code 1", "exit code -9") + "ModuleNotFoundError: No module named 'x'\nstep 9\n"
    n = next_step(
        JobInfo("FAILED", said, driver_exit_code=-9),
        RunStatus.RUNNING,
        submission_id="s-2",
        stop_requested=False,
        progressed=False,
        no_progress=0,
    )
    assert n.step == "resubmit" and "No module named" not in (n.message or ""), n


@pytest.mark.e2e
def test_a_slurm_batch_step_that_dies_at_import_is_lost_with_the_error_in_status(cluster, tmp_path):
    """The job's Python cannot import ftlaunch's own dependencies (a node whose venv lacks a package):
    the batch step dies before any supervisor runs; Slurm shows only a failed job. `status` says lost
    with the import error the step printed into train.log, not only that the job no longer runs."""
    broken = tmp_path / "node-site" / "ftlaunch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import psutil_missing_on_this_node  # a package the node lacks\n")
    sbatch = Path(cluster["env"]["PATH"].split(os.pathsep)[0]) / "sbatch"
    # the job's environment only (sbatch passes its own to the job): `train` here imports the real package
    text = sbatch.read_text().replace(
        "FAKE_SLURM_COMMAND=sbatch", f"PYTHONPATH={broken.parent} FAKE_SLURM_COMMAND=sbatch"
    )
    sbatch.write_text(text)
    env = cluster["env"]
    r = ftl(env, "train", str(cluster["config"]), "--slurm", "--nodes", "2", "--gpu", "A100-80GBx8",
            "--source-gpus", "16", "--json")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)

    def lost() -> dict | None:
        s = json.loads(ftl(env, "status", run["id"], "--json").stdout)
        return s if s["status"] in ("lost", "failed", "succeeded") else None

    final = wait_for(lost, "the job's end", timeout=120)
    error = "No module named 'psutil_missing_on_this_node'"
    assert final["status"] == "lost" and error in final["message"], final
    assert "its batch step died" in final["message"] and "ftlaunch resume" in final["message"], final["message"]
    assert said(error, ftl(env, "status", run["id"]).stdout)


def test_a_lost_slurm_runs_output_names_an_import_death_only_at_its_very_end():
    from ftlaunch.run.runview import batch_step_death

    died = "step 7\nTraceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'y'\n"
    assert "No module named 'y'" in batch_step_death(died)["cause"]
    warned = "Traceback (most recent call last):\nImportError: no flash_attn\nstep 1\nstep 2\nstep 3\n"
    assert batch_step_death(warned) is None  # a warning long before the end: not how the job ended
    cancelled = died + "slurmstepd: error: *** JOB 12 ON node1 CANCELLED ***\nstep 9\nstep 10\n"
    assert batch_step_death(cancelled) is None
    assert batch_step_death(died.replace("ModuleNotFoundError: No module", "RuntimeError: no")) is None
