"""Activation memory of one micro-batch: what each decoder layer saves for backward, the working
set of one layer's backward, and the loss's logits.

Derived like Korthikanti et al. 2022 and adapted to the HF llama-style code (see
docs/memory-model.md, "Activations"). Pure; every figure in bytes.
"""

from __future__ import annotations

from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.memory.states import dtype_bytes, lora_modules
from ftlaunch.plan.modelspec import ModelSpec, linear_shapes


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> float:
    """Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    eq. (1): activation bytes per GPT layer, 16-bit, no parallelism, no recomputation:
    s*b*h*(34 + 5*a*s/h). Kept as the reference the llama-style count below is derived from.
    """
    return s * b * h * (34 + 5 * a * s / h)


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
    return not setup.pure_bf16 and dtype_bytes(setup.compute_dtype) == 2 and setup.zero_stage == 0


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
    a = dtype_bytes(setup.compute_dtype)
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
        per_layer_in = sum(i * c for i, _, c in lora_modules(spec, setup.lora_target)) / max(1, spec.num_layers)
        saved += a * t * per_layer_in
    return saved


def _layer_backward_transient(spec: ModelSpec, setup: TrainSetup, b: int, s: int) -> float:
    """Gradient buffers alive while one layer runs backward (on top of its saved activations):
    incoming/outgoing hidden grads (2aTh), the grads of the MLP intermediates (3aT I_eff), and for
    eager attention the fp32 softmax grads (2 x 4 b heads s^2). QLoRA adds one dequantised weight.
    """
    a = dtype_bytes(setup.compute_dtype)
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


def stored_and_working(spec: ModelSpec, setup: TrainSetup) -> tuple[float, float]:
    """(stored bytes, working-set bytes) of activations for one micro-batch.

    No checkpointing: stored = sum over layers of _layer_saved_bytes; working = one layer's backward
    transients. With checkpointing (llamafactory default, reentrant torch.utils.checkpoint per
    decoder layer): stored = the layer inputs, a*b*s*h per layer (Korthikanti's "2sbh" with full
    recomputation); working = one layer recomputed (its saved activations) + its backward
    transients. Both add the final norm / lm_head input ((4 + a) T h) and the attention mask built
    once per step (eager: a b s^2 float mask; sdpa with micro-batch > 1: b s^2 bool mask).
    """
    b, s = setup.micro_batch, setup.seq_len
    a = dtype_bytes(setup.compute_dtype)
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


def logits_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """Peak of the loss: 12 bytes per token per vocab entry.

    transformers ForCausalLMLoss upcasts the 16-bit logits (a) with logits.float() (4) and
    cross_entropy keeps the log_softmax output (4): 10 bytes in forward; in backward the saved
    log_softmax output (4) + nll_loss grad (4) + log_softmax grad (4) = 12 bytes, the larger phase.
    """
    return 12.0 * setup.micro_batch * setup.seq_len * spec.vocab_size
