"""What the click edges share: the environment as input, and the "what to plan for" options.

`plan`, `train` and `estimate` take the same hardware and batch options; they are declared once here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click


def env_now() -> dict[str, str]:
    """The environment is input, read in one place, at call time."""
    return dict(os.environ)


def target_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--gpu, --hardware, --source-gpus, --global-batch, --headroom, --params, --model-config."""
    f = click.option("--gpu", help="Plan for a catalog card instead of probing: V100-32GB, A100-80GBx4, none.")(f)
    f = click.option(
        "--hardware",
        "hardware_file",
        type=click.Path(dir_okay=False),
        help="Plan for a machine captured with `ftlaunch env --json`.",
    )(f)
    f = click.option(
        "--source-gpus",
        type=click.IntRange(min=1),
        help="GPUs the config was written for (default 1); sets the source global batch.",
    )(f)
    f = click.option("--global-batch", type=click.IntRange(min=1), help="Source global batch, set directly.")(f)
    f = click.option(
        "--headroom",
        type=click.FloatRange(0.0, 0.9),
        default=0.12,
        show_default=True,
        help="Share of GPU memory kept free.",
    )(f)
    f = click.option("--params", help="Model size when config.json is not at hand, e.g. 7B.")(f)
    f = click.option(
        "--model-config",
        type=click.Path(dir_okay=False, exists=True),
        help="A config.json that sizes the model when the weights are elsewhere (hub id).",
    )(f)
    return f
