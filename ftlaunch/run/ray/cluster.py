"""A Ray cluster as the planner sees it, and LLaMA-Factory's own Ray mode checked against it. Pure.

The nodes come from the dashboard's state API (``/api/v0/nodes``: each alive node's
``resources_total``: CPU, GPU, memory in bytes, ``accelerator_type:<TYPE>``), never from this
machine's probe: the job runs where Ray places it. A run's trainer runs on one node (torchrun on
the node that holds its driver, which Ray places by ``entrypoint_num_gpus``/``entrypoint_num_cpus``):
the plan is made for the largest node.

LLaMA-Factory 0.9.5's Ray mode (``USE_RAY=1``, ``ray_num_workers``) asks for a placement group of one
bundle per device of the whole cluster (``ray.cluster_resources()['GPU']``, or ``['CPU']`` on a
CPU-only cluster), each ``{CPU: 10}`` (plus one GPU), strategy PACK (train/trainer_utils.py
``get_placement_group``; upstream issue 10348). What does not fit waits forever without a word:
``ray_mode_refusal`` says so before anything is submitted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftlaunch.errors import HardwareError
from ftlaunch.plan.catalog import CARDS
from ftlaunch.plan.hardware import Gpu, Hardware, all_pairs, parse_gpu_spec

# LLaMA-Factory's bundle: 10 CPUs per worker (train/trainer_utils.py get_placement_group, 0.9.5).
LF_CPUS_PER_BUNDLE = 10
_BYTES_PER_GIB = 1024**3


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster: its address, CPUs, GPUs, memory (GiB) and GPU type (Ray's
    ``accelerator_type``, e.g. "A100-80G", "H100", or None)."""

    ip: str
    cpus: float
    gpus: int
    memory_gib: float | None
    accelerator: str | None = None
    head: bool = False


def parse_nodes(data: Mapping[str, Any]) -> tuple[Node, ...]:
    """The alive nodes of a ``/api/v0/nodes?detail=1`` answer (the dashboard's JSON). A node that is
    not ALIVE is not counted: Ray places nothing there."""
    result = (data.get("data") or {}).get("result") or {}
    rows = result.get("result") if isinstance(result, Mapping) else result
    nodes = []
    for row in rows or ():
        if str(row.get("state", "ALIVE")).upper() != "ALIVE":
            continue
        res = row.get("resources_total") or {}
        types = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
        memory = res.get("memory")
        nodes.append(
            Node(
                ip=str(row.get("node_ip") or "?"),
                cpus=float(res.get("CPU") or 0),
                gpus=int(res.get("GPU") or 0),
                memory_gib=None if memory is None else round(float(memory) / _BYTES_PER_GIB, 2),
                accelerator=types[0] if types else None,
                head=bool(row.get("is_head_node")),
            )
        )
    return tuple(nodes)


def describe(nodes: Sequence[Node]) -> str:
    """The cluster in one line: "1 node: 4 CPUs, no GPU, 22.4 GiB"."""
    cpus = sum(n.cpus for n in nodes)
    gpus = sum(n.gpus for n in nodes)
    types = sorted({n.accelerator for n in nodes if n.accelerator})
    memory = sum(n.memory_gib or 0 for n in nodes)
    gpu_text = f"{gpus} GPUs" + (f" ({', '.join(types)})" if types else "") if gpus else "no GPU"
    plural = "s" if len(nodes) != 1 else ""
    return f"{len(nodes)} node{plural}: {cpus:g} CPUs, {gpu_text}, {memory:.1f} GiB"


def _norm(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


def card_of(accelerator: str | None) -> tuple[str | None, str | None]:
    """Ray's accelerator type -> (the catalog card, a note). "A100-80G" -> A100-80GB; "A100" could be
    either A100: the one with less memory is planned for (never more than there is), said in the note;
    no card of that name: (None, why)."""
    if not accelerator:
        return None, "the cluster's GPUs carry no accelerator_type; name the card with --gpu CARDxN"
    wanted = _norm(accelerator)
    exact = [k for k in CARDS if _norm(k) == wanted]
    found = exact or [k for k in CARDS if _norm(k).startswith(wanted)]
    if not found:
        return None, f"Ray's accelerator type {accelerator!r} is not in the catalog; name the card with --gpu CARDxN"
    found.sort(key=lambda k: CARDS[k].memory_mib)
    note = None
    if len(found) > 1:
        note = (
            f"Ray's accelerator type {accelerator!r} could be {' or '.join(found)}: planned for {found[0]} "
            f"(the least memory); name it with --gpu {found[-1]}xN if the cluster has that"
        )
    return found[0], note


def hardware_for(nodes: Sequence[Node], gpu: str | None, source: str) -> Hardware:
    """The machine a Ray run is planned for: the largest node (most GPUs, then CPUs) of ``nodes``.

    ``gpu``: what `--gpu` said: None plans every GPU of that node (a CPU cluster: one process);
    ``CARDxN`` names the card (when Ray's type is ambiguous) and how many of a node's GPUs to use;
    ``nonexN``/``cpuxN`` plans N trainer processes on a node's CPUs. HardwareError when no node has
    what was asked, naming what the cluster has."""
    if not nodes:
        raise HardwareError(f"the Ray cluster at {source} has no alive node", hint="start one with `ray start`")
    node = max(nodes, key=lambda n: (n.gpus, n.cpus))
    key, count = parse_gpu_spec(gpu) if gpu else (None, None)
    notes = [f"Ray cluster {source}: {describe(nodes)}; planned for node {node.ip}"]
    memory = node.memory_gib
    if key == "none" or (key is None and node.gpus == 0):
        return _cpu_hardware(nodes, gpu, count, source, notes)
    if node.gpus == 0:
        raise HardwareError(
            f"--gpu {gpu}: the Ray cluster at {source} has no GPU ({describe(nodes)})",
            hint="--gpu nonexN trains N processes on a node's CPUs",
        )
    wanted = count or node.gpus
    if wanted > node.gpus:
        raise HardwareError(
            f"--gpu {gpu}: {wanted} GPUs on one node, but the largest node of the Ray cluster at {source} has "
            f"{node.gpus} ({describe(nodes)})",
            hint=f"at most x{node.gpus}: a Ray run trains on one node",
        )
    if key is not None and node.accelerator and not _norm(key).startswith(_norm(node.accelerator)):
        raise HardwareError(
            f"--gpu {gpu}: Ray says its GPUs are {node.accelerator} (node {node.ip}), not {key}",
            hint="leave the card out (--gpu is then the cluster's), or name the card the cluster has",
        )
    if key is None:
        key, note = card_of(node.accelerator)
        if key is None:
            raise HardwareError(f"the Ray cluster at {source}: {note}", hint="e.g. --engine ray --gpu A100-80GBx8")
        if note:
            notes.append(note)
    card = CARDS[key]
    gpus = tuple(
        Gpu(index=i, name=card.nvml_name, total_mib=card.memory_mib, compute_capability=card.compute_capability)
        for i in range(wanted)
    )
    return Hardware(
        gpus=gpus,
        source=f"ray:{source}",
        host_ram_gib=memory,
        host_available_gib=memory,
        cpu_count=max(1, math.floor(node.cpus)),
        notes=tuple(notes),
        p2p_blocked=() if card.p2p else all_pairs(wanted),
    )


def _cpu_hardware(nodes: Sequence[Node], gpu: str | None, count: int | None, source: str, notes: list[str]) -> Hardware:
    """``nonexN``/``cpuxN`` (or a CPU cluster): N trainer processes on the node with the most CPUs."""
    processes = max(1, count or 1)
    cpu_node = max(nodes, key=lambda n: n.cpus)
    if cpu_node.cpus < processes:
        raise HardwareError(
            f"--gpu {gpu}: {processes} trainer processes, but the largest node of the Ray cluster at {source} "
            f"has {cpu_node.cpus:g} CPUs ({describe(nodes)})",
            hint=f"--gpu nonex{max(1, int(cpu_node.cpus))} at most, or a node started with more --num-cpus",
        )
    return Hardware(
        source=f"ray:{source}",
        host_ram_gib=cpu_node.memory_gib,
        host_available_gib=cpu_node.memory_gib,
        cpu_count=max(1, math.floor(cpu_node.cpus)),
        cpu_processes=processes,
        notes=tuple(notes),
    )


def wants_ray_mode(values: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    """Does this config run LLaMA-Factory's own Ray mode? USE_RAY=1 in the environment (LLaMA-Factory's
    ``use_ray()``), or a ``ray_num_workers`` in the config (its only use is that mode)."""
    return str(env.get("USE_RAY", "")).lower() in {"1", "true", "y", "yes"} or "ray_num_workers" in values


def ray_mode_refusal(nodes: Sequence[Node], num_workers: int, source: str) -> str | None:
    """Why LLaMA-Factory's Ray mode would never start on ``nodes`` (None: its placement group fits).

    It asks for one bundle per device of the whole cluster (GPUs; CPUs where there is no GPU), each
    of LF_CPUS_PER_BUNDLE CPUs (and one GPU); a node holds min(CPUs // 10, GPUs) of them."""
    gpus = sum(n.gpus for n in nodes)
    if gpus:
        bundles = gpus
        fits = sum(min(int(n.cpus // LF_CPUS_PER_BUNDLE), n.gpus) for n in nodes)
        unit = "GPU"
    else:
        bundles = int(sum(n.cpus for n in nodes))
        fits = sum(int(n.cpus // LF_CPUS_PER_BUNDLE) for n in nodes)
        unit = "CPU"
    if num_workers > bundles:
        return (
            f"LLaMA-Factory's Ray mode: ray_num_workers {num_workers} is more than the {bundles} {unit}s of the "
            f"Ray cluster at {source} ({describe(nodes)}); it refuses to start"
        )
    if fits >= bundles:
        return None
    demand = f"{bundles} bundles of {{CPU: {LF_CPUS_PER_BUNDLE}" + (", GPU: 1}" if gpus else "}")
    why = (
        f"LLaMA-Factory's Ray mode would wait forever for its placement group on the Ray cluster at {source} "
        f"({describe(nodes)}): it asks for one bundle per {unit} of the whole cluster whatever ray_num_workers "
        f"says ({demand}, PACK; upstream issue 10348), and the cluster holds {fits} of them"
    )
    if gpus:
        starts = sorted({f"ray start --num-cpus={LF_CPUS_PER_BUNDLE * n.gpus}" for n in nodes if n.gpus})
        return (
            f"{why}; it fits when each GPU node offers 10 CPUs per GPU: {' / '.join(starts)} (with --num-gpus as now)"
        )
    return (
        f"{why}; on a cluster without GPUs no --num-cpus fits (each CPU offered adds a bundle of "
        f"{LF_CPUS_PER_BUNDLE} CPUs): `ray start --num-cpus=N` never does"
    )


RAY_MODE_HINT = (
    "drop USE_RAY/ray_num_workers and let ftlaunch run the trainer as a Ray job instead "
    "(`--engine ray`, torchrun on a node: --gpu nonexN on CPU nodes, every GPU of a node otherwise)"
)
