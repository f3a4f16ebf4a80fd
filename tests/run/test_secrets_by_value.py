"""Secrets by value, not by name (issue 40, item 1): one module (ftlaunch/run/secrecy.py) says what is
secret, and no such value leaves the user's process in anything ftlaunch writes or starts.

A real detached run of the scripted trainer (tests/fake_trainer.py) with a marker secret planted each
way: a FTLAUNCH_NOTIFY URL with ?token=, MY_DB_PASSWORD in the environment, HF_TOKEN, a secret config
key, a secret override, secret-looking YAML comments. While the trainer runs (it hangs at a step), its
/proc/PID/cmdline and environ and the supervisor's cmdline are read; then the run is stopped, bundled,
and every file under FTLAUNCH_HOME and the output_dir is grepped. A real local HTTP server is the
notification's destination (it gets the messages; they hold no marker). Slurm: `train --slurm` with a
stand-in sbatch that records the environment it was given (what --export=ALL hands the job).
"""

from __future__ import annotations

import http.server
import json
import os
import secrets
import stat
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from ftlaunch.run import secrecy
from ftlaunch.run.notify import NotifySpec, keep_spec, read_spec
from ftlaunch.run.ray.submit import job_env
from ftlaunch.run.slurm.sbatch import SlurmRequest, render_job
from ftlaunch.run.trainer import trainer_env

from ..conftest import child_env, venv_bin
from ..fake_trainer import install
from ..helpers import wait_for
from .test_e2e_secrets import holders


def mark(name: str) -> str:
    return f"{name}{secrets.token_hex(10)}"


def ftl(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=300)


class Hook(http.server.BaseHTTPRequestHandler):
    got: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        Hook.got.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hook():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    Hook.got = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


# ---------------------------------------------------------------- what is secret (pure)


def test_secret_names_by_their_parts_not_by_substrings():
    for name in ("HF_TOKEN", "MY_DB_PASSWORD", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY", "SSH_KEY", "FTLAUNCH_NOTIFY"):
        assert secrecy.secret_name(name), name
    for name in ("TOKENIZERS_PARALLELISM", "PATH", "PWD", "GIT_AUTHOR_NAME", "HF_HOME", "KEYBOARD"):
        assert not secrecy.secret_name(name), name


def test_url_credentials_and_env_values_are_secrets_by_value():
    url = "https://bob:s3cretpw@hooks.example.org/hook?event=all&token=T0KENVALUE&sig=abcdef12"
    assert set(secrecy.url_secrets(f"see {url} now")) == {"s3cretpw", "T0KENVALUE", "abcdef12"}
    assert secrecy.url_secrets("https://example.org/x?page=2&lang=en") == []
    env = {
        "FTLAUNCH_NOTIFY": "http://h/a?token=AAAA1111 json://h/b",
        "MY_DB_PASSWORD": "hunter2xyz",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",  # a flag: nothing to mask
        "HTTPS_PROXY": "http://u:proxypass@proxy:3128",  # a plain name whose value holds a password
        "PATH": "/usr/bin",
    }
    found = secrecy.env_secret_values(env)
    for v in ("http://h/a?token=AAAA1111", "json://h/b", "AAAA1111", "hunter2xyz", "proxypass"):
        assert v in found, v
    assert "1" not in found and "/usr/bin" not in found
    assert secrecy.public_env(env)["MY_DB_PASSWORD"] == "***" and secrecy.public_env(env)["PATH"] == "/usr/bin"


def test_scrub_masks_secret_comments_and_keeps_every_other_byte():
    text = (
        "# db password: hunter2xyz\n"
        "stage: sft   # the usual\n"
        "hub_token: hf_abcdefghijklmnopqrstuvwx  # token=tok12345\n"
        "data_url: https://u:pw12345678@data.example.org/set?api_key=k3y12345&split=train\n"
        "cutoff_len: 1024  # 1024 tokens: enough\n"
        "\ttabs and trailing space   \n"
    )
    want = (
        "# db password: ***\n"
        "stage: sft   # the usual\n"
        "hub_token: ***  # token=***\n"
        "data_url: https://u:***@data.example.org/set?api_key=***&split=train\n"
        "cutoff_len: 1024  # 1024 tokens: enough\n"
        "\ttabs and trailing space   \n"
    )
    assert secrecy.scrub(text.encode(), ()).decode() == want
    assert secrecy.scrub(want.encode(), ()) == want.encode()  # scrubbed text stays as it is


def test_scrub_masks_every_secret_phrase_of_a_long_one_line_comment():
    """A stacks dump or a log can be one long line: each secret phrase after its `#` is masked, the
    rest kept (scripts/bench_scrub.py times it: the rule was quadratic in the line's length)."""
    filler = "x = 1; " * 2000
    line = f"code()  # {filler} password: pw1secret {filler} # token=tok2secret {filler}"
    got = secrecy.scrub(line.encode(), ()).decode()
    assert "pw1secret" not in got and "tok2secret" not in got
    assert got == line.replace("pw1secret", "***").replace("tok2secret", "***")


def test_the_trainer_env_has_no_notification_setting_and_the_ray_job_env_no_secret_value():
    env = {
        "PATH": "/usr/bin",
        "FTLAUNCH_NOTIFY": "http://127.0.0.1:9/hook?token=MARKER123",
        "FTLAUNCH_HOME": "/h",
        "HF_TOKEN": "hf_" + "a" * 30,
        "HF_ENDPOINT": "https://user:mirrorpass@mirror.example.org",
        "WANDB_PROJECT": "p",
        "WANDB_NOTES": "run with hunter2xyz",  # holds the value of a secret variable
        "MY_DB_PASSWORD": "hunter2xyz",
        "TOKENIZERS_PARALLELISM": "false",
    }
    child = trainer_env(env, {"NPROC_PER_NODE": "1"})
    assert "FTLAUNCH_NOTIFY" not in child and child["HF_TOKEN"] == env["HF_TOKEN"]  # its credential stays
    job = job_env(env, {"NPROC_PER_NODE": "1", "SOME_API_KEY": "x" * 8}, "/venv/bin/python", ["sEcReTfromjson"])
    text = json.dumps(job)
    for value in ("MARKER123", "hf_aaaa", "mirrorpass", "hunter2xyz", "x" * 8):
        assert value not in text, value
    assert job["TOKENIZERS_PARALLELISM"] == "false" and job["WANDB_PROJECT"] == "p" and job["NPROC_PER_NODE"] == "1"
    assert secrecy.job_env({"WANDB_NOTES": "a sEcReTfromjson b"}, ["sEcReTfromjson"]) == {}


def test_an_sbatch_arg_with_a_secret_is_refused_by_name(tmp_path):
    from ftlaunch.errors import ConfigError

    req = SlurmRequest(1, 0, sbatch_args=("--export=ALL,MY_DB_PASSWORD=hunter2xyz",))
    with pytest.raises(ConfigError) as exc:
        render_job(tmp_path / "run", "RID", "n", req, "/venv/bin/python", ["cli"], {"FTLAUNCH_HOME": "/h"})
    assert "hunter2xyz" not in str(exc.value) and "--export" in str(exc.value)
    ok = render_job(tmp_path / "run", "RID", "n", SlurmRequest(1, 0), "/p", ["cli"], {"FTLAUNCH_HOME": "/h"})
    assert "export FTLAUNCH_HOME=/h" in ok.script


def test_a_kept_ftlaunch_notify_reaches_the_jobs_supervisor_and_survives_resume_notify(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    url = "http://127.0.0.1:9/hook?token=MARKERKEPT"
    from ftlaunch.run.store import keep_notify_secrets, read_secrets

    keep_notify_secrets(run_dir, {"FTLAUNCH_NOTIFY": url})
    job = {"FTLAUNCH_HOME": str(tmp_path / "home")}  # the job's env: no FTLAUNCH_NOTIFY
    assert url in read_spec(run_dir, job).urls
    keep_spec(run_dir, NotifySpec(urls=("http://127.0.0.1:9/other",)))  # resume --notify: the kept one stays
    assert set(read_spec(run_dir, job).urls) == {url, "http://127.0.0.1:9/other"}
    assert stat.S_IMODE((run_dir / "secrets.json").stat().st_mode) == 0o600
    assert url in json.dumps(read_secrets(run_dir))


# ---------------------------------------------------------------- a real run


CONFIG = """# db password: {comment}
stage: sft
do_train: true
output_dir: {out}
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
hub_token: {hub}   # token={trailing}
"""


def test_no_marker_leaves_the_users_process_in_a_real_local_run(tmp_path, isolated_home, hook):
    m = {k: mark(k) for k in ("NOTIFYTOK", "DBPASS", "COMMENT", "TRAILING", "KEYHUB", "OVERRIDE")}
    hf = "hf_" + secrets.token_hex(16)
    out = tmp_path / "out"
    cfg = tmp_path / "c.yaml"
    text = CONFIG.format(comment=m["COMMENT"], out=out, hub=m["KEYHUB"], trailing=m["TRAILING"])
    cfg.write_text(text)
    script = [{"print_env": "MY_DB_PASSWORD", "train": True, "steps": 12, "save_steps": 4, "hang_at": 3}]
    env = child_env(
        FTLAUNCH_NOTIFY=f"http://127.0.0.1:{hook}/hook?token={m['NOTIFYTOK']}",
        MY_DB_PASSWORD=m["DBPASS"],
        HF_TOKEN=hf,
        FTLAUNCH_LLAMAFACTORY_CLI=str(install(tmp_path)),
        FAKE_TRAINER_COUNTER=str(tmp_path / "counter"),
        FAKE_TRAINER_SCRIPT=json.dumps(script),
    )
    r = ftl("train", str(cfg), f"swanlab_api_key={m['OVERRIDE']}", "--gpu", "A10G", "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    markers = [*m.values(), hf]
    try:
        wait_for(lambda: "hanging" in (run_dir / "train.log").read_text(), "the trainer to reach its hang", 120)
        state = json.loads((run_dir / "state.json").read_text())
        tpid, spid = state["trainer_pid"], state["pid"]
        cmdlines = Path(f"/proc/{tpid}/cmdline").read_bytes() + Path(f"/proc/{spid}/cmdline").read_bytes()
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{tpid}/environ").read_bytes().decode().split("\0") if v)
    finally:
        stopped = ftl("stop", run_dir.name, env=env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not [v for v in markers if v.encode() in cmdlines]  # ps shows no secret
    # The trainer has what it needs: hub_token as HF_TOKEN, the override as SWANLAB_API_KEY (issue 24),
    # the user's own variables; never the notification settings (they stay with the supervisor).
    assert "FTLAUNCH_NOTIFY" not in environ and not [k for k, v in environ.items() if m["NOTIFYTOK"] in v]
    assert environ["HF_TOKEN"] == m["KEYHUB"] and environ["SWANLAB_API_KEY"] == m["OVERRIDE"]
    assert environ["MY_DB_PASSWORD"] == m["DBPASS"]
    assert not [k for k, v in environ.items() if m["COMMENT"] in v or m["TRAILING"] in v]

    wait_for(lambda: json.loads((run_dir / "state.json").read_text())["status"] == "stopped", "stopped", 120)
    notified = wait_for(
        lambda: [
            e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
            if e["event"] == "notified" and e.get("notice") == "stopped"
        ],
        "the stop's notification",
        120,
    )  # fmt: skip
    assert notified[0]["ok"], notified
    assert len(Hook.got) >= 2 and not [b for b in Hook.got if any(v.encode() in b for v in markers)]
    assert "printed ***" in (run_dir / "train.log").read_text()  # MY_DB_PASSWORD's value, masked by value

    bundle = tmp_path / "b.tar.gz"
    r = ftl("bundle", run_dir.name, "-o", str(bundle), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(bundle) as tar:
        members = {t.name.split("/", 1)[1]: tar.extractfile(t).read() for t in tar.getmembers() if t.isfile()}
    assert not [n for n, data in members.items() if any(v.encode() in data for v in markers)]

    # source.yaml: the config as given, byte for byte, but its secrets
    want = CONFIG.format(comment="***", out=out, hub="***", trailing="***")
    assert (run_dir / "source.yaml").read_text() == want and members["source.yaml"].decode() == want
    found = holders(markers, isolated_home, out)
    assert [p.name for p in found] == ["secrets.json"], found
    assert stat.S_IMODE(found[0].stat().st_mode) == 0o600
    assert json.loads(found[0].read_text()) == {"hub_token": m["KEYHUB"], "swanlab_api_key": m["OVERRIDE"]}


def test_slurm_neither_writes_nor_exports_a_notification_secret(tmp_path, isolated_home):
    """`train --slurm` with a stand-in sbatch that writes down its arguments and its environment (what
    sbatch's default --export=ALL hands the job); the job's supervisor finds FTLAUNCH_NOTIFY's URL in
    the run's secrets.json instead."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text('#!/bin/sh\nd="$(dirname "$0")"\necho "$@" > "$d/args"\nenv > "$d/env"\necho 4242\n')
    (bindir / "sbatch").chmod(0o755)
    token, dbpass = mark("SLURMTOK"), mark("DBPASS")
    url = f"http://127.0.0.1:9/hook?token={token}"
    env = child_env(
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        FTLAUNCH_LLAMAFACTORY_CLI=str(install(tmp_path)),
        FTLAUNCH_NOTIFY=url,
        MY_DB_PASSWORD=dbpass,
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"# password={dbpass}\nstage: sft\ndo_train: true\noutput_dir: {tmp_path / 'out'}\n")
    r = ftl("train", str(cfg), "--slurm", "--nodes", "2", "--gpu", "none", "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    exported = (bindir / "env").read_text()
    assert "FTLAUNCH_NOTIFY" not in exported and token not in exported
    assert f"MY_DB_PASSWORD={dbpass}" in exported  # the user's own variables reach the job, as sbatch passes them
    found = holders([token, dbpass], isolated_home, bindir.parent / "out", run_dir)
    assert sorted({p.name for p in found}) == ["secrets.json"], found
    job = {k: v for k, v in env.items() if k != "FTLAUNCH_NOTIFY"}
    assert url in read_spec(run_dir, job).urls  # what the job's supervisor will notify
