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

__all__ = [
    "Rule",
    "ZERO3_SAFE_PTQ",
    "is_training",
    "predict_only",
    "ptq_of",
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
) -> dict[str, str]:
    """The trainer env that makes llamafactory-cli run exactly ``processes`` processes on a machine
    with ``gpus`` visible GPUs. The one place a planned world size becomes environment variables.

    - several processes: ``FORCE_TORCHRUN=1 NPROC_PER_NODE=n`` (and ``NCCL_P2P_DISABLE=1`` when the
      planned GPUs cannot reach each other peer to peer: NCCL hangs or errors otherwise);
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
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE=str(processes))
        if p2p_blocked:
            env["NCCL_P2P_DISABLE"] = "1"
        return env
    if gpus > 1 and pin is not None:
        env["CUDA_VISIBLE_DEVICES"] = pin
    if deepspeed:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="1")
    return env


# ------------------------------------------------------------------ DeepSpeed availability

DEEPSPEED_PIP = "pip install --no-build-isolation deepspeed"


def deepspeed_missing(versions: Mapping[str, str | None]) -> bool:
    """True only when a probe recorded that DeepSpeed is not installed (``versions["deepspeed"]``
    present and None). A what-if card or a hardware file without versions is not known to lack it."""
    return "deepspeed" in versions and versions["deepspeed"] is None


def names(rules: Sequence[Rule]) -> str:
    """The rules' names, for a reason or a message."""
    return ", ".join(r.name for r in rules)
