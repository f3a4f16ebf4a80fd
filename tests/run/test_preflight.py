"""The preflight: LLaMA-Factory's own parser on the adapted config before `train` starts anything.

Fast lane: the pure parts and the shell with a scripted child Python (cache, secrets, skip). End-to-end
lane: the real child in the venv's Python (llamafactory 0.9.5) on emulated cards, and `train` / `plan
--check` refused with LLaMA-Factory's message verbatim, nothing created, no trainer started.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ftlaunch.errors import ConfigError, ExitCode
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.planner import Plan
from ftlaunch.run.preflight import (
    cache_key,
    card_of,
    check_configs,
    parse_env,
    preflight,
    refusal_error,
    require,
    trainer_python,
    verdict_of,
)

from ..conftest import EXAMPLES, child_env, have_llamafactory, tiny_config, venv_bin, write_yaml

LF_REFUSAL = "`train_on_prompt` or `mask_history` cannot be set as True except SFT."


def a_plan(hw_spec: str = "none", env: dict | None = None, **config) -> Plan:
    hw = catalog_hardware(hw_spec)
    cfg = {"model_name_or_path": "m", "stage": "sft", "do_train": True, "dataset": "d", "output_dir": "o", **config}
    return Plan(
        config=cfg,
        env=env or {},
        changes=(),
        hardware=hw,
        world_size=hw.world_size,
        precision="fp32",
        global_batch_source=8,
        global_batch_target=8,
        micro_batch=8,
        accumulation=1,
    )


def children(home: Path) -> list[dict]:
    log = home / "cache" / "preflight" / "children.jsonl"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


# ---------------------------------------------------------------- pure parts


def test_the_card_is_the_plans_hardware():
    card = card_of(catalog_hardware("A100-80GBx4"))
    assert card == {"name": "NVIDIA A100-SXM4-80GB", "count": 4, "cc": [8, 0], "total_mib": 81920, "driver": None}
    assert card_of(catalog_hardware("V100-32GB"))["cc"] == [7, 0]
    assert card_of(catalog_hardware("none")) is None


def test_the_parse_env_is_what_llamafactory_reads():
    caller = {"PATH": "/bin", "HF_TOKEN": "hf_secret", "CUDA_VISIBLE_DEVICES": "", "USE_V1": "1", "ACCELERATE_X": "y"}
    penv = parse_env(caller, {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"})
    assert penv == {"ACCELERATE_X": "y", "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4", "USE_V1": "1"}
    # the caller's CUDA_VISIBLE_DEVICES was applied by the probe; the plan's is what the trainer gets
    assert parse_env(caller, {"CUDA_VISIBLE_DEVICES": "0,1"})["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_the_cache_key_follows_config_env_card_and_trainer():
    card = card_of(catalog_hardware("T4"))
    base = cache_key("stage: sft\n", {}, card, "lf-0.9.5")
    assert base == cache_key("stage: sft\n", {}, card, "lf-0.9.5")
    assert base != cache_key("stage: pt\n", {}, card, "lf-0.9.5")
    assert base != cache_key("stage: sft\n", {"NPROC_PER_NODE": "2"}, card, "lf-0.9.5")
    assert base != cache_key("stage: sft\n", {}, card_of(catalog_hardware("A100-80GB")), "lf-0.9.5")
    assert base != cache_key("stage: sft\n", {}, card, "lf-0.9.6")
    assert base != cache_key("stage: sft\n", {}, card, "lf-0.9.5", assume=True)


def test_a_refusal_is_a_config_error_with_llamafactorys_message_verbatim():
    v = verdict_of(
        {"verdict": "refused", "message": LF_REFUSAL, "exception": "ValueError", "where": "llamafactory/x.py:1"},
        "0.9.5",
        1.0,
    )
    err = refusal_error(v)
    assert isinstance(err, ConfigError) and err.exit_code == ExitCode.CONFIG
    assert LF_REFUSAL in err.message and "0.9.5" in err.message
    with pytest.raises(ConfigError, match="cannot be set as True except SFT"):
        require(v)
    require(verdict_of({"verdict": "ok"}, "0.9.5", 1.0))  # ok passes
    # the emulation failing is no verdict: skipped, never a refusal
    assert verdict_of({"verdict": "error", "message": "boom", "exception": "AttributeError"}, "0.9.5", 1.0).status == (
        "skipped"
    )


# ---------------------------------------------------------------- the shell, with a scripted child


def scripted_python(tmp_path: Path, verdict: dict) -> Path:
    """A 'Python' that runs no llamafactory: it records the spec it got and answers ``verdict``."""
    script = tmp_path / "fake-python"
    record = tmp_path / "spec-seen.json"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, stat, sys\n"
        "spec_path, out_path = sys.argv[2], sys.argv[3]\n"
        "spec = json.load(open(spec_path))\n"
        "mode = stat.S_IMODE(os.stat(spec_path).st_mode)\n"
        f"json.dump({{'spec': spec, 'mode': mode, 'path': spec_path}}, open({str(record)!r}, 'w'))\n"
        f"json.dump({{'llamafactory': '0.9.5', 'results': [{json.dumps(verdict)}]}}, open(out_path, 'w'))\n"
    )
    script.chmod(0o755)
    return script


def test_a_second_preflight_of_the_same_plan_spawns_no_child(tmp_path, isolated_home):
    python = scripted_python(tmp_path, {"verdict": "refused", "message": LF_REFUSAL, "exception": "ValueError"})
    env = dict(os.environ)
    first = preflight(a_plan(), env, python=str(python))
    assert first.status == "refused" and first.message == LF_REFUSAL and not first.cached
    second = preflight(a_plan(), env, python=str(python))
    assert second.status == "refused" and second.message == LF_REFUSAL and second.cached
    assert len(children(isolated_home)) == 1  # one child for two preflights
    preflight(a_plan(learning_rate=1e-3), env, python=str(python))  # another config: checked again
    preflight(a_plan("T4"), env, python=str(python))  # another card: checked again
    assert len(children(isolated_home)) == 3
    assert list((isolated_home / "cache" / "preflight").glob("*.json"))


def test_secrets_reach_the_child_only_in_a_0600_file_that_is_removed(tmp_path, isolated_home):
    python = scripted_python(tmp_path, {"verdict": "ok"})
    v = preflight(a_plan(hub_token="hf_verysecret123"), dict(os.environ), python=str(python))
    assert v.ok
    seen = json.loads((tmp_path / "spec-seen.json").read_text())
    assert "hub_token: hf_verysecret123" in seen["spec"]["items"][0]["yaml"]  # what the trainer reads
    assert seen["mode"] == 0o600 and not Path(seen["path"]).exists()
    for f in (isolated_home / "cache").rglob("*"):
        if f.is_file():
            assert "hf_verysecret123" not in f.read_text()


def test_without_the_trainers_python_the_check_is_skipped_with_a_warning(tmp_path, isolated_home, monkeypatch):
    stand_in = tmp_path / "llamafactory-cli"
    stand_in.write_text("#!/bin/sh\necho not the real one\n")
    stand_in.chmod(0o755)
    monkeypatch.setenv("FTLAUNCH_LLAMAFACTORY_CLI", str(stand_in))
    said = []
    v = preflight(a_plan(), dict(os.environ), say=said.append)
    assert v.status == "skipped" and said and said[0].startswith("preflight skipped")
    assert trainer_python(dict(os.environ)) is None
    require(v)  # skipped never refuses


def test_the_trainers_python_is_llamafactory_clis_shebang(tmp_path, monkeypatch):
    cli = tmp_path / "llamafactory-cli"
    cli.write_text(f"#!{sys.executable}\nimport sys\nfrom llamafactory.cli import main\nsys.exit(main())\n")
    cli.chmod(0o755)
    monkeypatch.setenv("FTLAUNCH_LLAMAFACTORY_CLI", str(cli))
    assert trainer_python(dict(os.environ)) == sys.executable


def test_a_child_that_cannot_run_skips_the_check(tmp_path, isolated_home):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'llamafactory'\"; exit 1\n")
    broken.chmod(0o755)
    said = []
    v = preflight(a_plan(), dict(os.environ), python=str(broken), say=said.append)
    assert v.status == "skipped" and "cannot import llamafactory" in v.message
    assert not list((isolated_home / "cache" / "preflight").glob("*.json"))  # no verdict, nothing cached


# ---------------------------------------------------------------- end to end: the real child


def _need_lf():
    if not have_llamafactory():
        pytest.skip("the train extra (llamafactory) is not installed")


DS = EXAMPLES / "examples" / "deepspeed"
BASE = "model_name_or_path: Qwen/Qwen3-4B\nstage: sft\ndo_train: true\ndataset: alpaca_en_demo\ntemplate: qwen3\n"
A100X4 = card_of(catalog_hardware("A100-80GBx4"))
V100 = card_of(catalog_hardware("V100-32GB"))
V100X4 = card_of(catalog_hardware("V100-32GBx4"))
TORCHRUN4 = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}


@pytest.mark.e2e
def test_the_child_emulates_the_planned_card_and_launch():
    _need_lf()
    items = [
        ("lora-x4", "finetuning_type: lora\nbf16: true\nper_device_train_batch_size: 2\n"
         "gradient_accumulation_steps: 4\n", TORCHRUN4, A100X4),
        ("zero3-pure-bf16", f"finetuning_type: full\npure_bf16: true\ndeepspeed: {DS}/ds_z3_config.json\n",
         TORCHRUN4, A100X4),
        ("zero3-predict", f"finetuning_type: lora\nbf16: true\ndo_eval: true\nval_size: 0.1\n"
         f"predict_with_generate: true\ndeepspeed: {DS}/ds_z3_config.json\n", TORCHRUN4, A100X4),
        ("pure-bf16-v100", "finetuning_type: full\npure_bf16: true\n", {}, V100),
        ("bf16-v100", "finetuning_type: lora\nbf16: true\n", {}, V100),
        ("fp16-vs-ds-json", f"finetuning_type: full\nfp16: true\ndeepspeed: {DS}/ds_z3_fp8_config.json\n",
         TORCHRUN4, V100X4),
        ("one-process-on-4", "finetuning_type: lora\nbf16: true\nper_device_train_batch_size: 2\n"
         "gradient_accumulation_steps: 4\n", {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1"}, A100X4),
        ("cpu", "finetuning_type: lora\n", {}, None),
        ("torchrun-on-cpu", "finetuning_type: lora\n", {"FORCE_TORCHRUN": "1"}, None),
    ]  # fmt: skip
    spec = [{"id": i, "yaml": BASE + y, "env": e, "card": c} for i, y, e, c in items]
    out = check_configs(spec, dict(os.environ), assume_packages=True, timeout=300)
    r = {x["id"]: x for x in out["results"]}
    assert out["llamafactory"] == "0.9.5"
    assert r["lora-x4"]["verdict"] == "ok", r["lora-x4"]
    assert (r["lora-x4"]["world_size"], r["lora-x4"]["global_batch"], r["lora-x4"]["torchrun"]) == (4, 32, True)
    assert r["lora-x4"]["compute_dtype"] == "bfloat16" and r["lora-x4"]["parallel_mode"] == "distributed"
    assert r["zero3-pure-bf16"]["message"] == "`pure_bf16` is incompatible with DeepSpeed ZeRO-3."
    assert r["zero3-pure-bf16"]["where"] == "llamafactory/hparams/parser.py:385"
    assert r["zero3-predict"]["message"] == "`predict_with_generate` is incompatible with DeepSpeed ZeRO-3."
    assert r["pure-bf16-v100"]["message"] == "This device does not support `pure_bf16`."
    assert r["bf16-v100"]["message"].startswith("Your setup doesn't support bf16/gpu.")
    assert "ds fp16.enabled=False vs hf fp16|fp16_full_eval=True" in r["fp16-vs-ds-json"]["message"]
    # the first case: 4 GPUs but NPROC_PER_NODE=1 -> LLaMA-Factory sees one process
    assert (r["one-process-on-4"]["world_size"], r["one-process-on-4"]["global_batch"]) == (1, 8)
    assert r["cpu"]["verdict"] == "ok" and r["cpu"]["world_size"] == 1 and not r["cpu"]["torchrun"]
    assert r["torchrun-on-cpu"]["verdict"] == "refused" and "nproc_per_node 0" in r["torchrun-on-cpu"]["message"]
    assert "deepspeed" in r["zero3-pure-bf16"]["assumed"] or _has_deepspeed()


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def ftl(*args, env, timeout=300):
    r = subprocess.run([str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout)
    r.said = " ".join((r.stdout + r.stderr).split())  # the console wraps at its width
    return r


def recording_cli(tmp_path: Path) -> tuple[Path, Path]:
    """llamafactory-cli as installed (imports llamafactory), which first leaves a mark that it started."""
    mark = tmp_path / "trainer-started"
    cli = tmp_path / "bin" / "llamafactory-cli"
    cli.parent.mkdir()
    cli.write_text(
        f"#!{venv_bin() / 'python'}\nimport pathlib, sys\npathlib.Path({str(mark)!r}).write_text('started')\n"
        "from llamafactory.cli import main\nsys.exit(main())\n"
    )
    cli.chmod(cli.stat().st_mode | stat.S_IXUSR)
    return cli, mark


@pytest.mark.e2e
def test_train_refused_by_llamafactory_exits_3_creates_nothing_and_needs_no_child(tiny, tmp_path, isolated_home):
    """LLaMA-Factory's refusal of `train_on_prompt` outside SFT depends on the config alone: since issue 30
    the plan's rules (plan/rules.py config_refusals) say it verbatim before any preflight child starts,
    for train and `plan --check` alike (the child's cache is tested by the accepted case below)."""
    cli, mark = recording_cli(tmp_path)
    env = child_env(FTLAUNCH_LLAMAFACTORY_CLI=str(cli))
    cfg = write_yaml(tmp_path / "pt.yaml", tiny_config(tiny, tmp_path / "out", stage="pt", train_on_prompt=True))
    r = ftl("train", str(cfg), "--foreground", env=env)
    assert r.returncode == 3, r.stdout + r.stderr
    assert LF_REFUSAL in r.said and "Traceback" not in r.stderr
    runs = isolated_home / "runs"
    assert not runs.exists() or not [p for p in runs.iterdir() if not p.name.startswith(".")]
    assert not mark.exists() and not (tmp_path / "out").exists()  # no trainer, no output_dir
    assert len(children(isolated_home)) == 0  # no preflight child was needed
    checked = ftl("plan", str(cfg), "--check", env=env)
    assert checked.returncode == 3 and LF_REFUSAL in checked.said
    assert len(children(isolated_home)) == 0
    assert not mark.exists()


@pytest.mark.e2e
def test_plan_check_says_ok_then_answers_from_the_cache(tiny, tmp_path, isolated_home):
    _need_lf()
    env = child_env()
    cfg = write_yaml(tmp_path / "ok.yaml", tiny_config(tiny, tmp_path / "out"))
    r = ftl("plan", str(cfg), "--check", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "accepts the adapted config" in r.said
    j = ftl("plan", str(cfg), "--check", "--json", env=env)
    assert j.returncode == 0, j.stderr
    verdict = json.loads(j.stdout)["preflight"]
    assert verdict["status"] == "ok" and verdict["cached"] is True and verdict["llamafactory"] == "0.9.5"
    assert len(children(isolated_home)) == 1
    # for a catalog card the card is emulated in the child: bf16 kept on an A100, LLaMA-Factory agrees
    a100 = ftl("plan", str(cfg), "--check", "--gpu", "A100-80GB", "--json", env=env)
    assert a100.returncode == 0, a100.stderr
    out = json.loads(a100.stdout)
    assert out["config"]["bf16"] is True and out["preflight"]["status"] == "ok"
    assert len(children(isolated_home)) == 2
