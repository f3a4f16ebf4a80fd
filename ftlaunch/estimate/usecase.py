"""The estimate use cases: estimate a config on one machine, or compare several machines.

Each plans (ftlaunch.run.prepare.make_plan), counts the tokens with llamafactory's own preprocessing
in a scratch folder (ftlaunch.estimate.probe), optionally probes this machine, and builds the
estimate (ftlaunch.estimate.core). Rendering is the command line's; progress lines go to `say`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftlaunch.estimate import compare
from ftlaunch.estimate import probe as estimate_probe
from ftlaunch.estimate.core import Estimate, build_estimate
from ftlaunch.estimate.facts import model_facts
from ftlaunch.estimate.padding import TokenStats
from ftlaunch.files import home
from ftlaunch.run.options import RunOptions

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan
    from ftlaunch.run.prepare import PlanRequest

Say = Callable[[str], None]


def counting_request(req: PlanRequest) -> PlanRequest:
    """An estimate's --mirror fetches a hub model's tokenizer files and config.json, never its weights:
    counting needs the tokenizer, sizing the config."""
    return replace(req, tokenizer_files=True, download_weights=False) if req.mirror else req


def estimate_plan_of(req: PlanRequest, env: Mapping[str, str]) -> Plan:
    """make_plan for an estimate: a model path missing here is refused (the count needs its tokenizer),
    with what to do instead."""
    from ftlaunch.errors import ConfigError
    from ftlaunch.run.prepare import make_plan

    try:
        return make_plan(counting_request(req), env)[1]
    except ConfigError as exc:
        if exc.hint is None and any(MISSING_MODEL in p for p in exc.problems):
            raise ConfigError(exc.problems, hint=MISSING_MODEL_HINT) from None
        raise


# plan/config.py's words for a model path that is not on this machine
MISSING_MODEL = "model_name_or_path: local path"
MISSING_MODEL_HINT = (
    "an estimate counts tokens with the model's tokenizer: override model_name_or_path with a folder that "
    "holds it, or with the base model's hub id and --mirror auto (fetches only its tokenizer and config.json); "
    "`ftlaunch plan --gpu ...` plans without the model"
)


def count_source(p: Plan, values: dict[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """What the counting child loads: a snapshot fetched by --mirror (offline), else the config's model."""
    if not p.hub:
        return values, dict(env)
    from ftlaunch.hub.download import offline_env

    return {**values, "model_name_or_path": p.hub["path"]}, {**env, **offline_env()}


def count_tokens(values: Mapping[str, Any], env: Mapping[str, str], say: Say, why: str = "") -> TokenStats:
    """Exact token counts in a scratch folder under FTLAUNCH_HOME (kept, with its log, on failure)."""
    from ftlaunch.errors import ConfigError
    from ftlaunch.plan import v1

    if v1.schema_of(values, False)[0]:
        raise ConfigError(
            "estimate: a USE_V1 config cannot be counted yet: ftlaunch counts tokens with llamafactory's v0 "
            "preprocessing (get_train_args, get_dataset), which has no train_dataset/micro_batch_size",
            hint="`ftlaunch plan` plans it; estimate a v0 config of the same model and data instead",
        )
    work = Path(tempfile.mkdtemp(prefix="count-", dir=scratch_base(env, say)))
    say(f"counting tokens with llamafactory's own preprocessing{why} ...")
    stats = estimate_probe.count_tokens(values, env, work)  # on failure the log stays in `work` (named in the hint)
    shutil.rmtree(work, ignore_errors=True)
    return stats


def scratch_base(env: Mapping[str, str], say: Say) -> Path:
    """Where counts and probes work: FTLAUNCH_HOME/scratch (a failure's log stays there). An estimate
    keeps nothing, so when that cannot be written (FTLAUNCH_HOME read-only, full, or a file) it works
    in the system's temp folder instead and says so, rather than failing."""
    base = home(env) / "scratch"
    try:
        base.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".writable-", dir=base))
        return base
    except OSError as exc:
        other = Path(tempfile.gettempdir())
        why = (exc.strerror or str(exc)).lower()
        say(f"warning: cannot write {base} ({why}): working in {other} instead (an estimate keeps nothing there)")
        return other


def estimate_plan(p: Plan, req: PlanRequest, stats: TokenStats, probe: Any = None) -> Estimate:
    """The estimate of one plan: its batch, the model's shape and the card's peak (or a probe)."""
    facts = model_facts(p, req.params, req.model_config, req.headroom)
    return build_estimate(
        stats,
        micro_batch=p.micro_batch,
        accumulation=p.accumulation,
        world_size=p.world_size,
        gpus=p.hardware.gpu_count,
        values=dict(p.config),
        probe=probe,
        shape=facts.shape,
        peak_tflops_per_gpu=facts.peak_tflops,
        checkpointing_off_fits=facts.checkpointing_off_fits,
        checkpointing_off_note=facts.checkpointing_off_note,
        extra={
            "hardware": p.hardware.describe(),
            "precision": p.precision,
            "memory": p.memory.to_dict() if p.memory else None,
            "plan_warnings": list(p.warnings),
        },
    )


@dataclass(frozen=True)
class OneMachine:
    """`estimate` on one machine: the counted tokens, the estimate and its cost range (with a price)."""

    stats: TokenStats
    estimate: Estimate
    cost: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = self.estimate.to_dict()
        if self.cost is not None:
            out["cost"] = self.cost
        return out


def estimate_one(
    config: str,
    overrides: Sequence[str],
    opts: RunOptions,
    env: Mapping[str, str],
    *,
    prices: Mapping[str, float],
    probe_steps: int | None = None,
    warmup_steps: int = 5,
    say: Say,
) -> OneMachine:
    """Plan CONFIG for `opts`' machine, count its tokens, probe this machine if asked, and estimate."""
    req = opts.plan_request(config, tuple(overrides), strict=True)
    p = estimate_plan_of(req, env)
    compare.check_prices(prices, [(opts.gpu or "", p.hardware.gpu_model if p.hardware.gpus else None)])
    values = dict(p.config)
    stats = count_tokens(*count_source(p, values, env), say)
    probe = None
    if probe_steps:
        say(f"probing: {warmup_steps} warm-up + {probe_steps} measured steps in a scratch output_dir ...")
        work = scratch_base(env, say)
        probe = estimate_probe.probe_throughput(values, env, probe_steps, warmup_steps, plan_env=p.env, workdir=work)
    result = estimate_plan(p, req, stats, probe=probe)
    cost = None
    if prices and result.time.gpu_hours:
        price = compare.price_for(opts.gpu or "", p.hardware.gpu_model, prices)
        if price is not None:
            cost = [round(h * price, 2) for h in result.time.gpu_hours]
    return OneMachine(stats, result, cost)


def compare_machines(
    config: str,
    overrides: Sequence[str],
    machines: Sequence[tuple[str, str]],
    base: RunOptions,
    prices: Mapping[str, float],
    env: Mapping[str, str],
    say: Say,
) -> dict[str, Any]:
    """Plan and estimate each machine (("gpu", name) or ("hardware_file", path)); count the tokens
    once (they do not depend on the machine). A machine the config does not fit gets a refusal row."""
    from ftlaunch.errors import DoesNotFitError
    from ftlaunch.run.prepare import get_hardware

    if prices:  # before any planning or counting: a --price naming no compared card is refused
        named = []
        for kind, value in machines:
            hw = get_hardware(replace(base, **{kind: value}).plan_request(config, tuple(overrides), strict=True), env)
            named.append((value if kind == "gpu" else "", hw.gpu_model if hw.gpus else None))
        compare.check_prices(prices, named)
    stats = None
    rows = []
    for kind, value in machines:
        req = replace(base, **{kind: value}).plan_request(config, tuple(overrides), strict=True)
        try:
            p = estimate_plan_of(req, env)
        except DoesNotFitError as exc:
            hw = get_hardware(req, env)
            rows.append(compare.row_from_refusal(value, hw.gpu_model, hw.gpu_count, exc.message, exc.alternatives))
            continue
        if stats is None:
            stats = count_tokens(*count_source(p, dict(p.config), env), say, " (once for all machines)")
        result = estimate_plan(p, req, stats)
        planned = {
            **p.to_dict(),
            "precision": p.precision,
            "micro_batch": p.micro_batch,
            "accumulation": p.accumulation,
        }
        rows.append(compare.row_from_estimate(value, planned, result.to_dict(), prices))
    out: dict[str, Any] = {"machines": [r.to_dict() for r in compare.order(rows)]}
    if stats is not None:
        s = stats.summary()
        out["tokens"] = {k: s.get(k) for k in ("samples", "total_tokens", "label_tokens", "cutoff_len", "packing")}
    return out
