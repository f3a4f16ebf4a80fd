"""Model architecture -> exact parameter count, from a Hugging Face ``config.json`` dict.

No torch / transformers import: the count is computed from the shapes that the transformers
modelling code (v5.x, ``models/<type>/modeling_<type>.py``) builds for each family, so that it
equals ``sum(p.numel() for p in model.parameters())`` with tied embeddings counted once.

Families counted exactly (checked against transformers in ``tests/plan/test_modelspec.py``):
llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral, gemma, gemma2, gemma3_text, phi3.
Any other ``model_type`` is counted as llama-like from the config keys
(``attention_bias``, ``mlp_bias``, ``head_dim``) and marked ``count_method="llama-like"``.
Composite (vision-language) configs are read through their ``text_config``; the vision tower is
*not* counted there (``count_method="text-only"``).
A pre-quantized checkpoint (AWQ, GPTQ, AQLM, ... : ``quantization_config`` in config.json) keeps
its method and weight bits (``quant_method``, ``quant_bits``): the memory model sizes its linear
weights at those bits, not at 16, and the rules refuse ZeRO-3 and the CPU for it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ftlaunch.files import JSON_LIMIT, read_user_bytes, value_error
from ftlaunch.plan.rules import ptq_of

__all__ = [
    "ModelSpec",
    "spec_from_config",
    "load_config_json",
    "load_model_spec",
    "spec_from_param_count",
    "parse_param_count",
    "embedding_params",
    "layer_params",
    "linear_shapes",
]


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer plus its exact parameter count."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    params: int  # exact total parameter count as transformers builds it (tied counted once)
    num_experts: int = 0  # routed experts per MoE layer (0 = dense model)
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0  # per routed expert
    shared_expert_intermediate_size: int = 0  # qwen2_moe shared expert (0 = none)
    num_moe_layers: int = 0  # how many of num_layers are sparse (the rest use the dense MLP)
    qk_norm: bool = False  # RMSNorm on q and k per head (qwen3, gemma3)
    norms_per_layer: int = 2  # RMSNorms per decoder layer (gemma2/3 have 4)
    count_method: str = "exact"  # "exact" | "llama-like" | "text-only" | "synthetic"
    # A pre-quantized (PTQ) checkpoint: config.json's quantization_config (ftlaunch.plan.rules.ptq_of)
    quant_method: str | None = None  # "awq", "gptq", "aqlm", ... (None: 16-bit weights)
    quant_bits: int | None = None  # bits a linear weight is stored in (None: loads dequantized)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Family rules, taken from transformers v5 modelling code.
#   qkv_bias / o_bias: callables on the config dict giving whether q/k/v and o_proj have a bias
#   tie_default: the config class default for tie_word_embeddings when config.json omits it
# --------------------------------------------------------------------------------------------


def _attention_bias(cfg: dict) -> bool:
    return bool(cfg.get("attention_bias", False))


@dataclass(frozen=True)
class _Family:
    qkv_bias: Any  # Callable[[dict], bool]
    o_bias: Any  # Callable[[dict], bool]
    mlp_bias: Any  # Callable[[dict], bool]
    qk_norm: bool = False
    norms_per_layer: int = 2
    tie_default: bool = False
    moe: str = ""  # "" | "qwen2_moe" | "qwen3_moe" | "mixtral"
    kv_default: int | None = None  # config-class default of num_key_value_heads (None: = heads)
    head_dim_default: int | None = None  # config-class default of head_dim (None: hidden/heads)


def _false(cfg: dict) -> bool:
    return False


def _true(cfg: dict) -> bool:
    return True


def _mlp_bias(cfg: dict) -> bool:
    return bool(cfg.get("mlp_bias", False))


def _qwen2_moe_qkv_bias(cfg: dict) -> bool:
    return bool(cfg.get("qkv_bias", True))


_FAMILIES: dict[str, _Family] = {
    # LlamaAttention: q/k/v/o all bias=config.attention_bias; LlamaMLP bias=config.mlp_bias
    "llama": _Family(_attention_bias, _attention_bias, _mlp_bias),
    # MistralAttention / MistralMLP: bias=False everywhere
    "mistral": _Family(_false, _false, _false, kv_default=8),
    # Qwen2Attention: q/k/v bias=True, o_proj bias=False
    "qwen2": _Family(_true, _false, _false, kv_default=32),
    # Qwen3Attention: q/k/v/o bias=config.attention_bias, q_norm/k_norm over head_dim
    "qwen3": _Family(_attention_bias, _attention_bias, _false, qk_norm=True, kv_default=32, head_dim_default=128),
    # Qwen2MoeAttention: q/k/v bias=config.qkv_bias (default True), o_proj no bias
    "qwen2_moe": _Family(_qwen2_moe_qkv_bias, _false, _false, moe="qwen2_moe", kv_default=16),
    "qwen3_moe": _Family(_attention_bias, _attention_bias, _false, qk_norm=True, moe="qwen3_moe", kv_default=4),
    "mixtral": _Family(_false, _false, _false, moe="mixtral", kv_default=8),
    "gemma": _Family(_attention_bias, _attention_bias, _false, tie_default=True, kv_default=16, head_dim_default=256),
    # Gemma2/3 decoder layers: input/post_attention/pre_feedforward/post_feedforward norms
    "gemma2": _Family(
        _attention_bias,
        _attention_bias,
        _false,
        norms_per_layer=4,
        tie_default=True,
        kv_default=4,
        head_dim_default=256,
    ),
    "gemma3_text": _Family(
        _attention_bias,
        _attention_bias,
        _false,
        qk_norm=True,
        norms_per_layer=4,
        tie_default=True,
        kv_default=4,
        head_dim_default=256,
    ),
    # Phi3: fused qkv_proj / gate_up_proj, no biases (same parameter count as split projections)
    "phi3": _Family(_false, _false, _false),
}

_LLAMA_LIKE = _Family(_attention_bias, _attention_bias, _mlp_bias, tie_default=True)


def _require(cfg: dict, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json is missing required key {key!r}")
    return cfg[key]


def _int(cfg: dict, key: str) -> int:
    value = _require(cfg, key)
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.json key {key!r} is not an integer: {value!r}") from exc


def _moe_layer_count(cfg: dict, num_layers: int, family: _Family) -> int:
    """Number of sparse layers.

    qwen2_moe / qwen3_moe: layer i is sparse iff i not in mlp_only_layers and num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0 (Qwen2MoeDecoderLayer.__init__). Mixtral: every layer.
    """
    if family.moe == "mixtral":
        return num_layers
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return sum(1 for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)


def spec_from_config(cfg: dict) -> ModelSpec:
    """Build a ModelSpec (with the exact parameter count) from a config.json dict.

    Raises ValueError naming the missing key when a required key is absent.
    """
    if not isinstance(cfg, dict):
        raise ValueError("config must be a dict (the parsed config.json)")
    method, bits = ptq_of(cfg)
    spec = _spec_from_config(cfg)
    return _replace(spec, quant_method=method, quant_bits=bits) if method else spec


def _spec_from_config(cfg: dict) -> ModelSpec:
    count_method = "exact"
    model_type = str(cfg.get("model_type", "") or "")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        # composite models (llava, qwen2_vl, gemma3, ...): count the language model only
        text = dict(cfg["text_config"])
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings"))
        if text.get("tie_word_embeddings") is None:
            text.pop("tie_word_embeddings")
        inner = _spec_from_config(text)
        return _replace(inner, model_type=inner.model_type or model_type, count_method="text-only")
    if model_type == "gemma3":  # a text-only gemma3 config saved with the composite type
        model_type = "gemma3_text"
    family = _FAMILIES.get(model_type)
    if family is None:
        family = _LLAMA_LIKE
        count_method = "llama-like"

    h = _int(cfg, "hidden_size")
    num_layers = _int(cfg, "num_hidden_layers")
    num_heads = _int(cfg, "num_attention_heads")
    vocab = _int(cfg, "vocab_size")
    # absent keys take the transformers config-class defaults (they differ between families)
    num_kv = int(cfg.get("num_key_value_heads") or family.kv_default or num_heads)
    head_dim = int(cfg.get("head_dim") or family.head_dim_default or (h // num_heads))
    tie = cfg.get("tie_word_embeddings")
    tie = family.tie_default if tie is None else bool(tie)

    num_experts = 0
    top_k = 0
    moe_inter = 0
    shared_inter = 0
    num_moe_layers = 0
    if family.moe == "mixtral":
        num_experts = _int(cfg, "num_local_experts")
        top_k = int(cfg.get("num_experts_per_tok", 2))
        intermediate = _int(cfg, "intermediate_size")
        moe_inter = intermediate
    elif family.moe in ("qwen2_moe", "qwen3_moe"):
        num_experts = int(cfg.get("num_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
        intermediate = _int(cfg, "intermediate_size")
        if num_experts:
            moe_inter = _int(cfg, "moe_intermediate_size")
            if family.moe == "qwen2_moe":
                shared_inter = _int(cfg, "shared_expert_intermediate_size")
    else:
        intermediate = _int(cfg, "intermediate_size")
    if num_experts:
        num_moe_layers = _moe_layer_count(cfg, num_layers, family)

    q_dim = num_heads * head_dim
    kv_dim = num_kv * head_dim

    # ---- per-layer attention: q/k/v/o projections (+ biases), optional q_norm/k_norm
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h
    if family.qkv_bias(cfg):
        attn += q_dim + 2 * kv_dim
    if family.o_bias(cfg):
        attn += h
    if family.qk_norm:
        attn += 2 * head_dim
    norms = family.norms_per_layer * h

    # ---- per-layer MLP: gate/up/down (SwiGLU), optional bias
    def dense_mlp(inter: int) -> int:
        n = 3 * h * inter
        if family.mlp_bias(cfg):
            n += 2 * inter + h
        return n

    sparse_mlp = 0
    if num_experts:
        sparse_mlp = num_experts * 3 * h * moe_inter + num_experts * h  # experts + router weight
        if shared_inter:
            sparse_mlp += dense_mlp(shared_inter) + h  # shared_expert + shared_expert_gate (h -> 1)
    dense_layers = num_layers - num_moe_layers
    layers = num_layers * (attn + norms) + dense_layers * dense_mlp(intermediate) + num_moe_layers * sparse_mlp

    embed = vocab * h
    lm_head = 0 if tie else vocab * h
    total = embed + lm_head + layers + h  # + final norm

    return ModelSpec(
        model_type=model_type or "unknown",
        hidden_size=h,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        params=total,
        num_experts=num_experts,
        experts_per_token=top_k,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter,
        num_moe_layers=num_moe_layers,
        qk_norm=family.qk_norm,
        norms_per_layer=family.norms_per_layer,
        count_method=count_method,
    )


def _replace(spec: ModelSpec, **changes: Any) -> ModelSpec:
    data = spec.to_dict()
    data.update(changes)
    return ModelSpec(**data)


def load_config_json(path: str | Path) -> dict | None:
    """Read ``<path>/config.json`` (or ``path`` itself if it is a file). None if absent."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:  # a FIFO, a device or a huge file is a ValueError (the callers' "cannot size the model")
        data = json.loads(read_user_bytes(p, limit=JSON_LIMIT, what=str(p), error=value_error))
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: config.json is not a JSON object")
    return data


def load_model_spec(model_dir: str | Path) -> ModelSpec | None:
    """ModelSpec for a local model directory; None when there is no config.json there."""
    cfg = load_config_json(model_dir)
    if cfg is None:
        return None
    return spec_from_config(cfg)


# --------------------------------------------------------------------------------------------
# Helpers shared with ftlaunch.plan.memory (states, activations)
# --------------------------------------------------------------------------------------------


def embedding_params(spec: ModelSpec) -> int:
    """embed_tokens + lm_head (lm_head counted only when untied)."""
    return spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)


def layer_params(spec: ModelSpec) -> float:
    """Average parameters of one decoder layer: (total - embeddings - final norm) / num_layers."""
    return max(0, spec.params - embedding_params(spec) - spec.hidden_size) / max(1, spec.num_layers)


def linear_shapes(spec: ModelSpec) -> dict[str, list[tuple[int, int, int]]]:
    """nn.Linear modules of the decoder layers: name -> [(in_features, out_features, count), ...].

    Used for LoRA adapter sizes and for which weights bitsandbytes quantizes. MoE routed experts are
    3-D parameters in transformers v5 (not nn.Linear), so they are not listed; the qwen2_moe shared
    expert is, and shares the names gate_proj/up_proj/down_proj with the dense MLP layers.
    """
    h = spec.hidden_size
    q_dim = spec.num_heads * spec.head_dim
    kv_dim = spec.num_kv_heads * spec.head_dim
    n = spec.num_layers
    shapes: dict[str, list[tuple[int, int, int]]] = {
        "q_proj": [(h, q_dim, n)],
        "k_proj": [(h, kv_dim, n)],
        "v_proj": [(h, kv_dim, n)],
        "o_proj": [(q_dim, h, n)],
    }
    mlp: list[tuple[int, int]] = []  # (intermediate, number of modules)
    if n - spec.num_moe_layers:
        mlp.append((spec.intermediate_size, n - spec.num_moe_layers))
    if spec.num_moe_layers and spec.shared_expert_intermediate_size:
        mlp.append((spec.shared_expert_intermediate_size, spec.num_moe_layers))
    for name in ("gate_proj", "up_proj", "down_proj"):
        entries = [((inter, h, c) if name == "down_proj" else (h, inter, c)) for inter, c in mlp]
        if entries:
            shapes[name] = entries
    if spec.num_moe_layers and spec.shared_expert_intermediate_size:
        shapes["shared_expert_gate"] = [(h, 1, spec.num_moe_layers)]
    return shapes


# --------------------------------------------------------------------------------------------
# "--params 7B": parse and synthesise plausible llama-like shapes
# --------------------------------------------------------------------------------------------

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_param_count(text: str) -> int:
    """Parse "7B", "1.5b", "500M", "7e9", "8,030,261,248", "70 B" into an integer count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().replace(",", "").replace("_", "").replace(" ", "").upper()
        m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(E[+-]?\d+)?([KMBGT]?)(?:PARAMS?)?", s)
        if not m:
            raise ValueError(f"cannot parse parameter count {text!r} (expected e.g. 7B, 1.5b, 500M, 7e9)")
        value = float(m.group(1) + (m.group(2) or "")) * _SUFFIX[m.group(3)]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"parameter count must be a positive number, got {text!r}")
    return int(round(value))


# Published llama-like shapes (hidden, layers, heads, kv_heads, intermediate, vocab, tied), used as
# templates: Qwen2.5-0.5B/1.5B, Llama-3.2-3B, Llama-3-8B, Llama-2-13B, Qwen2.5-32B, Llama-3-70B,
# Llama-3.1-405B; plus a tiny one for toy sizes.
_TEMPLATES: tuple[tuple[int, int, int, int, int, int, bool], ...] = (
    (256, 4, 4, 4, 688, 32000, True),
    (896, 24, 14, 2, 4864, 151936, True),
    (1536, 28, 12, 2, 8960, 151936, True),
    (3072, 28, 24, 8, 8192, 128256, True),
    (4096, 32, 32, 8, 14336, 128256, False),
    (5120, 40, 40, 40, 13824, 32000, False),
    (5120, 64, 40, 8, 27648, 152064, False),
    (8192, 80, 64, 8, 28672, 128256, False),
    (16384, 126, 128, 8, 53248, 128256, False),
)


def _template_count(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool) -> int:
    hd = h // heads
    per_layer = 2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter + 2 * h
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def spec_from_param_count(text: str) -> ModelSpec:
    """Last resort when only a size is known: llama-like shapes whose total is close to ``text``.

    The template with the nearest published size is taken and its layer count rescaled so that the
    shapes add up to roughly the requested total; ``params`` is set to the requested count exactly
    (memory estimates use ``params`` for model states and the shapes only for activations).
    """
    target = parse_param_count(text)
    best = min(_TEMPLATES, key=lambda t: abs(math.log(_template_count(*t) / target)))
    h, layers, heads, kv, inter, vocab, tied = best
    fixed = vocab * h * (1 if tied else 2) + h
    per_layer = _template_count(h, 1, heads, kv, inter, vocab, tied) - fixed
    layers = max(1, round((target - fixed) / per_layer))
    return ModelSpec(
        model_type="llama",
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=h // heads,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        params=target,
        count_method="synthetic",
    )
