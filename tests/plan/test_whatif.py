"""What-if plans of configs written elsewhere (issue 30, item 1).

A config names the author's model by an absolute path on the author's machine. Planning it for another
machine (--gpu, --hardware) or sizing the model without its weights (--model-config, --params) is a
plan with a warning naming the path; `train` here, and a plain `plan` for this machine, still refuse it.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.plan.config import resolve_paths

from ..conftest import MODEL_CONFIGS
from ..helpers import said

QWEN = MODEL_CONFIGS / "qwen2.5-1.5b" / "config.json"


def _user_config(tmp_path, **extra: str):
    """A user's LoRA config as published: paths of the author's machine, none of them here."""
    lines = {
        "model_name_or_path": "/home/someone-else/models/Qwen2.5-1.5B-Instruct",
        "stage": "sft",
        "do_train": "true",
        "finetuning_type": "lora",
        "lora_target": "all",
        "dataset": "alpaca_en_demo",
        "template": "qwen",
        "cutoff_len": "1024",
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": "2",
        "gradient_accumulation_steps": "4",
        "bf16": "true",
        **extra,
    }
    p = tmp_path / "user.yaml"
    p.write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
    return p


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_plan_for_another_card_warns_of_the_missing_model_path(tmp_path):
    cfg = _user_config(tmp_path)
    r = _cli("plan", str(cfg), "--gpu", "A100-80GB", "--model-config", str(QWEN), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    named = [w for w in d["warnings"] if "/home/someone-else/models/Qwen2.5-1.5B-Instruct" in w]
    assert len(named) == 1 and "model_name_or_path" in named[0] and "--gpu A100-80GB" in named[0]
    assert d["memory"] is not None  # sized by --model-config
    assert d["config"]["model_name_or_path"] == "/home/someone-else/models/Qwen2.5-1.5B-Instruct"  # kept as written


def test_params_alone_make_it_a_what_if(tmp_path):
    cfg = _user_config(tmp_path)
    r = _cli("plan", str(cfg), "--params", "1.5B", "--json")
    assert r.exit_code == 0, r.output
    warnings = json.loads(r.output)["warnings"]
    assert any("model_name_or_path" in w and "--params 1.5B" in w for w in warnings)


def test_missing_adapter_deepspeed_and_checkpoint_are_warnings_too(tmp_path):
    cfg = _user_config(
        tmp_path,
        adapter_name_or_path="/home/someone-else/saves/lora-a,/home/someone-else/saves/lora-b",
        deepspeed="/home/someone-else/LLaMA-Factory/examples/deepspeed/ds_z3_config.json",
        resume_from_checkpoint="/home/someone-else/saves/checkpoint-500",
    )
    r = _cli("plan", str(cfg), "--gpu", "A100-80GBx4", "--model-config", str(QWEN), "--json")
    assert r.exit_code == 0, r.output
    warnings = _flat(" | ".join(json.loads(r.output)["warnings"]))
    assert "adapter_name_or_path: local path /home/someone-else/saves/lora-a does not exist" in warnings
    assert "deepspeed: file /home/someone-else/LLaMA-Factory/examples/deepspeed/ds_z3_config.json" in warnings
    assert "resume_from_checkpoint: /home/someone-else/saves/checkpoint-500 does not exist" in warnings


def test_the_hardware_file_is_a_what_if(tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"gpus": [{"index": 0, "name": "NVIDIA A100-SXM4-80GB", "total_mib": 81920}]}))
    r = _cli("plan", str(_user_config(tmp_path)), "--hardware", str(hw), "--json")
    assert r.exit_code == 0, r.output
    assert any("--hardware" in w and "model_name_or_path" in w for w in json.loads(r.output)["warnings"])


def test_plan_for_this_machine_and_train_still_refuse_it(tmp_path):
    cfg = _user_config(tmp_path)
    r = _cli("plan", str(cfg))  # this machine, sized from the weights that are not here
    assert r.exit_code == 3, r.output
    assert "local path /home/someone-else/models/Qwen2.5-1.5B-Instruct does not exist" in _flat(r.output)
    for extra in ((), ("--gpu", "A100-80GB", "--model-config", str(QWEN))):
        r = _cli("train", str(cfg), *extra)
        assert r.exit_code == 3, r.output
        assert "local path /home/someone-else/models/Qwen2.5-1.5B-Instruct does not exist" in _flat(r.output)
        assert not said("planned anyway", r.output)


def test_several_local_adapters_resolve_each(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    values, problems, _ = resolve_paths({"adapter_name_or_path": "./a, ./b, org/hub-adapter"}, tmp_path)
    assert problems == []
    assert values["adapter_name_or_path"] == f"{tmp_path / 'a'},{tmp_path / 'b'},org/hub-adapter"
    _, problems, _ = resolve_paths({"adapter_name_or_path": "./a,./gone"}, tmp_path)
    assert problems == ["adapter_name_or_path: local path ./gone does not exist"]
