"""The one ZeRO-3 CPU-offload rule, shared by the memory chooser (planning) and the OOM ladder (recovery).

Both decide "offload" as the placeholder value ``ZERO3_OFFLOAD`` for the ``deepspeed`` key; ``materialize``
turns it into what the trainer needs: the bundled DeepSpeed config and a torchrun launch for the
planned world size (DeepSpeed refuses to start without FORCE_TORCHRUN, even on one GPU; the env comes
from ``rules.launch_env``, the one place a world size becomes variables). ``refusal`` says when the
trainer would refuse ZeRO-3 for a config (``rules.zero3_refusals``). Pure but for the path of a
package file.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import Any

from ftlaunch.plan import rules

ZERO3_OFFLOAD = "ds_z3_offload"  # placeholder value, mapped to ftlaunch/data/ds_z3_offload_config.json


def offload_config_path() -> str:
    return str(resources.files("ftlaunch").joinpath("data/ds_z3_offload_config.json"))


def materialize(value: Any, world_size: int = 1) -> tuple[Any, dict[str, str]]:
    """(config value, launch env) for a decided value: the placeholder becomes the bundled config,
    launched as ``world_size`` processes (never fewer than the plan's: NPROC_PER_NODE is the world)."""
    if value == ZERO3_OFFLOAD:
        return offload_config_path(), rules.launch_env(world_size, gpus=world_size, deepspeed=True)
    return value, {}


def refusal(values: Mapping[str, Any], ptq: str | None = None) -> str | None:
    """Why ZeRO-3 offload may not be put into ``values`` (the trainer's own words), or None."""
    found = rules.zero3_refusals(values, ptq)
    return "; ".join(str(r) for r in found) or None
