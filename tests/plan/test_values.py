"""Values that cannot train are refused before anything starts, with the key (or field) named and every
problem listed at once (issue 21, case 6): the learning rate, undefined datasets, do_train false,
save_steps 0, a non-UTF-8 YAML, a broken --hardware file, `--gpu ''`, `--price` for no compared card."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.errors import ConfigError, HardwareError
from ftlaunch.estimate.compare import unmatched_prices
from ftlaunch.plan.config import load_config, resolve_paths, training_problems
from ftlaunch.plan.hardware import catalog_hardware, hardware_file_problems
from ftlaunch.probe.hardware import load_hardware_file

from ..helpers import said


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def write(tmp_path, text: str, name: str = "c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def data_dir(tmp_path, names=("alpaca_tiny",)):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "dataset_info.json").write_text(json.dumps({n: {"file_name": f"{n}.json"} for n in names}))
    return d


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", ".nan", "-.inf", "'1e-4x'"])
def test_learning_rate_must_be_finite_and_positive(tmp_path, value):
    p = write(tmp_path, "stage: sft\nlearning_rate: 1.0e-4\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, [f"learning_rate={value}"], cwd=tmp_path)
    assert "learning_rate" in str(ei.value) and ei.value.exit_code == 3


def test_good_learning_rates_pass(tmp_path):
    p = write(tmp_path, "stage: sft\nlearning_rate: 1.0e-4\n")
    for value in ("2e-5", "1.0e-4", "0.001", "1"):
        load_config(p, [f"learning_rate={value}"], cwd=tmp_path)


def test_save_steps_zero_is_refused_with_steps_strategy(tmp_path):
    p = write(tmp_path, "stage: sft\nsave_steps: 0\n")
    with pytest.raises(ConfigError, match="save_steps"):
        load_config(p, cwd=tmp_path)
    with pytest.raises(ConfigError, match="save_steps"):
        load_config(p, ["save_strategy=steps", "save_steps=-5"], cwd=tmp_path)
    assert load_config(p, ["save_strategy=epoch"], cwd=tmp_path).values["save_steps"] == 0  # unused then
    assert load_config(p, ["save_steps=0.1"], cwd=tmp_path).values["save_steps"] == 0.1  # a ratio


def test_all_bad_values_are_listed_at_once(tmp_path):
    p = write(tmp_path, "stage: sft\nlearning_rate: .nan\nsave_steps: 0\nper_device_train_batch_size: 0\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, cwd=tmp_path)
    text = str(ei.value)
    assert "3 problems" in text and "learning_rate" in text and "save_steps" in text
    assert "per_device_train_batch_size" in text


def test_undefined_dataset_names_are_refused(tmp_path):
    data_dir(tmp_path, ["alpaca_tiny", "identity"])
    values = {"dataset": "alpaca_tiny, alpaca_tinyy", "eval_dataset": ["nope"], "dataset_dir": "data"}
    _, problems, _ = resolve_paths(values, tmp_path, strict=False)
    assert len(problems) == 2
    assert "'alpaca_tinyy'" in problems[0] and "did you mean 'alpaca_tiny'" in problems[0]
    assert "eval_dataset" in problems[1] and "'nope'" in problems[1]
    _, problems, _ = resolve_paths({**values, "dataset": "identity", "eval_dataset": None}, tmp_path)
    assert problems == []


def test_online_and_saved_tokenized_datasets_are_not_checked(tmp_path):
    data_dir(tmp_path)
    assert resolve_paths({"dataset": "org/any", "dataset_dir": "ONLINE"}, tmp_path)[1] == []
    (tmp_path / "tok").mkdir()
    saved = {"dataset": "gone", "dataset_dir": "data", "tokenized_path": str(tmp_path / "tok")}
    assert resolve_paths(saved, tmp_path)[1] == []


def test_undefined_dataset_refused_by_plan_and_train(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data_dir(tmp_path)
    cfg = write(tmp_path, "stage: sft\ndo_train: true\ndataset: missing_one\ndataset_dir: data\noutput_dir: out\n")
    for cmd in ("plan", "train"):
        r = run(cmd, str(cfg), "--gpu", "none")
        assert r.exit_code == 3, r.output
        assert "missing_one" in r.output and "dataset_info.json" in r.output
    assert not (tmp_path / "out").exists()


def test_do_train_false_is_refused_for_training_commands(tmp_path, monkeypatch):
    assert training_problems({"do_train": False}) and training_problems({"do_train": "false"})
    assert training_problems({"do_train": True}) == [] and training_problems({}) == []
    monkeypatch.chdir(tmp_path)
    # an evaluation config LLaMA-Factory takes (do_eval needs an eval split: parser.py:362)
    cfg = write(tmp_path, "stage: sft\ndo_train: false\ndo_eval: true\ndataset: a\nval_size: 0.1\noutput_dir: out\n")
    r = run("train", str(cfg), "--gpu", "none")
    assert r.exit_code == 3 and "do_train" in r.output, r.output
    r = run("schedule", "add", "nightly", str(cfg), "--cron", "0 2 * * *")
    assert r.exit_code == 3 and "do_train" in r.output, r.output
    r = run("plan", str(cfg), "--gpu", "none")  # plan only shows it: a warning
    assert r.exit_code == 0 and "do_train" in r.output, r.output


@pytest.mark.parametrize("cmd", ["plan", "train", "estimate", "schedule"])
def test_non_utf8_yaml_is_a_config_error_with_the_offset(tmp_path, monkeypatch, cmd):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "latin.yaml"
    cfg.write_bytes("stage: sft\nrun_name: caf\xe9\n".encode("latin-1"))
    args = ["schedule", "add", "n1", str(cfg), "--cron", "0 2 * * *"] if cmd == "schedule" else [cmd, str(cfg)]
    r = run(*args)
    assert r.exit_code == 3, r.output
    assert "latin.yaml" in r.output and "UTF-8" in r.output and said("offset 24", r.output)
    assert "Traceback" not in r.output


@pytest.mark.parametrize(
    ("gpu", "top", "field"),
    [
        ({"total_mib": 0}, {}, "gpus[0].total_mib"),
        ({"total_mib": -100}, {}, "gpus[0].total_mib"),
        ({"total_mib": "lots"}, {}, "gpus[0].total_mib"),
        ({}, {"host_ram_gib": "sixty"}, "host_ram_gib"),
        ({}, {"host_ram_gib": 0}, "host_ram_gib"),
        ({"compute_capability": "eight"}, {}, "gpus[0].compute_capability"),
    ],
)
def test_hardware_file_fields_are_checked(tmp_path, gpu, top, field):
    data = {"gpus": [{"index": 0, "name": "NVIDIA A10", "total_mib": 23028, **gpu}], "host_ram_gib": 64, **top}
    assert any(p.startswith(field) for p in hardware_file_problems(data))
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(data))
    with pytest.raises(HardwareError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_hardware_file(hw)
    cfg = write(tmp_path, "stage: sft\noutput_dir: out\n")
    r = run("plan", str(cfg), "--hardware", str(hw))
    assert r.exit_code == 4, r.output
    assert field in r.output and "Traceback" not in r.output


def test_hardware_file_lists_every_field_at_once():
    data = {"gpus": [{"index": 0, "name": "A10", "total_mib": 0}, {"name": ""}], "host_ram_gib": "x"}
    problems = hardware_file_problems(data)
    joined = " ".join(problems)
    for field in ("gpus[0].total_mib", "gpus[1].index", "gpus[1].total_mib", "gpus[1].name", "host_ram_gib"):
        assert field in joined
    assert hardware_file_problems({"gpus": [{"index": 0, "name": "A10", "total_mib": 23028}]}) == []


def test_empty_gpu_name_is_refused(tmp_path):
    with pytest.raises(HardwareError, match="names no card"):
        catalog_hardware("  ")
    cfg = write(tmp_path, "stage: sft\noutput_dir: out\n")
    r = run("plan", str(cfg), "--gpu", "")
    assert r.exit_code == 4 and said("names no card", r.output), r.output


def test_price_for_no_compared_machine_is_refused(tmp_path):
    assert unmatched_prices({"NOPE": 1.0, "A100-80GB": 2.0}, [("A100-80GBx4", "NVIDIA A100-SXM4-80GB")]) == ["NOPE"]
    assert unmatched_prices({"A100": 2.0}, [("", "NVIDIA A100-SXM4-80GB")]) == []
    cfg = write(tmp_path, "stage: sft\noutput_dir: out\n")
    r = run("estimate", str(cfg), "--gpu", "A100-80GB", "--gpu", "T4", "--price", "NOPE=1")
    assert r.exit_code == 2, r.output
    assert "NOPE" in r.output and "A100-80GB" in r.output and "T4" in r.output
