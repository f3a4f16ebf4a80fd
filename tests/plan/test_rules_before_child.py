"""LLaMA-Factory's refusals of the config alone are ftlaunch's before any child runs (issue 30, item 6).

Each case is a config LLaMA-Factory 0.9.5 refuses from its values alone; its own get_train_args (in a
child process with the installed llamafactory) raises a message, and ftlaunch.plan.rules must list that
very message, and `plan` must refuse it as a config error (exit 3) without starting anything. Configs
it accepts must pass both.
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.plan.rules import config_refusals, missing_refusals

from ..conftest import child_env

BASE = {"model_name_or_path": "m", "stage": "sft", "do_train": True, "dataset": "a", "finetuning_type": "lora"}

REFUSED = {
    "lora+galore": {"use_galore": True},
    "lora+apollo": {"use_apollo": True},
    "lora+badam": {"use_badam": True},
    "galore+badam": {"finetuning_type": "full", "use_galore": True, "use_badam": True},
    "finetuning_type": {"finetuning_type": "qlora"},
    "ref_model_quantization_bit": {"stage": "dpo", "ref_model_quantization_bit": 2},
    "ppo without reward_model": {"stage": "ppo"},
    "ppo lora reward on full": {"stage": "ppo", "reward_model": "r", "finetuning_type": "full"},
    "dpo label smoothing": {"stage": "dpo", "pref_loss": "ipo", "dpo_label_smoothing": 0.1},
    "llama_pro full": {"finetuning_type": "full", "use_llama_pro": True},
    "pissa kto": {"stage": "kto", "pissa_init": True},
    "pissa dpo": {"stage": "dpo", "pissa_init": True},
    "loraplus on full": {"finetuning_type": "full", "loraplus_lr_ratio": 16},
    "rslora on freeze": {"finetuning_type": "freeze", "use_rslora": True},
    "dora on oft": {"finetuning_type": "oft", "use_dora": True},
    "val_size without dataset": {"do_train": False, "dataset": None, "val_size": 0.1},
    "val_size and eval_dataset": {"eval_dataset": "b", "val_size": 0.1},
    "interleave on concat": {"dataset": "a,b", "interleave_probs": "0.5,0.5"},
    "interleave length": {"dataset": "a,b", "interleave_probs": [0.5, 0.3, 0.2], "mix_strategy": "interleave_under"},
    "streaming val_size": {"streaming": True, "val_size": 0.1, "max_steps": 10},
    "streaming max_samples": {"streaming": True, "max_samples": 100, "max_steps": 10},
    "mask_history and train_on_prompt": {"mask_history": True, "train_on_prompt": True},
    "image pixels": {"image_max_pixels": 100, "image_min_pixels": 200},
    "video pixels": {"video_max_pixels": 100},
    "export quantization": {"export_quantization_bit": 4},
    "predict_with_generate on pt": {"stage": "pt", "predict_with_generate": True, "val_size": 0.1},
    "neat_packing on rm": {"stage": "rm", "neat_packing": True},
    "train_on_prompt on dpo": {"stage": "dpo", "train_on_prompt": True},
    "do_predict without generate": {"do_predict": True, "val_size": 0.1},
    "rm best model": {
        "stage": "rm",
        "load_best_model_at_end": True,
        "eval_strategy": "steps",
        "save_strategy": "steps",
        "val_size": 0.1,
    },
    "ppo evaluation": {"stage": "ppo", "reward_model": "r", "do_train": False},
    "ppo shift_attn": {"stage": "ppo", "reward_model": "r", "shift_attn": True},
    "ppo logger": {"stage": "ppo", "reward_model": "r", "report_to": "mlflow"},
    "streaming max_steps": {"streaming": True},
    "do_eval without split": {"do_eval": True},
    "eval_strategy without split": {"eval_strategy": "steps"},
    "generate and accuracy": {"predict_with_generate": True, "compute_accuracy": True, "val_size": 0.1},
    "device map": {"quantization_bit": 4, "quantization_device_map": "auto"},
    "fp8 and quantization": {"fp8": True, "quantization_bit": 4},
    "vllm backend": {"infer_backend": "vllm"},
    "adapter on full": {"finetuning_type": "full", "adapter_name_or_path": "x"},
    "quantized freeze": {"finetuning_type": "freeze", "quantization_bit": 4},
    "quantized pissa": {"quantization_bit": 4, "pissa_init": True},
    "quantized resize": {"quantization_bit": 4, "resize_vocab": True},
    "quantized new adapter": {"quantization_bit": 4, "adapter_name_or_path": "x", "create_new_adapter": True},
    "quantized two adapters": {"quantization_bit": 4, "adapter_name_or_path": "x,y"},
    "trackio without project": {"report_to": "trackio", "project": ""},
    "no model": {"model_name_or_path": None},
    "training without dataset": {"dataset": None},
}

ACCEPTED = {
    "lora": {},
    "dora": {"use_dora": True},
    "full": {"finetuning_type": "full"},
    "dpo sigmoid smoothing": {"stage": "dpo", "dpo_label_smoothing": 0.1},
    "pt": {"stage": "pt"},
    "eval split": {"do_eval": True, "val_size": 0.1},
    "streaming": {"streaming": True, "max_steps": 10},
    "interleave": {"dataset": "a,b", "interleave_probs": [0.5, 0.5], "mix_strategy": "interleave_under"},
    "ppo": {"stage": "ppo", "reward_model": "r", "report_to": "tensorboard"},
    "qlora": {"quantization_bit": 4, "adapter_name_or_path": "x"},
}

# get_train_args as llamafactory-cli calls it, on every case: {case: "ExceptionType: message" or "ok"}
CHILD = r"""
import json, sys
from llamafactory.hparams import get_train_args

out = {}
for name, cfg in json.loads(sys.argv[1]).items():
    try:
        get_train_args({k: v for k, v in cfg.items() if v is not None} | {"output_dir": sys.argv[2]})
        out[name] = "ok"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _config(extra: dict) -> dict:
    return {**BASE, **extra}


def _ours(values: dict) -> list[str]:
    return [r.message for r in (*config_refusals(values), *missing_refusals(values))]


@pytest.fixture(scope="module")
def llamafactory_says(tmp_path_factory, lf_child) -> dict[str, str]:
    cases = {name: _config(extra) for name, extra in {**REFUSED, **ACCEPTED}.items()}
    r = lf_child.run(
        ["-c", CHILD, json.dumps(cases), str(tmp_path_factory.mktemp("out"))],
        env=child_env(DISABLE_VERSION_CHECK="1", CUDA_VISIBLE_DEVICES=""),
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_ftlaunch_lists_the_message_llamafactory_raises(case, llamafactory_says):
    said = llamafactory_says[case]
    assert said != "ok", f"{case}: LLaMA-Factory accepts it"
    kind, _, message = said.partition(": ")
    assert kind in ("ValueError", "AssertionError")
    assert message in _ours(_config(REFUSED[case])), f"{case}: {said}"


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_what_llamafactory_accepts_ftlaunch_accepts(case, llamafactory_says):
    assert llamafactory_says[case] == "ok", llamafactory_says[case]
    assert _ours(_config(ACCEPTED[case])) == []


def test_every_rule_cites_its_upstream_line():
    values = _config({"use_galore": True, "use_badam": True, "stage": "ppo", "streaming": True})
    for rule in config_refusals(values):
        path, _, line = rule.source.partition(":")
        assert path.startswith("hparams/") and path.endswith(".py") and line.isdigit(), rule


def test_plain_plan_refuses_lora_with_galore_in_milliseconds(tmp_path):
    cfg = tmp_path / "galore.yaml"
    cfg.write_text(
        "model_name_or_path: Qwen/Qwen2.5-1.5B\nstage: sft\ndo_train: true\ndataset: alpaca\n"
        "finetuning_type: lora\nuse_galore: true\nuse_badam: true\noutput_dir: out\n"
    )
    start = time.process_time()
    r = CliRunner().invoke(main, ["plan", str(cfg), "--gpu", "V100-32GB", "--params", "1.5B"])
    took = time.process_time() - start
    assert r.exit_code == 3, r.output
    text = " ".join(r.output.split())
    assert "Cannot use LoRA with GaLore, APOLLO or BAdam together." in text
    assert "Cannot use GaLore, APOLLO or BAdam together." in text  # every refusal at once
    assert "hparams/finetuning_args.py:596" in text
    assert took < 2.0  # no child: the trainer's own check costs 15-20 s


def test_plan_warns_of_a_config_without_a_model_or_dataset(tmp_path):
    cfg = tmp_path / "nodata.yaml"
    cfg.write_text("stage: sft\ndo_train: true\noutput_dir: out\n")
    r = CliRunner().invoke(main, ["plan", str(cfg), "--gpu", "V100-32GB", "--params", "1.5B", "--json"])
    assert r.exit_code == 0, r.output
    warnings = " | ".join(json.loads(r.output)["warnings"])
    assert "Please specify dataset for training." in warnings and "Please provide `model_name_or_path`." in warnings
