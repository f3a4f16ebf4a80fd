# ruff: noqa: F811  (the imported `fake` fixture is taken as a parameter)
"""The trainer's environment recorded per attempt and checked on every restart (issue 25), with the
scripted trainer (tests/fake_trainer.py) run by the real supervisor; the site-packages reader on
folders laid out as a venv and a plain install are."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from ftlaunch.files import write_json_atomic
from ftlaunch.run.environment import attempt_path, read_environment, site_dirs, trainer_interpreter
from ftlaunch.run.store import read_events, read_state
from ftlaunch.run.supervisor import Supervisor

from ..conftest import needs_train_stack
from ..fake_trainer import write_config
from .test_reliability import cli, fake, starts  # noqa: F401  (fake: the scripted trainer, a fixture)

CRASH_AFTER_CKPT = {"train": True, "steps": 8, "save_steps": 4, "crash_after_saves": 1}


def dist(site: Path, name: str, version: str, direct_url: dict | None = None) -> None:
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nlong description\n")
    if direct_url:
        (d / "direct_url.json").write_text(json.dumps(direct_url))


def test_a_venv_is_read_from_its_prefix_and_the_base_with_system_site_packages(tmp_path):
    base = tmp_path / "base"
    dist(base / "lib" / "python3.11" / "site-packages", "six", "1.16.0")
    dist(base / "lib" / "python3.11" / "site-packages", "torch", "2.0.0")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    site = venv / "lib" / "python3.11" / "site-packages"
    dist(site, "torch", "2.6.0")
    dist(site, "LLaMA_Factory", "0.9.6.dev0", {"url": "file:///src/lf", "dir_info": {"editable": True}})
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text("__version__ = '2.6.0'\ncuda: Optional[str] = '12.4'\n")
    cfg = f"home = {base / 'bin'}\ninclude-system-site-packages = false\nversion = 3.11.7\n"
    (venv / "pyvenv.cfg").write_text(cfg)
    e = read_environment(str(venv / "bin" / "python"), {}, gpus=False)
    assert e.packages == {"torch": "2.6.0", "llama-factory": "0.9.6.dev0"} and e.python_version == "3.11.7"
    assert e.sources["llama-factory"]["dir_info"] == {"editable": True} and e.system["torch_cuda"] == "12.4"
    (venv / "pyvenv.cfg").write_text(cfg.replace("false", "true"))
    e = read_environment(str(venv / "bin" / "python"), {}, gpus=False)
    assert e.packages == {"torch": "2.6.0", "llama-factory": "0.9.6.dev0", "six": "1.16.0"}  # the venv's torch wins


def test_a_plain_install_reads_the_user_site_first(tmp_path):
    prefix = tmp_path / "usr"
    (prefix / "bin").mkdir(parents=True)
    dist(prefix / "lib" / "python3.12" / "site-packages", "six", "1.16.0")
    dist(tmp_path / "home" / ".local" / "lib" / "python3.12" / "site-packages", "six", "1.17.0")
    dirs, version = site_dirs(str(prefix / "bin" / "python3.12"), {"HOME": str(tmp_path / "home")})
    assert version == "3.12" and dirs[0].parts[-5:-3] == ("home", ".local")
    assert (
        read_environment(str(prefix / "bin" / "python3.12"), {"HOME": str(tmp_path / "home")}, gpus=False).packages[
            "six"
        ]
        == "1.17.0"
    )


def test_the_trainer_interpreter_is_its_shebang(tmp_path):
    cli = tmp_path / "llamafactory-cli"
    cli.write_text(f"#!{sys.executable}\nimport llamafactory\n")
    cli.chmod(0o755)
    assert trainer_interpreter({"FTLAUNCH_LLAMAFACTORY_CLI": str(cli)}) == sys.executable


def test_nvml_gives_driver_cuda_and_gpus():
    from ftlaunch.run.environment import nvml_system

    class Mem:
        total = 24 * 2**30

    class FakeNvml:
        def nvmlInit(self): ...
        def nvmlShutdown(self): ...
        def nvmlSystemGetCudaDriverVersion(self):
            return 12040

        def nvmlSystemGetDriverVersion(self):
            return b"550.54.15"

        def nvmlSystemGetNVMLVersion(self):
            return "12.550.54.15"

        def nvmlDeviceGetCount(self):
            return 1

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetName(self, h):
            return b"NVIDIA A10G"

        def nvmlDeviceGetMemoryInfo(self, h):
            return Mem()

    assert nvml_system(FakeNvml) == {
        "driver": "550.54.15",
        "cuda_driver": "12.4",
        "nvml": "12.550.54.15",
        "gpus": ["NVIDIA A10G (24576 MiB)"],
    }

    def missing():
        raise ImportError("no pynvml")

    assert nvml_system(missing) == {"why": "NVML unavailable: no pynvml"}


# ---------------------------------------------------------------- runs


def edit_recorded(run_dir: Path, attempt: int, **versions: str) -> None:
    path = attempt_path(run_dir, attempt)
    rec = json.loads(path.read_text())
    rec["packages"].update(versions)
    write_json_atomic(path, rec)


def failed_with_a_checkpoint(tmp_path: Path, fake, home: Path) -> Path:
    """A run whose first attempt saved checkpoint-4 and crashed, then failed on a config error."""
    fake(CRASH_AFTER_CKPT, {"config_error": "Undefined dataset x"})
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground")
    assert r.exit_code == 1, r.output
    (run_dir,) = [p for p in (home / "runs").iterdir() if not p.name.startswith(".")]
    return run_dir


@needs_train_stack
def test_every_attempt_records_the_trainer_environment(tmp_path, fake, isolated_home):
    run_dir = failed_with_a_checkpoint(tmp_path, fake, isolated_home)
    one, two = (json.loads(attempt_path(run_dir, n).read_text()) for n in (1, 2))
    assert one["attempt"] == 1 and one["hash"] == two["hash"] and one["python"] == sys.executable
    assert one["packages"]["llamafactory"] and one["packages"]["torch"] and len(one["packages"]) > 50
    recorded = [e for e in read_events(run_dir) if e["event"] == "environment"]
    assert [e["attempt"] for e in recorded] == [1, 2] and all(e["ms"] < 1000 for e in recorded)
    assert read_state(run_dir).environment["hash"] == one["hash"]
    assert not [e for e in read_events(run_dir) if e["event"] == "environment_changed"]


@needs_train_stack
def test_resume_after_a_deciding_package_changed_is_refused_with_the_table(tmp_path, fake, isolated_home):
    run_dir = failed_with_a_checkpoint(tmp_path, fake, isolated_home)
    now = json.loads(attempt_path(run_dir, 2).read_text())["packages"]
    edit_recorded(run_dir, 2, transformers="4.49.0", six="0.1")  # as if trained with another stack
    fake({"train": True, "steps": 8, "save_steps": 4})
    r = cli("resume", run_dir.name, "--foreground")
    assert r.exit_code == 18, r.output
    row = next(line.split() for line in r.output.splitlines() if line.strip().startswith("transformers"))
    assert row == ["transformers", "4.49.0", now["transformers"]]
    assert "--allow-env-change" in r.output and "checkpoint-4" in r.output and "six" not in r.output
    assert starts(tmp_path) == 2 and read_state(run_dir).status == "failed"  # nothing started or changed

    r = cli("resume", run_dir.name, "--foreground", "--allow-env-change")
    assert r.exit_code == 0, r.output
    assert starts(tmp_path) == 3 and read_state(run_dir).status == "succeeded"
    changed = [e for e in read_events(run_dir) if e["event"] == "environment_changed"]
    assert len(changed) == 1 and changed[0]["attempt"] == 3 and not changed[0]["refused"]
    assert changed[0]["deciding"] == [{"what": "transformers", "before": "4.49.0", "after": now["transformers"]}]
    assert [d["what"] for d in changed[0]["other"]] == ["six"]
    status = cli("status", run_dir.name)
    line = f"environment changed at attempt 3 (transformers 4.49.0 -> {now['transformers']})"
    assert line in " ".join(status.output.split()).replace("│", "") or line in status.output
    assert json.loads(cli("status", run_dir.name, "--json").output)["environment_changed"] == line
    # resumed again: the last attempt trained with today's stack, no consent needed
    assert cli("resume", run_dir.name, "--foreground").exit_code == 0


def test_only_other_packages_changed_resumes_and_lists_them_in_the_events(tmp_path, fake, isolated_home):
    run_dir = failed_with_a_checkpoint(tmp_path, fake, isolated_home)
    edit_recorded(run_dir, 2, six="0.1")
    fake({"train": True, "steps": 8, "save_steps": 4})
    assert cli("resume", run_dir.name, "--foreground").exit_code == 0
    (changed,) = [e for e in read_events(run_dir) if e["event"] == "environment_changed"]
    assert changed["deciding"] == [] and changed["other"][0]["what"] == "six"
    assert json.loads(cli("status", run_dir.name, "--json").output)["environment_changed"] is None


def test_a_change_between_two_attempts_of_one_supervisor_ends_the_run_env_changed(tmp_path, fake, isolated_home):
    """Someone upgraded a deciding package while the run trained: the recovery attempt is not started."""
    fake({**CRASH_AFTER_CKPT, "step_sleep": 0.4}, {"train": True, "steps": 8, "save_steps": 4})
    from ftlaunch.plan.hardware import catalog_hardware  # noqa: F401  (the plan's card below)
    from ftlaunch.run.launch import create_run
    from ftlaunch.run.options import SupervisorSettings
    from ftlaunch.run.policy import RecoveryPolicy
    from ftlaunch.run.prepare import PlanRequest, make_plan

    env = dict(os.environ)
    loaded, p = make_plan(PlanRequest(config=str(write_config(tmp_path)), gpu="A10G"), env)
    policy = RecoveryPolicy.from_options(max_retries=3, max_crash_retries=2)
    run_dir = create_run(loaded, p, env, SupervisorSettings(policy=policy))

    def upgrade_during_attempt_1() -> None:
        deadline = time.monotonic() + 30
        while not attempt_path(run_dir, 1).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        edit_recorded(run_dir, 1, peft="0.0.1")

    t = threading.Thread(target=upgrade_during_attempt_1)
    t.start()
    code = Supervisor(run_dir, env, poll=0.05).run()
    t.join()
    st = read_state(run_dir)
    assert code == 18 and st.status == "env_changed" and st.failure_kind == "env_changed"
    assert starts(tmp_path) == 1 and st.attempt == 1 and not attempt_path(run_dir, 2).exists()
    assert "peft 0.0.1 ->" in st.message and "--allow-env-change" in st.message
    assert st.environment["changed"]["accepted"] is False
    assert (
        "not resumed (resume --allow-env-change)"
        in json.loads(cli("status", run_dir.name, "--json").output)["environment_changed"]
    )
    assert cli("resume", run_dir.name, "--foreground").exit_code == 18
    assert cli("resume", run_dir.name, "--foreground", "--allow-env-change").exit_code == 0
    assert read_state(run_dir).status == "succeeded" and starts(tmp_path) == 2


@needs_train_stack
def test_env_lock_and_diff_of_runs(tmp_path, fake, isolated_home):
    run_dir = failed_with_a_checkpoint(tmp_path, fake, isolated_home)
    out = tmp_path / "req.txt"
    r = cli("env", "--lock", run_dir.name, "-o", str(out))
    assert r.exit_code == 0, r.output
    text = out.read_text()
    lines = [x for x in text.splitlines() if x and not x.startswith("#")]
    rec = json.loads(attempt_path(run_dir, 2).read_text())
    assert f"transformers=={rec['packages']['transformers']}" in lines and len(lines) > 50
    assert all("==" in x or " @ " in x for x in lines) and "--index-url" not in text and str(Path.home()) not in text
    assert cli("env", "--lock").output == text  # default: the latest run, on stdout
    same = cli("env", "--diff", run_dir.name)
    assert same.exit_code == 0 and "the same environment" in same.output
    edit_recorded(run_dir, 2, transformers="4.49.0")
    d = json.loads(cli("env", "--diff", run_dir.name, "--json").output)
    assert d["deciding"] == [{"what": "transformers", "before": "4.49.0", "after": rec["packages"]["transformers"]}]
    assert d["before"] == f"run {run_dir.name}" and d["after"] == "this machine now"
    assert "transformers" in cli("env", "--diff", run_dir.name).output
    assert cli("env", "--lock", run_dir.name, "--json").exit_code == 2
