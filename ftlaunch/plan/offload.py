"""The one ZeRO-3 CPU-offload rule, shared by the memory chooser (planning) and the OOM ladder (recovery).

Both decide "offload" as the placeholder value ``ZERO3_OFFLOAD`` for the ``deepspeed`` key; ``materialize``
turns it into what the trainer needs: the bundled DeepSpeed config and a torchrun launch (DeepSpeed
refuses to start without FORCE_TORCHRUN, even on one GPU). Pure but for the path of a package file.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

ZERO3_OFFLOAD = "ds_z3_offload"  # placeholder value, mapped to ftlaunch/data/ds_z3_offload_config.json
OFFLOAD_ENV = {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1"}


def offload_config_path() -> str:
    return str(resources.files("ftlaunch").joinpath("data/ds_z3_offload_config.json"))


def materialize(value: Any) -> tuple[Any, dict[str, str]]:
    """(config value, launch env) for a decided value: the placeholder becomes the bundled config."""
    if value == ZERO3_OFFLOAD:
        return offload_config_path(), dict(OFFLOAD_ENV)
    return value, {}
