"""The kinds of value ftlaunch accepts per key are LLaMA-Factory's own (issue 30, item 3).

scripts/gen_llamafactory_keys.py reads them from LLaMA-Factory's argument dataclasses into
ftlaunch/data/llamafactory_keys.json; here they are held to what LLaMA-Factory's parser really does
with a YAML list and with a comma-separated string (HfArgumentParser.parse_dict, in a child process
with the installed llamafactory), and to what a plan does with them.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.errors import ConfigError
from ftlaunch.plan.config import known_keys, load_config, validate_keys

from ..conftest import ROOT, child_env

# Parses a config with each key that takes a list or a string, in both forms, with llamafactory's own
# parser (what `llamafactory-cli train` does to a YAML), and says what each became or why it failed.
CHILD = r"""
import json, sys
from llamafactory.hparams import parser
from transformers import HfArgumentParser

keys = json.loads(sys.argv[1])
base = dict(model_name_or_path="m", stage="sft", do_train=True, dataset="a,b", output_dir=sys.argv[2],
            finetuning_type="lora", mix_strategy="interleave_under")
samples = {"interleave_probs": [0.5, 0.5], "report_to": ["tensorboard"], "debug": ["underflow_overflow"],
           "fsdp": ["full_shard"], "dataset": ["a", "b"], "eval_dataset": ["a", "b"]}
out = {}
for k in keys:
    lst = samples.get(k, ["q_proj", "v_proj"])
    res = {}
    for form, v in (("list", lst), ("comma", ",".join(map(str, lst)))):
        try:
            objs = HfArgumentParser(parser._TRAIN_ARGS).parse_dict({**base, k: v})
            got = next(getattr(o, k) for o in objs if hasattr(o, k))
            res[form] = [str(getattr(x, "value", x)) for x in got] if isinstance(got, list) else got
        except Exception as e:
            res[form] = {"error": type(e).__name__}
    out[k] = res
print(json.dumps(out))
"""


def _list_or_str_keys() -> list[str]:
    return sorted(k for k, kind in known_keys().items() if {"list", "str"} <= set(kind.split("|")))


@pytest.fixture(scope="module")
def parsed(tmp_path_factory, lf_child) -> dict:
    keys = [*_list_or_str_keys(), "adapter_name_or_path"]
    r = lf_child.run(
        ["-c", CHILD, json.dumps(keys), str(tmp_path_factory.mktemp("out"))],
        env=child_env(DISABLE_VERSION_CHECK="1"),
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_list_keys_are_llamafactorys_split_fields():
    keys = _list_or_str_keys()
    # what LLaMA-Factory 0.9.5 passes through split_arg (finetuning_args.py:566-573, data_args.py:153-169)
    for k in ("lora_target", "additional_target", "freeze_trainable_modules", "dataset", "eval_dataset"):
        assert k in keys
    # split with str.split, not split_arg: a list fails there (model_args.py:211)
    assert known_keys()["adapter_name_or_path"] == "str"


def test_llamafactory_takes_a_list_wherever_ftlaunch_does(parsed):
    for key in _list_or_str_keys():
        assert not isinstance(parsed[key]["list"], dict), f"{key}: llamafactory refuses a list: {parsed[key]}"
        assert not isinstance(parsed[key]["comma"], dict), f"{key}: llamafactory refuses a string: {parsed[key]}"
    for key in ("lora_target", "additional_target", "freeze_trainable_modules", "dataset", "interleave_probs"):
        assert parsed[key]["list"] == parsed[key]["comma"], key  # lists and comma-separated strings alike


def test_a_key_llamafactory_splits_itself_refuses_a_list_in_both(parsed, tmp_path):
    assert parsed["adapter_name_or_path"]["list"] == {"error": "AttributeError"}
    problems = validate_keys({"adapter_name_or_path": ["a", "b"]})
    assert len(problems) == 1 and "'adapter_name_or_path' must be str" in problems[0]
    assert validate_keys({"adapter_name_or_path": "a,b"}) == []


def test_yaml_lists_load_like_comma_strings(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "stage: sft\nfinetuning_type: lora\nlora_target: [q_proj, k_proj]\ndataset:\n  - alpaca\n  - identity\n"
    )
    loaded = load_config(p, cwd=tmp_path)
    assert loaded.values["lora_target"] == ["q_proj", "k_proj"]
    assert load_config(p, ["lora_target=q_proj,k_proj"], cwd=tmp_path).values["lora_target"] == "q_proj,k_proj"


def test_a_yaml_no_for_a_word_key_says_to_quote_it(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("stage: sft\nsave_strategy: no\nlora_target: {a: 1}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, cwd=tmp_path)
    text = " ".join(str(ei.value).split())
    assert "'save_strategy' must be str, got bool False" in text and "quote it" in text
    assert "'lora_target' must be a list or str" in text and "comma-separated" in text


def test_a_plan_sizes_a_lora_target_list_as_its_comma_string(tmp_path):
    model_config = ROOT / "tests" / "data" / "corpus" / "model-configs" / "qwen2.5-1.5b" / "config.json"
    base = "model_name_or_path: Qwen/Qwen2.5-1.5B\nstage: sft\ndo_train: true\nfinetuning_type: lora\n"
    memory = {}
    for name, target in (("list", "[q_proj, v_proj]"), ("comma", "q_proj,v_proj"), ("all", "all")):
        p = tmp_path / f"{name}.yaml"
        p.write_text(base + f"lora_target: {target}\noutput_dir: {tmp_path / 'out'}\n")
        r = CliRunner().invoke(
            main, ["plan", str(p), "--gpu", "A100-80GB", "--model-config", str(model_config), "--json"]
        )
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        memory[name] = d["memory"]
        if name == "list":
            assert d["config"]["lora_target"] == ["q_proj", "v_proj"]  # written back as the user wrote it
    assert memory["list"] == memory["comma"]
    assert memory["list"] != memory["all"]  # the targets were read, not defaulted
