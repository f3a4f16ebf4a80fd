"""Config loading: merge like llamafactory-cli, resolve paths, reject bad input with every problem."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ftlaunch.errors import ConfigError
from ftlaunch.plan.config import dump_yaml, known_keys, load_config, parse_value, read_header, resolve_paths

from ..conftest import EXAMPLES, ROOT, child_env, have_llamafactory, upstream_training_examples


def test_overrides_parse_as_yaml_scalars_like_omegaconf():
    assert parse_value("2e-5") == 2e-5  # OmegaConf reads this as float; plain YAML 1.1 would not
    assert parse_value("1.0e-4") == 1e-4
    assert parse_value("true") is True
    assert parse_value("8") == 8
    assert parse_value("identity,alpaca_en_demo") == "identity,alpaca_en_demo"
    assert parse_value("null") is None


def test_overrides_merge_and_keep_order(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("stage: sft\nlearning_rate: 1.0e-5\nbf16: true\n")
    loaded = load_config(p, ["learning_rate=2e-5", "cutoff_len=512"], cwd=tmp_path)
    assert list(loaded.values) == ["stage", "learning_rate", "bf16", "cutoff_len"]
    assert loaded.values["learning_rate"] == 2e-5


def test_every_problem_is_listed_at_once(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("stage: sft\nlerning_rate: 1.0e-5\nper_device_train_batch_size: [1, 2]\nbogus: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, ["--bf16", "true", "cutoff_len=abc"], cwd=tmp_path)
    text = str(ei.value)
    assert "'bogus'" in text and "'lerning_rate'" in text and "did you mean 'learning_rate'" in text
    assert "per_device_train_batch_size" in text
    assert "not `--key value`" in text
    assert "cutoff_len" in text  # int key given a string
    assert ei.value.exit_code == 3


def test_unparsable_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("stage: sft\n  bad: [unclosed\n")
    with pytest.raises(ConfigError, match="does not parse"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)


def test_relative_paths_resolve_from_cwd():
    loaded = load_config("examples/train_full/qwen3_full_sft.yaml", cwd=EXAMPLES)
    values, problems, warnings = resolve_paths(loaded.values, loaded.base_dir, strict=False)
    assert problems == []
    assert values["deepspeed"] == str((EXAMPLES / "examples/deepspeed/ds_z3_config.json").resolve())
    assert values["output_dir"] == str(EXAMPLES.resolve() / "saves/qwen3-4b/full/sft")
    assert values["model_name_or_path"] == "Qwen/Qwen3-4B-Instruct-2507"  # a hub id stays
    assert any("dataset_info.json" in w for w in warnings)  # plan warns, train fails
    _, problems, _ = resolve_paths(loaded.values, loaded.base_dir, strict=True)
    assert any("dataset_info.json" in p for p in problems)


def test_missing_deepspeed_and_local_model_are_problems(tmp_path):
    vals = {"deepspeed": "ds/missing.json", "model_name_or_path": "./models/none", "output_dir": "out"}
    _, problems, _ = resolve_paths(vals, tmp_path)
    assert len(problems) == 2
    assert any("deepspeed" in p for p in problems) and any("model_name_or_path" in p for p in problems)


def test_header_round_trip():
    text = dump_yaml({"stage": "sft", "bf16": False}, {"world_size": 4, "global_batch": 64})
    assert read_header(text) == {"world_size": 4, "global_batch": 64}
    assert "ftlaunch-plan" not in text.splitlines()[1]


def test_known_keys_cover_the_corpus_examples():
    import yaml

    keys = known_keys()
    # v1 configs (USE_V1) have their own schema: tests/plan/test_v1.py
    paths = [EXAMPLES / rel for rel in upstream_training_examples()]
    assert len(paths) >= 7, "the vendored corpus under tests/data/corpus is incomplete"
    for path in paths:
        data = yaml.safe_load(path.read_text())
        unknown = set(data) - set(keys)
        assert not unknown, f"{path}: {unknown}"


def test_a_date_like_value_stays_text_as_omegaconf_keeps_it(tmp_path):
    # llamafactory merges with OmegaConf, which gives the trainer "2024-01-01", not a date.
    (tmp_path / "c.yaml").write_text("stage: sft\nrun_name: 2024-01-01\nlearning_rate: 1e-5\n")
    loaded = load_config("c.yaml", ("output_dir=2025-02-03",), cwd=tmp_path)
    assert loaded.values["run_name"] == "2024-01-01" and loaded.values["output_dir"] == "2025-02-03"
    assert loaded.values["learning_rate"] == 1e-5


def test_a_date_like_override_stays_text_too(tmp_path):
    (tmp_path / "c.yaml").write_text("stage: sft\nrun_name: first\n")
    loaded = load_config("c.yaml", ("run_name=2024-01-01",), cwd=tmp_path)
    assert loaded.values["run_name"] == "2024-01-01"


def test_an_override_that_does_not_parse_is_listed_with_the_rest(tmp_path):
    (tmp_path / "c.yaml").write_text("stage: sft\nbogus: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config("c.yaml", ("lora_target=[q_proj",), cwd=tmp_path)
    text = str(ei.value)
    assert "lora_target=[q_proj" in text and "does not parse" in text and "'bogus'" in text


READ_ARGS = """
import json, sys
from llamafactory.hparams.parser import read_args
sys.argv = ["llamafactory-cli", *sys.argv[1:]]
print(json.dumps(read_args()))
"""


@pytest.mark.skipif(not have_llamafactory(), reason="the train extra (llamafactory) is not installed")
def test_loading_gives_what_llamafactory_read_args_gives(tmp_path, lf_child):
    (tmp_path / "c.yaml").write_text(
        "stage: sft\nrun_name: 2024-01-01\nlearning_rate: 1e-5\nbf16: yes\ncutoff_len: 1_024\n"
        "dataset: identity,alpaca_en_demo\nlora_target: q_proj,v_proj\noutput_dir: ${oc.env:HOME}/out\n"
    )
    overrides = ["warmup_ratio=.1", "logging_steps=0x10", "save_steps=", "run_name=2025-02-03", "num_train_epochs=3"]
    r = lf_child.run(
        ["-c", READ_ARGS, str(tmp_path / "c.yaml"), *overrides], env=child_env(DISABLE_VERSION_CHECK="1"), check=True
    )
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    assert load_config("c.yaml", overrides, cwd=tmp_path).values == theirs


# YAML that OmegaConf reads its own way: floats without a dot, no timestamps, bools of YAML 1.1,
# underscores, sexagesimals, text that looks like an interpolation or MISSING.
TRICKY_YAML = (
    "a: 1e5\nb: 1.5e-3\nc: -.5\nd: +1_000\ne: 0x10\nf: 0o17\ng: .inf\nh: -.Inf\ni: 1:20\nj: 1:20.5\nk: ~\n"
    "l: Yes\nm: off\nn: '1e5'\no: 2024-01-01 10:00:00\np: [1, 2.0, 3e4]\nq: {r: 1}\ns: 1.\nt: +.5\n"
    'u: ${oc.env:HOME}/x\nv: ???\nw: "\\u00e9"\nx: [q_proj, {y: null}]\n'
)


def _omegaconf_values(path):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path))


def test_a_plain_config_loads_as_omegaconf_loads_it_without_importing_it(tmp_path):
    from ftlaunch.plan.config import _plain_mapping

    (tmp_path / "tricky.yaml").write_text(TRICKY_YAML)
    files = [tmp_path / "tricky.yaml", *sorted((EXAMPLES.parent.parent).rglob("*.yaml"))]
    fast = 0
    for path in files:
        mine = _plain_mapping(path.read_text(encoding="utf-8"), json_file=False)
        if mine is not None:
            fast += 1
            assert mine == _omegaconf_values(path), path
    assert fast > 100  # the fast path is the usual one
    # nothing past plain takes it: anchors and merge keys, a duplicate key, keys that are not text
    for text in ("a: &x 1\nb: *x\n", "base: {a: 1}\nc:\n  <<: {a: 2}\n", "a: 1\na: 2\n", "1: a\nb: c\n", "word\n"):
        assert _plain_mapping(text, json_file=False) is None, text


def test_load_config_takes_the_fast_path_and_omegaconf_for_overrides(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage: sft\nlearning_rate: 1e-5\nrun_name: 2024-01-01\nlora_target: [q_proj, v_proj]\n")
    code = (
        "import sys, json; from ftlaunch.plan.config import load_config; "
        f"v = load_config({str(cfg)!r}).values; before = 'omegaconf' in sys.modules; "
        f"w = load_config({str(cfg)!r}, ['cutoff_len=512']).values; "
        "print(json.dumps([v, w, before, 'omegaconf' in sys.modules]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    plain, merged, before, after = json.loads(r.stdout.strip().splitlines()[-1])
    assert plain == _omegaconf_values(cfg) and merged == {**plain, "cutoff_len": 512}
    assert (before, after) == (False, True)


def test_a_plan_imports_planning_only(tmp_path):
    """`ftlaunch plan` (issue 30: a plan in 0.2 s) imports no supervisor, estimator, scheduler, hub
    client, OmegaConf (for a plain YAML without overrides) or torch; scripts/bench_plan.py times it."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: Qwen/Qwen2.5-1.5B\nstage: sft\ndo_train: true\ndataset: a\noutput_dir: out\n")
    code = (
        "import sys; from ftlaunch.cli.main import main; "
        f"main(['plan', {str(cfg)!r}, '--gpu', 'A100-80GB', '--params', '1.5B'], standalone_mode=False); "
        "print(' '.join(sorted(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    loaded = set(r.stdout.splitlines()[-1].split())
    assert "ftlaunch.run.prepare" in loaded and "ftlaunch.plan.planner" in loaded
    for module in (
        "ftlaunch.run.supervisor",
        "ftlaunch.run.options",
        "ftlaunch.estimate",
        "ftlaunch.schedule",
        "ftlaunch.cli.run_cmds",
        "ftlaunch.cli.estimate",
        "ftlaunch.hub.download",
        "ftlaunch.plan.memory.simulate",
        "omegaconf",
        "ray",
        "torch",
    ):
        assert module not in loaded, module


def test_the_plan_benchmark_runs(tmp_path):
    """scripts/bench_plan.py times real plans (its figures are the machine's; only its shape is tested)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_plan.py"), "-n", "1", "--no-llamafactory", "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    row = json.loads(r.stdout)["ftlaunch plan"]
    assert row["runs"] == 1 and 0 < row["median_cpu_s"] and 0 < row["median_wall_s"]
