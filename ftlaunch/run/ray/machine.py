"""The plan request of a Ray run: the cluster's own resources as the machine (not this machine's
probe), and LLaMA-Factory's own Ray mode refused before anything is planned when its placement
group cannot fit (it would wait forever without a word).

The cluster's machine reaches the planner as a hardware file (``--hardware``'s path, the one way a
described machine enters planning), written under FTLAUNCH_HOME/ray/.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ftlaunch.errors import ConfigError
from ftlaunch.files import home_folder, write_json_atomic
from ftlaunch.plan.config import load_config
from ftlaunch.run.prepare import PlanRequest
from ftlaunch.run.ray import jobs
from ftlaunch.run.ray.cluster import RAY_MODE_HINT, hardware_for, ray_mode_refusal, wants_ray_mode


def refuse_ray_mode(req: PlanRequest, env: Mapping[str, str], nodes: tuple, address: str) -> None:
    """ConfigError (exit 3) when the config asks for LLaMA-Factory's Ray mode and its placement group
    cannot fit the cluster: the reason, and the `ray start --num-cpus` that would fit."""
    values = load_config(req.config, req.overrides, cwd=req.cwd).values
    if not wants_ray_mode(values, env):
        return
    workers = int(values.get("ray_num_workers") or 1)
    why = ray_mode_refusal(nodes, workers, address)
    if why is not None:
        raise ConfigError(why, hint=RAY_MODE_HINT)


def cluster_request(req: PlanRequest, env: Mapping[str, str], address: str) -> PlanRequest:
    """``req`` for the Ray cluster at ``address``: its largest node (``--gpu`` names the card or the
    CPU processes, checked against it). EngineUnreachable when the head does not answer."""
    if req.hardware_file:
        raise ConfigError(
            "--engine ray plans for the cluster's own resources: --hardware does not apply",
            hint="leave --hardware out; --gpu CARDxN or nonexN chooses among what the cluster has",
        )
    nodes = jobs.nodes(address)
    refuse_ray_mode(req, env, nodes, address)
    hw = hardware_for(nodes, req.gpu, address)
    if req.host_ram_gib:
        hw = replace(hw, host_ram_gib=req.host_ram_gib, host_available_gib=req.host_ram_gib)
    folder = home_folder(env, "ray")
    path = Path(folder) / (address.split("://", 1)[-1].replace(":", "_").replace("/", "_") + ".json")
    write_json_atomic(path, hw.to_dict())
    return replace(req, gpu=None, hardware_file=str(path))
