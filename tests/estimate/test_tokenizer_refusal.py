"""Token counting refuses a tokenizer that cannot encode (issue 21, case 7).

A model folder with config.json but no tokenizer files: transformers 5 builds an empty tokenizer for
some model types (a Qwen2 config gives a Qwen2Tokenizer of vocabulary 1 that encodes every text to
[]), so llamafactory's preprocessing "counts" a few special tokens per sample. ftlaunch refuses with a
config error naming the folder and what is missing, before the child runs (file check) and inside it
(an encoding check, for what the file check cannot see).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.errors import ConfigError
from ftlaunch.estimate import probe

from ..conftest import MODEL_CONFIGS, tiny_config, write_yaml
from ..helpers import said


def test_a_folder_without_vocabulary_files_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")  # holds no vocabulary
    problem = probe.tokenizer_problem(str(tmp_path))
    assert problem and str(tmp_path) in problem and "tokenizer.json" in problem
    (tmp_path / "tokenizer.json").write_text("{}")
    assert probe.tokenizer_problem(str(tmp_path)) is None
    assert probe.tokenizer_problem("Qwen/Qwen2.5-1.5B") is None  # a hub id: the child checks it


def test_count_tokens_refuses_before_starting_the_child(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as ei:  # a child would fail with TrainerError: it cannot start
        probe.count_tokens({"model_name_or_path": str(model)}, {}, tmp_path / "w", python="/nonexistent/python")
    assert ei.value.exit_code == 3 and str(model) in str(ei.value) and "no tokenizer files" in str(ei.value)


def test_estimate_exits_3_naming_the_folder(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(MODEL_CONFIGS / "qwen2.5-1.5b" / "config.json", model / "config.json")
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json"}}))
    (data / "d.json").write_text(json.dumps([{"instruction": "hi", "input": "", "output": "yo"}]))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model_name_or_path: {model}\nstage: sft\ndo_train: true\nfinetuning_type: lora\ndataset: d\n"
        f"dataset_dir: {data}\ntemplate: default\noutput_dir: {tmp_path / 'out'}\n"
    )
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["estimate", str(cfg), "--gpu", "A100-80GB"])
    assert r.exit_code == 3, r.output
    assert said(str(model), r.output) and said("no tokenizer files", r.output)


@pytest.mark.e2e
def test_tiny_model_without_tokenizer_files_is_refused(tiny, tmp_path, monkeypatch):
    """The tiny model of scripts/make_tiny.py with its tokenizer files removed: `estimate` exits 3."""
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, tmp_path / "out", model_name_or_path=str(model)))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["estimate", str(cfg)])
    assert r.exit_code == 3, r.output
    assert said(str(model), r.output) and said("no tokenizer files", r.output)


@pytest.mark.e2e
def test_the_child_refuses_an_empty_tokenizer(tiny, tmp_path, monkeypatch):
    """Past the file check (here skipped), the counting child itself refuses transformers 5's empty
    tokenizer (a Qwen2 config without tokenizer files) instead of counting 3 tokens per sample."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(MODEL_CONFIGS / "qwen2.5-1.5b" / "config.json", model / "config.json")
    values = tiny_config(tiny, tmp_path / "out", model_name_or_path=str(model), bf16=False)
    monkeypatch.setattr(probe, "tokenizer_problem", lambda model: None)
    with pytest.raises(ConfigError) as ei:
        probe.count_tokens(values, dict(os.environ), tmp_path / "work")
    text = str(ei.value)
    assert ei.value.exit_code == 3 and str(model) in text and "encodes" in text and "[]" in text
