"""LLaMA-Factory's own rules that a plan must obey, stated once. Pure: values in, verdicts out.

Each refusal is a ``Rule`` carrying LLaMA-Factory 0.9.5's message verbatim and where it is raised, so
a plan that cannot take a step (ZeRO-3 offload, several processes, a GPU) names the rule instead of
emitting a config the trainer would refuse. Also here, because each is one fact about the trainer:
which precision a DeepSpeed JSON already fixes, which cards have fp8 and FlashAttention-2, what a
planned world size means for every launch variable, and what a pre-quantized (PTQ) model is.

Sources (site-packages/llamafactory): hparams/parser.py ``get_train_args`` (ZeRO-3, distributed and
DeepSpeed refusals), model/model_utils/quantization.py ``configure_quantization`` (PTQ and on-the-fly
quantization under ZeRO-3), launcher.py (when torchrun is used), transformers
integrations/deepspeed.py ``trainer_config_process`` (fp16/bf16 ``enabled`` must match).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftlaunch.plan.flags import truthy
from ftlaunch.plan.keyschema import shipped_keys

__all__ = [
    "Rule",
    "ZERO3_SAFE_PTQ",
    "is_training",
    "predict_only",
    "ptq_of",
    "config_refusals",
    "missing_refusals",
    "zero3_refusals",
    "distributed_refusals",
    "deepspeed_refusals",
    "single_process",
    "cuda_only",
    "ds_precision",
    "has_fp8",
    "has_fa2",
    "launch_env",
    "LAUNCH_KEYS",
    "DEEPSPEED_PIP",
    "deepspeed_missing",
]


@dataclass(frozen=True)
class Rule:
    """One refusal: a short name, LLaMA-Factory's message verbatim, and where it is raised."""

    name: str
    message: str
    source: str

    def __str__(self) -> str:
        return f'LLaMA-Factory refuses it: "{self.message}" ({self.source})'


def _flag(values: Mapping[str, Any], key: str) -> bool:
    return truthy(values.get(key))


# ------------------------------------------------------------------ what the config does


def is_training(values: Mapping[str, Any]) -> bool:
    """``do_train`` as HF TrainingArguments reads it (default false: nothing trains without it)."""
    return _flag(values, "do_train")


def predict_only(values: Mapping[str, Any]) -> bool:
    """A config that evaluates or predicts and never trains: it must not be sized as training."""
    if is_training(values):
        return False
    return any(_flag(values, k) for k in ("do_predict", "do_eval", "predict_with_generate"))


# Pre-quantized methods LLaMA-Factory dequantizes at load (quantization.py:97-115): they load as
# 16-bit weights and are allowed under ZeRO-3.
ZERO3_SAFE_PTQ = ("mxfp4", "fp8")


def ptq_of(model_config: Mapping[str, Any] | None) -> tuple[str | None, int | None]:
    """(quant_method, weight bits) of a pre-quantized model's config.json ``quantization_config``;
    (None, None) for a model that is not. Bits are None where the weights load dequantized (fp8,
    mxfp4) or the width is not stated. AQLM is 2-bit (LLaMA-Factory sets ``bits = 2``, and its
    1x16 codebooks over groups of 8 are 2 bits a weight)."""
    qc = (model_config or {}).get("quantization_config")
    if not isinstance(qc, Mapping) or not qc:
        return None, None
    method = str(qc.get("quant_method") or "").lower() or "unknown"
    if method in ZERO3_SAFE_PTQ:
        return method, None
    if method == "aqlm":
        return method, 2
    if method == "bitsandbytes":
        if qc.get("load_in_4bit"):
            return method, 4
        if qc.get("load_in_8bit"):
            return method, 8
    bits = qc.get("bits", qc.get("w_bit"))
    try:
        return method, int(bits) if bits is not None else None
    except (TypeError, ValueError):
        return method, None


# ------------------------------------------------------------------ refusals


# ------------------------------------------------------------------ refusals of the config alone
#
# What LLaMA-Factory 0.9.5 refuses from the config's values alone, before a model or a device is
# looked at: the argument dataclasses' __post_init__ (raised inside HfArgumentParser.parse_dict) and
# get_train_args' checks in hparams/parser.py. Each is stated with its message verbatim and the line
# that raises it, so plain `plan` says it in milliseconds instead of the trainer after its imports.
# Left to their own shells: checks of the launch (parser.py:350, 353: the planner sets the launch
# env), of the device (parser.py:381 pure_bf16), of files (model_args.py:221 new_special_tokens_config,
# parser.py:495 output_dir), of installed packages (parser.py:205-256), of USE_MCA (parser.py:265-283).
# The ZeRO-3, distributed and DeepSpeed refusals, which depend on the plan, are the functions below.


def _lf(values: Mapping[str, Any], key: str) -> Any:
    """A key's value as LLaMA-Factory sees it: the config's, else its dataclass default (from the
    shipped key list, generated from the installed llamafactory)."""
    if key in values:
        return values[key]
    return shipped_keys().get("defaults", {}).get(key)


def _items(value: Any) -> list[str] | None:
    """A split_arg value (data_args.py:148): a comma string split and stripped, a list kept, None None."""
    if value is None:
        return None
    if isinstance(value, str):
        return [item.strip() for item in value.split(",")]
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def _num(value: Any, default: float = 0.0) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _report_to(value: Any) -> list[str] | None:
    """report_to as transformers normalises it (training_args.py:1560-1567), or None for "all" (the
    integrations installed where it trains: not the config's alone)."""
    names = [] if value is None else _items(value) if isinstance(value, (list, tuple)) else [str(value)]
    if names == ["all"]:
        return None
    return [] if names == ["none"] else names


def config_refusals(values: Mapping[str, Any]) -> tuple[Rule, ...]:
    """Every refusal LLaMA-Factory 0.9.5 raises from this training config's values alone (see above),
    in the order it meets them. It stops at the first; this lists all."""
    v = lambda key: _lf(values, key)  # noqa: E731
    on = lambda key: truthy(v(key))  # noqa: E731
    stage, ft = str(v("stage")), str(v("finetuning_type"))
    dataset, eval_dataset = _items(v("dataset")), _items(v("eval_dataset"))
    val_size, quant = _num(v("val_size")), v("quantization_bit")
    adapter = v("adapter_name_or_path")
    probs = _items(v("interleave_probs"))
    interleaved = probs is not None and v("mix_strategy") != "concat"  # data_args.py:165-169
    report = _report_to(v("report_to"))
    # transformers sets do_eval when an eval_strategy is set (training_args.py:1537)
    do_eval = on("do_eval") or str(v("eval_strategy") or "no") != "no"
    fa, pa, ma, pr = "hparams/finetuning_args.py", "hparams/data_args.py", "hparams/model_args.py", "hparams/parser.py"
    checks: list[tuple[bool, str, str, str]] = [
        # (refused?, keys, LLaMA-Factory's message, where)
        (ft not in ("lora", "oft", "freeze", "full"), "finetuning_type", "Invalid fine-tuning method.", f"{fa}:576"),
        (
            v("ref_model_quantization_bit") not in (None, 8, 4),
            "ref_model_quantization_bit",
            "We only accept 4-bit or 8-bit quantization.",
            f"{fa}:577",
        ),
        (
            v("reward_model_quantization_bit") not in (None, 8, 4),
            "reward_model_quantization_bit",
            "We only accept 4-bit or 8-bit quantization.",
            f"{fa}:578",
        ),
        (
            stage == "ppo" and v("reward_model") is None,
            "stage: ppo, reward_model",
            "`reward_model` is necessary for PPO training.",
            f"{fa}:581",
        ),
        (
            stage == "ppo" and v("reward_model_type") == "lora" and ft != "lora",
            "reward_model_type: lora, finetuning_type",
            "`reward_model_type` cannot be lora for Freeze/Full PPO training.",
            f"{fa}:584",
        ),
        (
            stage == "ppo" and v("reward_model_type") == "oft" and ft != "oft",
            "reward_model_type: oft, finetuning_type",
            "`reward_model_type` cannot be oft for Freeze/Full PPO training.",
            f"{fa}:587",
        ),
        (
            stage == "dpo" and v("pref_loss") != "sigmoid" and _num(v("dpo_label_smoothing")) > 1e-6,
            "pref_loss, dpo_label_smoothing",
            "`dpo_label_smoothing` is only valid for sigmoid loss function.",
            f"{fa}:590",
        ),
        (
            on("use_llama_pro") and ft == "full",
            "use_llama_pro, finetuning_type: full",
            "`use_llama_pro` is only valid for Freeze or LoRA training.",
            f"{fa}:593",
        ),
        (
            ft == "lora" and (on("use_galore") or on("use_apollo") or on("use_badam")),
            "finetuning_type: lora, " + ", ".join(k for k in ("use_galore", "use_apollo", "use_badam") if on(k)),
            "Cannot use LoRA with GaLore, APOLLO or BAdam together.",
            f"{fa}:596",
        ),
        (
            sum(on(k) for k in ("use_galore", "use_apollo", "use_badam")) > 1,
            ", ".join(k for k in ("use_galore", "use_apollo", "use_badam") if on(k)),
            "Cannot use GaLore, APOLLO or BAdam together.",
            f"{fa}:599",
        ),
        (
            # use_ref_model: dpo with a loss other than orpo/simpo (finetuning_args.py:574)
            on("pissa_init")
            and (stage in ("ppo", "kto") or (stage == "dpo" and v("pref_loss") not in ("orpo", "simpo"))),
            f"pissa_init, stage: {stage}",
            "Cannot use PiSSA for current training stage.",
            f"{fa}:602",
        ),
        (
            ft != "lora" and v("loraplus_lr_ratio") is not None,
            "loraplus_lr_ratio",
            "`loraplus_lr_ratio` is only valid for LoRA training.",
            f"{fa}:606",
        ),
        (ft != "lora" and on("use_rslora"), "use_rslora", "`use_rslora` is only valid for LoRA training.", f"{fa}:609"),
        (ft != "lora" and on("use_dora"), "use_dora", "`use_dora` is only valid for LoRA training.", f"{fa}:612"),
        (ft != "lora" and on("pissa_init"), "pissa_init", "`pissa_init` is only valid for LoRA training.", f"{fa}:615"),
        (
            dataset is None and val_size > 1e-6,
            "val_size, dataset",
            "Cannot specify `val_size` if `dataset` is None.",
            f"{pa}:160",
        ),
        (
            eval_dataset is not None and val_size > 1e-6,
            "val_size, eval_dataset",
            "Cannot specify `val_size` if `eval_dataset` is not None.",
            f"{pa}:163",
        ),
        (
            v("interleave_probs") is not None and v("mix_strategy") == "concat",
            "interleave_probs, mix_strategy: concat",
            "`interleave_probs` is only valid for interleaved mixing.",
            f"{pa}:167",
        ),
        (
            interleaved and dataset is not None and len(dataset) != len(probs or []),
            "dataset, interleave_probs",
            "The length of dataset and interleave probs should be identical.",
            f"{pa}:171",
        ),
        (
            interleaved and eval_dataset is not None and len(eval_dataset) != len(probs or []),
            "eval_dataset, interleave_probs",
            "The length of eval dataset and interleave probs should be identical.",
            f"{pa}:174",
        ),
        (
            on("streaming") and 1e-6 < val_size < 1,
            "streaming, val_size",
            "Streaming mode should have an integer val size.",
            f"{pa}:177",
        ),
        (
            on("streaming") and v("max_samples") is not None,
            "streaming, max_samples",
            "`max_samples` is incompatible with `streaming`.",
            f"{pa}:180",
        ),
        (
            on("mask_history") and on("train_on_prompt"),
            "mask_history, train_on_prompt",
            "`mask_history` is incompatible with `train_on_prompt`.",
            f"{pa}:183",
        ),
        (
            _num(v("image_max_pixels")) < _num(v("image_min_pixels")),
            "image_max_pixels, image_min_pixels",
            "`image_max_pixels` cannot be smaller than `image_min_pixels`.",
            f"{ma}:348",
        ),
        (
            _num(v("video_max_pixels")) < _num(v("video_min_pixels")),
            "video_max_pixels, video_min_pixels",
            "`video_max_pixels` cannot be smaller than `video_min_pixels`.",
            f"{ma}:351",
        ),
        (
            v("export_quantization_bit") is not None and v("export_quantization_dataset") is None,
            "export_quantization_bit, export_quantization_dataset",
            "Quantization dataset is necessary for exporting.",
            f"{ma}:397",
        ),
        (
            stage != "sft" and on("predict_with_generate"),
            f"predict_with_generate, stage: {stage}",
            "`predict_with_generate` cannot be set as True except SFT.",
            f"{pr}:318",
        ),
        (
            stage != "sft" and on("neat_packing"),
            f"neat_packing, stage: {stage}",
            "`neat_packing` cannot be set as True except SFT.",
            f"{pr}:321",
        ),
        (
            stage != "sft" and (on("train_on_prompt") or on("mask_history")),
            f"train_on_prompt/mask_history, stage: {stage}",
            "`train_on_prompt` or `mask_history` cannot be set as True except SFT.",
            f"{pr}:324",
        ),
        (
            stage == "sft" and on("do_predict") and not on("predict_with_generate"),
            "do_predict, predict_with_generate",
            "Please enable `predict_with_generate` to save model predictions.",
            f"{pr}:327",
        ),
        (
            stage in ("rm", "ppo") and on("load_best_model_at_end"),
            f"load_best_model_at_end, stage: {stage}",
            "RM and PPO stages do not support `load_best_model_at_end`.",
            f"{pr}:330",
        ),
        (
            stage == "ppo" and not on("do_train"),
            "stage: ppo, do_train",
            "PPO training does not support evaluation, use the SFT stage to evaluate models.",
            f"{pr}:334",
        ),
        (
            stage == "ppo" and on("shift_attn"),
            "stage: ppo, shift_attn",
            "PPO training is incompatible with S^2-Attn.",
            f"{pr}:337",
        ),
        (
            stage == "ppo" and v("reward_model_type") == "lora" and on("use_kt"),
            "reward_model_type: lora, use_kt",
            "KTransformers does not support lora reward model.",
            f"{pr}:340",
        ),
        (
            stage == "ppo" and v("reward_model_type") == "lora" and on("use_unsloth"),
            "reward_model_type: lora, use_unsloth",
            "Unsloth does not support lora reward model.",
            f"{pr}:343",
        ),
        (
            stage == "ppo"
            and report is not None
            and any(r not in ("wandb", "tensorboard", "trackio", "none") for r in report),
            "stage: ppo, report_to",
            "PPO only accepts wandb, tensorboard, or trackio logger.",
            f"{pr}:348",
        ),
        (
            v("max_steps") == -1 and on("streaming"),
            "streaming, max_steps",
            "Please specify `max_steps` in streaming mode.",
            f"{pr}:357",
        ),
        (
            (do_eval or on("do_predict") or on("predict_with_generate")) and eval_dataset is None and val_size < 1e-6,
            "do_eval/do_predict/eval_strategy, eval_dataset, val_size",
            "Please make sure eval_dataset be provided or val_size >1e-6",
            f"{pr}:365",
        ),
        (
            on("predict_with_generate") and on("compute_accuracy"),
            "predict_with_generate, compute_accuracy",
            "Cannot use `predict_with_generate` and `compute_accuracy` together.",
            f"{pr}:372",
        ),
        (
            on("do_train") and v("quantization_device_map") == "auto",
            "quantization_device_map: auto",
            "Cannot use device map for quantized models in training.",
            f"{pr}:375",
        ),
        (
            on("fp8") and quant is not None,
            "fp8, quantization_bit",
            "FP8 training is not compatible with quantization. Please disable one of them.",
            f"{pr}:404",
        ),
        (
            v("infer_backend") not in (None, "huggingface"),
            "infer_backend",
            "vLLM/SGLang backend is only available for API, CLI and Web.",
            f"{pr}:407",
        ),
        (
            adapter is not None and ft != "lora",
            "adapter_name_or_path, finetuning_type",
            "Adapter is only valid for the LoRA method.",
            f"{pr}:186",
        ),
        (
            quant is not None and ft not in ("lora", "oft"),
            "quantization_bit, finetuning_type",
            "Quantization is only compatible with the LoRA or OFT method.",
            f"{pr}:190",
        ),
        (
            quant is not None and on("pissa_init"),
            "quantization_bit, pissa_init",
            "Please use scripts/pissa_init.py to initialize PiSSA for a quantized model.",
            f"{pr}:193",
        ),
        (
            quant is not None and on("resize_vocab"),
            "quantization_bit, resize_vocab",
            "Cannot resize embedding layers of a quantized model.",
            f"{pr}:196",
        ),
        (
            quant is not None and adapter is not None and on("create_new_adapter"),
            "quantization_bit, adapter_name_or_path, create_new_adapter",
            "Cannot create new adapter upon a quantized model.",
            f"{pr}:199",
        ),
        (
            quant is not None and adapter is not None and len(str(adapter).split(",")) != 1,
            "quantization_bit, adapter_name_or_path",
            "Quantized model only accepts a single adapter. Merge them first.",
            f"{pr}:202",
        ),
        (
            report is not None and "trackio" in report and not v("project"),
            "report_to: trackio, project",
            "`--project` must be specified when using Trackio.",
            f"{pr}:137",
        ),
    ]
    return tuple(Rule(keys, message, where) for refused, keys, message, where in checks if refused)


def missing_refusals(values: Mapping[str, Any]) -> tuple[Rule, ...]:
    """LLaMA-Factory's refusals of a config that lacks what training needs: no model
    (model_args.py:208), or do_train without a dataset (parser.py:360). Apart from config_refusals:
    a config without them can still be planned (a fragment, to compare cards), so `plan` warns of them
    (ftlaunch.plan.config.resolve_paths) and `train` leaves them to the trainer's own first check,
    as ftlaunch's runs with a scripted trainer need."""
    out = []
    if values.get("model_name_or_path") is None:
        out.append(Rule("model_name_or_path", "Please provide `model_name_or_path`.", "hparams/model_args.py:208"))
    if truthy(values.get("do_train")) and values.get("dataset") is None:
        out.append(Rule("do_train, dataset", "Please specify dataset for training.", "hparams/parser.py:360"))
    return tuple(out)


def zero3_refusals(values: Mapping[str, Any], ptq: str | None = None) -> tuple[Rule, ...]:
    """Every reason LLaMA-Factory refuses this config under DeepSpeed ZeRO-3 (offload or not).

    ``ptq`` is the model's pre-quantization method (:func:`ptq_of` of its config.json), if any."""
    out: list[Rule] = []
    if _flag(values, "predict_with_generate"):
        out.append(
            Rule(
                "predict_with_generate",
                "`predict_with_generate` is incompatible with DeepSpeed ZeRO-3.",
                "hparams/parser.py:369",
            )
        )
    if _flag(values, "pissa_init"):  # pissa_convert does not matter: the check is pissa_init alone
        out.append(
            Rule(
                "pissa_init",
                "Please use scripts/pissa_init.py to initialize PiSSA in DeepSpeed ZeRO-3.",
                "hparams/parser.py:378",
            )
        )
    if _flag(values, "pure_bf16"):
        out.append(Rule("pure_bf16", "`pure_bf16` is incompatible with DeepSpeed ZeRO-3.", "hparams/parser.py:385"))
    if _flag(values, "use_unsloth"):
        out.append(Rule("use_unsloth", "Unsloth is incompatible with DeepSpeed ZeRO-3.", "hparams/parser.py:410"))
    if _flag(values, "use_kt"):
        out.append(Rule("use_kt", "KTransformers is incompatible with DeepSpeed ZeRO-3.", "hparams/parser.py:413"))
    method = ptq
    if method is not None and method not in ZERO3_SAFE_PTQ:
        out.append(
            Rule(
                f"ptq:{method}",
                "DeepSpeed ZeRO-3 or FSDP is incompatible with PTQ-quantized models.",
                "model/model_utils/quantization.py:101",
            )
        )
    elif method is None and values.get("quantization_bit") not in (None, "", "none", "None"):
        qmethod = str(values.get("quantization_method") or "bnb").lower()
        bits = str(values.get("quantization_bit"))
        if qmethod == "bnb" and bits != "4":
            out.append(
                Rule(
                    "quantization_bit",
                    "Only 4-bit quantized model can use fsdp+qlora or auto device map.",
                    "model/model_utils/quantization.py:188",
                )
            )
        elif qmethod in ("hqq", "eetq"):
            out.append(
                Rule(
                    f"quantization_method:{qmethod}",
                    f"{qmethod.upper()} quantization is incompatible with DeepSpeed ZeRO-3 or FSDP.",
                    "model/model_utils/quantization.py:200" if qmethod == "hqq" else "quantization.py:212",
                )
            )
    return tuple(out)


def distributed_refusals(values: Mapping[str, Any], *, zero3: bool) -> tuple[Rule, ...]:
    """Reasons LLaMA-Factory refuses this config with several processes (``zero3``: the plan runs
    ZeRO-3, which layer-wise BAdam needs there)."""
    out: list[Rule] = []
    if _flag(values, "use_galore") and _flag(values, "galore_layerwise"):
        out.append(
            Rule(
                "galore_layerwise",
                "Distributed training does not support layer-wise GaLore.",
                "hparams/parser.py:389",
            )
        )
    if _flag(values, "use_apollo") and _flag(values, "apollo_layerwise"):
        out.append(
            Rule(
                "apollo_layerwise",
                "Distributed training does not support layer-wise APOLLO.",
                "hparams/parser.py:392",
            )
        )
    if _flag(values, "use_badam"):
        if str(values.get("badam_mode") or "layer") == "ratio":
            out.append(
                Rule(
                    "badam_ratio",
                    "Radio-based BAdam does not yet support distributed training, use layer-wise BAdam.",
                    "hparams/parser.py:396",
                )
            )
        elif not zero3:
            out.append(
                Rule(
                    "badam_layer",
                    "Layer-wise BAdam only supports DeepSpeed ZeRO-3 training.",
                    "hparams/parser.py:398",
                )
            )
    return tuple(out)


def deepspeed_refusals(values: Mapping[str, Any]) -> tuple[Rule, ...]:
    """Reasons LLaMA-Factory refuses any DeepSpeed config (any stage) for this config."""
    if _flag(values, "use_galore") or _flag(values, "use_apollo"):
        return (
            Rule("galore_apollo", "GaLore and APOLLO are incompatible with DeepSpeed yet.", "hparams/parser.py:401"),
        )
    return ()


def single_process(values: Mapping[str, Any]) -> str | None:
    """Why the trainer runs one process whatever the machine, or None. KTransformers trains in one
    process over the visible GPUs; the launcher skips torchrun for it only when the environment says
    USE_KT=1 (launcher.py:60 reads ``use_kt()``, an env flag, not the config key)."""
    if _flag(values, "use_kt"):
        return "KTransformers (use_kt) trains in one process: USE_KT=1 keeps llamafactory-cli from launching torchrun"
    return None


def cuda_only(values: Mapping[str, Any], ptq: str | None = None, bits: int | None = None) -> str | None:
    """Why this config (on a model pre-quantized with ``ptq`` at ``bits``) cannot train without a
    CUDA GPU, or None."""
    method = ptq
    if method is not None and method not in ZERO3_SAFE_PTQ:
        width = f"{bits}-bit " if bits else ""
        return (
            f"the model is pre-quantized ({width}{method.upper()}, quantization_config in its config.json): "
            "its kernels need a CUDA GPU"
        )
    if values.get("quantization_bit") not in (None, "", "none", "None"):
        qmethod = str(values.get("quantization_method") or "bnb")
        return (
            f"quantization_bit {values.get('quantization_bit')} (QLoRA, {qmethod}) quantizes the weights with "
            "CUDA kernels (bitsandbytes): it needs a CUDA GPU"
        )
    return None


# ------------------------------------------------------------------ precision and kernels


def ds_precision(ds: Mapping[str, Any] | None) -> dict[str, bool]:
    """The precisions a DeepSpeed JSON hard-codes: {"fp16": bool, "bf16": bool} for each section
    whose ``enabled`` is true or false (not "auto", not absent). transformers refuses a mismatch
    with the TrainingArguments ("ds fp16.enabled=False vs hf fp16")."""
    out: dict[str, bool] = {}
    for key in ("fp16", "bf16"):
        section = (ds or {}).get(key)
        if not isinstance(section, Mapping) or "enabled" not in section:
            continue
        enabled = section["enabled"]
        if isinstance(enabled, str) and enabled.strip().lower() == "auto":
            continue
        out[key] = truthy(enabled)
    return out


def has_fp8(cc: tuple[int, int] | None) -> bool:
    """fp8 tensor cores: Ada (8.9) and Hopper (9.0) or newer; unknown capability fails closed."""
    return cc is not None and cc >= (8, 9)


def has_fa2(cc: tuple[int, int] | None) -> bool:
    """FlashAttention-2 kernels: Ampere (8.0) or newer; unknown capability fails closed."""
    return cc is not None and cc >= (8, 0)


# ------------------------------------------------------------------ what a world size means

# Every variable llamafactory-cli's launcher reads to decide how many processes run (launcher.py:64-77)
# that a plan sets; NNODES, NODE_RANK and MASTER_* are the multi-node launcher's (ftlaunch plans one
# node; a Slurm batch step exports them itself), so a plan never sets them.
LAUNCH_KEYS = ("FORCE_TORCHRUN", "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES", "NCCL_P2P_DISABLE")


def launch_env(
    processes: int,
    *,
    gpus: int,
    deepspeed: bool,
    pin: str | None = None,
    p2p_blocked: bool = False,
    kt: bool = False,
    nodes: int = 1,
) -> dict[str, str]:
    """The trainer env that makes llamafactory-cli run exactly ``processes`` processes over ``nodes``
    nodes, each with ``gpus`` visible GPUs. The one place a planned world size becomes environment
    variables.

    - several processes: ``FORCE_TORCHRUN=1 NPROC_PER_NODE=n`` (and ``NCCL_P2P_DISABLE=1`` when the
      planned GPUs cannot reach each other peer to peer: NCCL hangs or errors otherwise); over
      several nodes ``NNODES=m`` too, and ``NPROC_PER_NODE`` is each node's share (a node's
      ``NODE_RANK`` and ``MASTER_ADDR`` are set where it starts: run/slurm/sbatch.py);
    - one process with DeepSpeed: ``FORCE_TORCHRUN=1 NPROC_PER_NODE=1`` (parser.py:354 refuses
      DeepSpeed outside torchrun, even on one device);
    - one process on a machine with several GPUs: ``CUDA_VISIBLE_DEVICES=pin`` (the launcher would
      otherwise start torchrun over every visible GPU, launcher.py:60); ``kt``: KTransformers keeps
      every GPU in its one process, with ``USE_KT=1`` so the launcher starts no torchrun;
    - one process otherwise: nothing.
    """
    env: dict[str, str] = {}
    if kt and gpus > 1:
        env["USE_KT"] = "1"
    if processes > 1:
        env.update(torchrun_env(processes, nodes))
        if p2p_blocked:
            env["NCCL_P2P_DISABLE"] = "1"
        return env
    if gpus > 1 and pin is not None:
        env["CUDA_VISIBLE_DEVICES"] = pin
    if deepspeed:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="1")
    return env


def torchrun_env(processes: int, nodes: int = 1) -> dict[str, str]:
    """torchrun over ``processes`` processes on ``nodes`` nodes, as many on each."""
    if nodes > 1:
        return {"FORCE_TORCHRUN": "1", "NNODES": str(nodes), "NPROC_PER_NODE": str(processes // nodes)}
    return {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(processes)}


# ------------------------------------------------------------------ DeepSpeed availability

DEEPSPEED_PIP = "pip install --no-build-isolation deepspeed"


def deepspeed_missing(versions: Mapping[str, str | None]) -> bool:
    """True only when a probe recorded that DeepSpeed is not installed (``versions["deepspeed"]``
    present and None). A what-if card or a hardware file without versions is not known to lack it."""
    return "deepspeed" in versions and versions["deepspeed"] is None


def names(rules: Sequence[Rule]) -> str:
    """The rules' names, for a reason or a message."""
    return ", ".join(r.name for r in rules)
