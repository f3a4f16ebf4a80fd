"""A pure GPU-memory model for LLaMA-Factory training, and the micro-batch choice built on it.

No I/O, no torch. Every number is in GiB (2**30 bytes). The model, its sources and where it
deviates from them are written up in ``docs/memory-model.md``; each function below names the
formula it implements.

Peak per GPU = overhead + max(forward/backward phase, optimizer-step phase), where
  forward/backward = weights + gradients + optimizer states + activations + logits
  optimizer step   = resident weights + gradients + optimizer states + step temporaries
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ftlaunch.plan.modelspec import ModelSpec, layer_params, linear_shapes

__all__ = [
    "GIB",
    "CUDA_CONTEXT_GIB",
    "NCCL_GIB",
    "FRAGMENTATION",
    "TrainSetup",
    "MemoryEstimate",
    "Choice",
    "FITS",
    "TIGHT",
    "DOES_NOT_FIT",
    "MIN_HEADROOM",
    "gib_pair",
    "verdict_of",
    "default_optimizer",
    "setup_from_config",
    "trainable_params",
    "estimate",
    "peak_from_tensors",
    "choose_micro_batch",
    "corrected",
    "korthikanti_layer_bytes",
    "deepspeed_zero2_gpu_bytes",
    "deepspeed_zero3_gpu_bytes",
    "largest_module_params",
]

GIB = float(2**30)

# Overhead outside the tensors PyTorch allocates (see docs/memory-model.md, "Overhead"), from the
# one real ledger this project has (a V100 OOM: 27.81 GiB allocated, 1.02 GiB reserved but
# unallocated, 30.30 GiB used by the process):
CUDA_CONTEXT_GIB = 1.5  # outside PyTorch's allocator: context, cuBLAS/cuDNN workspaces, kernels
NCCL_GIB = 0.4  # NCCL communicator buffers when world_size > 1
FRAGMENTATION = 0.04  # caching-allocator reserved/allocated slack, as a fraction of the tensor peak
DS_BUFFER_FACTOR = 1.5  # DeepSpeed estimators' additional_buffer_factor for host RAM

_ATTN = ("eager", "sdpa", "fa2")
_FT_TYPES = ("full", "lora", "freeze", "oft")


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


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory of one training step, GiB.

    ``activations_gib`` = stored activations + one layer's backward working set; ``logits_gib`` =
    the loss peak. The two working sets do not coexist, so ``peak_gib`` = ``overhead_gib`` +
    max(weights + gradients + optimizer + stored + max(working set, logits),
        resident weights + gradients + optimizer + ``transient_gib``), not the sum of the fields.
    """

    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float
    peak_gib: float
    host_gib: float  # host RAM needed for offloaded states (0 without offload)
    trainable_params: int
    transient_gib: float = 0.0  # optimizer-step temporaries (foreach AdamW); only in the step phase
    tensors_gib: float = 0.0  # predicted torch.cuda.max_memory_allocated() (peak without overhead)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ============================================================================================
# llamafactory config -> TrainSetup
# ============================================================================================


def _as_bool(value: Any, default: bool = False) -> bool:
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


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
    pure_bf16 = _as_bool(c.get("pure_bf16"))
    # llamafactory get_train_args: bf16 or pure_bf16 -> bfloat16, elif fp16 -> float16
    if _as_bool(c.get("bf16")) or pure_bf16:
        dtype = "bf16"
    elif _as_bool(c.get("fp16")):
        dtype = "fp16"
    else:
        dtype = "fp32"
    packing = c.get("packing")
    packing = _as_bool(packing) if packing is not None else str(c.get("stage", "sft")) == "pt"

    stage, off_opt, off_par = 0, False, False
    ds_value = c.get("deepspeed")
    if deepspeed_config is not None:
        stage, off_opt, off_par = _zero_from_dict(deepspeed_config)
    elif isinstance(ds_value, dict):
        stage, off_opt, off_par = _zero_from_dict(ds_value)
    elif isinstance(ds_value, str) and ds_value.strip():
        stage, off_opt, off_par = _zero_from_name(ds_value)

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
        gradient_checkpointing=not _as_bool(c.get("disable_gradient_checkpointing")),
        attn_impl=_attn_from_flash_attn(c.get("flash_attn")),
        zero_stage=stage,
        offload_optimizer=off_opt,
        offload_params=off_par,
        world_size=max(1, int(world_size)),
    )


# ============================================================================================
# Parameter bookkeeping
# ============================================================================================

_LORA_ALIASES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),  # phi3 fused projection
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w1": ("gate_proj",),
    "w3": ("up_proj",),
    "w2": ("down_proj",),
}


def _lora_modules(spec: ModelSpec, target: str) -> list[tuple[int, int, int]]:
    """(in, out, count) of every nn.Linear LoRA wraps.

    llamafactory ``lora_target: all`` = every nn.Linear except lm_head (find_all_linear_modules).
    """
    shapes = linear_shapes(spec)
    names: list[str] = []
    for raw in str(target or "all").split(","):
        name = raw.strip()
        if not name:
            continue
        if name == "all":
            names.extend(shapes)
        else:
            names.extend(_LORA_ALIASES.get(name, (name,)))
    out: list[tuple[int, int, int]] = []
    for name in dict.fromkeys(names):  # de-duplicated, order kept
        out.extend(shapes.get(name, []))
    return out


def _linear_weight_params(spec: ModelSpec) -> int:
    """Weights of all decoder nn.Linear layers: what bitsandbytes replaces with Linear4bit/8bitLt.

    lm_head / embeddings are kept in the compute dtype (transformers get_keys_to_not_convert), and
    MoE experts (3-D parameters in transformers v5) and norms are not nn.Linear either.
    """
    return sum(i * o * c for entries in linear_shapes(spec).values() for i, o, c in entries)


def trainable_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """Parameters with requires_grad under llamafactory's adapter setup.

    full: all; freeze: |freeze_trainable_layers| decoder layers (llamafactory _setup_freeze_tuning,
    freeze_trainable_modules=all); lora/oft: r * (in + out) per wrapped nn.Linear (lora_A: r x in,
    lora_B: out x r).
    """
    ft = setup.finetuning_type
    if ft == "full":
        return spec.params
    if ft == "freeze":
        n = min(abs(int(setup.freeze_trainable_layers)), spec.num_layers)
        return int(round(n * layer_params(spec)))
    if ft in ("lora", "oft"):
        return sum(setup.lora_rank * (i + o) * c for i, o, c in _lora_modules(spec, setup.lora_target))
    raise ValueError(f"unknown finetuning_type {ft!r} (expected full, lora or freeze)")


def largest_module_params(spec: ModelSpec) -> int:
    """Largest number of parameters held directly by one module (DeepSpeed's largest_layer_params).

    DeepSpeed ``model_to_params`` takes max over modules of sum(p.numel() for p in
    m.parameters(recurse=False)): for LLMs that is the embedding / lm_head (V*h), a projection, or
    the fused MoE experts module (E * 3 * h * moe_intermediate).
    """
    h = spec.hidden_size
    cands = [spec.vocab_size * h]
    for entries in linear_shapes(spec).values():
        cands.extend(i * o for i, o, _ in entries)
    if spec.num_experts:
        cands.append(spec.num_experts * 3 * h * spec.moe_intermediate_size)
    return max(cands)


def _dtype_bytes(dtype: str) -> int:
    d = dtype.lower()
    if d in ("bf16", "fp16", "bfloat16", "float16", "half"):
        return 2
    if d in ("fp32", "float32", "float"):
        return 4
    raise ValueError(f"unknown compute_dtype {dtype!r} (expected bf16, fp16 or fp32)")


def _quant_bytes_per_param(bits: int, in_features: int) -> float:
    """Bytes per quantized weight.

    4-bit bitsandbytes NF4 (llamafactory default double_quantization=True): 0.5 byte + one 8-bit
    absmax per 64-weight block + one fp32 constant per 256 blocks = 0.5 + 1/64 + 4/(64*256).
    8-bit LLM.int8: 1 byte + one fp32 scale per output row = 1 + 4/in_features.
    Other bit widths (HQQ): bits/8 + fp16 scale and zero per 64-weight group.
    """
    if bits == 4:
        return 0.5 + 1 / 64 + 4 / (64 * 256)
    if bits == 8:
        return 1.0 + 4 / max(1, in_features)
    return bits / 8 + 4 / 64


def _optimizer_state_bytes(optim: str, state_bytes: int, spec: ModelSpec) -> float:
    """Optimizer state bytes per trainable parameter (states kept in the parameter's dtype).

    HF "model memory anatomy": AdamW 8 bytes/param (two fp32 moments), 8-bit AdamW (bitsandbytes)
    2 bytes (+ one fp32 absmax per 256-value block per state), Adafactor ~4 bytes per row+column of
    each matrix (factored second moment, no first moment by default), SGD 0 (HF passes no momentum).
    """
    o = optim.lower()
    if "8bit" in o or "bnb" in o:
        states = 1 if "lion" in o else 2
        return states * (1 + 4 / 256)
    if "4bit" in o:
        return 2 * (0.5 + 4 / 128)
    if "adafactor" in o:
        return state_bytes * 2 / spec.hidden_size
    if o.startswith("sgd"):
        return 0.0
    if "lion" in o or "adagrad" in o or "rmsprop" in o:
        return state_bytes * 1.0
    if "ademamix" in o:
        return state_bytes * 3.0
    return state_bytes * 2.0  # AdamW family (adamw_torch, _fused, adamw_hf, apex, galore, ...)


def _optimizer_step_transient(optim: str) -> float:
    """Multiples of the trainable parameter bytes allocated as temporaries at optimizer.step().

    torch.optim foreach implementations (the default for adamw_torch on CUDA) use "~ sizeof(params)
    more peak memory than the for-loop version due to the intermediates" (torch.optim docs; in
    _multi_tensor_adam it is exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)). Fused and
    bitsandbytes optimizers update in place.
    """
    o = optim.lower()
    if "fused" in o or "8bit" in o or "bnb" in o or "4bit" in o or o.startswith("sgd") or "adafactor" in o:
        return 0.0
    return 1.0


# ============================================================================================
# Published reference formulas (used directly and by the tests)
# ============================================================================================


def deepspeed_zero2_gpu_bytes(total_params: int, num_gpus: int, cpu_offload: bool) -> tuple[int, int]:
    """DeepSpeed estimate_zero2_model_states_mem_needs (stage_1_and_2.py), one node: (gpu, cpu).

    gpu = 2P with offload, else 4P + 16P/N; cpu = P * max(4N, 16) * 1.5 with offload, else 4PN*1.5.
    """
    n = num_gpus
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * n, 16) * DS_BUFFER_FACTOR
    else:
        gpu = 4 * total_params + int(16 * total_params / n)
        cpu = total_params * 4 * n * DS_BUFFER_FACTOR
    return int(gpu), int(cpu)


def deepspeed_zero3_gpu_bytes(
    total_params: int, largest_layer_params: int, num_gpus: int, offload_optimizer: bool, offload_params: bool
) -> tuple[int, int]:
    """DeepSpeed estimate_zero3_model_states_mem_needs (stage3.py), one node, zero_init=True: (gpu, cpu).

    largest = 4 * largest_layer_params; gpu = largest (+2P/N without param offload) with optimizer
    offload, else largest + 18P/N; cpu = 18P*1.5 / 16P*1.5 / largest_layer*4*N*1.5.
    """
    largest = 4 * largest_layer_params
    n = num_gpus
    if offload_optimizer:
        if offload_params:
            gpu = largest
            cpu = total_params * 18 * DS_BUFFER_FACTOR
        else:
            gpu = largest + int(2 * total_params / n)
            cpu = total_params * 16 * DS_BUFFER_FACTOR
    else:
        gpu = largest + int(18 * total_params / n)
        cpu = largest_layer_params * 4 * n * DS_BUFFER_FACTOR
    return int(gpu), int(cpu)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> float:
    """Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    eq. (1): activation bytes per GPT layer, 16-bit, no parallelism, no recomputation:
    s*b*h*(34 + 5*a*s/h). Kept as the reference the llama-style count below is derived from.
    """
    return s * b * h * (34 + 5 * a * s / h)


# ============================================================================================
# Components
# ============================================================================================


@dataclass(frozen=True)
class _States:
    weights: float  # bytes, forward/backward phase (incl. autocast copies)
    weights_resident: float  # bytes at the optimizer step
    grads: float
    optimizer: float
    transient: float
    host: float
    head_copy: float = 0.0  # autocast copy of a trainable fp32 lm_head, saved for its backward
    embedding_grad_extra: float = 0.0  # embedding-gradient temporaries at the end of backward


def _model_states(spec: ModelSpec, setup: TrainSetup, trainable: int) -> _States:
    """Weights, gradients, optimizer states per GPU, and host RAM for offloaded states.

    No DeepSpeed (HF Trainer + torch AMP, llamafactory adapter.py):
      - frozen weights at the load dtype (compute dtype: 2 bytes bf16/fp16, 4 fp32), or quantized
        (nn.Linear weights at _quant_bytes_per_param, everything else at the compute dtype);
      - trainable weights upcast to fp32 unless pure_bf16 ("cast_trainable_params_to_fp32");
      - AMP autocast caches a 16-bit copy of every fp32 trainable weight during forward (2 bytes);
      - gradients in the trainable parameter's dtype; optimizer states per _optimizer_state_bytes.
      Full AMP: 4 + 2 + 4 + 8 = 18 bytes/param (LLaMA-Factory README "Full (bf16 or fp16)": 18x GB);
      pure_bf16: 2 + 2 + 4 = 8 bytes/param (README "Full (pure_bf16)": 8x GB).
    ZeRO-1/2 (DeepSpeed estimate_zero2_model_states_mem_needs, generalised to a trainable subset T):
      16-bit params 2P + 16-bit grads 2T + fp32 grad partition 4T/N + (fp32 master 4 + states) T/N
      = 4P + 16P/N for full Adam; optimizer offload leaves only the 16-bit params (2P) on the GPU.
    ZeRO-3 (estimate_zero3_model_states_mem_needs): all of the above partitioned over N plus
      4 * largest_layer_params for the gathered layer = 4L + 18P/N; offload_optimizer: 4L + 2P/N;
      offload both: 4L.
    Host RAM (offload): DeepSpeed's cpu terms with its 1.5 buffer factor: 1.5 * (fp32 master, grads,
      states of T) [+ 1.5 * 16-bit params with param offload] = 24P / 27P for full Adam.
    """
    n = max(1, setup.world_size)
    P = spec.params
    T = trainable
    act_bytes = _dtype_bytes(setup.compute_dtype)
    quant = setup.quantization_bit
    if quant is not None and setup.finetuning_type not in ("lora", "oft"):
        raise ValueError("quantized models can only be trained with LoRA (llamafactory adapter.py)")

    # frozen + trainable-base bytes at load time
    if quant is not None:
        lin = _linear_weight_params(spec)
        qbytes = lin * _quant_bytes_per_param(quant, spec.hidden_size)
        base_bytes = qbytes + (P - lin) * act_bytes
    else:
        base_bytes = P * act_bytes

    ft = setup.finetuning_type
    base_trainable = T if ft in ("full", "freeze") else 0  # part of the base model that trains
    adapter = T if ft in ("lora", "oft") else 0
    frozen_bytes = base_bytes * (1 - base_trainable / P) if P else 0.0

    if setup.zero_stage == 0:
        upcast = not setup.pure_bf16  # adapter.py: cast_trainable_params_to_fp32
        wt = 4 if upcast else act_bytes  # trainable param (and grad, state) dtype
        amp_copy = 2 if (upcast and act_bytes == 2) else 0  # autocast weight cache
        resident = frozen_bytes + T * wt
        weights = resident + T * amp_copy
        grads = T * wt
        opt = T * _optimizer_state_bytes(setup.optimizer, wt, spec)
        transient = T * wt * _optimizer_step_transient(setup.optimizer)
        head_copy = 0.0
        emb_extra = 0.0
        if ft == "full":
            emb = spec.vocab_size * spec.hidden_size * wt  # E: one embedding-sized gradient
            head_copy = spec.vocab_size * spec.hidden_size * amp_copy
            # Measured with the simulator: with tied embeddings the engine buffers lm_head's
            # gradient contribution (E) until the embedding's backward returns its own (E) and sums
            # them (E) before accumulating: 3E alive while the E in .grad is not there yet (2E more
            # than the gradients) at accumulation 1, 3E more when .grad already holds one. Untied,
            # only a later micro-batch's in-place accumulation needs a second E.
            if spec.tie_word_embeddings:
                emb_extra = emb * (3 if setup.accumulation > 1 else 2)
            else:
                emb_extra = emb if setup.accumulation > 1 else 0.0
        return _States(weights, resident, grads, opt, transient, 0.0, head_copy, emb_extra)

    # DeepSpeed: module cast to 16-bit, fp32 master + fp32 grad partition + states in fp32
    half = 2 if act_bytes == 2 else 4
    params16 = frozen_bytes * (half / act_bytes) + (base_trainable + adapter) * half
    states_per_t = 4 + _optimizer_state_bytes(setup.optimizer, 4, spec)  # master + optimizer states
    fp32_grad = 4.0
    transient = 0.0
    host = 0.0
    if setup.zero_stage in (1, 2):
        weights = params16
        if setup.offload_optimizer:
            grads = 0.0
            opt = 0.0
            host = DS_BUFFER_FACTOR * T * (fp32_grad + states_per_t)
        else:
            grads = T * half + T * fp32_grad / n
            opt = T * states_per_t / n
            transient = T * 4 / n * _optimizer_step_transient(setup.optimizer)
        return _States(weights, weights, grads, opt, transient, host)

    # ZeRO-3
    gathered = 4 * largest_module_params(spec) * (half / 2)
    if setup.offload_params:
        weights = gathered
        host += DS_BUFFER_FACTOR * params16
    else:
        weights = gathered + params16 / n
    if setup.offload_optimizer:
        grads = 0.0
        opt = 0.0
        host += DS_BUFFER_FACTOR * T * (fp32_grad + states_per_t)
    else:
        grads = T * fp32_grad / n
        opt = T * states_per_t / n
        transient = T * 4 / n * _optimizer_step_transient(setup.optimizer)
    return _States(weights, weights, grads, opt, transient, host)


def _mlp_saved_bytes(spec: ModelSpec, tokens: int, a: int, moe_layer: bool) -> float:
    """Bytes saved for backward by one MLP block.

    Dense SwiGLU (LlamaMLP: down(act(gate(x)) * up(x))): gate out, act out, up out, product = 4aTI
    (Korthikanti's GeLU MLP is 19sbh with 4h; SwiGLU with I has no dropout).
    MoE (transformers v5 experts loop): per routed token the gathered input, gate_up output (2I),
    act output, product and down output = a(2h + 4I_moe) * top_k; router softmax in fp32 (4E);
    qwen2_moe shared expert like a dense MLP plus its gated output (h).
    """
    h = spec.hidden_size
    if not moe_layer:
        return 4 * a * tokens * spec.intermediate_size
    k = max(1, spec.experts_per_token)
    saved = a * tokens * k * (2 * h + 4 * spec.moe_intermediate_size) + 4 * tokens * spec.num_experts
    if spec.shared_expert_intermediate_size:
        saved += a * tokens * (4 * spec.shared_expert_intermediate_size + h)
    return saved


def _upcast_under_autocast(setup: TrainSetup) -> bool:
    """Trainable weights in fp32 under 16-bit autocast (llamafactory's default without DeepSpeed)."""
    return not setup.pure_bf16 and _dtype_bytes(setup.compute_dtype) == 2 and setup.zero_stage == 0


def _norms_saved_bytes(spec: ModelSpec, setup: TrainSetup, a: int) -> float:
    """Bytes per token per hidden unit that one layer's RMSNorms keep for backward.

    Each saves its fp32 upcast input (4). Then: with a frozen base (LoRA) nothing more (the weight
    needs no gradient). In 16-bit without upcast, the 16-bit output the projections read (a). With
    fp32 trainable norm weights under autocast, ``weight * hidden`` promotes the output to fp32 and
    every projection reading it saves its own autocast copy (a each: q, k, v after the attention
    norm; gate, up after the MLP norm), while the weight's gradient needs the normalised hidden
    state (4 when the residual stream is fp32, as with a trainable fp32 embedding in full
    fine-tuning, else a). Seen with the simulator: counting one 16-bit output per norm put full
    fine-tuning without checkpointing 1.3-2.1 % under.
    """
    if setup.finetuning_type in ("lora", "oft"):
        return 4.0 * spec.norms_per_layer
    if not _upcast_under_autocast(setup):
        return (4.0 + a if a == 2 else 8.0) * spec.norms_per_layer
    names = linear_shapes(spec)
    attn_readers = sum(1 for n in ("q_proj", "k_proj", "v_proj", "qkv_proj") if n in names) or 1
    mlp_readers = sum(1 for n in ("gate_proj", "up_proj", "gate_up_proj") if n in names) or 2
    resid = 4 if setup.finetuning_type == "full" else a
    extra_norms = max(0, spec.norms_per_layer - 2) * (4 + a)  # gemma's post-norms
    return (4 + resid + attn_readers * a) + (4 + resid + mlp_readers * a) + extra_norms


def _layer_saved_bytes(spec: ModelSpec, setup: TrainSetup, b: int, s: int, moe_layer: bool) -> float:
    """Bytes one decoder layer saves for backward without recomputation (llama-style block).

    Derived like Korthikanti et al. 2022 eq. (1) (sbh(34 + 5as/h) for GPT), adapted to HF llama code:
      - each RMSNorm saves its fp32 upcast input (4 bytes) and the 16-bit normalised output (a),
        which is also the input the next projections save: (4 + a) T h per norm;
      - q_norm/k_norm (qwen3, gemma3): (4 + a) T (q_dim + kv_dim);
      - attention: Q (a T q_dim); K and V at kv_dim, or q_dim when repeat_kv materialises them
        (eager always; sdpa when a mask is passed, i.e. micro-batch > 1 with padding);
        sdpa/fa2 save their output + logsumexp (4 T heads) and o_proj saves its input
        (sdpa output is transposed+contiguous'd, so one more a T q_dim; fa2 output is reused);
        eager saves the fp32 softmax output (4 b heads s^2) and its 16-bit copy (a b heads s^2)
        instead of Korthikanti's 5as^2b (no dropout in llama: attention_dropout = 0);
      - MLP per _mlp_saved_bytes;
      - LoRA (fp32 adapters under 16-bit autocast): peft casts the input to fp32 for lora_A and
        autocast re-casts it to 16-bit, a copy lora_A saves: a T in_features per wrapped module
        (not under DeepSpeed, whose engine casts the adapters to 16-bit as well).
    """
    a = _dtype_bytes(setup.compute_dtype)
    t = b * s
    h = spec.hidden_size
    qd = spec.num_heads * spec.head_dim
    kvd = spec.num_kv_heads * spec.head_dim
    # A frozen base (LoRA) needs no weight gradients, and autograd saves an input only for the
    # gradients it must compute: the 16-bit norm outputs, the o_proj input and the down_proj input
    # are then not kept (measured with the simulator: the formula was 10-13% over without this).
    frozen = setup.finetuning_type in ("lora", "oft")
    norm = 4 if frozen else (4 + a if a == 2 else 8)
    saved = _norms_saved_bytes(spec, setup, a) * t * h
    if spec.qk_norm:
        saved += norm * t * (qd + kvd)
    impl = setup.attn_impl
    repeat = impl == "eager" or (impl == "sdpa" and b > 1)
    kv_saved = qd if repeat else kvd
    saved += a * t * (qd + 2 * kv_saved)  # Q, K, V
    o_proj_input = 0 if frozen else a * t * qd
    if impl == "eager":
        saved += (4 + (a if a == 2 else 0)) * b * spec.num_heads * s * s
        saved += o_proj_input
    elif impl == "sdpa":
        saved += a * t * qd + o_proj_input + 4 * t * spec.num_heads
    else:  # fa2: its output is the o_proj input
        saved += a * t * qd + 4 * t * spec.num_heads
    saved += _mlp_saved_bytes(spec, t, a, moe_layer)
    if frozen and not moe_layer:
        saved -= a * t * spec.intermediate_size  # down_proj input
    if setup.finetuning_type in ("lora", "oft") and not setup.pure_bf16 and a == 2 and setup.zero_stage == 0:
        per_layer_in = sum(i * c for i, _, c in _lora_modules(spec, setup.lora_target)) / max(1, spec.num_layers)
        saved += a * t * per_layer_in
    return saved


def _layer_backward_transient(spec: ModelSpec, setup: TrainSetup, b: int, s: int) -> float:
    """Gradient buffers alive while one layer runs backward (on top of its saved activations):
    incoming/outgoing hidden grads (2aTh), the grads of the MLP intermediates (3aT I_eff), and for
    eager attention the fp32 softmax grads (2 x 4 b heads s^2). QLoRA adds one dequantised weight.
    """
    a = _dtype_bytes(setup.compute_dtype)
    t = b * s
    h = spec.hidden_size
    if spec.num_moe_layers:
        i_eff = max(1, spec.experts_per_token) * spec.moe_intermediate_size + spec.shared_expert_intermediate_size
        if spec.num_moe_layers < spec.num_layers:
            i_eff = max(i_eff, spec.intermediate_size)
    else:
        i_eff = spec.intermediate_size
    tr = a * t * (2 * h + 3 * i_eff)
    if setup.attn_impl == "eager":
        tr += 8 * b * spec.num_heads * s * s
    if setup.quantization_bit is not None:
        tr += a * max(i * o for entries in linear_shapes(spec).values() for i, o, _ in entries)
    return tr


def _activations(spec: ModelSpec, setup: TrainSetup) -> tuple[float, float]:
    """(stored bytes, working-set bytes) of activations for one micro-batch.

    No checkpointing: stored = sum over layers of _layer_saved_bytes; working = one layer's backward
    transients. With checkpointing (llamafactory default, reentrant torch.utils.checkpoint per
    decoder layer): stored = the layer inputs, a*b*s*h per layer (Korthikanti's "2sbh" with full
    recomputation); working = one layer recomputed (its saved activations) + its backward
    transients. Both add the final norm / lm_head input ((4 + a) T h) and the attention mask built
    once per step (eager: a b s^2 float mask; sdpa with micro-batch > 1: b s^2 bool mask).
    """
    b, s = setup.micro_batch, setup.seq_len
    a = _dtype_bytes(setup.compute_dtype)
    t = b * s
    h = spec.hidden_size
    dense_layers = spec.num_layers - spec.num_moe_layers
    saved_dense = _layer_saved_bytes(spec, setup, b, s, False) if dense_layers else 0.0
    saved_moe = _layer_saved_bytes(spec, setup, b, s, True) if spec.num_moe_layers else 0.0
    transient = _layer_backward_transient(spec, setup, b, s)
    outside = (4 + a) * t * h
    if setup.attn_impl == "eager":
        outside += a * b * s * s
    elif setup.attn_impl == "sdpa" and b > 1:
        outside += b * s * s
    # Freeze tuning: llamafactory checkpoints (and autograd records) only the trainable layers; the
    # frozen ones before them run without a graph.
    share = 1.0
    if setup.finetuning_type == "freeze" and spec.num_layers:
        share = min(abs(int(setup.freeze_trainable_layers)), spec.num_layers) / spec.num_layers
    # the residual stream is fp32 when a trainable fp32 embedding feeds it (full fine-tuning, upcast)
    resid = 4 if setup.finetuning_type == "full" and _upcast_under_autocast(setup) else a
    if setup.gradient_checkpointing:
        stored = share * spec.num_layers * resid * t * h + outside
        working = max(saved_dense, saved_moe) + transient
    else:
        stored = share * (dense_layers * saved_dense + spec.num_moe_layers * saved_moe) + outside
        working = transient
    return stored, working


def _phases(spec: ModelSpec, setup: TrainSetup, st: _States, stored: float, working: float) -> tuple[float, ...]:
    """Tensor bytes at the three peaks of forward/backward without DeepSpeed (see the simulator).

    Gradients are alive in the forward pass only with accumulation > 1 (``zero_grad(set_to_none)``
    frees them after each optimizer step). The autocast weight cache (16-bit copies of fp32
    trainable weights) lives until the forward's autocast region ends; afterwards only the copies
    autograd saved remain: all of them without checkpointing, the lm_head's with it (the
    checkpointed layers re-cast during recomputation).
      loss     = resident + copies + optimizer + [gradients] + stored + forward logits (10 B/token/V)
      backward = resident + saved copies + optimizer + [gradients] + stored + max(working, logits)
      end      = resident + optimizer + gradients + max(working set, embedding-gradient temporaries)
    """
    resident, copies = st.weights_resident, st.weights - st.weights_resident
    grads_fwd = st.grads if setup.accumulation > 1 else 0.0
    saved_copies = st.head_copy if setup.gradient_checkpointing else copies
    tokens_v = setup.micro_batch * setup.seq_len * spec.vocab_size
    loss = resident + copies + st.optimizer + grads_fwd + stored + 10.0 * tokens_v
    backward = resident + saved_copies + st.optimizer + grads_fwd + stored + max(working, 12.0 * tokens_v)
    end = resident + st.optimizer + st.grads + max(working, st.embedding_grad_extra)
    return loss, backward, end


def _logits_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """Peak of the loss: 12 bytes per token per vocab entry.

    transformers ForCausalLMLoss upcasts the 16-bit logits (a) with logits.float() (4) and
    cross_entropy keeps the log_softmax output (4): 10 bytes in forward; in backward the saved
    log_softmax output (4) + nll_loss grad (4) + log_softmax grad (4) = 12 bytes, the larger phase.
    """
    return 12.0 * setup.micro_batch * setup.seq_len * spec.vocab_size


# ============================================================================================
# estimate()
# ============================================================================================


def peak_from_tensors(tensors_gib: float, world_size: int = 1) -> float:
    """Process memory (GiB) for a tensor peak: + the CUDA context and workspaces outside PyTorch,
    + NCCL buffers on several GPUs, + the caching allocator's slack. Also turns a simulated tensor
    peak into a figure comparable with the card."""
    return tensors_gib * (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB + (NCCL_GIB if world_size > 1 else 0.0)


def estimate(spec: ModelSpec, setup: TrainSetup) -> MemoryEstimate:
    """Peak GPU memory per device (GiB) for one training step of ``setup`` on ``spec``."""
    if setup.attn_impl not in _ATTN:
        raise ValueError(f"unknown attn_impl {setup.attn_impl!r} (expected eager, sdpa or fa2)")
    if setup.micro_batch < 1 or setup.seq_len < 1:
        raise ValueError("micro_batch and seq_len must be >= 1")
    if setup.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {setup.zero_stage}")
    T = trainable_params(spec, setup)
    st = _model_states(spec, setup, T)
    stored, working = _activations(spec, setup)
    logits = _logits_bytes(spec, setup)

    step = st.weights_resident + st.grads + st.optimizer + st.transient
    if setup.zero_stage == 0:
        tensors = max(step, *_phases(spec, setup, st, stored, working))
    else:
        # DeepSpeed cannot be simulated here: the older, conservative sum (gradients and the autocast
        # copies alive throughout; the loss peak and a layer's working set do not coexist).
        fwd_bwd = st.weights + st.grads + st.optimizer + stored + max(working, logits)
        tensors = max(fwd_bwd, step)
    peak = peak_from_tensors(tensors / GIB, setup.world_size) * GIB
    overhead = peak - tensors
    return MemoryEstimate(
        weights_gib=st.weights / GIB,
        gradients_gib=st.grads / GIB,
        optimizer_gib=st.optimizer / GIB,
        activations_gib=(stored + working) / GIB,
        logits_gib=logits / GIB,
        overhead_gib=overhead / GIB,
        peak_gib=peak / GIB,
        host_gib=st.host / GIB,
        trainable_params=T,
        transient_gib=st.transient / GIB,
        tensors_gib=tensors / GIB,
    )


# ============================================================================================
# choose_micro_batch(): the verdict and what would fit
# ============================================================================================

FITS = "fits"  # within the target headroom
TIGHT = "tight"  # within the physical memory, with less than the target headroom
DOES_NOT_FIT = "does_not_fit"
# A tight plan keeps at least this share of the card free: the calibration goal lets the formulas
# under-predict by at most 2% (docs/memory-model.md, "Calibration"), so less than that is a guess.
MIN_HEADROOM = 0.02

# Kinds of alternatives, ordered by how much they change the training.
SAME_NUMBERS = "same-numbers"  # the same optimisation, bit for bit or nearly (offload, recompute)
NUMERICS = "numerics"  # the same method with slightly different arithmetic (8-bit states, bf16 weights)
METHOD = "method"  # a different method or data (LoRA, QLoRA, shorter cutoff)
HARDWARE = "hardware"  # more GPUs


def gib_pair(a: float, b: float) -> tuple[str, str]:
    """Two GiB figures with as many decimals (1 to 3) as it takes to tell them apart, so a refusal
    never reads "13.2 GiB > 13.2 GiB"."""
    x, y = f"{a:.1f}", f"{b:.1f}"
    for d in (1, 2, 3):
        x, y = f"{a:.{d}f}", f"{b:.{d}f}"
        if x != y:
            break
    return x, y


def verdict_of(peak_gib: float, capacity_gib: float, headroom: float) -> str:
    """fits (peak within capacity x (1 - headroom)), tight (within capacity x (1 - MIN_HEADROOM)),
    or does_not_fit."""
    if peak_gib <= capacity_gib * (1 - headroom):
        return FITS
    if peak_gib <= capacity_gib * (1 - min(headroom, MIN_HEADROOM)):
        return TIGHT
    return DOES_NOT_FIT


def _divisors_desc(n: int) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


Estimator = Callable[[TrainSetup], MemoryEstimate]


def corrected(spec: ModelSpec, correction: float = 1.0) -> Estimator:
    """``estimate`` on ``spec`` with every peak scaled by ``correction`` (observed / predicted peak
    of an earlier run of the same config on the same card; 1.0 = the formulas as they are)."""
    if correction == 1.0:
        return lambda setup: estimate(spec, setup)

    def scaled(setup: TrainSetup) -> MemoryEstimate:
        est = estimate(spec, setup)
        return replace(
            est, peak_gib=est.peak_gib * correction, overhead_gib=est.peak_gib * correction - est.tensors_gib
        )

    return scaled


def _scan(est_fn: Estimator, setup: TrainSetup, candidates: list[int], per_device: int, limit: float):
    """The largest candidate micro-batch whose peak is within ``limit``; accumulation follows it."""
    tried: list[tuple[int, float]] = []
    for mb in candidates:
        est = est_fn(replace(setup, micro_batch=mb, accumulation=per_device // mb))
        tried.append((mb, round(est.peak_gib, 2)))
        if est.peak_gib <= limit:
            return mb, est, tuple(tried)
    return None, est_fn(replace(setup, micro_batch=1, accumulation=per_device)), tuple(tried)


@dataclass(frozen=True)
class Choice:
    micro_batch: int | None  # None -> nothing fits
    setup: TrainSetup  # the setup chosen (may have gradient_checkpointing/attn/zero changed)
    estimate: MemoryEstimate
    changes: tuple[tuple[str, object, object, str], ...]  # (llamafactory key, old, new, reason)
    tried: tuple[tuple[int, float], ...]  # (micro_batch, peak_gib) for the final setup
    alternatives: tuple[dict, ...]  # filled when nothing fits
    verdict: str = FITS
    capacity_gib: float = 0.0

    @property
    def headroom_gib(self) -> float:
        """What the predicted peak leaves free on the card."""
        return self.capacity_gib - self.estimate.peak_gib

    @property
    def headroom_share(self) -> float:
        return self.headroom_gib / self.capacity_gib if self.capacity_gib else 0.0


def choose_micro_batch(
    spec: ModelSpec,
    setup: TrainSetup,
    *,
    capacity_gib: float,
    per_device_batch: int,
    headroom: float = 0.12,
    host_ram_gib: float | None = None,
    host_ram_note: str | None = None,
    bf16_capable: bool = True,
    can_flash: bool = False,
    correction: float = 1.0,
) -> Choice:
    """Largest divisor of ``per_device_batch`` whose peak fits in capacity*(1-headroom).

    When even micro-batch 1 does not fit, in order: gradient checkpointing on, eager attention ->
    sdpa (fa2 if ``can_flash``), re-trying all batch sizes after each step. If still nothing fits
    with the target headroom, the largest micro-batch within capacity*(1-MIN_HEADROOM) is taken
    with verdict *tight* (it runs at full speed; the recovery ladder covers a misjudgement).
    Only then ZeRO-3 with CPU offload of optimizer and parameters (only if the host RAM is known
    and suffices: it is several times slower). finetuning_type, cutoff_len, learning rate and data
    are never changed; if nothing fits ``micro_batch`` is None, the verdict *does_not_fit*, and
    ``alternatives`` lists what would, ordered by how much each changes the training.
    ``host_ram_note`` says where ``host_ram_gib`` comes from when it is an assumption;
    ``correction`` scales every predicted peak (see :func:`corrected`).
    """
    if per_device_batch < 1:
        raise ValueError("per_device_batch must be >= 1")
    if capacity_gib <= 0:
        raise ValueError("capacity_gib must be > 0")
    usable = capacity_gib * (1 - headroom)
    tight_limit = capacity_gib * (1 - min(headroom, MIN_HEADROOM))
    host_usable = host_ram_gib * (1 - headroom) if host_ram_gib is not None else None
    cands = _divisors_desc(per_device_batch)
    changes: list[tuple[str, object, object, str]] = []
    est_fn = corrected(spec, correction)

    def done(mb: int, cur: TrainSetup, est: MemoryEstimate, tried: tuple, verdict: str) -> Choice:
        chosen = replace(cur, micro_batch=mb, accumulation=per_device_batch // mb)
        return Choice(mb, chosen, est, tuple(changes), tried, (), verdict, capacity_gib)

    def over(peak: float) -> str:
        p, u = gib_pair(peak, usable)
        return f"peak {p} GiB > {u} GiB usable ({capacity_gib:g} GiB, {headroom * 100:.0f}% headroom) at micro-batch 1"

    cur = setup
    mb, est, tried = _scan(est_fn, cur, cands, per_device_batch, usable)
    if mb is not None:
        return done(mb, cur, est, tried, FITS)

    # Same numbers, cheaper memory: checkpointing, then a kernel that does not store the scores.
    impl = "fa2" if can_flash else "sdpa"
    ladder = (
        (
            not cur.gradient_checkpointing,
            ("disable_gradient_checkpointing", True, False),
            {"gradient_checkpointing": True},
            "gradient checkpointing keeps only each layer's input",
        ),
        (
            cur.attn_impl == "eager",
            ("flash_attn", "disabled", impl),
            {"attn_impl": impl},
            f"{impl} attention does not store the {cur.seq_len}x{cur.seq_len} score matrix per head",
        ),
    )
    for wanted, (key, old, new), fields, why in ladder:
        if not wanted:
            continue
        cur = replace(cur, **fields)
        after = est_fn(replace(cur, micro_batch=1, accumulation=per_device_batch)).peak_gib
        changes.append((key, old, new, f"{over(est.peak_gib)}; {why}: {after:.1f} GiB"))
        mb, est, tried = _scan(est_fn, cur, cands, per_device_batch, usable)
        if mb is not None:
            return done(mb, cur, est, tried, FITS)

    base_for_alternatives = cur
    mb, t_est, t_tried = _scan(est_fn, cur, cands, per_device_batch, tight_limit)
    if mb is not None:
        return done(mb, cur, t_est, t_tried, TIGHT)

    # ZeRO-3 with CPU offload of optimizer states and parameters
    offload = replace(cur, zero_stage=3, offload_optimizer=True, offload_params=True)
    if offload != cur:
        off_est = est_fn(replace(offload, micro_batch=1, accumulation=per_device_batch))
        if host_usable is not None and off_est.host_gib <= host_usable:
            changes.append(
                (
                    "deepspeed",
                    None if cur.zero_stage == 0 else f"zero{cur.zero_stage}",
                    "ds_z3_offload",
                    f"{over(est.peak_gib)}; ZeRO-3 CPU offload moves parameters and optimizer states "
                    f"to host RAM (needs {off_est.host_gib:.1f} GiB of {host_ram_gib:g} GiB"
                    f"{', ' + host_ram_note if host_ram_note else ''}): {off_est.peak_gib:.1f} GiB",
                )
            )
            cur = offload
            for limit, verdict in ((usable, FITS), (tight_limit, TIGHT)):
                mb, o_est, o_tried = _scan(est_fn, cur, cands, per_device_batch, limit)
                if mb is not None:
                    return done(mb, cur, o_est, o_tried, verdict)

    alternatives = _alternatives(
        est_fn,
        replace(base_for_alternatives, accumulation=per_device_batch),
        capacity_gib,
        headroom,
        host_ram_gib,
        host_ram_note,
        bf16_capable,
    )
    return Choice(
        None,
        replace(cur, micro_batch=1, accumulation=per_device_batch),
        est,
        tuple(changes),
        tried,
        alternatives,
        DOES_NOT_FIT,
        capacity_gib,
    )


def _host_check(need_gib: float, host_ram_gib: float | None, headroom: float, note: str | None) -> str | None:
    """None when ``need_gib`` of host RAM is available, else why not."""
    if host_ram_gib is None:
        return f"needs {need_gib:.0f} GiB host RAM; host RAM unknown (pass --host-ram)"
    if need_gib > host_ram_gib * (1 - headroom):
        where = f"machine has {host_ram_gib:.0f}" + (f" ({note})" if note else "")
        return f"needs {need_gib:.0f} GiB host RAM, {where}"
    return None


def _alternatives(
    est_fn: Estimator,
    base: TrainSetup,
    capacity_gib: float,
    headroom: float,
    host_ram_gib: float | None,
    host_ram_note: str | None,
    bf16_capable: bool,
) -> tuple[dict, ...]:
    """What would fit at micro-batch 1, each option changing one thing the chooser may not.

    Rows are ordered by kind: same numbers (DeepSpeed offload on the same GPUs), numerics (8-bit
    optimizer states, pure_bf16), method or data (LoRA, QLoRA, cutoff), then more hardware. Each
    has its predicted GPU peak, host RAM need, a speed word and, when it does not fit, why.
    """
    base = replace(base, micro_batch=1)
    out: list[dict] = []

    def add(option: str, kind: str, setup: TrainSetup, change: dict, speed: str) -> None:
        est = est_fn(setup)
        verdict = verdict_of(est.peak_gib, capacity_gib, headroom)
        why = None
        if verdict == DOES_NOT_FIT:
            p, c = gib_pair(est.peak_gib, capacity_gib * (1 - min(headroom, MIN_HEADROOM)))
            why = f"peak {p} GiB > {c} GiB"
        elif verdict == TIGHT:
            why = f"tight: {(capacity_gib - est.peak_gib) / capacity_gib:.1%} headroom"
        host_why = _host_check(est.host_gib, host_ram_gib, headroom, host_ram_note) if est.host_gib else None
        row = {
            "option": option,
            "kind": kind,
            "peak_gib": round(est.peak_gib, 2),
            "host_gib": round(est.host_gib, 1),
            "fits": verdict != DOES_NOT_FIT and host_why is None,
            "verdict": verdict if host_why is None else DOES_NOT_FIT,
            "change": change,
            "speed": speed,
        }
        if host_why:
            row["why"] = host_why if why is None or verdict == TIGHT else f"{why}; {host_why}"
        elif why:
            row["why"] = why
        if est.host_gib:
            row["host_ram_gib"] = host_ram_gib
        out.append(row)

    full_or_freeze = base.finetuning_type in ("full", "freeze")
    # --- same numbers: DeepSpeed on the GPUs at hand, optimizer (and parameters) in host RAM
    if full_or_freeze and base.zero_stage == 0:
        add(
            "ZeRO-2 optimizer offload",
            SAME_NUMBERS,
            replace(base, zero_stage=2, offload_optimizer=True, offload_params=False),
            {"deepspeed": "ds_z2_offload"},
            "slower (optimizer step on the CPU)",
        )
    off = replace(base, zero_stage=3, offload_optimizer=True, offload_params=True)
    if off != base:
        add(
            "ZeRO-3 CPU offload",
            SAME_NUMBERS,
            off,
            {"deepspeed": "ds_z3_offload"},
            "much slower (weights streamed from host RAM)",
        )
    # --- numerics: 8-bit optimizer states, bf16 weights without fp32 masters
    if full_or_freeze and "8bit" not in base.optimizer:
        add(
            "8-bit AdamW",
            NUMERICS,
            replace(base, optimizer="adamw_bnb_8bit"),
            {"optim": "adamw_bnb_8bit"},
            "same",
        )
        add(
            "paged 8-bit AdamW",
            NUMERICS,
            replace(base, optimizer="paged_adamw_8bit"),
            {"optim": "paged_adamw_8bit"},
            "same (pages states to host RAM under pressure)",
        )
    if base.finetuning_type == "full" and not base.pure_bf16 and bf16_capable:
        add(
            "pure_bf16 (no fp32 master weights)",
            NUMERICS,
            replace(base, pure_bf16=True, compute_dtype="bf16"),
            {"pure_bf16": True, "bf16": True},
            "same or faster",
        )
    # --- method or data
    is_lora = base.finetuning_type in ("lora", "oft")
    if not is_lora or base.quantization_bit is not None:
        add(
            "LoRA r=8",
            METHOD,
            replace(
                base,
                finetuning_type="lora",
                lora_rank=8,
                lora_target="all",
                quantization_bit=None,
                pure_bf16=False,
                zero_stage=0,
                offload_optimizer=False,
                offload_params=False,
            ),
            {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "quantization_bit": None},
            "faster",
        )
    for bits in (8, 4):
        if base.quantization_bit == bits:
            continue
        ch: dict[str, Any] = {"finetuning_type": "lora", "quantization_bit": bits}
        qs = replace(base, finetuning_type="lora", quantization_bit=bits, pure_bf16=False)
        if not is_lora:
            ch.update({"lora_rank": 8, "lora_target": "all"})
            qs = replace(qs, lora_rank=8, lora_target="all", optimizer=base.optimizer)
        # QLoRA cannot be combined with ZeRO-3 param offload in llamafactory; drop DeepSpeed there
        if qs.zero_stage == 3:
            qs = replace(qs, zero_stage=0, offload_optimizer=False, offload_params=False)
        add(f"QLoRA {bits}-bit", METHOD, qs, ch, "faster than full, slower than LoRA (dequantisation)")
    if base.seq_len >= 2:
        half = base.seq_len // 2
        add(
            f"cutoff_len {half}",
            METHOD,
            replace(base, seq_len=half),
            {"cutoff_len": half},
            "faster (longer samples truncated)",
        )
    # --- more GPUs: ZeRO-3 (no offload) over N GPUs, the smallest N in 2..64 that fits
    chosen = None
    for n in (2, 4, 8, 16, 32, 64):
        if n <= base.world_size:
            continue
        cand = replace(base, world_size=n, zero_stage=3, offload_optimizer=False, offload_params=False)
        chosen = (n, cand)
        if est_fn(cand).peak_gib <= capacity_gib * (1 - headroom):
            break
    if chosen is not None:
        n, cand = chosen
        add(f"ZeRO-3 on {n} GPUs", HARDWARE, cand, {"deepspeed": "ds_z3", "gpus": n}, "faster")
    return tuple(out)
