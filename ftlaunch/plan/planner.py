"""The planning core: config + hardware + options -> Plan. Pure: no files, env, network or GPU.

Every decision is a ``Change(key, old, new, reason)``; rendering lives elsewhere: the plan table and
plan.txt in ``ftlaunch.present.render``, the terminal and ``--json`` in ``ftlaunch.cli.render``. What the
shells found around planning (resolved paths, pre-downloaded model and datasets, the run it is for) is
added once by ``ftlaunch.plan.prepared.final_plan``; nothing edits a Plan after that.
Invariant kept: global batch = micro-batch x accumulation x world size, exactly: where the global
batch does not divide over every GPU, the plan runs on the largest number of them it divides over
(``CUDA_VISIBLE_DEVICES``/``NPROC_PER_NODE``, rows of the table); only ``keep_devices`` (``--keep-devices``)
keeps every GPU with the nearest achievable batch, said in a warning. Over several alike nodes (a Slurm
job's: ``Hardware.nodes``, ``hardware.on_nodes``) the world is nodes x processes per node, as many on
every node (``NNODES``/``NPROC_PER_NODE``, rows of the table; ``Plan.nodes``): the plan is final for
every engine. Learning rate, epochs and scheduler never change.
LLaMA-Factory's own refusals (ZeRO-3, several processes, DeepSpeed, CUDA-only methods), the
precision a DeepSpeed JSON fixes, the cards' kernels and the launch env of a world size are
``ftlaunch.plan.rules``: the planner applies them, it does not restate them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ftlaunch.errors import ConfigError, HardwareError
from ftlaunch.plan import rules
from ftlaunch.plan.batch import devices_for, split_batch
from ftlaunch.plan.change import REMOVED, Change
from ftlaunch.plan.environment import default_notes
from ftlaunch.plan.flags import truthy
from ftlaunch.plan.hardware import Hardware
from ftlaunch.plan.memory.prediction import MemoryPrediction, memory_json
from ftlaunch.plan.memory.setup import deepspeed_stage
from ftlaunch.plan.offload import batch_mismatch, fixed_batch, source_batch, with_auto_batch


@dataclass(frozen=True)
class PlanOptions:
    source_gpus: int | None = None  # world size the config was written for (default 1)
    global_batch: int | None = None  # sets the source global batch directly
    headroom: float = 0.12
    remembered_micro_batch: int | None = None  # what worked last time on this card (recovery)
    remembered_reason: str | None = None
    # --keep-devices: every GPU, with the nearest achievable global batch, rather than fewer GPUs
    keep_devices: bool = False


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
    memory: MemoryPrediction | None = None
    simulated: Mapping[str, Any] | None = None  # the simulator's measurement (plan/memory/simulate.py)
    # Defaults the installed versions decide (plan/environment.py default_notes): said, not changed.
    notes: tuple[str, ...] = ()
    schema: str | None = None  # "v1": planned in the schema of LLaMA-Factory's v1 trainer (plan/v1.py)
    # Set by plan/prepared.py final_plan, kept in plan.json: the config keys made absolute, the model
    # pre-downloaded (repo, endpoint and why, path, size) and, per repo, the hub datasets downloaded.
    resolved_paths: tuple[str, ...] = ()
    hub: Mapping[str, Any] | None = None
    hub_datasets: tuple[Mapping[str, Any], ...] = ()
    # The run the plan is for (made once by run/prepare.py): its id, the key what it learns about memory
    # is kept under (plan/memory/store.py config_key), and the JSON files its folder gets beside
    # config.yaml (name -> content: pre-downloaded hub datasets' dataset_info.json).
    run_id: str | None = None
    memory_key: str | None = None
    files: Mapping[str, Any] = field(default_factory=dict)
    # The nodes the processes run on (a Slurm job's), as many on each: world_size = nodes x processes_per_node.
    nodes: int = 1

    @property
    def processes_per_node(self) -> int:
        return self.world_size // self.nodes

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
            "notes": list(self.notes),
            "memory": memory_json(self.memory, self.simulated),
            **({"resolved_paths": list(self.resolved_paths)} if self.resolved_paths else {}),
            **({"hub": dict(self.hub)} if self.hub is not None else {}),
            **({"hub_datasets": [dict(x) for x in self.hub_datasets]} if self.hub_datasets else {}),
            **({"schema": self.schema} if self.schema else {}),
            **({"nodes": self.nodes, "processes_per_node": self.processes_per_node} if self.nodes != 1 else {}),
        }


KEEP = object()  # meta["own_values"] has no value for a key: the config's own value stands


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
    machine: ``per_device`` x ``world`` = ``target``. ``world`` is the device count that keeps
    ``source`` exactly (fewer than offered where it does not divide over all of them), unless
    ``--keep-devices``: then every device, and ``target`` the nearest achievable."""

    source: int
    why: str
    per_device: int
    target: int
    warning: str | None = None  # said when the target is only the nearest achievable
    world: int = 1  # devices the batch is kept on (<= the world size offered)
    offered: int = 1  # the world size offered
    nodes: int = 1  # the nodes ``world`` and ``offered`` are spread over, as many on each

    @property
    def fewer_devices(self) -> str | None:
        """Why the plan uses fewer devices than offered, or None."""
        if self.world >= self.offered:
            return None
        if self.nodes > 1:
            n = self.nodes
            return (
                f"global batch {self.source} ({self.why}) does not divide over {n} nodes x {self.offered // n} "
                f"processes: {n} x {self.world // n} keep it exactly ({self.per_device} per device); "
                "--keep-devices uses all with the nearest batch instead"
            )
        return (
            f"global batch {self.source} ({self.why}) does not divide over {self.offered} GPUs: "
            f"{self.world} of them keep it exactly ({self.per_device} per device); "
            "--keep-devices uses all with the nearest batch instead"
        )


def global_batch_for(
    values: Mapping[str, Any],
    world_size: int,
    options: PlanOptions = PlanOptions(),
    meta: Mapping[str, Any] | None = None,
    ds: Mapping[str, Any] | None = None,
    nodes: int = 1,
) -> GlobalBatch:
    """The global batch ``plan`` keeps for ``values`` on ``world_size`` devices over ``nodes`` nodes. Pure.

    Source, first that applies: ``options.global_batch``; the global batch recorded in the ftlaunch
    header of an adapted config (``meta``: it wins over ``--source-gpus``, which would multiply an
    already adapted batch again); the batch numbers the DeepSpeed JSON ``ds`` fixes
    (``offload.source_batch``: ``train_batch_size``, or its micro-batch and accumulation x the source
    world size); micro-batch x accumulation x the world size the config was written for
    (``options.source_gpus``, else the header's world size, else 1).

    Where the source does not divide over ``world_size`` devices, the result keeps it on the largest
    device count it divides over (``world``), as many on each node; with ``options.keep_devices`` on
    all of them, with the nearest achievable batch and a warning. Over several nodes every node is
    kept (the job asks for them): where the batch does not divide over the nodes themselves, the
    nearest achievable over all their devices, with a warning."""
    micro_src = int(values.get("per_device_train_batch_size", 8) or 8)
    accum_src = int(values.get("gradient_accumulation_steps", 1) or 1)
    recorded = (meta or {}).get("global_batch")
    warning = None
    if options.global_batch is not None:
        g_source, why = options.global_batch, "--global-batch"
    elif isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 1:
        g_source, why = recorded, "recorded in the config's ftlaunch-plan header"
        if options.source_gpus is not None:
            why += f"; --source-gpus {options.source_gpus} not applied to an adapted config"
            warning = (
                f"global batch {recorded} is the one recorded in the adapted config's header; --source-gpus "
                f"{options.source_gpus} is ignored (pass --global-batch to change it)"
            )
    else:
        source_world = (
            options.source_gpus if options.source_gpus is not None else int((meta or {}).get("world_size", 1))
        )
        g_source, why = source_batch(ds, micro_src, accum_src, source_world) or (
            micro_src * accum_src * source_world,
            f"{micro_src} x {accum_src} x {source_world} GPU(s)",
        )
    per_device, rem = divmod(g_source, world_size)
    world = devices_for(g_source, world_size, nodes)
    if ((rem or per_device == 0) and options.keep_devices) or world == 0:
        # every device (--keep-devices, or not even one process per node keeps it): the nearest batch
        per_device = max(1, round(g_source / world_size))
        over = f"{world_size} GPUs" if options.keep_devices else f"{nodes} nodes"
        nearest = (
            f"global batch {g_source} does not divide over {over}; using {per_device * world_size}, the nearest "
            "achievable" + (" (--keep-devices)" if options.keep_devices else "")
        )
        warned = "; ".join(filter(None, [warning, nearest]))
        return GlobalBatch(g_source, why, per_device, per_device * world_size, warned, world_size, world_size, nodes)
    return GlobalBatch(g_source, why, g_source // world, g_source, warning, world, world_size, nodes)


def _flags_for(label: str) -> dict[str, bool]:
    return {"bf16": label in ("bf16", "pure_bf16"), "fp16": label == "fp16"}


def precision_for(
    values: Mapping[str, Any], hw: Hardware, ds_fixed: Mapping[str, bool] | None = None, ds_name: str = ""
) -> tuple[str, list[Change]]:
    """Decide precision. Returns (label, the changes it needs).

    ``ds_fixed`` is what the DeepSpeed JSON the plan keeps hard-codes (``rules.ds_precision``):
    transformers refuses a TrainingArguments flag that differs from it, so the plan's precision
    follows the JSON (the user's recipe) rather than rewriting it."""
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
        label, base_why = "fp16", why
    elif values.get("pure_bf16"):
        label, base_why = "pure_bf16", ""
    elif wants_bf16:
        label, base_why = "bf16", ""
    elif wants_fp16:
        label, base_why = "fp16", ""
    else:
        label, base_why = "fp32", ""
    fixed = dict(ds_fixed or {})
    if fixed and any(_flags_for(label)[k] != v for k, v in fixed.items()):
        said = ", ".join(f"{k}.enabled={str(v).lower()}" for k, v in sorted(fixed.items()))
        options = [x for x in ("bf16", "fp16", "fp32") if x != "bf16" or hw.bf16]
        fits = [x for x in options if all(_flags_for(x)[k] == v for k, v in fixed.items())]
        if not fits:
            raise ConfigError(
                f"deepspeed: {ds_name or 'the DeepSpeed config'} hard-codes {said}, which {hw.describe()} "
                "cannot train with (transformers refuses TrainingArguments that differ from it)",
                hint='set "enabled": "auto" in its fp16/bf16 sections, or plan for a card with bf16',
            )
        new = fits[0]
        why = (f"{base_why}; " if base_why else "") + (
            f"the DeepSpeed config {ds_name} hard-codes {said} and transformers refuses TrainingArguments "
            f"that differ from it: {new}"
        )
        edits = [e for e in edits if e.key not in ("bf16", "fp16")]
        for key, flag in _flags_for(new).items():
            if bool(values.get(key)) != flag:
                change(key, flag, why)
        if values.get("pure_bf16") and new != "bf16" and not any(e.key == "pure_bf16" for e in edits):
            change("pure_bf16", False, why)
        return new, edits
    if base_why:
        change("fp16", True, base_why + "; fp16 mixed precision instead")
    return label, edits


def _kernel_edits(values: Mapping[str, Any], hw: Hardware) -> list[Change]:
    """fp8 only where every planned card has it; flash_attn fa2 only from compute capability 8.0."""
    edits: list[Change] = []
    ccs = [g.compute_capability for g in hw.gpus]
    where = hw.describe()
    if hw.gpus:
        cc = ccs[0]
        where = f"{hw.gpus[0].name} (compute capability {f'{cc[0]}.{cc[1]}' if cc else 'unknown'})"
    if truthy(values.get("fp8")) and not (ccs and all(rules.has_fp8(c) for c in ccs)):
        why = f"{where} has no fp8 tensor cores (they need compute capability >= 8.9: Ada, Hopper)"
        edits.append(Change("fp8", values.get("fp8"), False, why))
        if truthy(values.get("fp8_enable_fsdp_float8_all_gather")):
            # LLaMA-Factory turns fp8 back on when this is set (parser.py:421)
            edits.append(
                Change("fp8_enable_fsdp_float8_all_gather", values["fp8_enable_fsdp_float8_all_gather"], False, why)
            )
    if str(values.get("flash_attn") or "").strip().lower() == "fa2" and not (
        ccs and all(rules.has_fa2(c) for c in ccs)
    ):
        edits.append(
            Change(
                "flash_attn",
                values.get("flash_attn"),
                "sdpa",
                f"{where}: FlashAttention-2 needs compute capability >= 8.0 (Ampere); torch SDPA instead",
            )
        )
    if truthy(values.get("tf32")) and not (ccs and all(rules.has_fa2(c) for c in ccs)):
        # transformers refuses it at start: "--tf32 requires Ampere or a newer GPU arch" (also on the CPU)
        why = f"{where}: TF32 needs compute capability >= 8.0 (Ampere); transformers refuses --tf32 there"
        edits.append(Change("tf32", values.get("tf32"), False, why))
    return edits


@dataclass(frozen=True)
class Processes:
    """How many trainer processes a plan runs, on which GPUs, and why when fewer than the machine has."""

    world: int
    pin: str | None = None  # CUDA_VISIBLE_DEVICES for one process on a machine with several GPUs
    why: str | None = None


def processes_for(values: Mapping[str, Any], hw: Hardware, *, zero3: bool) -> Processes:
    """One per GPU (``cpu_processes`` on the CPU), unless the config cannot run distributed
    (``rules``): then one, on the first GPU."""
    if not hw.gpus and hw.world_size > 1:
        refused = [rules.single_process(values)] if rules.single_process(values) else []
        refused += [str(r) for r in rules.distributed_refusals(values, zero3=zero3)]
        if refused:
            return Processes(1, None, f"one process of the {hw.world_size} offered on the CPU: " + "; ".join(refused))
        return Processes(hw.world_size)
    if hw.gpu_count <= 1:
        return Processes(1)
    first = hw.gpus[0]
    pin = first.uuid or str(first.index)
    single = rules.single_process(values)
    if single:
        return Processes(1, None, single)
    refused = rules.distributed_refusals(values, zero3=zero3)
    if refused:
        return Processes(
            1, pin, f"one process on GPU {first.index} of {hw.gpu_count}: " + "; ".join(str(r) for r in refused)
        )
    return Processes(hw.world_size)


def _offered_env(key: str, hw: Hardware) -> str | None:
    """What a launch on every GPU of ``hw`` would have set for ``key`` (the "before" of a fewer-devices row)."""
    return rules.launch_env(hw.world_size, gpus=hw.gpus_per_node, deepspeed=False, nodes=hw.nodes).get(key)


def plan(
    values: Mapping[str, Any],
    hardware: Hardware,
    options: PlanOptions = PlanOptions(),
    *,
    meta: Mapping[str, Any] | None = None,
    memory_chooser: Any = None,
    deepspeed_config: Mapping[str, Any] | None = None,
) -> Plan:
    """Adapt a merged llamafactory config to ``hardware``.

    ``meta`` is the ftlaunch header of an already adapted config (its world size and global batch);
    a re-plan adds ``own_values``: key -> the value the user's config had before ftlaunch set one for
    another machine (None: unset), restored where that machine's reason no longer holds.
    ``deepspeed_config`` is the parsed JSON that ``values["deepspeed"]`` names (for the precision it
    fixes and its ZeRO stage), None when there is none or it is not read.
    ``memory_chooser(values, hardware, per_device, most)`` -> MemoryDecision or None: supplied by the
    shell when a model spec is known (see ftlaunch.plan.memory.adapt); ``most`` is the remembered
    micro-batch (``options.remembered_micro_batch``), the largest it may choose, or None.
    """
    meta = meta or {}
    ed = _Editor(values)
    warnings: list[str] = []

    if not hardware.gpus:
        why = rules.cuda_only(values)
        if why:
            raise HardwareError(f"cannot train on {hardware.describe()}: {why}", hint="plan it for a CUDA GPU (--gpu)")

    # --- processes and DeepSpeed
    ds_stage = deepspeed_stage(dict(values), dict(deepspeed_config) if deepspeed_config else None)[0]
    ds_dropped: str | None = None
    if values.get("deepspeed") and hardware.gpu_count > 1:
        if rules.deepspeed_refusals(values):
            ds_dropped = "; ".join(str(r) for r in rules.deepspeed_refusals(values)) + "; plain DDP instead"
        elif rules.deepspeed_missing(hardware.versions):
            ds_dropped = (
                "DeepSpeed is not installed in the trainer's environment (see `ftlaunch env`): plain DDP over "
                f"torchrun instead, with the same global batch; to keep DeepSpeed: {rules.DEEPSPEED_PIP}"
            )
    procs = processes_for(values, hardware, zero3=ds_stage == 3 and not ds_dropped)
    nodes = hardware.nodes if procs.world > 1 else 1  # one process runs on one node
    # --- global batch: exact on the largest number of the GPUs it divides over (or --keep-devices)
    gb = global_batch_for(values, procs.world, options, meta, deepspeed_config, nodes)
    if gb.fewer_devices:
        # Over several nodes the job's GPUs are Slurm's to name: NPROC_PER_NODE alone says how many of them.
        pin = ",".join(g.uuid or str(g.index) for g in hardware.gpus[: gb.world]) if nodes == 1 else ""
        procs = Processes(gb.world, pin or None, gb.fewer_devices)
    world = procs.world
    if procs.why:
        warnings.append(procs.why)
    drop_ds: str | None = None
    if values.get("deepspeed"):
        if world == 1:
            drop_ds = (
                "one device: DeepSpeed would need torchrun (FORCE_TORCHRUN=1) and buys nothing "
                "without offload; plain single-process training"
                if hardware.gpu_count <= 1
                else f"{procs.why}; DeepSpeed buys nothing on one process without offload"
            )
        else:
            drop_ds = ds_dropped
    kept_ds = deepspeed_config if values.get("deepspeed") and not drop_ds else None
    planned = replace(hardware, gpus=hardware.gpus[:world]) if world < hardware.gpu_count else hardware
    planned = replace(planned, nodes=nodes) if planned.nodes != nodes else planned

    # --- precision and kernels (precision first: its rows lead the table)
    precision, edits = precision_for(values, planned, rules.ds_precision(kept_ds), str(values.get("deepspeed") or ""))
    for c in edits + _kernel_edits(values, planned):
        ed.set(c.key, c.new, c.reason)
    if drop_ds:
        ed.remove("deepspeed", drop_ds)

    # --- global batch (gb, decided with the processes above: kept on ``world`` devices)
    if gb.warning:
        warnings.append(gb.warning)
    per_device, g_source, g_target = gb.per_device, gb.source, gb.target
    micro_src = int(values.get("per_device_train_batch_size", 8) or 8)
    micro_src = fixed_batch(deepspeed_config).get("train_micro_batch_size_per_gpu", micro_src)

    remembered = options.remembered_micro_batch
    micro, accum = split_batch(per_device, remembered or micro_src)
    memory: MemoryPrediction | None = None
    on = f"{nodes} nodes x {world // nodes}" if nodes > 1 else f"{world}"
    batch_reason = f"keeps global batch {g_source} ({gb.why}) on {on} device(s)"
    if remembered:
        batch_reason = options.remembered_reason or "micro-batch that worked last time on this card"
    if memory_chooser is not None and rules.predict_only(values):
        warnings.append(
            "predict/eval only (do_train is not set): the memory model sizes training, so it is not applied; "
            "nothing (offload included) is chosen for memory"
        )
    elif memory_chooser is not None:
        decision = memory_chooser(ed.values, planned, per_device, remembered)
        if decision is not None:
            memory = decision.memory
            warnings.extend(decision.warnings)
            for c in decision.edits:
                if c.new is REMOVED:
                    ed.remove(c.key, c.reason)
                else:
                    ed.set(c.key, c.new, c.reason)
            if decision.micro_batch is not None:
                micro, accum = decision.micro_batch, per_device // decision.micro_batch
                # the remembered micro-batch explains the choice only when it is the one taken
                if decision.batch_reason and micro != remembered:
                    batch_reason = decision.batch_reason
    if g_target != g_source:
        batch_reason += f"; global batch {g_source} -> {g_target} (nearest divisible)"
    ed.set("per_device_train_batch_size", micro, batch_reason)
    ed.set("gradient_accumulation_steps", accum, batch_reason)
    # a user's DeepSpeed JSON kept as it is must not fix other batch numbers (transformers refuses them)
    if kept_ds is not None and ed.values.get("deepspeed") == values.get("deepspeed"):
        differ = batch_mismatch(kept_ds, micro, accum, world)
        if differ:
            named = values.get("deepspeed") if isinstance(values.get("deepspeed"), str) else "the DeepSpeed JSON"
            ed.set(
                "deepspeed",
                with_auto_batch(kept_ds),
                f"{named} fixes {', '.join(differ)}; transformers refuses DeepSpeed batch numbers that differ "
                'from the TrainingArguments: an adapted copy (inline) with "auto" there, every other setting as '
                "written",
            )

    # --- launch: what the world size means for every variable (rules.launch_env)
    per_node = world // nodes  # p2p_blocked holds one node's pairs
    blocked = per_node > 1 and any(i < per_node and j < per_node for i, j in hardware.p2p_blocked)
    if blocked:
        how = "assumed for this card (GeForce)" if hardware.source.startswith("catalog:") else "per NVML"
        warnings.append(
            f"NCCL_P2P_DISABLE=1: the planned GPUs cannot reach each other peer to peer ({how}); "
            "NCCL would hang or fail without it"
        )
    env = rules.launch_env(
        world,
        gpus=hardware.gpus_per_node,
        deepspeed=bool(ed.values.get("deepspeed")),
        pin=procs.pin,
        p2p_blocked=blocked,
        kt=rules.single_process(values) is not None,
        nodes=nodes,
    )
    if not hardware.gpus and world == 1 and ed.values.get("ddp_backend"):
        # accelerate (state.py:296) takes a named backend as distributed and asks torch for a process
        # group that one process never starts: "Default process group has not been initialized"
        ed.remove("ddp_backend", "one process on the CPU: a ddp_backend fails without a process group")
    own = (meta.get("own_values") or {}).get("ddp_backend", KEEP)
    if hardware.gpus and own is not KEEP and ed.values.get("ddp_backend") != own:
        # A run re-planned from the CPU onto GPUs: gloo (or no backend, for one process) was ftlaunch's
        # choice for the CPU, never the user's; gloo would carry gradients through host memory.
        why = f"on {hardware.describe()}: ftlaunch's choice for the CPU is taken back"
        if own is None:
            ed.remove("ddp_backend", f"{why}; LLaMA-Factory's default (accelerate picks nccl on CUDA)")
        else:
            ed.set("ddp_backend", own, f"{why}; the config's own value")
    cpu_world = not hardware.gpus and hardware.world_size > 1
    if cpu_world and world > 1 and ed.values.get("ddp_backend") != "gloo":
        # accelerate would pick MPI where torch has it (state.py _prepare_backend); NCCL needs GPUs
        ed.set("ddp_backend", "gloo", f"{world} processes on the CPU: gloo is torch's CPU backend (NCCL needs GPUs)")
    if nodes > 1 and meta.get("world_size") != world:
        each = "one per GPU" if hardware.gpus else "on the CPU"
        why = gb.fewer_devices or f"{nodes} nodes x {per_node} trainer process(es) ({each}), over torchrun"
        for key in ("FORCE_TORCHRUN", "NNODES", "NPROC_PER_NODE"):
            before = _offered_env(key, hardware) if gb.fewer_devices else None
            if before != env[key]:
                ed.changes.append(Change(key, before, env[key], why))
    elif cpu_world and meta.get("world_size") != world:
        why = (
            gb.fewer_devices
            or f"{world} trainer processes on the CPU (--gpu nonex{hardware.cpu_processes}), over torchrun"
        )
        for key in ("FORCE_TORCHRUN", "NPROC_PER_NODE"):
            if key in env:
                ed.changes.append(Change(key, None, env[key], why))
    elif gb.fewer_devices:
        if world > 1 and procs.pin:
            # launch_env pins only a single process; torchrun's ranks take the first NPROC_PER_NODE visible
            # GPUs, and naming them keeps a user's CUDA_VISIBLE_DEVICES from widening the set
            env["CUDA_VISIBLE_DEVICES"] = procs.pin
        if meta.get("world_size") != world:  # an adapted config made for this world size changes nothing
            for key in ("CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE"):
                if key in env:
                    ed.changes.append(Change(key, _offered_env(key, hardware), env[key], gb.fewer_devices))

    # --- resume safety
    if values.get("overwrite_output_dir"):
        ed.set(
            "overwrite_output_dir",
            False,
            "true would wipe checkpoints on every restart; false lets a restart resume from the last one",
        )
    if hardware.gpus and values.get("quantization_bit") and not hardware.gpus[0].compute_capability:
        warnings.append("quantization_bit needs bitsandbytes on a CUDA GPU")

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
        notes=tuple(default_notes(ed.values, hardware.versions)),
        nodes=nodes,
    )
