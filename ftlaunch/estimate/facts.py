"""What an estimate needs to know about the model on a plan: its shape (FLOPs per token), the
card's peak FLOP/s, and whether turning gradient checkpointing off would still fit (a lever).

Reads the model's config.json (through the memory model's spec lookup) and the DeepSpeed file the
config names; decides nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ftlaunch.estimate import throughput
from ftlaunch.estimate.throughput import ModelShape

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan


@dataclass(frozen=True)
class ModelFacts:
    """The model's shape, the card's peak, and the checkpointing-off verdict with its reason."""

    shape: ModelShape | None = None
    peak_tflops: float | None = None
    checkpointing_off_fits: bool | None = None
    checkpointing_off_note: str = ""


def model_facts(p: Plan, params: str | None, model_config: str | None, headroom: float) -> ModelFacts:
    """The facts of the plan's model on the plan's card (memory model: checkpointing off at its micro-batch)."""
    from ftlaunch.plan.config import load_deepspeed
    from ftlaunch.plan.memory.adapt import installed_default_optimizer, model_spec_for
    from ftlaunch.plan.memory.peak import estimate as memory_estimate
    from ftlaunch.plan.memory.setup import setup_from_config
    from ftlaunch.plan.memory.states import trainable_params

    values = dict(p.config)
    gpus = p.hardware.gpus
    peak = throughput.peak_tflops(gpus[0].name, p.precision) if gpus else None
    spec, _note = model_spec_for(values, params, model_config)
    if spec is None:
        return ModelFacts(peak_tflops=peak)
    optim = installed_default_optimizer()[0]  # what HF Trainer really uses when `optim` is unset
    setup = setup_from_config(
        values, world_size=p.world_size, deepspeed_config=load_deepspeed(values), default_optim=optim
    )
    shape = throughput.model_shape(spec, trainable_params(spec, setup))
    if not gpus:
        return ModelFacts(shape, peak, None, "CPU: host RAM is the limit")
    if not setup.gradient_checkpointing:
        return ModelFacts(shape, peak)
    off = memory_estimate(spec, replace(setup, gradient_checkpointing=False, micro_batch=p.micro_batch))
    usable = min(g.total_gib for g in gpus) * (1 - headroom)
    note = f"predicted peak {off.peak_gib:.1f} GiB vs {usable:.1f} GiB usable at micro-batch {p.micro_batch}"
    return ModelFacts(shape, peak, off.peak_gib <= usable, note)
