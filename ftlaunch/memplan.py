"""Glue between the planner and the memory model: finds the model's shape and builds the chooser.

``model_spec_for`` reads config.json (a shell, small); ``make_memory_chooser`` returns a pure
callable the planner calls with the config it is building.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, DoesNotFitError
from .hardware import Hardware
from .recovery import ZERO3_OFFLOAD


@dataclass(frozen=True)
class MemoryDecision:
    micro_batch: int | None
    memory: dict[str, Any]
    edits: tuple[tuple[str, Any, str], ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    batch_reason: str | None = None


def model_spec_for(
    values: Mapping[str, Any], params: str | None, model_config: str | None = None
) -> tuple[Any, str | None]:
    """(ModelSpec or None, a note when the size is unknown or guessed).

    Order: --model-config FILE, --params, a local model directory's config.json.
    """
    import json

    from . import modelspec

    if model_config:
        try:
            return modelspec.spec_from_config(json.loads(Path(model_config).read_text())), None
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"--model-config {model_config}: {exc}") from None

    if params:
        try:
            return modelspec.spec_from_param_count(params), f"model size from --params {params} (shapes guessed)"
        except ValueError as exc:
            raise ConfigError(f"--params {params!r}: {exc}") from None
    path = values.get("model_name_or_path")
    if isinstance(path, str) and Path(path).is_dir():
        try:
            spec = modelspec.load_model_spec(path)
        except (ValueError, KeyError) as exc:
            return None, f"{path}/config.json: cannot size the model ({exc}); memory model skipped"
        if spec is not None:
            return spec, None
    return None, (
        f"model size unknown for {path!r} (not a local directory with config.json): memory model "
        "skipped; download it first (`ftlaunch download`) or pass --params 7B"
    )


def make_memory_chooser(spec: Any, deepspeed_config: Mapping[str, Any] | None, *, headroom: float):
    from . import memory

    def choose(values: Mapping[str, Any], hw: Hardware, per_device: int, preferred: int) -> MemoryDecision | None:
        if not hw.gpus:
            return None  # CPU training: host RAM, not a card, is the limit; no micro-batch model
        ds = deepspeed_config if values.get("deepspeed") else None
        setup = memory.setup_from_config(dict(values), world_size=hw.world_size, deepspeed_config=ds)
        capacity = min(g.total_gib for g in hw.gpus)
        choice = memory.choose_micro_batch(
            spec,
            setup,
            capacity_gib=capacity,
            per_device_batch=per_device,
            headroom=headroom,
            host_ram_gib=hw.host_ram_gib,
            bf16_capable=hw.bf16,
            can_flash=all(g.flash_attn for g in hw.gpus),
        )
        est = choice.estimate.to_dict()
        usable = capacity * (1 - headroom)
        mem = {
            **est,
            "capacity_gib": round(capacity, 2),
            "usable_gib": round(usable, 2),
            "headroom": headroom,
            "fits": choice.micro_batch is not None,
            "tried": [list(t) for t in choice.tried],
            "model_params": spec.params,
        }
        if choice.micro_batch is None:
            raise DoesNotFitError(
                f"{spec.params / 1e9:.2f}B-parameter model, {setup.finetuning_type} fine-tuning, "
                f"cutoff_len {setup.seq_len}: peak {est['peak_gib']:.1f} GiB at micro-batch 1 > "
                f"{usable:.1f} GiB usable on {hw.describe()} ({headroom:.0%} headroom)",
                hint="ftlaunch never changes the method or data on its own; pick one of the options above",
                alternatives=[dict(a) for a in choice.alternatives],
            )
        edits: list[tuple[str, Any, str]] = []
        env: dict[str, str] = {}
        for key, _old, new, reason in choice.changes:
            if new == ZERO3_OFFLOAD:
                from .supervisor import offload_config_path

                new = offload_config_path()
                env.update({"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1"})
            edits.append((key, new, reason))
        reason = (
            f"largest micro-batch dividing {per_device} that fits: predicted peak "
            f"{est['peak_gib']:.1f} GiB <= {usable:.1f} GiB usable ({capacity:.0f} GiB, {headroom:.0%} headroom)"
        )
        return MemoryDecision(choice.micro_batch, mem, tuple(edits), env, (), reason)

    return choose
