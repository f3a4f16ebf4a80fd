"""The planning core: config + hardware + options -> Plan. Pure: no files, env, network or GPU.

Every decision is a ``Change(key, old, new, reason)``; rendering lives in ``ftlaunch.cli.render``.
Invariant kept: global batch = micro-batch x accumulation x world size (exactly where it divides,
else the nearest achievable, said in the table). Learning rate, epochs and scheduler never change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftlaunch.plan.batch import split_batch
from ftlaunch.plan.change import REMOVED, Change
from ftlaunch.plan.hardware import Hardware


@dataclass(frozen=True)
class PlanOptions:
    source_gpus: int | None = None  # world size the config was written for (default 1)
    global_batch: int | None = None  # sets the source global batch directly
    headroom: float = 0.12
    remembered_micro_batch: int | None = None  # what worked last time on this card (recovery)
    remembered_reason: str | None = None


@dataclass(frozen=True)
class Plan:
    config: dict[str, Any]
    env: dict[str, str]
    changes: tuple[Change, ...]
    hardware: Hardware
    world_size: int
    precision: str
    global_batch_source: int
    global_batch_target: int
    micro_batch: int
    accumulation: int
    warnings: tuple[str, ...] = ()
    memory: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # A plan whose config names its run's folder (pre-downloaded hub datasets) is made for one run:
    # its id, and the JSON files that folder gets beside config.yaml (name -> content).
    run_id: str | None = None
    files: Mapping[str, Any] = field(default_factory=dict)

    @property
    def header(self) -> dict[str, Any]:
        """What the adapted YAML remembers about its plan (a comment: llamafactory rejects keys)."""
        return {
            "world_size": self.world_size,
            "global_batch": self.global_batch_target,
            "gpu": self.hardware.gpu_model,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware.to_dict(),
            "config": self.config,
            "env": self.env,
            "changes": [c.to_dict() for c in self.changes],
            "global_batch": {"source": self.global_batch_source, "target": self.global_batch_target},
            "world_size": self.world_size,
            "precision": self.precision,
            "micro_batch": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "warnings": list(self.warnings),
            "memory": dict(self.memory) if self.memory is not None else None,
            **dict(self.extra),
        }


class _Editor:
    """Builds the adapted config in the source key order and records each change."""

    def __init__(self, values: Mapping[str, Any]):
        self.values = dict(values)
        self.changes: list[Change] = []

    def _record(self, key: str, old: Any, new: Any, reason: str) -> None:
        """One row per key: a later decision on the same key replaces the earlier row."""
        for i, c in enumerate(self.changes):
            if c.key == key:
                if c.old == new and type(c.old) is type(new):
                    del self.changes[i]  # back to where it started: no change at all
                else:
                    self.changes[i] = Change(key, c.old, new, reason)
                return
        self.changes.append(Change(key, old, new, reason))

    def set(self, key: str, new: Any, reason: str) -> None:
        old = self.values.get(key)
        if key in self.values and old == new and type(old) is type(new):
            return
        self.values[key] = new
        self._record(key, old, new, reason)

    def remove(self, key: str, reason: str) -> None:
        if key in self.values:
            self._record(key, self.values.pop(key), REMOVED, reason)


@dataclass(frozen=True)
class GlobalBatch:
    """The global batch a config asks for (``source``, and ``why``) and the one kept on the target
    machine: ``per_device`` x world size = ``target``, equal to ``source`` where it divides."""

    source: int
    why: str
    per_device: int
    target: int
    warning: str | None = None  # said when the target is only the nearest achievable


def global_batch_for(
    values: Mapping[str, Any],
    world_size: int,
    options: PlanOptions = PlanOptions(),
    meta: Mapping[str, Any] | None = None,
) -> GlobalBatch:
    """The global batch ``plan`` keeps for ``values`` on ``world_size`` devices. Pure.

    Source: ``options.global_batch``, else micro-batch x accumulation x the world size the config
    was written for (``options.source_gpus``, else the ftlaunch header's ``meta``, else 1)."""
    micro_src = int(values.get("per_device_train_batch_size", 8) or 8)
    accum_src = int(values.get("gradient_accumulation_steps", 1) or 1)
    if options.source_gpus is not None:
        source_world = options.source_gpus
    else:
        source_world = int((meta or {}).get("world_size", 1))
    if options.global_batch is not None:
        g_source, why = options.global_batch, "--global-batch"
    else:
        g_source, why = micro_src * accum_src * source_world, f"{micro_src} x {accum_src} x {source_world} GPU(s)"
    per_device, rem = divmod(g_source, world_size)
    if rem or per_device == 0:
        per_device = max(1, round(g_source / world_size))
        warning = (
            f"global batch {g_source} does not divide over {world_size} GPUs; "
            f"using {per_device * world_size}, the nearest achievable"
        )
        return GlobalBatch(g_source, why, per_device, per_device * world_size, warning)
    return GlobalBatch(g_source, why, per_device, g_source)


def precision_for(values: Mapping[str, Any], hw: Hardware) -> tuple[str, list[Change]]:
    """Decide precision. Returns (label, the changes it needs)."""
    wants_bf16 = bool(values.get("bf16")) or bool(values.get("pure_bf16"))
    wants_fp16 = bool(values.get("fp16"))
    edits: list[Change] = []

    def change(key: str, new: Any, reason: str) -> None:
        edits.append(Change(key, values.get(key), new, reason))

    if not hw.gpus:
        for key in ("bf16", "fp16", "pure_bf16"):
            if values.get(key):
                change(key, False, "no GPU: mixed precision needs CUDA; training runs in fp32 on the CPU")
        return "fp32", edits
    if wants_bf16 and not hw.bf16:
        cc = hw.gpus[0].compute_capability
        ccs = f"{cc[0]}.{cc[1]}" if cc else "unknown"
        why = f"{hw.gpus[0].name} (compute capability {ccs}) has no bf16; it needs >= 8.0 (Ampere)"
        if values.get("bf16"):
            change("bf16", False, why)
        if values.get("pure_bf16"):
            change("pure_bf16", False, why)
        change("fp16", True, why + "; fp16 mixed precision instead")
        return "fp16", edits
    if values.get("pure_bf16"):
        return "pure_bf16", edits
    if wants_bf16:
        return "bf16", edits
    if wants_fp16:
        return "fp16", edits
    return "fp32", edits


def plan(
    values: Mapping[str, Any],
    hardware: Hardware,
    options: PlanOptions = PlanOptions(),
    *,
    meta: Mapping[str, Any] | None = None,
    memory_chooser: Any = None,
) -> Plan:
    """Adapt a merged llamafactory config to ``hardware``.

    ``meta`` is the ftlaunch header of an already adapted config (its world size and global batch).
    ``memory_chooser(values, hardware, per_device, most)`` -> MemoryDecision or None: supplied by the
    shell when a model spec is known (see ftlaunch.plan.memory.adapt); ``most`` is the remembered
    micro-batch (``options.remembered_micro_batch``), the largest it may choose, or None.
    """
    meta = meta or {}
    ed = _Editor(values)
    warnings: list[str] = []
    world = hardware.world_size

    # --- precision
    precision, edits = precision_for(values, hardware)
    for c in edits:
        ed.set(c.key, c.new, c.reason)

    # --- strategy
    env: dict[str, str] = {}
    if world == 1:
        if values.get("deepspeed"):
            ed.remove(
                "deepspeed",
                "one device: DeepSpeed would need torchrun (FORCE_TORCHRUN=1) and buys nothing "
                "without offload; plain single-process training",
            )
    else:
        env["FORCE_TORCHRUN"] = "1"
        env["NPROC_PER_NODE"] = str(world)

    # --- global batch
    gb = global_batch_for(values, world, options, meta)
    if gb.warning:
        warnings.append(gb.warning)
    per_device, g_source, g_target = gb.per_device, gb.source, gb.target
    micro_src = int(values.get("per_device_train_batch_size", 8) or 8)

    remembered = options.remembered_micro_batch
    micro, accum = split_batch(per_device, remembered or micro_src)
    memory: Mapping[str, Any] | None = None
    batch_reason = f"keeps global batch {g_source} ({gb.why}) on {world} device(s)"
    if remembered:
        batch_reason = options.remembered_reason or "micro-batch that worked last time on this card"
    if memory_chooser is not None:
        decision = memory_chooser(ed.values, hardware, per_device, remembered)
        if decision is not None:
            memory = decision.memory
            warnings.extend(decision.warnings)
            for c in decision.edits:
                if c.new is REMOVED:
                    ed.remove(c.key, c.reason)
                else:
                    ed.set(c.key, c.new, c.reason)
            env.update(decision.env)
            if decision.micro_batch is not None:
                micro, accum = decision.micro_batch, per_device // decision.micro_batch
                # the remembered micro-batch explains the choice only when it is the one taken
                if decision.batch_reason and micro != remembered:
                    batch_reason = decision.batch_reason
    if g_target != g_source:
        batch_reason += f"; global batch {g_source} -> {g_target} (nearest divisible)"
    ed.set("per_device_train_batch_size", micro, batch_reason)
    ed.set("gradient_accumulation_steps", accum, batch_reason)

    # --- resume safety
    if values.get("overwrite_output_dir"):
        ed.set(
            "overwrite_output_dir",
            False,
            "true would wipe checkpoints on every restart; false lets a restart resume from the last one",
        )
    if hardware.gpus and values.get("quantization_bit") and not hardware.gpus[0].compute_capability:
        warnings.append("quantization_bit needs bitsandbytes on a CUDA GPU")
    if not hardware.gpus and values.get("quantization_bit"):
        warnings.append("quantization_bit (QLoRA) needs a CUDA GPU; this run will fail on the CPU")

    return Plan(
        config=ed.values,
        env=env,
        changes=tuple(ed.changes),
        hardware=hardware,
        world_size=world,
        precision=precision,
        global_batch_source=g_source,
        global_batch_target=g_target,
        micro_batch=micro,
        accumulation=accum,
        warnings=tuple(warnings),
        memory=memory,
    )
