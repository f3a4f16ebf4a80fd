"""Model states per GPU: weights, gradients and optimizer states, and host RAM for offloaded ones.

Parameter bookkeeping (what trains under each adapter), bytes per weight, gradient and optimizer
state, DeepSpeed's published ZeRO estimators, and ``model_states`` which combines them for one
setup (see docs/memory-model.md, "Model states"). Pure; every figure in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftlaunch.plan.memory.optimizers import (
    badam_block,
    layerwise_gradient_bytes,
    optimizer_bytes,
    optimizer_state_bytes,
    optimizer_step_transient,
)
from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.modelspec import ModelSpec, layer_params, linear_shapes

DS_BUFFER_FACTOR = 1.5  # DeepSpeed estimators' additional_buffer_factor for host RAM


_LORA_ALIASES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),  # phi3 fused projection
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w1": ("gate_proj",),
    "w3": ("up_proj",),
    "w2": ("down_proj",),
}


def lora_modules(spec: ModelSpec, target: str) -> list[tuple[int, int, int]]:
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
    lora_B: out x r). BAdam in layer mode: one decoder layer at a time (the block its
    switch_trainable_params leaves requiring grad; optimizers.badam_block).
    """
    ft = setup.finetuning_type
    custom = setup.custom
    if custom is not None and custom.kind == "badam" and custom.badam_mode != "ratio" and ft in ("full", "freeze"):
        return int(round(badam_block(spec, custom)))
    if ft == "full":
        return spec.params
    if ft == "freeze":
        n = min(abs(int(setup.freeze_trainable_layers)), spec.num_layers)
        return int(round(n * layer_params(spec)))
    if ft in ("lora", "oft"):
        return sum(setup.lora_rank * (i + o) * c for i, o, c in lora_modules(spec, setup.lora_target))
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


def dtype_bytes(dtype: str) -> int:
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


def deepspeed_zero2_gpu_bytes(total_params: int, num_gpus: int, cpu_offload: bool) -> tuple[int, int]:
    """DeepSpeed estimate_zero2model_states_mem_needs (stage_1_and_2.py), one node: (gpu, cpu).

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
    """DeepSpeed estimate_zero3model_states_mem_needs (stage3.py), one node, zero_init=True: (gpu, cpu).

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


@dataclass(frozen=True)
class ModelStates:
    weights: float  # bytes, forward/backward phase (incl. autocast copies)
    weights_resident: float  # bytes at the optimizer step
    grads: float
    optimizer: float
    transient: float
    host: float
    head_copy: float = 0.0  # autocast copy of a trainable fp32 lm_head, saved for its backward
    embedding_grad_extra: float = 0.0  # embedding-gradient temporaries at the end of backward


def model_states(spec: ModelSpec, setup: TrainSetup, trainable: int) -> ModelStates:
    """Weights, gradients, optimizer states per GPU, and host RAM for offloaded states.

    No DeepSpeed (HF Trainer + torch AMP, llamafactory adapter.py):
      - frozen weights at the load dtype (compute dtype: 2 bytes bf16/fp16, 4 fp32), or quantized
        (nn.Linear weights at _quant_bytes_per_param, everything else at the compute dtype);
      - trainable weights upcast to fp32 unless pure_bf16 ("cast_trainable_params_to_fp32");
      - AMP autocast caches a 16-bit copy of every fp32 trainable weight during forward (2 bytes);
      - gradients in the trainable parameter's dtype; optimizer states per optimizer_state_bytes.
      Full AMP: 4 + 2 + 4 + 8 = 18 bytes/param (LLaMA-Factory README "Full (bf16 or fp16)": 18x GB);
      pure_bf16: 2 + 2 + 4 = 8 bytes/param (README "Full (pure_bf16)": 8x GB).
    ZeRO-1/2 (DeepSpeed estimate_zero2model_states_mem_needs, generalised to a trainable subset T):
      16-bit params 2P + 16-bit grads 2T + fp32 grad partition 4T/N + (fp32 master 4 + states) T/N
      = 4P + 16P/N for full Adam; optimizer offload leaves only the 16-bit params (2P) on the GPU.
    ZeRO-3 (estimate_zero3model_states_mem_needs): all of the above partitioned over N plus
      4 * largest_layer_params for the gathered layer = 4L + 18P/N; offload_optimizer: 4L + 2P/N;
      offload both: 4L.
    Host RAM (offload): DeepSpeed's cpu terms with its 1.5 buffer factor: 1.5 * (fp32 master, grads,
      states of T) [+ 1.5 * 16-bit params with param offload] = 24P / 27P for full Adam.
    """
    n = max(1, setup.world_size)
    P = spec.params
    T = trainable
    act_bytes = dtype_bytes(setup.compute_dtype)
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

    custom = setup.custom
    badam = custom is not None and custom.kind == "badam" and ft in ("full", "freeze")
    if setup.zero_stage == 0 and badam:
        # BAdam (block_optim.py step_single_gpu): the model stays in its load dtype (adapter.py:319, no
        # upcast, so no autocast copies); the active block gets an fp32 copy (param_idx2hp) whose fp32
        # gradient is made from the 16-bit one at the step (_grad_to_hp); the base optimizer's states
        # cover that copy only.
        block = badam_block(spec, custom)
        resident = base_bytes + 4 * block
        grads = T * act_bytes  # the 16-bit gradients of what requires grad (ratio mode: everything)
        opt = block * optimizer_state_bytes(setup.optimizer, 4, spec)
        transient = 4 * block * (1 + optimizer_step_transient(setup.optimizer))
        return ModelStates(resident, resident, grads, opt, transient, 0.0)

    if setup.zero_stage == 0:
        upcast = not setup.pure_bf16  # adapter.py: cast_trainable_params_to_fp32
        wt = 4 if upcast else act_bytes  # trainable param (and grad, state) dtype
        amp_copy = 2 if (upcast and act_bytes == 2) else 0  # autocast weight cache
        resident = frozen_bytes + T * wt
        weights = resident + T * amp_copy
        grads = T * wt
        ob = optimizer_bytes(spec, setup.optimizer, custom, ft, T, wt)
        opt, transient = ob.states, ob.transient
        if custom is not None and custom.projected and custom.layerwise:
            grads = min(grads, layerwise_gradient_bytes(spec, wt))  # stepped and freed one by one
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
        return ModelStates(weights, resident, grads, opt, transient, 0.0, head_copy, emb_extra)

    # DeepSpeed: module cast to 16-bit, fp32 master + fp32 grad partition + states in fp32
    half = 2 if act_bytes == 2 else 4
    params16 = frozen_bytes * (half / act_bytes) + (base_trainable + adapter) * half
    ob = optimizer_bytes(spec, setup.optimizer, custom, ft, T, 4)  # the optimizer over fp32 masters
    states_per_t = 4 + ob.states / max(1, T)  # master + optimizer states
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
            transient = ob.transient / n
        return ModelStates(weights, weights, grads, opt, transient, host)

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
        transient = ob.transient / n
    return ModelStates(weights, weights, grads, opt, transient, host)
