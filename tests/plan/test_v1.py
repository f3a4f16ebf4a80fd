"""USE_V1 configs (issue 21, case 4): recognised, checked and planned in the v1 trainer's own schema
(micro_batch_size, global_batch_size, dist_config), with USE_V1=1 in the trainer's env; what cannot
be adapted is a config error naming USE_V1 and what is missing."""

from __future__ import annotations

import json

import pytest

from ftlaunch.errors import ConfigError
from ftlaunch.plan import v1
from ftlaunch.plan.config import dump_yaml, load_config, read_header
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.planner import PlanOptions
from ftlaunch.run.prepare import PlanRequest, make_plan

from ..conftest import EXAMPLES, ROOT, child_env, have_llamafactory
from ..helpers import said

V1_EXAMPLES = sorted((EXAMPLES / "examples" / "v1").rglob("*.yaml"))
# Refused, with the reason: llamafactory 0.9.5's own v1 parser rejects both (unknown cp_size / cp_mode).
REFUSED = {
    "train_full_qwen3_moe_fsdpturbo_ep_fsdp.yaml": ("'cp_size'", "dist_config.cp_size", "'fsdpturbo'"),
    "train_full_ulysses_cp.yaml": ("'cp_mode'", "'cp_size'"),
}


def plan_file(path, gpu="A100-80GBx4", **kw):
    return make_plan(PlanRequest(config=str(path), gpu=gpu, cwd=str(EXAMPLES), **kw), {})


def write(tmp_path, text, name="v1.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


BASE = "model: Qwen/Qwen3-0.6B\ntrain_dataset: org/data\noutput_dir: out\nlearning_rate: 1.0e-4\n"


def test_upstream_v1_examples_plan_or_name_what_is_missing():
    assert len(V1_EXAMPLES) == 17
    planned = []
    for path in V1_EXAMPLES:
        if path.name in REFUSED:
            with pytest.raises(ConfigError) as ei:
                plan_file(path)
            text = str(ei.value)
            assert "USE_V1" in text and all(bit in text for bit in REFUSED[path.name]), text
            continue
        loaded, p = plan_file(path)
        assert loaded.v1 and p.env["USE_V1"] == "1"
        assert p.env["NPROC_PER_NODE"] == "4" and p.env["FORCE_TORCHRUN"] == "1"
        cfg = p.config
        assert cfg["global_batch_size"] == p.global_batch_target == cfg["micro_batch_size"] * p.accumulation * 4
        assert set(loaded.values) <= set(cfg)  # every recipe key kept
        assert set(cfg) <= set(v1.v1_keys())
        planned.append(path.name)
    assert len(planned) == 15


def test_global_batch_kept_and_replanning_changes_nothing(tmp_path):
    cfg = write(tmp_path, BASE + "micro_batch_size: 4\nglobal_batch_size: 32\ndist_config:\n  name: fsdp2\n")
    loaded, p = make_plan(PlanRequest(config=str(cfg), gpu="A100-80GBx4", source_gpus=8, cwd=str(tmp_path)), {})
    assert p.global_batch_source == p.global_batch_target == 32  # the written global batch wins
    assert (p.config["micro_batch_size"], p.accumulation) == (4, 2)
    assert p.env == {"USE_V1": "1", "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}
    adapted = write(tmp_path, dump_yaml(p.config, p.header), "adapted.yaml")
    assert read_header(adapted.read_text())["world_size"] == 4
    _, again = make_plan(PlanRequest(config=str(adapted), gpu="A100-80GBx4", cwd=str(tmp_path)), {})
    assert again.changes == () and again.config == p.config


def test_without_global_batch_the_source_world_sets_it(tmp_path):
    cfg = write(tmp_path, BASE + "micro_batch_size: 2\n")
    _, p = make_plan(PlanRequest(config=str(cfg), gpu="A100-80GBx4", source_gpus=8, cwd=str(tmp_path)), {})
    assert p.global_batch_target == 16 and p.config["global_batch_size"] == 16
    assert (p.config["micro_batch_size"], p.accumulation) == (2, 2)


def test_cpu_plan_drops_what_the_cpu_cannot_do(tmp_path):
    cfg = write(tmp_path, BASE + "flash_attn: flash_attention_2\ndist_config:\n  name: fsdp2\n")
    _, p = make_plan(PlanRequest(config=str(cfg), gpu="none", cwd=str(tmp_path)), {})
    keys = {c.key for c in p.changes}
    assert p.config["bf16"] is False and p.precision == "fp32"  # v1's bf16 defaults to true
    assert p.config["flash_attn"] == "sdpa" and "dist_config" not in p.config and "dist_config" in keys
    assert p.config["resume_from_checkpoint"] == "auto"
    assert p.env == {"USE_V1": "1"}
    _, p = make_plan(PlanRequest(config=str(cfg), gpu="V100-32GB", cwd=str(tmp_path)), {})
    assert p.config["bf16"] is False and p.config["flash_attn"] == "sdpa"
    _, p = make_plan(PlanRequest(config=str(cfg), gpu="A100-80GB", cwd=str(tmp_path)), {})
    assert "bf16" not in p.config and p.config["flash_attn"] == "flash_attention_2" and p.precision == "bf16"


def test_offload_keeps_the_plugin_on_one_device_under_torchrun():
    values = {"model": "m", "dist_config": {"name": "fsdp2", "offload_params": True}}
    p = v1.plan_v1(values, catalog_hardware("T4"), PlanOptions())
    assert p.config["dist_config"] == values["dist_config"]
    assert p.env == {"USE_V1": "1", "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1"}


def test_context_parallel_needs_enough_devices():
    values = {"model": "m", "dist_config": {"name": "fsdp2", "cp_size": 2, "dp_size": 4}, "micro_batch_size": 1}
    with pytest.raises(ConfigError) as ei:
        v1.plan_v1(values, catalog_hardware("A100-80GB"))
    assert "USE_V1" in str(ei.value) and "dist_config.cp_size 2" in str(ei.value)
    p = v1.plan_v1({**values, "global_batch_size": 4}, catalog_hardware("A100-80GBx4"))
    assert p.config["dist_config"]["dp_size"] == 2  # dp x cp = world
    assert p.config["global_batch_size"] == 4 and p.config["micro_batch_size"] * p.accumulation * 2 == 4


def test_v1_values_are_checked_in_their_own_schema(tmp_path):
    cfg = write(
        tmp_path,
        BASE + "micro_batch_size: 0\nbatching_strategy: dynamic\ndist_config:\n  dp_size: 2\n"
        "per_device_train_batch_size: 2\n",
    )
    with pytest.raises(ConfigError) as ei:
        load_config(cfg, ["learning_rate=nan"], cwd=tmp_path, use_v1=True)
    text = str(ei.value)
    for bit in ("micro_batch_size", "batching_strategy", "needs a 'name'", "learning_rate", "USE_V1"):
        assert bit in text, bit
    assert "(in v1: micro_batch_size)" in text  # the v0 key's v1 name


def test_mixed_schemas_and_v0_under_use_v1_are_refused(tmp_path):
    mixed = write(tmp_path, BASE + "stage: sft\nmicro_batch_size: 1\n")
    with pytest.raises(ConfigError, match="mixes LLaMA-Factory's two schemas"):
        load_config(mixed, cwd=tmp_path)
    v0 = write(tmp_path, "model_name_or_path: m\nstage: sft\ndo_train: true\n", "v0.yaml")
    assert not load_config(v0, cwd=tmp_path).v1
    with pytest.raises(ConfigError) as ei:
        make_plan(PlanRequest(config=str(v0), gpu="none", cwd=str(tmp_path)), {"USE_V1": "1"})
    assert "'model_name_or_path' (in v1: model)" in str(ei.value) and "USE_V1=1" in str(ei.value)


@pytest.mark.skipif(not have_llamafactory(), reason="the train extra (llamafactory) is not installed")
def test_adapted_v1_configs_pass_llamafactorys_v1_parser_and_the_schema_is_current(tmp_path, lf_child):
    configs = []
    for path in V1_EXAMPLES:
        if path.name not in REFUSED:
            for gpu in ("none", "A100-80GBx4"):
                configs.append(plan_file(path, gpu=gpu)[1].config)
    spec = tmp_path / "configs.json"
    spec.write_text(json.dumps(configs))
    code = (
        "import json, sys\n"
        "from llamafactory.v1.config.arg_parser import get_args\n"
        "for c in json.load(open(sys.argv[1])): get_args(c)\n"
        "print('parsed', len(json.load(open(sys.argv[1]))))\n"
    )
    r = lf_child.run(["-c", code, str(spec)], env=child_env())
    assert r.returncode == 0 and said(f"parsed {len(configs)}", r.stdout), r.stderr[-2000:]
    r = lf_child.run(
        [str(ROOT / "scripts" / "gen_llamafactory_keys.py"), "--check"],
        env=child_env(DISABLE_VERSION_CHECK="1"),
        check=True,
    )
    assert json.loads(r.stdout.strip().splitlines()[-1])["v1"] == v1.schema(), "run scripts/gen_llamafactory_keys.py"


def test_estimate_refuses_a_v1_config_naming_use_v1(tmp_path):
    from click.testing import CliRunner

    from ftlaunch.cli.main import main

    cfg = write(tmp_path, BASE + "micro_batch_size: 1\n")
    r = CliRunner().invoke(main, ["estimate", str(cfg), "--gpu", "A100-80GB"])
    assert r.exit_code == 3 and "USE_V1" in r.output, r.output
