"""`ftlaunch bundle`: a real run of the scripted trainer (tests/fake_trainer.py) that crashes after a
checkpoint and then fails on its config, with secrets given three ways (HF_TOKEN in the environment,
hub_token in the YAML, swanlab_api_key on the command line) and one more dropped into stacks/ by hand
(a file the supervisor never redacts). The archive is opened and every member grepped."""

from __future__ import annotations

import json
import secrets
import subprocess
import tarfile

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.run.bundle import tail
from ftlaunch.run.secrecy import scrub, secret_values
from ftlaunch.run.store import RunFolder

from ..conftest import child_env, tiny_config, venv_bin, write_yaml
from ..fake_trainer import write_config
from ..helpers import said, wait_for
from .test_reliability import fake  # noqa: F401  (the scripted trainer, in-process)


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_scrub_masks_values_token_shapes_and_secret_keys():
    hub = "hf_" + "a1" * 15
    data = (
        f"url https://u:{'s3cr3tvalue'}@example.org/x\nhub_token: abcdef123\n"
        f'{{"swanlab_api_key": "zzzz9999", "loss": 1.5}}\nfound {hub} here\nlearning_rate: 1e-4\n'
    ).encode()
    out = scrub(data, ["s3cr3tvalue"]).decode()
    assert "s3cr3tvalue" not in out and "abcdef123" not in out and "zzzz9999" not in out and hub not in out
    assert "hub_token: ***" in out and '"swanlab_api_key": "***"' in out and "learning_rate: 1e-4" in out
    assert '"loss": 1.5' in out
    # nested secrets (notification URLs) and the secret variables of the environment, longest first
    notify = {"urls": ["json://h/tok-abcdef"], "cmd": "curl -d @- https://x/y", "on": ["failed", "started"]}
    vals = secret_values({"ftlaunch_notify": notify, "k": "tok-abcdef"}, {"HF_TOKEN": "hf_x1234", "PATH": "/bin"})
    assert vals == ["curl -d @- https://x/y", "json://h/tok-abcdef", "tok-abcdef", "hf_x1234"]  # no event names


def test_a_tail_starts_at_a_line_so_no_half_secret_is_kept():
    data = b"line one SECRETVALUE\nline two\nline three\n"
    cut, was_cut = tail(data, 20)
    assert was_cut and cut == b"line three\n"
    assert tail(data, 1000) == (data, False)


def test_the_bundle_of_a_failed_run_holds_what_a_report_needs_and_no_secret(tmp_path, fake, isolated_home, monkeypatch):  # noqa: F811
    env_token, yaml_token, key = (f"{p}{secrets.token_hex(12)}" for p in ("hf_", "hfy_", "sw_"))
    monkeypatch.setenv("HF_TOKEN", env_token)
    fake(
        {"print_env": "HF_TOKEN", "train": True, "steps": 8, "save_steps": 4, "crash_after_saves": 1},
        {"print_env": "SWANLAB_API_KEY", "config_error": "unknown key: bogus_key"},
    )
    cfg = write_config(tmp_path, hub_token=yaml_token)
    r = cli("train", str(cfg), f"swanlab_api_key={key}", "--gpu", "A10G", "--foreground")
    assert r.exit_code != 0, r.output
    run_dir = next(p for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    folder = RunFolder(run_dir)
    folder.stacks.mkdir(exist_ok=True)
    folder.stacks_of(1, "20260101T000000").write_text(f"Thread 1: main\n  env HF_TOKEN={env_token}\n  {key}\n")

    out = tmp_path / "bundles" / "b.tar.gz"
    r = cli("bundle", run_dir.name, "-o", str(out))
    assert r.exit_code == 0, r.output
    assert said(f"wrote {out}", r.output)
    with tarfile.open(out) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert all(m.name.startswith(f"ftlaunch-bundle-{run_dir.name}/") for m in tarfile.open(out).getmembers())

    print(f"\nbundle of a failed scripted run: {out.stat().st_size:,} bytes, {len(members)} members")
    leaks = {name for name, data in members.items() for s in (env_token, yaml_token, key) if s.encode() in data}
    assert leaks == set()
    assert "secrets.json" not in members and ".trainer-config.yaml" not in members
    expected = "plan.txt plan.json source.yaml config.yaml hardware.json state.json events.jsonl train.log"
    expected += " environment/attempt-1.json stacks/attempt-1-20260101T000000.txt"
    expected += " checkpoint/checkpoint-4/trainer_state.json summary.json SUMMARY.md MANIFEST.txt"
    for name in expected.split():
        assert name in members, (name, sorted(members))
    assert b"HF_TOKEN=***" in members["stacks/attempt-1-20260101T000000.txt"]
    assert b"printed ***" in members["train.log"]
    s = json.loads(members["summary.json"])
    assert s["failure"]["status"] == "failed" and s["failure"]["last_checkpoint"] == 4
    assert any("unknown key: bogus_key" in ln for ln in s["log_last_lines"])
    assert b"status: failed" in members["SUMMARY.md"] and b"secrets.json" in members["MANIFEST.txt"]
    assert members["plan.txt"] == folder.plan_text.read_bytes()  # the change table, as planned
    # the CLI's default name, in the working folder
    monkeypatch.chdir(tmp_path)
    r = cli("bundle")
    assert r.exit_code == 0, r.output
    assert (tmp_path / f"ftlaunch-bundle-{run_dir.name}.tar.gz").is_file()


@pytest.mark.e2e
def test_e2e_the_tiny_models_real_run_notifies_a_local_webhook_and_bundles_no_secret(tiny, tmp_path, isolated_home):
    """llamafactory-cli for real: HF_TOKEN in the environment, hub_token in the YAML, a webhook with a
    token in its path; the bundle holds the real checkpoint's trainer_state.json and none of the three."""
    from .test_notify import Hook

    env_token, yaml_token, hook_token = (f"{p}{secrets.token_hex(12)}" for p in ("hf_", "hfy_", "wh_"))
    hook = Hook()
    try:
        out = tmp_path / "out"
        cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out, hub_token=yaml_token))
        url = f"http://127.0.0.1:{hook.port}/{hook_token}"
        r = subprocess.run(
            [str(venv_bin() / "ftlaunch"), "train", str(cfg), "--foreground", "--notify", url],
            env=child_env(HF_TOKEN=env_token),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for(lambda: "succeeded" in hook.events(), "the succeeded message")
        assert hook.events() == ["started", "succeeded"]
        done = hook.got[-1][2]
        assert done["step"] == done["total_steps"] > 0 and isinstance(done["loss"], float) and done["loss_trend"]
        bundle = tmp_path / "b.tar.gz"
        b = subprocess.run(
            [str(venv_bin() / "ftlaunch"), "bundle", "-o", str(bundle)],
            env=child_env(HF_TOKEN=env_token),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert b.returncode == 0, b.stderr
        with tarfile.open(bundle) as tar:
            members = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        print(f"\nbundle of a real tiny-model run: {bundle.stat().st_size:,} bytes, {len(members)} members")
        for s in (env_token, yaml_token, hook_token):
            assert not [n for n, data in members.items() if s.encode() in data], s
            assert s not in r.stdout + r.stderr + b.stdout + b.stderr
        state = json.loads(next(v for k, v in members.items() if k.endswith("/trainer_state.json")))
        assert state["global_step"] > 0 and state["log_history"]
        assert json.loads(members["summary.json"])["failure"]["status"] == "succeeded"
    finally:
        hook.close()
