"""What the machine has: GPUs, host RAM, disk. Values, catalog machines and the parsers, all pure.

The shells that fill them live in ftlaunch.probe: the probe (NVML, then ``nvidia-smi``, then "no
GPU"), the hardware file reader and the runtime GPU sampler. ``CUDA_VISIBLE_DEVICES`` is honoured
the way CUDA honours it (indices or UUIDs, cut at the first invalid entry; empty means no GPU).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ftlaunch.errors import HardwareError
from ftlaunch.plan.catalog import CARDS

MIB_PER_GIB = 1024


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_mib: int
    free_mib: int | None = None
    compute_capability: tuple[int, int] | None = None
    uuid: str | None = None

    @property
    def total_gib(self) -> float:
        return self.total_mib / MIB_PER_GIB

    @property
    def bf16(self) -> bool:
        """bf16 needs Ampere (8.0) or newer; unknown capability counts as no (fail closed)."""
        return self.compute_capability is not None and self.compute_capability >= (8, 0)

    @property
    def flash_attn(self) -> bool:
        """FlashAttention-2 kernels need Ampere or newer as well."""
        return self.bf16

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = (
            f"{self.compute_capability[0]}.{self.compute_capability[1]}" if self.compute_capability else None
        )
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Gpu:
        cc = d.get("compute_capability")
        return cls(
            index=int(d["index"]),
            name=str(d["name"]),
            total_mib=int(d["total_mib"]),
            free_mib=None if d.get("free_mib") is None else int(d["free_mib"]),
            compute_capability=parse_compute_capability(cc) if cc is not None else None,
            uuid=d.get("uuid"),
        )


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[Gpu, ...] = ()
    source: str = "none"
    driver_version: str | None = None
    host_ram_gib: float | None = None
    host_available_gib: float | None = None
    disk_free_gib: float | None = None
    cpu_count: int | None = None
    versions: Mapping[str, str | None] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # Pairs of GPU indices (as the trainer sees them) that cannot reach each other peer to peer:
    # measured by NVML on a probed machine, assumed for the catalog's cards without P2P (catalog.Card.p2p).
    p2p_blocked: tuple[tuple[int, int], ...] = ()
    # Trainer processes offered on a machine without GPUs (``--gpu nonexN``): torchrun over gloo.
    cpu_processes: int = 1
    # Alike nodes (a Slurm job's, `on_nodes`): ``gpus`` lists all their GPUs, node by node; host RAM,
    # disk, ``cpu_processes`` and ``p2p_blocked`` are one node's.
    nodes: int = 1

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def world_size(self) -> int:
        """Processes the trainer can run: one per GPU; without GPUs ``cpu_processes`` on each node."""
        return len(self.gpus) if self.gpus else max(1, self.cpu_processes) * self.nodes

    @property
    def gpus_per_node(self) -> int:
        return len(self.gpus) // self.nodes

    @property
    def bf16(self) -> bool:
        return bool(self.gpus) and all(g.bf16 for g in self.gpus)

    @property
    def gpu_model(self) -> str:
        if not self.gpus:
            return "cpu"
        names = sorted({g.name for g in self.gpus})
        return "+".join(names)

    def describe(self) -> str:
        if self.nodes > 1:
            if not self.gpus:
                return f"{self.nodes} CPU nodes ({max(1, self.cpu_processes)} process(es) each)"
            return f"{self.nodes} nodes of {replace(self, gpus=self.gpus[: self.gpus_per_node], nodes=1).describe()}"
        if not self.gpus:
            return (
                "no GPU (CPU only)" if self.cpu_processes <= 1 else f"no GPU (CPU only, {self.cpu_processes} processes)"
            )
        g = self.gpus[0]
        cc = g.compute_capability
        ccs = f", cc {cc[0]}.{cc[1]}" if cc else ""
        count = f"{len(self.gpus)}x " if len(self.gpus) > 1 else ""
        return f"{count}{g.name} ({g.total_gib:.0f} GiB{ccs})"

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "gpus": [g.to_dict() for g in self.gpus],
                "source": self.source,
                "driver_version": self.driver_version,
                "host_ram_gib": self.host_ram_gib,
                "host_available_gib": self.host_available_gib,
                "disk_free_gib": self.disk_free_gib,
                "cpu_count": self.cpu_count,
                "versions": dict(self.versions),
                "notes": list(self.notes),
                "p2p_blocked": [list(p) for p in self.p2p_blocked],
            }
            | ({"cpu_processes": self.cpu_processes} if self.cpu_processes != 1 else {})
            | ({"nodes": self.nodes} if self.nodes != 1 else {})
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str | None = None) -> Hardware:
        try:
            return cls(
                gpus=tuple(Gpu.from_dict(g) for g in d.get("gpus", [])),
                source=source or str(d.get("source", "file")),
                driver_version=d.get("driver_version"),
                host_ram_gib=d.get("host_ram_gib"),
                host_available_gib=d.get("host_available_gib"),
                disk_free_gib=d.get("disk_free_gib"),
                cpu_count=d.get("cpu_count"),
                versions=dict(d.get("versions") or {}),
                notes=tuple(d.get("notes") or ()),
                p2p_blocked=tuple((int(a), int(b)) for a, b in d.get("p2p_blocked") or ()),
                cpu_processes=int(d.get("cpu_processes") or 1),
                nodes=int(d.get("nodes") or 1),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise HardwareError(
                f"hardware description is malformed: {exc!r}",
                hint="write it with `ftlaunch env --json > hw.json` on the target machine",
            ) from exc


# ---------------------------------------------------------------- catalog (what-if planning)

# The catalog's cards are rows of ftlaunch.plan.catalog.CARDS (one table, read by the estimate too).
# name -> (NVML name, memory MiB as NVML reports it, compute capability): a view of it.
CATALOG: dict[str, tuple[str, int, tuple[int, int]]] = {
    k: (c.nvml_name, c.memory_mib, c.compute_capability) for k, c in CARDS.items()
}
# Cards without peer-to-peer access over PCIe (Card.p2p): a what-if for several of them plans
# NCCL_P2P_DISABLE=1; a probed machine is measured (nvmlDeviceGetP2PStatus) instead.
NO_P2P = frozenset(k for k, c in CARDS.items() if not c.p2p)


def _norm(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


# What exists, as bounds on the counts a user types (issue 31): the largest single machines have 16
# GPUs (DGX-2, HGX-2; HGX H100/H200/B200 have 8), and a fine-tuning job across more than 1,024 such
# nodes is outside what ftlaunch plans. Beyond them a typo (`H100x1000`, `x99999999999999999999`)
# is refused (exit 4) before anything is sized by it.
MAX_GPUS_PER_NODE = 16
MAX_NODES = 1024
# The most cards a catalog machine may hold: a Slurm job's whole cluster, nodes x GPUs per node.
MAX_CATALOG_GPUS = MAX_GPUS_PER_NODE * MAX_NODES


def _short(text: str, limit: int = 40) -> str:
    """A typed value as an error message shows it: whole, or its start and its length."""
    return text if len(text) <= limit else f"{text[:24]}...({len(text)} characters)"


def parse_gpu_spec(spec: str) -> tuple[str, int]:
    """``V100-32GB``, ``A100-80GBx4``, ``4xA100-80GB`` -> (catalog key, card count); ``none`` -> ("none", 0);
    ``nonexN`` (or ``cpuxN``) -> ("none", N): N trainer processes on the CPU.
    HardwareError for an unknown or ambiguous card, a count below 1 or above MAX_CATALOG_GPUS (read
    from its digits first: a count is never made an int of any size, nor anything sized by it)."""
    text = spec.strip()
    if not text:
        raise HardwareError(
            f"--gpu {_short(spec)!r} names no card",
            hint=f"use one of: {', '.join(CATALOG)}, optionally with xN (e.g. A100-80GBx4), or 'none' for the CPU; "
            "leave --gpu out to probe this machine",
        )
    if text.lower() in {"none", "cpu"}:
        return "none", 0
    cpu = re.fullmatch(r"(?:none|cpu)\s*[xX\*]\s*(\d+)|(\d+)\s*[xX\*]\s*(?:none|cpu)", text, re.IGNORECASE)
    if cpu:
        digits = (cpu.group(1) or cpu.group(2)).lstrip("0") or "0"
        if len(digits) > len(str(MAX_GPUS_PER_NODE)) or not 1 <= int(digits) <= MAX_GPUS_PER_NODE:
            raise HardwareError(
                f"--gpu {_short(spec)!r}: CPU processes must be 1 to {MAX_GPUS_PER_NODE}",
                hint="e.g. --gpu nonex2: two trainer processes on this machine's CPU",
            )
        return "none", int(digits)
    digits = "1"
    m = re.fullmatch(r"(.+?)\s*[xX\*]\s*(\d+)", text) or None
    names = [_norm(k) for k in CATALOG]
    whole_is_a_name = any(n.startswith(_norm(text)) for n in names)  # "RTX4090" is not "RT" x 4090
    # Nor is "RTX9090" (no such card) "RT" x 9090: an x that continues a card's name is no count.
    x_in_a_name = bool(m) and any(n.startswith(_norm(m.group(1)) + "X") for n in names)
    if m and not whole_is_a_name and not x_in_a_name and any(n.startswith(_norm(m.group(1))) for n in names):
        text, digits = m.group(1), m.group(2)
    else:
        m2 = re.fullmatch(r"(\d+)\s*[xX\*]\s*(.+)", text)
        if m2:
            digits, text = m2.group(1), m2.group(2)
    wanted = _norm(text)
    matches = [k for k in CATALOG if _norm(k) == wanted]
    if not matches:
        # Accept "H100" for "H100-80GB" and "V100" when the prefix is unambiguous.
        matches = [k for k in CATALOG if _norm(k).startswith(wanted)]
    digits = digits.lstrip("0") or "0"
    count = int(digits) if len(digits) <= len(str(MAX_CATALOG_GPUS)) else MAX_CATALOG_GPUS + 1
    if count < 1:
        raise HardwareError(f"--gpu {_short(spec)!r}: the card count must be 1 or more", hint="e.g. A100-80GBx4")
    if count > MAX_CATALOG_GPUS:
        raise HardwareError(
            f"--gpu {_short(spec)!r}: {_short(digits)} cards is more than any machine ftlaunch plans for (at most "
            f"{MAX_GPUS_PER_NODE} GPUs per node, {MAX_NODES} nodes: {MAX_CATALOG_GPUS} in all)",
            hint=f"give the GPUs of one node, e.g. --gpu A100-80GBx8 (at most x{MAX_GPUS_PER_NODE}); "
            "several nodes are `train --slurm --nodes N`",
        )
    if len(matches) > 1:
        raise HardwareError(
            f"--gpu {_short(spec)!r} is ambiguous: it could be {' or '.join(matches)}",
            hint=f"name one of them, e.g. --gpu {matches[0]}" + (f"x{count}" if count > 1 else ""),
        )
    if not matches:
        by_norm = {_norm(k): k for k in CATALOG}
        near = [by_norm[n] for n in difflib.get_close_matches(wanted, list(by_norm), n=3, cutoff=0.7)]
        raise HardwareError(
            f"--gpu {_short(spec)!r} is not in the catalog" + (f" (closest: {', '.join(near)})" if near else ""),
            hint=f"use one of: {', '.join(CATALOG)}, optionally with xN (e.g. A100-80GBx4), or 'none' (the "
            "CPU; nonexN: N CPU processes); "
            "or capture the machine with `ftlaunch env --json` and pass --hardware FILE",
        )
    return matches[0], count


def check_typed_machine(specs: Sequence[str], nodes: int | None = None) -> None:
    """The counts a user typed for one machine: each ``--gpu`` at most MAX_GPUS_PER_NODE cards (a
    spec is one node; a Slurm job is ``--nodes`` of them) and ``--nodes`` at most MAX_NODES.
    HardwareError (exit 4) naming the limit (or the card a spec names that is not in the catalog)."""
    if nodes is not None and nodes > MAX_NODES:
        raise HardwareError(
            f"--nodes {nodes}: more nodes than ftlaunch plans a job for (at most {MAX_NODES})",
            hint=f"at most --nodes {MAX_NODES} of up to {MAX_GPUS_PER_NODE} GPUs each",
        )
    for spec in specs:
        _key, count = parse_gpu_spec(spec)
        if count > MAX_GPUS_PER_NODE:
            raise HardwareError(
                f"--gpu {_short(spec)!r}: {count} GPUs in one machine; the largest have {MAX_GPUS_PER_NODE} "
                f"(ftlaunch's limit per node)",
                hint=f"give the GPUs of one node (at most x{MAX_GPUS_PER_NODE}); several nodes are "
                "`train --slurm --nodes N --gpu CARDxN`, or compare a node with `estimate --gpu`",
            )


def catalog_hardware(spec: str, host_ram_gib: float | None = None) -> Hardware:
    """``V100-32GB``, ``A100-80GBx4``, ``4xA100-80GB`` or ``none`` -> a Hardware value (at most
    MAX_CATALOG_GPUS cards: a Slurm job's cluster is one such value)."""
    key, count = parse_gpu_spec(spec)
    if key == "none":
        source = f"catalog:nonex{count}" if count > 1 else "catalog:none"
        return Hardware(source=source, host_ram_gib=host_ram_gib, cpu_processes=max(1, count))
    card = CARDS[key]
    mib = card.memory_mib
    gpus = tuple(
        Gpu(index=i, name=card.nvml_name, total_mib=mib, free_mib=mib, compute_capability=card.compute_capability)
        for i in range(count)
    )
    blocked = () if card.p2p else all_pairs(count)
    return Hardware(gpus=gpus, source=f"catalog:{key}x{count}", host_ram_gib=host_ram_gib, p2p_blocked=blocked)


def on_nodes(hw: Hardware, nodes: int) -> Hardware:
    """``nodes`` machines like ``hw`` (a Slurm job's nodes: `--gpu CARDxN` names one): every node's
    GPUs, node by node (indices go on counting; a UUID names one card of one machine, so none is
    kept); on CPU nodes, ``cpu_processes`` on each. The planner plans nodes x processes per node on it."""
    if nodes <= 1:
        return hw
    per = hw.gpus
    gpus = tuple(replace(g, index=n * len(per) + i, uuid=None) for n in range(nodes) for i, g in enumerate(per))
    return replace(hw, gpus=gpus, nodes=nodes * hw.nodes)


def all_pairs(count: int) -> tuple[tuple[int, int], ...]:
    """The pairs of a node's cards, of at most MAX_GPUS_PER_NODE cards: peer to peer works within a
    node, and a table of every pair of a cluster's cards would grow with the square of a typed count
    (the planner asks only whether a pair among the cards it uses is blocked: the first node's say)."""
    n = min(count, MAX_GPUS_PER_NODE)
    return tuple((i, j) for i in range(n) for j in range(i + 1, n))


def hardware_from_json(text: str, where: str | Path) -> Hardware:
    """A hardware file's text (``ftlaunch env --json``) as a Hardware value, every field checked;
    ``where`` names the file in messages and in the value's source. Pure: the probe shell reads."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HardwareError(
            f"hardware file {where} is not valid JSON: {exc}",
            hint="write it with `ftlaunch env --json > hw.json`",
        ) from exc
    if not isinstance(data, dict):
        raise HardwareError(f"hardware file {where} must hold a JSON object")
    if "gpus" not in data:  # without it, any JSON object would be planned as a machine with no GPU
        if isinstance(data.get("hardware"), dict):
            seen = "`ftlaunch plan --json` output, not a machine"
        else:
            seen = f"no machine (keys: {', '.join(sorted(map(str, data)))[:200] or 'none'})"
        raise HardwareError(
            f"hardware file {where} has no 'gpus' list: it holds {seen}",
            hint="write it with `ftlaunch env --json > hw.json` on the target machine (gpus [] for no GPU)",
        )
    if problems := hardware_file_problems(data):
        raise HardwareError(
            f"hardware file {where} is malformed: " + "; ".join(problems),
            hint="write it with `ftlaunch env --json > hw.json` on the target machine",
        )
    return Hardware.from_dict(data, source=f"file:{where}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def hardware_file_problems(data: Mapping[str, Any]) -> list[str]:
    """Every field of a hardware description (``ftlaunch env --json``) that cannot be planned for,
    named by its path (``gpus[0].total_mib``). Pure."""
    problems: list[str] = []

    def number(where: str, value: Any, *, minimum: float, strict: bool, whole: bool = False) -> None:
        if value is None:
            return
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        kind = "a whole number" if whole else "a number"
        if not _is_number(value) or (whole and int(value) != value):
            problems.append(f"{where} must be {kind} {bound}, got {value!r}")
        elif value < minimum or (strict and value == minimum):
            problems.append(f"{where} must be {bound}, got {value!r}")

    gpus = data.get("gpus", [])
    if not isinstance(gpus, list):
        problems.append(f"gpus must be a list, got {type(gpus).__name__}")
        gpus = []
    if len(gpus) > MAX_GPUS_PER_NODE:
        problems.append(f"gpus lists {len(gpus)} cards; one machine has at most {MAX_GPUS_PER_NODE}")
        gpus = []
    for i, g in enumerate(gpus):
        at = f"gpus[{i}]"
        if not isinstance(g, dict):
            problems.append(f"{at} must be an object, got {type(g).__name__}")
            continue
        for key in ("index", "name", "total_mib"):
            if g.get(key) is None:
                problems.append(f"{at}.{key} is missing")
        if g.get("name") is not None and (not isinstance(g["name"], str) or not g["name"].strip()):
            problems.append(f"{at}.name must be a card name, got {g['name']!r}")
        number(f"{at}.index", g.get("index"), minimum=0, strict=False, whole=True)
        number(f"{at}.total_mib", g.get("total_mib"), minimum=0, strict=True)
        number(f"{at}.free_mib", g.get("free_mib"), minimum=0, strict=False)
        cc = g.get("compute_capability")
        if cc is not None and parse_compute_capability_or_none(cc) is None:
            problems.append(f'{at}.compute_capability must be like "8.0", got {cc!r}')
    number("host_ram_gib", data.get("host_ram_gib"), minimum=0, strict=True)
    number("host_available_gib", data.get("host_available_gib"), minimum=0, strict=False)
    number("disk_free_gib", data.get("disk_free_gib"), minimum=0, strict=False)
    number("cpu_count", data.get("cpu_count"), minimum=1, strict=False, whole=True)
    for key, kind in (("versions", dict), ("notes", list)):
        if data.get(key) is not None and not isinstance(data[key], kind):
            problems.append(f"{key} must be a JSON {'object' if kind is dict else 'list'}, got {data[key]!r}")
    return problems


def parse_compute_capability_or_none(value: Any) -> tuple[int, int] | None:
    try:
        return parse_compute_capability(value)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------- pure parsers


def parse_compute_capability(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return int(value[0]), int(value[1])
    text = str(value).strip()
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2))


NVIDIA_SMI_QUERY = "index,name,memory.total,memory.free,compute_cap,uuid,driver_version"


def parse_nvidia_smi_csv(text: str) -> tuple[list[Gpu], str | None]:
    """Parse ``nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv,noheader,nounits`` output."""
    gpus: list[Gpu] = []
    driver: str | None = None
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 4:
            raise HardwareError(f"unexpected nvidia-smi line: {line!r}")
        cc = parse_compute_capability(cols[4]) if len(cols) > 4 else None
        try:
            gpus.append(
                Gpu(
                    index=int(cols[0]),
                    name=cols[1],
                    total_mib=int(float(cols[2])),
                    free_mib=int(float(cols[3])) if cols[3] not in {"[N/A]", "N/A"} else None,
                    compute_capability=cc,
                    uuid=cols[5] if len(cols) > 5 else None,
                )
            )
        except ValueError as exc:
            raise HardwareError(f"unexpected nvidia-smi line: {line!r}") from exc
        if len(cols) > 6:
            driver = cols[6]
    return gpus, driver


def filter_visible(gpus: Sequence[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """Apply CUDA_VISIBLE_DEVICES as CUDA does: a list of indices or UUIDs, stop at the first bad one.

    The result is renumbered 0..n-1, as the trainer will see it.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[Gpu] = []
    for raw in cuda_visible_devices.split(","):
        item = raw.strip()
        if not item:
            break
        found: Gpu | None = None
        if re.fullmatch(r"\d+", item):
            found = next((g for g in gpus if g.index == int(item)), None)
        else:
            found = next((g for g in gpus if g.uuid and g.uuid.startswith(item)), None)
        if found is None or found in chosen:
            break
        chosen.append(found)
    return [replace(g, index=i) for i, g in enumerate(chosen)]


# NVML's nvmlGpuP2PStatus_t: 0 is NVML_P2P_STATUS_OK; anything else (chipset or GPU not supported,
# topology, disabled by the driver, unknown) means no peer-to-peer read between the two.
NVML_P2P_STATUS_OK = 0
NVML_P2P_CAPS_INDEX_READ = 0


def blocked_pairs(statuses: Mapping[tuple[str, str], int], visible: Sequence[Gpu]) -> tuple[tuple[int, int], ...]:
    """Pairs of ``visible`` GPUs (by their index as the trainer sees them) whose P2P status is not OK.

    ``statuses`` maps (uuid, uuid) to nvmlDeviceGetP2PStatus's answer, in either order; a pair with
    no answer counts as blocked (fail closed: NCCL_P2P_DISABLE only costs bandwidth)."""
    out: list[tuple[int, int]] = []
    for a_i, a in enumerate(visible):
        for b in visible[a_i + 1 :]:
            key, rev = (a.uuid or "", b.uuid or ""), (b.uuid or "", a.uuid or "")
            status = statuses.get(key, statuses.get(rev))
            if status != NVML_P2P_STATUS_OK:
                out.append((min(a.index, b.index), max(a.index, b.index)))
    return tuple(out)
