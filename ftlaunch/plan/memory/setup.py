"""The training setup the memory model reads, parsed from a merged LLaMA-Factory config.

``TrainSetup`` is what the formulas need to know about a run (method, precision, batch, sequence,
attention kernel, DeepSpeed stage and offload); ``setup_from_config`` fills it from a config the way
llamafactory would read it (absent keys take llamafactory's defaults), and ``default_optimizer``
names the optimizer HF Trainer picks when the config sets none. Pure: no files, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ftlaunch.plan.flags import truthy
from ftlaunch.plan.memory.optimizers import CustomOptimizer, custom_optimizer


@dataclass(frozen=True)
class TrainSetup:
    finetuning_type: str = "lora"  # "full" | "lora" | "freeze"  (llamafactory finetuning_type)
    quantization_bit: int | None = None  # 4 or 8 for QLoRA (llamafactory quantization_bit)
    lora_rank: int = 8
    lora_target: str = "all"  # "all" or comma list like "q_proj,v_proj"
    freeze_trainable_layers: int = 2
    compute_dtype: str = "bf16"  # "bf16" | "fp16" | "fp32"
    pure_bf16: bool = False  # llamafactory pure_bf16: weights in bf16, no fp32 master
    optimizer: str = "adamw_torch"  # llamafactory/HF key `optim`
    micro_batch: int = 1
    accumulation: int = 1  # gradient_accumulation_steps: > 1 keeps gradients alive in the forward pass
    seq_len: int = 2048  # cutoff_len
    packing: bool = False
    gradient_checkpointing: bool = True  # llamafactory default (disable_gradient_checkpointing=false)
    attn_impl: str = "sdpa"  # "eager" | "sdpa" | "fa2"
    zero_stage: int = 0  # DeepSpeed stage 0..3
    offload_optimizer: bool = False
    offload_params: bool = False
    world_size: int = 1
    # what LLaMA-Factory's create_custom_optimizer builds instead of ``optimizer`` (GaLore, APOLLO,
    # BAdam, Adam-mini, Muon; plan/memory/optimizers.py), None for HF's own
    custom: CustomOptimizer | None = None


def _attn_from_flash_attn(value: Any) -> str:
    # llamafactory AttentionFunction: auto -> transformers default (sdpa), disabled -> eager
    v = str(value or "auto").strip().lower()
    return {"disabled": "eager", "eager": "eager", "sdpa": "sdpa", "fa2": "fa2", "fa3": "fa2"}.get(v, "sdpa")


def _zero_from_name(name: str) -> tuple[int, bool, bool]:
    """Infer (stage, offload_optimizer, offload_params) from a DeepSpeed config *file name*.

    Used only when the caller passes no parsed dict: llamafactory's examples are named
    ds_z{0,2,3}[_offload]_config.json; ftlaunch's own value "ds_z3_offload" round-trips.
    """
    base = name.replace("\\", "/").rsplit("/", 1)[-1].lower()
    m = re.search(r"z(?:ero)?_?([0-3])", base)
    stage = int(m.group(1)) if m else 0
    offload = "offload" in base
    return stage, offload and stage >= 1, offload and stage == 3


def _zero_from_dict(ds: dict) -> tuple[int, bool, bool]:
    zero = ds.get("zero_optimization") or {}
    try:
        stage = int(zero.get("stage", 0) or 0)
    except (TypeError, ValueError):
        stage = 0

    def on_cpu(key: str) -> bool:
        sub = zero.get(key) or {}
        return isinstance(sub, dict) and str(sub.get("device", "none")).lower() == "cpu"

    return stage, on_cpu("offload_optimizer"), on_cpu("offload_param") and stage == 3


def deepspeed_stage(config: dict, deepspeed_config: dict | None = None) -> tuple[int, bool, bool]:
    """(ZeRO stage, offload_optimizer, offload_params) of ``config["deepspeed"]``: from the parsed
    JSON when given, else an inline dict, else the file name; (0, False, False) without DeepSpeed."""
    ds_value = (config or {}).get("deepspeed")
    if not ds_value:
        return 0, False, False
    if deepspeed_config is not None:
        return _zero_from_dict(deepspeed_config)
    if isinstance(ds_value, dict):
        return _zero_from_dict(ds_value)
    if isinstance(ds_value, str) and ds_value.strip():
        return _zero_from_name(ds_value)
    return 0, False, False


def _version_tuple(version: str | None) -> tuple[int, ...]:
    out: list[int] = []
    for part in re.split(r"[.+-]", version or "")[:3]:
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def default_optimizer(transformers_version: str | None, torch_version: str | None) -> str:
    """The ``optim`` HF TrainingArguments uses when the config sets none.

    transformers >= 4.54 defaults to ``adamw_torch_fused`` when torch >= 2.8 (training_args.py,
    ``default_optim``), else ``adamw_torch`` (foreach on CUDA). Unknown versions give the foreach
    variant, whose optimizer step needs more memory: the conservative guess.
    """
    if _version_tuple(transformers_version) >= (4, 54) and _version_tuple(torch_version) >= (2, 8):
        return "adamw_torch_fused"
    return "adamw_torch"


def setup_from_config(
    config: dict,
    world_size: int = 1,
    deepspeed_config: dict | None = None,
    default_optim: str = "adamw_torch",
) -> TrainSetup:
    """TrainSetup from a merged llamafactory config dict; absent keys take llamafactory's defaults.

    ``deepspeed_config`` is the parsed DeepSpeed JSON when ``config["deepspeed"]`` is a path (this
    function reads no files). Without it, a dict value of ``config["deepspeed"]`` is used, else the
    stage/offload are inferred from the file name. ``default_optim`` is the optimizer when ``optim``
    is unset (the caller reads the installed versions: :func:`default_optimizer`).
    """
    c = config or {}
    ft = str(c.get("finetuning_type") or "lora").lower()
    qbit = c.get("quantization_bit")
    qbit = int(qbit) if qbit not in (None, "", "none", "None") else None
    target = c.get("lora_target", "all")
    if isinstance(target, (list, tuple)):
        target = ",".join(str(t).strip() for t in target)
    pure_bf16 = truthy(c.get("pure_bf16"))
    # llamafactory get_train_args: bf16 or pure_bf16 -> bfloat16, elif fp16 -> float16
    if truthy(c.get("bf16")) or pure_bf16:
        dtype = "bf16"
    elif truthy(c.get("fp16")):
        dtype = "fp16"
    else:
        dtype = "fp32"
    packing = c.get("packing")
    packing = truthy(packing) if packing is not None else str(c.get("stage", "sft")) == "pt"

    if deepspeed_config is not None:  # parsed JSON given: the caller has checked the key is set
        stage, off_opt, off_par = _zero_from_dict(deepspeed_config)
    else:
        stage, off_opt, off_par = deepspeed_stage(c)

    return TrainSetup(
        finetuning_type=ft,
        quantization_bit=qbit,
        lora_rank=int(c.get("lora_rank", 8) or 8),
        lora_target=str(target or "all"),
        freeze_trainable_layers=int(c.get("freeze_trainable_layers", 2)),
        compute_dtype=dtype,
        pure_bf16=pure_bf16,
        optimizer=str(c.get("optim") or default_optim),  # see default_optimizer()
        micro_batch=int(c.get("per_device_train_batch_size", 8) or 8),  # HF default 8
        accumulation=max(1, int(c.get("gradient_accumulation_steps", 1) or 1)),
        seq_len=int(c.get("cutoff_len", 2048) or 2048),  # llamafactory DataArguments default
        packing=packing,
        gradient_checkpointing=not truthy(c.get("disable_gradient_checkpointing")),
        attn_impl=_attn_from_flash_attn(c.get("flash_attn")),
        zero_stage=stage,
        offload_optimizer=off_opt,
        offload_params=off_par,
        world_size=max(1, int(world_size)),
        custom=custom_optimizer(c),
    )
