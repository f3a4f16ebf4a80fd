"""A newcomer's first hour (issue 11): output that reads well at any width, one option set for
every command that starts a run, resume that follows, messages that say what is true."""

from __future__ import annotations

import io
import json
import subprocess
import time

import click
from click.testing import CliRunner
from rich.console import Console

from ftlaunch.cli.main import main
from ftlaunch.cli.render import runs_table
from ftlaunch.cli.schedule import schedule_group
from ftlaunch.present.render import PIPE_WIDTH

from ..conftest import venv_bin
from ..helpers import said
from ..schedule.test_schedule import fake_trainer, project, scratch_crontab  # noqa: F401 (fixtures)

RUN_IDS = ["20261201-131301-89ab", "20261201-131302-cdef"]


def render(renderable, width: int) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, no_color=True).print(renderable)
    return buf.getvalue()


def test_runs_table_never_cuts_an_id_at_any_width():
    from ftlaunch.run.state import RunStatus
    from ftlaunch.run.view import RunView

    rows = [
        RunView(
            id=i,
            name="a-rather-long-run-name-for-a-table",
            status=RunStatus.SUCCEEDED,
            run_dir=f"/home/someone/.ftlaunch/runs/{i}",
            attempt=1,
            step=48,
            total_steps=48,
            loss=1.2345,
            created="2026-12-01T13:13:01+00:00",
            output_dir="/home/someone/projects/finetune/saves/qwen2.5-1.5b/full/sft",
        )
        for i in RUN_IDS
    ]
    for width in (60, 80, 120):
        text = render(runs_table(rows), width)
        for run_id in RUN_IDS:
            assert run_id in text, (width, text)
        assert max(len(line) for line in text.splitlines()) <= width


def test_piped_train_prints_its_plan_at_pipe_width_without_orphan_borders(project, fake_trainer):  # noqa: F811
    r = CliRunner().invoke(main, ["train", str(project), "--gpu", "V100-32GB", "--source-gpus", "8"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= PIPE_WIDTH
    header = next(line for line in lines if "before" in line and "after" in line)
    assert "key" in header and "why" in header  # the whole header on one line
    # A hard-wrapped table leaves border characters alone on a line; a rendered one never does.
    assert not [line for line in lines if line.strip() in ("│", "┃", "┘", "┛", "┐", "┓")]


def test_schedule_add_takes_every_option_train_takes():
    def opts(cmd: click.Command) -> set[str]:
        return {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts}

    train_only = {"--foreground", "--follow", "-f", "--json", "--fresh", "--resume-existing"}
    train_only |= {"--slurm", "--nodes", "--partition", "--time", "--account", "--sbatch-arg"}  # a batch job
    train_only |= {"--engine"}  # where the supervisor lives: --slurm's general form (a schedule's run is local)
    train_only |= {"--address"}  # --engine ray's head
    train_only |= {"--master-addr", "--rendezvous-timeout"}  # a batch job's rendezvous
    train_only |= {"--simulate", "--no-simulate"}  # a check before an interactive start
    missing = opts(main.commands["train"]) - train_only - opts(schedule_group.commands["add"])
    assert not missing, f"schedule add lacks {sorted(missing)}"
    for o in ("--mirror", "--model-config", "--params", "--headroom", "--hardware", "--name", "--no-recover"):
        assert o in opts(schedule_group.commands["add"])


def test_scheduled_run_is_the_same_run(project, fake_trainer, isolated_home, tmp_path):  # noqa: F811
    from ftlaunch.run.store import read_state

    r = CliRunner().invoke(
        schedule_group,
        [
            "add", "nightly", str(project), "--cron", "0 2 * * *", "--gpu", "A10G",
            "--headroom", "0.2", "--name", "night-run", "--no-recover", "--max-crash-retries", "5",
        ],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    rec = json.loads((isolated_home / "schedules" / "nightly.json").read_text())
    assert (rec["headroom"], rec["run_name"], rec["no_recover"], rec["max_crash_retries"]) == (
        0.2,
        "night-run",
        True,
        5,
    )
    r = CliRunner().invoke(schedule_group, ["run", "nightly"])
    assert r.exit_code == 0, r.output
    (run_dir,) = (isolated_home / "runs").iterdir()
    state = read_state(run_dir)
    assert state.name == "night-run" and state.recover is False and state.budget.crash_max == 5
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["memory"] is None or plan["memory"].get("headroom") == 0.2


def ftl(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_resume_of_a_live_run_follows_it_to_the_end(project, fake_trainer, monkeypatch):  # noqa: F811
    import os

    fake_trainer({"sleep": 3, "ok": True, "steps": 4})
    env = dict(os.environ)
    started = ftl("train", str(project), "--gpu", "A10G", "--json", env=env)
    assert started.returncode == 0, started.stderr
    run_id = json.loads(started.stdout)["id"]
    t0 = time.monotonic()
    r = ftl("resume", run_id, env=env)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr  # it followed until the run succeeded
    assert said("following its log", r.stdout) and said("fake trainer attempt 1", r.stdout)
    assert took > 1.0, took  # it did not just say so and return
    assert ftl("status", run_id, env=env).returncode == 0


def test_resume_no_follow_returns_at_once(project, fake_trainer):  # noqa: F811
    import os

    fake_trainer({"sleep": 5, "ok": True, "steps": 4})
    env = dict(os.environ)
    run_id = json.loads(ftl("train", str(project), "--gpu", "A10G", "--json", env=env).stdout)["id"]
    r = ftl("resume", run_id, "--no-follow", env=env)
    assert r.returncode == 0 and said("is alive", r.stdout) and said(f"ftlaunch logs -f {run_id}", r.stdout)
    ftl("stop", run_id, "--grace", "5", env=env)


def test_lost_run_counts_its_gpu_hours(project, fake_trainer, isolated_home):  # noqa: F811
    import os
    import signal

    from ftlaunch.run.store import read_state

    fake_trainer({"sleep": 30, "ok": True, "steps": 4})
    env = dict(os.environ)
    run_id = json.loads(ftl("train", str(project), "--gpu", "A10G", "--json", env=env).stdout)["id"]
    run_dir = isolated_home / "runs" / run_id
    deadline = time.monotonic() + 20
    while not read_state(run_dir).trainer_pid:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.5)
    state = read_state(run_dir)
    os.killpg(int(state.trainer_pid), signal.SIGKILL)  # the trainer's group
    os.kill(int(state.pid), signal.SIGKILL)  # and the supervisor: nobody records an end
    (run_dir / "train.log").touch()
    deadline = time.monotonic() + 10
    while True:
        view = json.loads(ftl("status", run_id, "--json", env=env).stdout)
        if view["status"] == "lost" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert view["status"] == "lost"
    assert view["wall_seconds"] >= 1.0 and view["gpu_hours"] > 0, view


def test_does_not_fit_table_says_why_an_option_is_no_and_groups_by_kind():
    from ftlaunch.present.render import alternatives_table

    alts = [
        {"option": "ZeRO-3 CPU offload", "kind": "same-numbers", "peak_gib": 5.3, "host_gib": 202.0, "fits": False,
         "why": "needs 202 GiB host RAM, machine has 24", "change": {"deepspeed": "ds_z3_offload"}},
        {"option": "8-bit AdamW", "kind": "numerics", "peak_gib": 9.0, "host_gib": 0.0, "fits": True,
         "speed": "same", "change": {"optim": "adamw_bnb_8bit"}},
        {"option": "LoRA r=8", "kind": "method", "peak_gib": 6.5, "fits": True, "speed": "faster",
         "change": {"finetuning_type": "lora"}},
    ]  # fmt: skip
    text = render(alternatives_table(alts), 100)
    flat = " ".join(text.split())
    assert "needs 202 GiB host RAM, machine has 24" in flat
    assert flat.index("same numbers:") < flat.index("ZeRO-3") < flat.index("other numerics:") < flat.index("8-bit")
    assert flat.index("8-bit") < flat.index("other method/data:") < flat.index("LoRA")
    assert "optim=adamw_bnb_8bit" in flat and "(speed: faster)" in flat and "(speed: same)" not in flat


def test_error_messages_are_not_read_as_markup(tmp_path):
    # A path with brackets in a message must print as it is (rich would eat "[x]" as a style).
    bad = tmp_path / "cfg[v2].yaml"
    r = CliRunner().invoke(main, ["plan", str(bad)])
    assert r.exit_code == 3 and "cfg[v2].yaml" in "".join(r.output.split()), r.output


def test_train_json_keys_agree_between_help_and_the_docs():
    from pathlib import Path

    # train's reference moved from the README to docs/ (issue 41): the local keys there, Slurm's with the engines
    docs = Path(__file__).resolve().parents[2] / "docs"
    text = (docs / "commands-run.md").read_text() + (docs / "engines.md").read_text()
    help_text = " ".join(CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output.split())
    for keys in ('{"id", "run_dir", "pid"}', '{"id", "run_dir", "exit_code"}', '{"id", "run_dir", "slurm_job_id"}'):
        assert keys in help_text and keys in text, keys


def test_json_output_is_strict_even_with_a_nan_loss():
    from ftlaunch.files import to_json

    text = to_json({"loss": float("nan"), "lr": float("inf"), "rows": [1.0, float("-inf")], "ok": 0.5})
    assert json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) == {
        "loss": "nan", "lr": "inf", "rows": [1.0, "-inf"], "ok": 0.5,
    }  # fmt: skip


def test_plan_json_never_prints_a_secret_config_key(project):  # noqa: F811
    r = CliRunner().invoke(
        main, ["plan", str(project), "--gpu", "A10G", "--json", "hub_token=hf_abcdefghijklmnopqrstuvwx"]
    )
    assert r.exit_code == 0, r.output
    assert "hf_abcdefghijklmnopqrstuvwx" not in r.output and json.loads(r.output)["config"]["hub_token"] == "***"
