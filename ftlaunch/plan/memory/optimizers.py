"""Optimizer memory by optimizer: the states (and step temporaries) of each optimizer LLaMA-Factory
0.9.5 can train with, sized from its own definition.

Two ways a config picks its optimizer, read by :func:`custom_optimizer` in LLaMA-Factory's order
(``train/trainer_utils.py:527-548`` ``create_custom_optimizer``: GaLore, APOLLO, LoRA+, BAdam,
Adam-mini, Muon) and otherwise HF's ``optim`` (transformers ``trainer_optimizer.py:607-640``, one
``_get_*`` per name), sized per trainable parameter by :func:`optimizer_state_bytes`:

- ``use_galore`` / ``optim: galore_*``: moments of the rank-r projection of each targeted 2-D
  ``nn.Linear`` weight, plus the projection matrix (GaLore ``galore_torch/adamw.py`` step: state
  ``exp_avg``/``exp_avg_sq`` are ``zeros_like(grad)`` of the projected grad; ``galore_projector.py``
  ``project``: std projection keeps ``Vh[:r]`` (r x min) and makes an (max x r) grad); every other
  trainable parameter (embeddings, norms, lm_head) keeps full moments;
- ``use_apollo``: the same shapes (APOLLO ``apollo_torch/apollo.py`` step: ``exp_avg``/``exp_avg_sq``
  of the projected grad; a random projector of rank r), plus one full-size scaled gradient per step;
- ``use_badam``: one decoder layer trains at a time (BAdam ``block_optim.py`` ``infer_param_groups``:
  one block per ``layers.N.``, embedding and lm_head excluded; ``_grad_to_hp``/``_update_param``: an
  fp32 copy of the active block and its fp32 gradient; the base optimizer's states for it only); the
  model stays in half precision (LLaMA-Factory ``model/adapter.py:319``);
- ``use_adam_mini``: ``m`` like the parameter for every trainable one, ``v`` one value per output
  neuron (embedding, lm_head, value, attention output, MLP), per head (query, key) or per tensor
  (norms) (Adam-mini 1.1.1 on PyPI, ``adam_mini.py`` step: ``state["m"] = torch.zeros_like(p)``,
  ``state["vmean"]`` of ``neuron_per_gpu`` or ``head_per_gpu`` rows);
- ``use_muon``: one momentum buffer for 2-D weights other than embeddings and lm_head, AdamW's two
  moments for the rest (LLaMA-Factory ``third_party/muon/muon.py:176-210``);
- ``loraplus_lr_ratio``: LoRA+ only sets learning rates per group; the optimizer is ``optim``'s
  (``trainer_utils.py:398`` ``Trainer.get_optimizer_cls_and_kwargs``), sized as such.

Pure: no torch. Bytes throughout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftlaunch.plan.flags import truthy
from ftlaunch.plan.modelspec import ModelSpec, layer_params, linear_shapes

CUSTOM_KINDS = ("galore", "apollo", "badam", "adam_mini", "muon")


@dataclass(frozen=True)
class CustomOptimizer:
    """The optimizer LLaMA-Factory builds instead of HF's (``create_custom_optimizer``)."""

    kind: str  # one of CUSTOM_KINDS
    rank: int = 16  # GaLore/APOLLO projection rank (galore_rank / apollo_rank, default 16)
    target: str = "all"  # galore_target / apollo_target: "all" or module names
    layerwise: bool = False  # galore_layerwise / apollo_layerwise: a step per parameter in backward
    badam_mode: str = "layer"  # "layer" (one decoder layer at a time) or "ratio"
    badam_ratio: float = 0.05  # badam_update_ratio (ratio mode)

    @property
    def projected(self) -> bool:
        return self.kind in ("galore", "apollo")


def _optim_arg(optim_args: Any, key: str) -> str | None:
    """One ``key=value`` of HF's comma-separated ``optim_args``."""
    for part in str(optim_args or "").split(","):
        k, _, v = part.partition("=")
        if k.strip() == key and v.strip():
            return v.strip()
    return None


def custom_optimizer(config: Mapping[str, Any]) -> CustomOptimizer | None:
    """What ``create_custom_optimizer`` builds for ``config`` (None: HF's ``optim`` as it is).

    transformers' own ``optim: galore_*`` / ``apollo_*`` names (``trainer_optimizer.py:349-409``: rank
    from ``optim_args``, default 128) are the same projections."""
    c = config or {}

    def rank(key: str) -> int:
        try:
            return max(1, int(c.get(key, 16) or 16))
        except (TypeError, ValueError):
            return 16

    def target(key: str) -> str:
        t = c.get(key, "all")
        return ",".join(str(x).strip() for x in t) if isinstance(t, (list, tuple)) else str(t or "all")

    for kind in ("galore", "apollo"):
        if truthy(c.get(f"use_{kind}")):
            layerwise = truthy(c.get(f"{kind}_layerwise"))
            return CustomOptimizer(kind, rank(f"{kind}_rank"), target(f"{kind}_target"), layerwise)
    if c.get("loraplus_lr_ratio") is not None:
        return None  # LoRA+: optim's own class with per-group learning rates
    if truthy(c.get("use_badam")):
        try:
            ratio = float(c.get("badam_update_ratio", 0.05) or 0.05)
        except (TypeError, ValueError):
            ratio = 0.05
        return CustomOptimizer("badam", badam_mode=str(c.get("badam_mode") or "layer"), badam_ratio=ratio)
    if truthy(c.get("use_adam_mini")):
        return CustomOptimizer("adam_mini")
    if truthy(c.get("use_muon")):
        return CustomOptimizer("muon")
    optim = str(c.get("optim") or "").lower()
    for kind in ("galore", "apollo"):
        if optim.startswith(kind + "_"):
            r = _optim_arg(c.get("optim_args"), "rank")
            return CustomOptimizer(kind, int(r) if r and r.isdigit() else 128, "all", optim.endswith("_layerwise"))
    return None


def base_optimizer(optim: str, custom: CustomOptimizer | None) -> str:
    """The element-wise optimizer whose states the non-projected parameters keep.

    GaLore picks GaLoreAdamW for ``adamw_torch``, GaLoreAdamW8bit for the bitsandbytes 8-bit names and
    GaLoreAdafactor for ``adafactor`` (trainer_utils.py:239-244; transformers' ``galore_adamw_8bit`` /
    ``galore_adafactor`` likewise); APOLLO only AdamW (trainer_utils.py:330)."""
    o = optim.lower()
    if custom is not None and custom.projected:
        if "8bit" in o:
            return "adamw_8bit"
        if "adafactor" in o:
            return "adafactor"
        return "adamw_torch"
    return o


# The optim names LLaMA-Factory builds each projection on (trainer_utils.py:239-246 and :330-333);
# any other raises NotImplementedError("Unknown optim") when the trainer is created.
PROJECTED_BASES = {
    "galore": ("adamw_torch", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "adafactor"),
    "apollo": ("adamw_torch",),
}


def unbuildable(custom: CustomOptimizer | None, optim: str) -> str | None:
    """Why LLaMA-Factory cannot build ``custom`` on ``optim`` (use_galore / use_apollo only), or None."""
    if custom is None or not custom.projected or optim.startswith(custom.kind + "_"):
        return None
    allowed = PROJECTED_BASES[custom.kind]
    if optim in allowed:
        return None
    return (
        f"use_{custom.kind} with optim {optim}: LLaMA-Factory builds {custom.kind} only on {', '.join(allowed)} "
        f'(train/trainer_utils.py) and raises NotImplementedError("Unknown optim: {optim}.") when training '
        "starts; set optim: adamw_torch"
    )


def optimizer_state_bytes(optim: str, state_bytes: int, spec: ModelSpec) -> float:
    """Optimizer state bytes per trainable parameter of HF's ``optim`` (``state_bytes``: the
    parameter's dtype, which torch.optim keeps its states in).

    States per parameter, from each class's ``step``:
      AdamW family (adamw_torch[_fused], apex, anyprecision, stable_adamw, schedule_free_adamw/radam:
      ``z`` + ``exp_avg_sq``) 2; AdEMAMix (``exp_avg_fast``, ``exp_avg_slow``, ``exp_avg_sq``) and
      GrokAdamW (+ ``grok_ema``) 3; Lion, Adagrad (``sum``), RMSprop (``square_avg``; HF passes no
      momentum), schedule_free_sgd (``z``) 1; SGD 0 (HF passes no momentum, trainer_optimizer.py:315);
      LOMO 0 (the update is fused into backward); Adafactor and AdaLomo a factored second moment, one
      value per row and column (HF passes beta1=None: no first moment).
    Bytes per state: the parameter's dtype for torch.optim; fp32 for bitsandbytes' ``*_32bit``;
    1 byte + one fp32 absmax per 256-value block for 8-bit (bitsandbytes blockwise, torchao 8-bit);
    4 bits + one fp32 scale per 128 for torchao ``adamw_torch_4bit``.
    """
    o = optim.lower()
    if o == "lomo":
        return 0.0
    if "adafactor" in o or o == "adalomo":
        return state_bytes * 2 / spec.hidden_size
    if o.startswith("sgd"):
        return 0.0
    if "ademamix" in o or "grokadamw" in o:
        states = 3
    elif "lion" in o or "adagrad" in o or "rmsprop" in o or o == "schedule_free_sgd":
        states = 1
    else:
        states = 2  # the AdamW family
    if "8bit" in o:
        return states * (1 + 4 / 256)
    if "4bit" in o:
        return states * (0.5 + 4 / 128)
    if "32bit" in o:
        return states * 4.0
    return states * float(state_bytes)


def optimizer_step_transient(optim: str) -> float:
    """Multiples of the trainable parameter bytes allocated as temporaries at optimizer.step().

    torch.optim foreach implementations (the default for adamw_torch on CUDA) use "~ sizeof(params)
    more peak memory than the for-loop version due to the intermediates" (torch.optim docs; in
    _multi_tensor_adam it is exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)). Fused,
    bitsandbytes and torchao optimizers update in place; SGD without momentum, Adafactor and LOMO
    hold no full-size temporaries.
    """
    o = optim.lower()
    in_place = ("fused", "8bit", "bnb", "4bit", "32bit", "adafactor", "lomo")
    if any(k in o for k in in_place) or o.startswith("sgd"):
        return 0.0
    return 1.0


@dataclass(frozen=True)
class OptimizerBytes:
    states: float  # bytes kept between steps
    transient: float  # bytes alive only during optimizer.step()


def _targeted(spec: ModelSpec, target: str) -> list[tuple[int, int, int]]:
    """(in, out, count) of the decoder's nn.Linear weights whose module name contains a target
    (``any(target in name)``, trainer_utils.py:212; ``all``: every linear layer but lm_head)."""
    shapes = linear_shapes(spec)
    wanted = [t.strip() for t in str(target or "all").split(",") if t.strip()]
    out: list[tuple[int, int, int]] = []
    for name, entries in shapes.items():
        if "all" in wanted or any(t in name for t in wanted):
            out.extend(entries)
    return out


def trainable_share(spec: ModelSpec, finetuning_type: str, trainable: int) -> float:
    """The share of the decoder's linear layers that trains: 1 for full, the trained layers' share
    for freeze (their linears train with them)."""
    if finetuning_type == "full":
        return 1.0
    return min(1.0, trainable / max(1.0, layer_params(spec) * spec.num_layers))


def badam_block(spec: ModelSpec, custom: CustomOptimizer) -> float:
    """Parameters of the block BAdam trains at once: one decoder layer, or ``badam_update_ratio``
    of the model in ratio mode."""
    if custom.badam_mode == "ratio":
        return spec.params * custom.badam_ratio
    return layer_params(spec)


def _largest_linear(spec: ModelSpec) -> int:
    return max((i * o for entries in linear_shapes(spec).values() for i, o, _ in entries), default=0)


def optimizer_bytes(
    spec: ModelSpec, optim: str, custom: CustomOptimizer | None, finetuning_type: str, trainable: float, wt: int
) -> OptimizerBytes:
    """States and step temporaries of the optimizer for ``trainable`` parameters kept in ``wt``
    bytes each (4: fp32, upcast or a DeepSpeed master; 2: pure_bf16)."""
    base = base_optimizer(optim, custom)
    per = optimizer_state_bytes(base, wt, spec)
    plain = OptimizerBytes(trainable * per, trainable * wt * optimizer_step_transient(base))
    if custom is None or custom.kind == "badam":  # BAdam: the base optimizer over its block (states.py)
        return plain
    emb = spec.vocab_size * spec.hidden_size
    if custom.kind == "adam_mini":
        # m like the parameter; v one value per output row (adam_mini.py step), at most T / hidden_size
        largest = max(emb if finetuning_type == "full" else 0, _largest_linear(spec))
        return OptimizerBytes(wt * trainable * (1 + 1 / spec.hidden_size), wt * min(largest, trainable))
    share = trainable_share(spec, finetuning_type, int(trainable)) if finetuning_type in ("full", "freeze") else 0.0
    if custom.kind == "muon":
        # 2-D non-embedding weights: one momentum buffer (muon.py:176); the rest: AdamW's two (muon.py:209)
        matrices = trainable if finetuning_type not in ("full", "freeze") else share * _linear_total(spec)
        others = max(0.0, trainable - matrices)
        newton_schulz = 3 * 2 * _largest_linear(spec)  # bf16 iterates of one matrix at a time
        return OptimizerBytes(matrices * wt + others * 2 * wt, newton_schulz)
    # GaLore / APOLLO: projected moments for each targeted linear weight, full moments elsewhere
    projected_states = 0.0
    projected_params = 0.0
    for i, o, count in _targeted(spec, custom.target):
        r = min(custom.rank, i, o)
        n = count * share
        projected_params += i * o * n
        if base == "adafactor":  # factored second moment of the (max x r) projected gradient
            moments = (max(i, o) + r) * wt
        else:
            moments = per * max(i, o) * r
        projected_states += n * (moments + wt * r * min(i, o))  # + the projection matrix
    others = max(0.0, trainable - projected_params)
    # per step: the projected gradient, its update and the full-size update projected back (one
    # matrix at a time; APOLLO's scaled gradient is that full-size one), and every update_proj_gap
    # steps an SVD (GaLore) of one gradient: float copy, U and Vh
    largest = _largest_linear(spec)
    transient = max(3 * largest * 4, others * wt * optimizer_step_transient(base))
    return OptimizerBytes(projected_states + others * per, transient)


def _linear_total(spec: ModelSpec) -> float:
    return float(sum(i * o * c for entries in linear_shapes(spec).values() for i, o, c in entries))


def layerwise_gradient_bytes(spec: ModelSpec, wt: int) -> float:
    """Gradients alive with a layer-wise GaLore/APOLLO step: each parameter is stepped and its gradient
    freed in its post-accumulate-grad hook (trainer_utils.py:264-271), so about one parameter's
    gradient at a time: the largest one, the embedding or a linear weight."""
    return float(max(spec.vocab_size * spec.hidden_size, _largest_linear(spec))) * wt


def describe(custom: CustomOptimizer | None, optim: str) -> str:
    """How the plan names the optimizer it sized."""
    if custom is None:
        return optim
    if custom.projected:
        how = "layer-wise, " if custom.layerwise else ""
        return f"{custom.kind} ({how}rank {custom.rank}, {base_optimizer(optim, custom)})"
    if custom.kind == "badam":
        what = f"ratio {custom.badam_ratio:g}" if custom.badam_mode == "ratio" else "one layer at a time"
        return f"badam ({what}, {optim})"
    return custom.kind.replace("_", "-")


__all__ = [
    "CUSTOM_KINDS",
    "CustomOptimizer",
    "OptimizerBytes",
    "badam_block",
    "base_optimizer",
    "custom_optimizer",
    "describe",
    "layerwise_gradient_bytes",
    "optimizer_bytes",
    "optimizer_state_bytes",
    "optimizer_step_transient",
    "trainable_share",
    "unbuildable",
]
