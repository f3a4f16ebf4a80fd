"""Disk space a run will take: one checkpoint's size, how many are saved and kept, and a verdict on
the free space of the output_dir's filesystem. Pure: the shell (``ftlaunch.run.disk``) measures
free space, the tokenizer files and the dataset rows, and passes them in.

What a checkpoint holds, as transformers 5.x ``Trainer._save_checkpoint`` and LLaMA-Factory 0.9.5
write it (measured on the tiny model, docs/disk.md):

- the weights, in the dtype the trainable parameters have at save time. LLaMA-Factory upcasts the
  trainable ones to fp32 unless ``pure_bf16`` (``model/adapter.py``: cast_trainable_params_to_fp32),
  so a full bf16 SFT saves fp32 weights (4 bytes/param); frozen ones stay in the load dtype. LoRA
  saves only the adapter. Under DeepSpeed the engine's 16-bit module is saved (ZeRO-3: gathered,
  ``stage3_gather_16bit_weights_on_model_save`` as in LLaMA-Factory's example configs);
- ``optimizer.pt``: the optimizer's state per trainable parameter (AdamW: two moments in the
  parameter's dtype). Without DeepSpeed there is no separate fp32 master copy: torch AMP trains the
  fp32 parameters themselves. DeepSpeed writes ``global_stepN/`` instead: fp32 master + fp32 moments
  of every trainable parameter over the ranks' ``*_optim_states.pt``, and (ZeRO-1/2) the 16-bit
  module again in ``mp_rank_00_model_states.pt``;
- ``scheduler.pt``, ``rng_state.pth`` (one per rank), ``trainer_state.json`` (grows with the log
  history), ``training_args.bin``, config and tokenizer files. ``save_only_model`` keeps only the
  weights, trainer_state.json and the config/tokenizer files.

Saves with ``save_strategy: steps`` happen every ``save_steps`` and at the last step
(transformers' DefaultFlowCallback saves at the end too); ``save_total_limit`` L deletes the oldest
after each save, so L + 1 are on disk while one is written. The final model (weights, no optimizer)
lands in output_dir after the last step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from ftlaunch.plan.batch import epoch_steps
from ftlaunch.plan.flags import truthy
from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.memory.states import dtype_bytes, lora_modules, optimizer_state_bytes, trainable_params
from ftlaunch.plan.modelspec import ModelSpec

MIB = 2**20
GIB = 2**30

# Small files, measured in checkpoint-N of the tiny model (transformers 5.6, torch 2.14, CPU):
# rng_state.pth 14,455 B, scheduler.pt 1,465 B, training_args.bin 5,841-5,905 B, trainer_state.json
# 1,418 B with 4 log entries -> 3,431 B with 16 (about 170 B per entry). Rounded up.
RNG_BYTES_PER_RANK = 16 * 1024
SCHEDULER_BYTES = 2 * 1024
TRAINING_ARGS_BYTES = 8 * 1024
TRAINER_STATE_BASE = 1024
BYTES_PER_LOG_ENTRY = 256  # trainer_state.json log_history, and trainer_log.jsonl in output_dir
CONFIG_FILES_BYTES = 2 * 1024  # config.json + generation_config.json when the shell found none
ADAPTER_FILES_BYTES = 8 * 1024  # adapter_config.json + the README.md PEFT writes
DEEPSPEED_FILES_BYTES = 64 * 1024  # zero_to_fp32.py, latest, the ZeRO-3 per-rank model_states stubs
FINAL_EXTRA_BYTES = 64 * 1024  # output_dir: all_results/train_results.json, README.md, loss plot
# Per tensor: a safetensors header entry (~102 B measured); torch.save's zip record per storage
# (~284 B measured, over exp_avg, exp_avg_sq and step of each parameter).
SAFETENSORS_BYTES_PER_TENSOR = 128
TORCH_SAVE_BYTES_PER_TENSOR = 320

# The verdict keeps this much free beyond what it predicts: block rounding (13 files a checkpoint,
# 4 KiB blocks), trainer_log.jsonl growing, the estimate's own error (docs/disk.md: within 1% on the
# tiny model), and whatever else writes to the filesystem meanwhile.
HEADROOM_FRACTION = 0.02
HEADROOM_MIN_BYTES = 1 * MIB


@dataclass(frozen=True)
class SaveSettings:
    """The keys of a config that decide how often and how much is saved."""

    strategy: str = "steps"  # save_strategy: steps | epoch | best | no
    every: float = 500.0  # save_steps (a ratio of the total steps when < 1)
    total_limit: int | None = None  # save_total_limit
    weights_only: bool = False  # save_only_model
    logging_steps: float = 500.0
    eval_steps: float | None = None

    @classmethod
    def from_config(cls, values: Mapping[str, Any]) -> SaveSettings:
        limit = values.get("save_total_limit")
        eval_steps = values.get("eval_steps")
        return cls(
            strategy=str(values.get("save_strategy") or "steps").lower(),
            every=float(values.get("save_steps") or 500),
            total_limit=int(limit) if limit not in (None, "", "none", "None") and int(limit) > 0 else None,
            weights_only=truthy(values.get("save_only_model")),
            logging_steps=float(values.get("logging_steps") or 500),
            eval_steps=float(eval_steps) if eval_steps else None,
        )


@dataclass(frozen=True)
class RunLength:
    """Optimizer steps the run will take, when known before the data is read."""

    total_steps: int | None  # None: unknown (epochs over a dataset whose rows were not counted)
    per_epoch: int | None = None
    how: str = ""  # how it was found, for the assumptions


def run_length(
    values: Mapping[str, Any], rows: int | None, micro_batch: int, accumulation: int, world: int
) -> RunLength:
    """Steps as transformers' Trainer counts them: ``max_steps`` when > 0, else ceil(epochs x
    ceil(ceil(rows / (micro x world)) / accumulation)). ``rows``: training rows after max_samples
    and val_size (the shell counts them), None when unknown."""
    max_steps = int(values.get("max_steps") or -1)
    per_epoch = None
    if rows is not None:
        per_epoch = epoch_steps(rows, micro_batch, accumulation, world)[1]
    if max_steps > 0:
        return RunLength(max_steps, per_epoch, f"max_steps {max_steps}")
    if per_epoch is None:
        return RunLength(None, None, "run length unknown before the data is read")
    epochs = float(values.get("num_train_epochs", 3.0) or 3.0)
    total = math.ceil(epochs * per_epoch)
    return RunLength(total, per_epoch, f"{rows} rows / ({micro_batch} x {accumulation} x {world}) x {epochs:g} epochs")


@dataclass(frozen=True)
class DiskForecast:
    """What the run will write to its output_dir's filesystem. Bytes throughout.

    ``save_every``: steps between saves (None: no saves, or not predictable); ``total_steps`` None
    when the run's length is unknown, and then ``saves``, ``kept`` and ``total_bytes`` are None too.
    ``total_bytes`` is the peak: ``kept`` checkpoints (one more while a new one is written, under a
    save_total_limit) plus the final model."""

    checkpoint_bytes: int
    final_bytes: int
    save_every: int | None
    total_steps: int | None
    saves: int | None
    kept: int | None
    total_bytes: int | None
    save_total_limit: int | None = None
    weights_only: bool = False
    parts: Mapping[str, int] | None = None  # one checkpoint: weights, optimizer, other
    assumptions: tuple[str, ...] = ()

    def save_step(self, k: int) -> int | None:
        """The step of the k-th save (1-based), None past the last one or when unpredictable."""
        if not self.save_every or k < 1:
            return None
        step = k * self.save_every
        if self.total_steps is None:
            return step
        if step >= self.total_steps:
            last = self.saves or 0
            return self.total_steps if k == last else None
        return step

    def next_save_after(self, step: int) -> int | None:
        """The step of the first save after ``step`` (None: no save left, or unpredictable)."""
        if not self.save_every:
            return None
        k = step // self.save_every + 1
        found = self.save_step(k)
        return self.save_step(k + 1) if found is not None and found <= step else found

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["parts"] = dict(self.parts or {})
        out["assumptions"] = list(self.assumptions)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DiskForecast:
        """Read back what ``to_dict`` wrote (RunState.disk); keys of a newer version are ignored."""
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["assumptions"] = tuple(known.get("assumptions") or ())
        return cls(**known)


def _tensors(spec: ModelSpec) -> int:
    """Parameter tensors of a decoder-only model (biases left out: only header bytes depend on it)."""
    per_layer = 7 + spec.norms_per_layer + (2 if spec.qk_norm else 0)
    return spec.num_layers * per_layer + (1 if spec.tie_word_embeddings else 2) + 1


def _weight_bytes(spec: ModelSpec, setup: TrainSetup, trainable: int) -> tuple[int, int, str]:
    """(bytes of the saved weights, tensors saved, why)."""
    act = dtype_bytes(setup.compute_dtype)
    ft = setup.finetuning_type
    adapter = ft in ("lora", "oft")
    tensors = 2 * sum(c for _i, _o, c in lora_modules(spec, setup.lora_target)) if adapter else _tensors(spec)
    if setup.zero_stage:
        half = 2 if act == 2 else 4
        n = trainable if adapter else spec.params
        return n * half, tensors, f"DeepSpeed ZeRO-{setup.zero_stage}: the engine's {half * 8}-bit weights saved"
    trained = act if setup.pure_bf16 else 4  # LLaMA-Factory cast_trainable_params_to_fp32
    if adapter:
        return trainable * trained, tensors, f"adapter only, {trained * 8}-bit"
    frozen = spec.params - trainable
    why = f"trainable weights {trained * 8}-bit" + (f", frozen {act * 8}-bit" if frozen else "")
    return trainable * trained + frozen * act, tensors, why


def _optimizer_bytes(spec: ModelSpec, setup: TrainSetup, trainable: int, adapter_tensors: int) -> tuple[int, str]:
    """Bytes of optimizer.pt (or DeepSpeed's global_stepN/) for one checkpoint, and why."""
    act = dtype_bytes(setup.compute_dtype)
    if setup.zero_stage:
        per = 4 + optimizer_state_bytes(setup.optimizer, 4, spec)  # fp32 master + fp32 states
        module = 0
        if setup.zero_stage < 3:  # mp_rank_00_model_states.pt: the 16-bit module (PEFT: trainable only)
            adapter = setup.finetuning_type in ("lora", "oft")
            module = (trainable if adapter else spec.params) * (2 if act == 2 else 4)
        why = f"DeepSpeed: fp32 master + {setup.optimizer} state ({per:g} B/trainable param)"
        return int(trainable * per) + module + DEEPSPEED_FILES_BYTES, why
    wt = act if setup.pure_bf16 else 4
    per = optimizer_state_bytes(setup.optimizer, wt, spec)
    overhead = 3 * adapter_tensors * TORCH_SAVE_BYTES_PER_TENSOR
    return int(trainable * per) + overhead, f"{setup.optimizer} state {per:g} B/trainable param, no master copy"


def forecast(
    spec: ModelSpec,
    setup: TrainSetup,
    save: SaveSettings,
    length: RunLength,
    *,
    model_files_bytes: int | None = None,
    world_size: int = 1,
) -> DiskForecast:
    """Predict one checkpoint's size and what the whole run writes.

    ``model_files_bytes``: config and tokenizer files of the model as found beside its weights
    (every checkpoint and the final model carry a copy); None when unknown."""
    trainable = trainable_params(spec, setup)
    weights, tensors, weights_why = _weight_bytes(spec, setup, trainable)
    weights += tensors * SAFETENSORS_BYTES_PER_TENSOR
    adapter = setup.finetuning_type in ("lora", "oft")
    files = model_files_bytes if model_files_bytes is not None else CONFIG_FILES_BYTES
    files += TRAINING_ARGS_BYTES + (ADAPTER_FILES_BYTES if adapter else 0)
    total = length.total_steps
    log_entries = int(total / max(1.0, save.logging_steps)) if total else 0
    state_bytes = TRAINER_STATE_BASE + BYTES_PER_LOG_ENTRY * log_entries
    optimizer = 0
    optimizer_why = "save_only_model: no optimizer, scheduler or RNG state"
    other = files + state_bytes
    if not save.weights_only:
        optimizer, optimizer_why = _optimizer_bytes(spec, setup, trainable, tensors)
        other += SCHEDULER_BYTES + RNG_BYTES_PER_RANK * max(1, world_size)
    checkpoint = weights + optimizer + other
    final = weights + files + FINAL_EXTRA_BYTES + 2 * state_bytes  # + trainer_state.json, trainer_log.jsonl

    every, saves = _saves(save, length)
    assumptions = [
        f"{setup.finetuning_type}, {trainable:,} of {spec.params:,} parameters trainable ({spec.count_method} count)",
        f"weights: {weights_why}",
        f"optimizer: {optimizer_why}",
        f"steps: {length.how}",
    ]
    if model_files_bytes is None:
        assumptions.append("tokenizer files not found beside the model: not counted")
    kept = total_bytes = None
    if saves is not None:
        limit = save.total_limit
        kept = saves if limit is None else min(saves, limit)
        writing = saves if limit is None else min(saves, limit + 1)
        total_bytes = max(writing * checkpoint, kept * checkpoint + final)
        if limit is not None:
            assumptions.append(f"save_total_limit {limit}: {limit} kept, {limit + 1} on disk while one is written")
    return DiskForecast(
        checkpoint_bytes=checkpoint,
        final_bytes=final,
        save_every=every,
        total_steps=total,
        saves=saves,
        kept=kept,
        total_bytes=total_bytes,
        save_total_limit=save.total_limit,
        weights_only=save.weights_only,
        parts={"weights": weights, "optimizer": optimizer, "other": other},
        assumptions=tuple(assumptions),
    )


def _saves(save: SaveSettings, length: RunLength) -> tuple[int | None, int | None]:
    """(steps between saves, number of saves); saves None when the run's length is unknown.

    steps: every ``save_steps`` and at the last step; epoch: at each epoch's end; best: at most one
    per evaluation (counted as if every evaluation improved); no: none."""
    total = length.total_steps
    if save.strategy in ("no", "none", "false"):
        return None, 0
    if save.strategy == "epoch":
        every = length.per_epoch
    else:
        n = save.every if save.strategy == "steps" else (save.eval_steps or save.logging_steps)
        if 0 < n < 1:  # a ratio of the total steps
            if total is None:
                return None, None
            n = math.ceil(n * total)
        every = max(1, int(n))
    if every is None or total is None:
        return every, None
    return every, math.ceil(total / every)


# ------------------------------------------------------------------------------------------ verdict


class DiskVerdictKind(StrEnum):
    OK = "ok"
    WARN = "warn"  # the run as configured fills the disk at ``fill_step``
    REFUSE = "refuse"  # not even the first save fits
    UNKNOWN_LENGTH = "unknown_length"  # one fits; whether the run fills the disk depends on its length


@dataclass(frozen=True)
class DiskVerdict:
    kind: DiskVerdictKind
    free_bytes: int
    headroom_bytes: int
    fits: int | None  # checkpoints that fit at once (None: no limit to speak of)
    fill_step: int | None = None  # the step whose save (or the final model) does not fit
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}


def headroom(fc: DiskForecast) -> int:
    """Bytes kept free beyond the forecast: HEADROOM_FRACTION of a checkpoint, at least HEADROOM_MIN_BYTES."""
    return max(HEADROOM_MIN_BYTES, int(HEADROOM_FRACTION * fc.checkpoint_bytes))


def human(n: float) -> str:
    """Bytes for a message: 1.8 MB, 18.4 GB (decimal units, like df -H)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def disk_verdict(fc: DiskForecast, free_bytes: int, where: str = "the output_dir's filesystem") -> DiskVerdict:
    """Refuse when the first save (or, without saves, the final model) cannot fit with headroom; warn
    with the step at which the disk fills when the run as configured will fill it."""
    room = free_bytes - headroom(fc)
    first = fc.checkpoint_bytes if fc.save_every else fc.final_bytes
    what = "one checkpoint" if fc.save_every else "the final model"
    fits = max(0, room // fc.checkpoint_bytes) if fc.checkpoint_bytes else None
    base = dict(free_bytes=free_bytes, headroom_bytes=headroom(fc), fits=fits)
    if first > room:
        msg = f"{what} takes {human(first)}; {where} has {human(free_bytes)} free (keeping {human(headroom(fc))} spare)"
        return DiskVerdict(DiskVerdictKind.REFUSE, message=msg, fill_step=fc.save_step(1), **base)
    if not fc.save_every:
        return DiskVerdict(DiskVerdictKind.OK, **base)
    assert fits is not None
    # The save that would need fits + 1 checkpoints on disk at once (L + 1 at most under a limit).
    at_once = _at_once(fc)
    if at_once is None or at_once > fits:
        step = fc.save_step(fits + 1)
        if step is not None:
            size = human(fc.checkpoint_bytes)
            if fc.saves is None:
                msg = (
                    f"{fits} checkpoint(s) of {human(fc.checkpoint_bytes)} fit in {human(free_bytes)} free on {where}: "
                    f"the save at step {step} would fill it, if the run gets that far"
                )
                return DiskVerdict(DiskVerdictKind.UNKNOWN_LENGTH, fill_step=step, message=msg, **base)
            msg = (
                f"the disk fills at step {step}: {fits} of {fc.saves} checkpoints of {size} fit in "
                f"{human(free_bytes)} free on {where}"
            )
            return DiskVerdict(DiskVerdictKind.WARN, fill_step=step, message=msg, **base)
    if fc.kept is not None and fc.kept * fc.checkpoint_bytes + fc.final_bytes > room:
        msg = (
            f"the disk fills at step {fc.total_steps} with the final model: {fc.kept} checkpoints of "
            f"{human(fc.checkpoint_bytes)} and a final model of {human(fc.final_bytes)} need more than "
            f"{human(free_bytes)} free on {where}"
        )
        return DiskVerdict(DiskVerdictKind.WARN, fill_step=fc.total_steps, message=msg, **base)
    return DiskVerdict(DiskVerdictKind.OK, **base)


def _at_once(fc: DiskForecast) -> int | None:
    """Checkpoints on disk at once at the peak (None: unbounded, as far as is known)."""
    if fc.save_total_limit is None:
        return fc.saves
    return fc.save_total_limit + 1 if fc.saves is None else min(fc.saves, fc.save_total_limit + 1)


def enough_for_save(fc: DiskForecast, free_bytes: int) -> bool:
    """Whether the next checkpoint fits, with headroom (the supervisor asks before each save)."""
    return fc.checkpoint_bytes + headroom(fc) <= free_bytes
