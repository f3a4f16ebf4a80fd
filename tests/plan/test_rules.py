"""LLaMA-Factory's own rules in the planner (issue 21): each case of "Why" that the planning core
got wrong, planned the way `ftlaunch plan` plans it (the pure planner with the memory chooser)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from ftlaunch.errors import ConfigError, DoesNotFitError, HardwareError
from ftlaunch.plan import rules
from ftlaunch.plan.config import dump_yaml, read_header
from ftlaunch.plan.hardware import Gpu, Hardware, blocked_pairs, catalog_hardware
from ftlaunch.plan.memory.adapt import make_memory_chooser
from ftlaunch.plan.modelspec import spec_from_config, spec_from_param_count
from ftlaunch.plan.offload import ZERO3_OFFLOAD, materialize, offload_config_path
from ftlaunch.plan.planner import PlanOptions, plan
from ftlaunch.probe.hardware import p2p_from_nvml, probe

# Meta-Llama-3-8B's config.json (the shape of the upstream AWQ/GPTQ examples' models)
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
Z0 = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 0}}
Z3 = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}

FULL_7B = {
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "full",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 8,
    "cutoff_len": 2048,
    "bf16": True,
}


def chooser(spec, ds=None):
    return make_memory_chooser(spec, ds, headroom=0.12, default_optim=("adamw_torch", "optim unset (test)"))


def replan(first, hw, spec, ds=None, options=PlanOptions()):
    text = dump_yaml(first.config, first.header)
    return plan(
        yaml.safe_load(text), hw, options, meta=read_header(text), memory_chooser=chooser(spec, ds), deepspeed_config=ds
    )


# ---------------------------------------------------------------- 1. a world size means one env


def test_offload_on_several_gpus_runs_every_process_and_replans_to_the_same():
    """asft on A100-80GBx4 --source-gpus 8 --params 7B: the plan claimed world 4, its env said 1."""
    values = {**FULL_7B, "deepspeed": "examples/deepspeed/ds_z0_config.json"}
    hw = catalog_hardware("A100-80GBx4")
    spec = spec_from_param_count("7B")
    p = plan(values, hw, PlanOptions(source_gpus=8), memory_chooser=chooser(spec, Z0), deepspeed_config=Z0)
    # the bundled offload JSON with the user's other settings carried over (inline), or the bundled file
    ds = p.config["deepspeed"]
    assert ds == offload_config_path() or ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert p.world_size == 4 and p.env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}
    assert p.micro_batch * p.accumulation * 4 == p.global_batch_target == 256
    again = replan(p, hw, spec)
    assert again.changes == () and again.env == p.env


def test_launch_env_is_the_one_meaning_of_a_world_size():
    assert rules.launch_env(1, gpus=1, deepspeed=False) == {}
    assert rules.launch_env(1, gpus=1, deepspeed=True) == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1"}
    assert rules.launch_env(4, gpus=4, deepspeed=True) == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}
    assert rules.launch_env(1, gpus=4, deepspeed=False, pin="GPU-a") == {"CUDA_VISIBLE_DEVICES": "GPU-a"}
    assert rules.launch_env(2, gpus=2, deepspeed=False, p2p_blocked=True)["NCCL_P2P_DISABLE"] == "1"
    # the OOM ladder's offload keeps the world it is given
    assert materialize(ZERO3_OFFLOAD, world_size=4)[1]["NPROC_PER_NODE"] == "4"


# ---------------------------------------------------------------- 2. never a config refused under ZeRO-3


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        ({"predict_with_generate": True, "eval_dataset": "x"}, "predict_with_generate"),
        ({"finetuning_type": "lora", "pissa_init": True, "pissa_convert": True}, "pissa_init"),
        ({"finetuning_type": "lora", "use_kt": True}, "KTransformers"),
        ({"pure_bf16": True}, "pure_bf16"),
    ],
)
def test_zero3_offload_is_never_put_where_llamafactory_refuses_it(extra, rule):
    values = {**FULL_7B, **extra}
    spec = spec_from_param_count("70B" if values["finetuning_type"] == "lora" else "7B")
    hw = catalog_hardware("A10", host_ram_gib=2048)  # bf16: pure_bf16 is kept
    with pytest.raises(DoesNotFitError) as err:
        plan(values, hw, PlanOptions(), memory_chooser=chooser(spec))
    assert rule in err.value.message and "ZeRO-3" in err.value.message
    offload_rows = [a for a in err.value.alternatives if "ZeRO-3" in a["option"]]
    assert offload_rows and not any(a["fits"] for a in offload_rows)
    assert all(rule in a["why"] for a in offload_rows)
    # the same config without the refused option is offloaded
    clean = {k: v for k, v in values.items() if k not in extra or k == "finetuning_type"}
    assert plan(clean, hw, PlanOptions(), memory_chooser=chooser(spec)).config["deepspeed"] == offload_config_path()


def test_a_predict_only_config_is_not_sized_as_training():
    """nlg_eval on V100: a predict-only config got ZeRO-3 offload, which predict_with_generate refuses."""
    values = {
        "stage": "sft",
        "do_predict": True,
        "predict_with_generate": True,
        "finetuning_type": "lora",
        "eval_dataset": "identity",
        "per_device_eval_batch_size": 1,
        "bf16": True,
    }
    p = plan(values, catalog_hardware("V100-32GB"), PlanOptions(), memory_chooser=chooser(spec_from_param_count("70B")))
    assert "deepspeed" not in p.config and p.memory is None
    assert any("predict/eval only" in w for w in p.warnings)
    assert rules.predict_only(values) and not rules.predict_only({**values, "do_train": True})


def test_a_ptq_model_is_sized_at_its_bits_and_never_under_zero3():
    awq = spec_from_config({**LLAMA3_8B, "quantization_config": AWQ})
    plain = spec_from_config(LLAMA3_8B)
    assert (awq.quant_method, awq.quant_bits, awq.params) == ("awq", 4, plain.params)
    values = {**FULL_7B, "finetuning_type": "lora", "lora_target": "all", "per_device_train_batch_size": 1}
    values["gradient_accumulation_steps"] = 1
    hw = catalog_hardware("A100-80GB")
    w_awq = plan(values, hw, PlanOptions(), memory_chooser=chooser(awq)).memory.estimate.weights_gib
    w_plain = plan(values, hw, PlanOptions(), memory_chooser=chooser(plain)).memory.estimate.weights_gib
    assert w_plain > 14 and w_awq < 7, (w_awq, w_plain)  # 15 GiB at bf16; ~5.5 GiB at 4 bits
    # where only offload would fit, the plan says so and names the rule
    long = {**values, "cutoff_len": 32768, "disable_gradient_checkpointing": False}
    with pytest.raises(DoesNotFitError, match="PTQ-quantized"):
        plan(long, catalog_hardware("T4", host_ram_gib=512), PlanOptions(), memory_chooser=chooser(awq))
    assert rules.zero3_refusals({}, "awq")[0].name == "ptq:awq"
    assert rules.zero3_refusals({}, "fp8") == ()  # dequantized at load: allowed
    assert rules.ptq_of({"quantization_config": {"quant_method": "aqlm"}}) == ("aqlm", 2)


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        ({"use_galore": True, "galore_layerwise": True}, "galore_layerwise"),
        ({"use_apollo": True, "apollo_layerwise": True}, "apollo_layerwise"),
        ({"use_badam": True, "badam_mode": "layer"}, "badam_layer"),
        ({"use_badam": True, "badam_mode": "ratio"}, "badam_ratio"),
    ],
)
def test_layerwise_methods_run_one_process(extra, name):
    values = {**FULL_7B, **extra}
    p = plan(values, catalog_hardware("A100-80GBx4"), PlanOptions(source_gpus=8))
    assert p.world_size == 1 and p.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert p.micro_batch * p.accumulation == p.global_batch_target == 256
    (rule,) = rules.distributed_refusals(values, zero3=False)
    assert rule.name == name and any(rule.message in w for w in p.warnings)


def test_layerwise_badam_keeps_its_zero3_world():
    values = {**FULL_7B, "use_badam": True, "badam_mode": "layer", "deepspeed": "ds_z3_config.json"}
    p = plan(values, catalog_hardware("A100-80GBx4"), PlanOptions(), deepspeed_config=Z3)
    assert p.world_size == 4 and p.config["deepspeed"] == "ds_z3_config.json"


def test_one_process_pins_the_probed_gpu_by_uuid():
    gpus = tuple(Gpu(i, "NVIDIA A100-SXM4-80GB", 81920, compute_capability=(8, 0), uuid=f"GPU-{i}") for i in range(2))
    p = plan({**FULL_7B, "use_galore": True, "galore_layerwise": True}, Hardware(gpus=gpus, source="nvml"))
    assert p.env == {"CUDA_VISIBLE_DEVICES": "GPU-0"}


# ---------------------------------------------------------------- 3. precision agrees with a DeepSpeed JSON


def test_precision_follows_a_deepspeed_json_that_hard_codes_fp16_off():
    """The fp8 DeepSpeed example on V100-32GBx4: fp16 against "fp16": {"enabled": false}."""
    ds = {"fp16": {"enabled": False}, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}
    values = {**FULL_7B, "fp8": True, "deepspeed": "ds_z3_fp8_config.json"}
    p = plan(values, catalog_hardware("V100-32GBx4"), PlanOptions(), deepspeed_config=ds)
    assert p.precision == "fp32" and not p.config.get("fp16") and p.config["bf16"] is False
    assert "fp16.enabled=false" in {c.key: c for c in p.changes}["bf16"].reason
    assert rules.ds_precision(ds) == {"fp16": False}
    # on a bf16 card the same JSON and config agree: nothing to change
    a100 = plan(values, catalog_hardware("H100-80GBx4"), PlanOptions(), deepspeed_config=ds)
    assert a100.precision == "bf16" and "bf16" not in {c.key for c in a100.changes}


def test_precision_follows_a_json_that_hard_codes_bf16_on():
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    p = plan({"fp16": True, "deepspeed": "z2.json"}, catalog_hardware("A100-80GBx2"), deepspeed_config=ds)
    assert p.precision == "bf16" and p.config["bf16"] is True and p.config["fp16"] is False
    with pytest.raises(ConfigError, match="bf16.enabled=true"):
        plan({"fp16": True, "deepspeed": "z2.json"}, catalog_hardware("V100-32GBx2"), deepspeed_config=ds)


def test_a_dropped_deepspeed_json_fixes_nothing():
    ds = {"fp16": {"enabled": False}}
    p = plan({"bf16": True, "deepspeed": "z.json"}, catalog_hardware("V100-32GB"), deepspeed_config=ds)
    assert p.precision == "fp16" and "deepspeed" not in p.config


# ---------------------------------------------------------------- 4. the cards' kernels and links


@pytest.mark.parametrize(("card", "kept"), [("H100-80GB", True), ("L4", True), ("A100-80GB", False), ("none", False)])
def test_fp8_only_where_the_card_has_it(card, kept):
    p = plan({"fp8": True, "fp8_enable_fsdp_float8_all_gather": True}, catalog_hardware(card))
    assert p.config["fp8"] is kept and p.config["fp8_enable_fsdp_float8_all_gather"] is kept
    if not kept:
        assert "8.9" in {c.key: c for c in p.changes}["fp8"].reason


@pytest.mark.parametrize(
    ("card", "impl"), [("V100-32GB", "sdpa"), ("T4", "sdpa"), ("none", "sdpa"), ("A100-80GB", "fa2")]
)
def test_fa2_only_from_compute_capability_8(card, impl):
    p = plan({"flash_attn": "fa2"}, catalog_hardware(card))
    assert p.config["flash_attn"] == impl


@pytest.mark.parametrize(("card", "kept"), [("V100-32GB", False), ("T4", False), ("none", False), ("A100-80GB", True)])
def test_tf32_only_from_compute_capability_8(card, kept):
    """transformers refuses `tf32: true` before Ampere and on the CPU ("--tf32 requires Ampere or a newer
    GPU arch"): found by the user-config corpus (tests/data/user_configs/07-qwen25-3b-full-rtx4090.yaml)."""
    p = plan({"tf32": True}, catalog_hardware(card))
    assert p.config["tf32"] is kept
    if not kept:
        assert "8.0" in {c.key: c for c in p.changes}["tf32"].reason


def test_nccl_p2p_disable_where_the_gpus_cannot_reach_each_other():
    assert plan({}, catalog_hardware("RTX4090x2")).env["NCCL_P2P_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in plan({}, catalog_hardware("A100-80GBx2")).env
    assert "NCCL_P2P_DISABLE" not in plan({}, catalog_hardware("RTX4090")).env
    gpus = [Gpu(i, "g", 1, uuid=f"U{i}") for i in range(3)]
    assert blocked_pairs({("U0", "U1"): 0, ("U2", "U0"): 0, ("U1", "U2"): 0}, gpus) == ()
    assert blocked_pairs({("U0", "U1"): 0, ("U0", "U2"): 4, ("U1", "U2"): 0}, gpus) == ((0, 2),)
    assert blocked_pairs({("U0", "U1"): 0}, gpus) == ((0, 2), (1, 2))  # no answer: blocked


class FakeNvml:
    """A pynvml stand-in answering for two GPUs that have no P2P between them."""

    NVML_P2P_CAPS_INDEX_READ = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return "550.1"

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA GeForce RTX 4090"

    def nvmlDeviceGetMemoryInfo(self, h):
        class M:
            total = free = 24564 * 2**20

        return M()

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (8, 9)

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetP2PStatus(self, a, b, caps):
        return 4  # NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED


def test_probe_records_p2p_from_nvml_and_the_plan_disables_it():
    assert p2p_from_nvml(FakeNvml()) == {("GPU-0", "GPU-1"): 4}
    hw = probe({}, nvml_loader=FakeNvml)
    assert hw.p2p_blocked == ((0, 1),)
    assert Hardware.from_dict(hw.to_dict()).p2p_blocked == ((0, 1),)
    assert plan({}, hw).env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "NCCL_P2P_DISABLE": "1"}


# ---------------------------------------------------------------- 5. the recorded batch; CUDA-only methods


def test_the_recorded_global_batch_wins_over_source_gpus():
    values = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 16}
    hw = catalog_hardware("A100-80GB")
    first = plan(values, hw, PlanOptions(source_gpus=8))
    assert first.global_batch_target == 512
    text = dump_yaml(first.config, first.header)
    again = plan(yaml.safe_load(text), hw, PlanOptions(source_gpus=8), meta=read_header(text))
    assert again.global_batch_source == 512 and again.changes == ()
    assert any("recorded" in w and "--source-gpus 8 is ignored" in w for w in again.warnings)
    forced = plan(yaml.safe_load(text), hw, PlanOptions(source_gpus=8, global_batch=64), meta=read_header(text))
    assert forced.global_batch_target == 64
    assert "--global-batch" in {c.key: c for c in forced.changes}["gradient_accumulation_steps"].reason


def test_qlora_and_ptq_models_are_refused_without_a_gpu():
    with pytest.raises(HardwareError, match="needs a CUDA GPU"):
        plan({"finetuning_type": "lora", "quantization_bit": 4}, catalog_hardware("none"))
    awq = spec_from_config({**LLAMA3_8B, "quantization_config": AWQ})
    with pytest.raises(HardwareError, match="pre-quantized .*AWQ"):
        plan({"finetuning_type": "lora"}, catalog_hardware("none"), memory_chooser=chooser(awq))


# ---------------------------------------------------------------- 6. DeepSpeed not installed


def test_deepspeed_not_installed_plain_ddp_when_it_is_not_needed():
    hw = replace(catalog_hardware("A100-80GBx4"), versions={"deepspeed": None})
    values = {"finetuning_type": "lora", "do_train": True, "deepspeed": "ds_z2_config.json", "bf16": True}
    p = plan(values, hw, PlanOptions(), memory_chooser=chooser(spec_from_param_count("1B")))
    assert "deepspeed" not in p.config and p.env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}
    assert rules.DEEPSPEED_PIP in {c.key: c for c in p.changes}["deepspeed"].reason
    # unknown (a what-if card records no versions): kept
    assert plan(values, catalog_hardware("A100-80GBx4")).config["deepspeed"] == "ds_z2_config.json"


def test_deepspeed_not_installed_refused_with_the_pip_command_when_it_is_needed():
    hw = replace(catalog_hardware("A100-80GBx4"), versions={"deepspeed": None})
    values = {**FULL_7B, "deepspeed": "ds_z3_config.json"}
    with pytest.raises(DoesNotFitError, match="pip install --no-build-isolation deepspeed"):
        plan(values, hw, PlanOptions(), memory_chooser=chooser(spec_from_param_count("13B"), Z3), deepspeed_config=Z3)


def test_ktransformers_on_several_gpus_gets_use_kt_so_the_launcher_starts_no_torchrun():
    from ftlaunch.plan import rules

    assert rules.launch_env(1, gpus=4, deepspeed=False, kt=True) == {"USE_KT": "1"}
    assert rules.launch_env(1, gpus=1, deepspeed=False, kt=True) == {}
