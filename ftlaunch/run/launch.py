"""Launching: write a run's folder completely and make it visible with one rename (``create_run``),
claim its output_dir first (``new_run``), and the one launch use case ``start_run`` that `train` and
`schedule run` call for every engine: plan, check (LLaMA-Factory's parser, the disk forecast), simulate
a tight plan, create, hand to the engine (ftlaunch.run.engines). Starting a supervisor on this machine
(``supervise``, ``start_detached``) is the local engine's (run/engines/local.py), re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from ftlaunch.files import now_iso
from ftlaunch.locks import set_owner
from ftlaunch.plan.config import (
    LoadedConfig,
    dump_yaml,
    redact_secret_text,
    split_secrets,
)
from ftlaunch.plan.planner import Plan
from ftlaunch.present.render import plan_text
from ftlaunch.run import transitions as journal
from ftlaunch.run.engines import Created, Engine, Started
from ftlaunch.run.engines.local import Local, start_detached, supervisor_command
from ftlaunch.run.events import Event
from ftlaunch.run.options import SupervisorSettings
from ftlaunch.run.outdir import Existing, claim_output_dir, home_problem
from ftlaunch.run.prepare import PlanRequest
from ftlaunch.run.state import RunState, RunStatus, StartFacts
from ftlaunch.run.store import NewRun, create_folder, runs_root
from ftlaunch.run.trainer import find_trainer, public_env

# Re-exported: the local engine's shell, and what a launch returns, under the names callers know.
__all__ = ["Started", "create_run", "new_run", "simulate_if_tight", "start_detached", "start_run", "supervise"]
__all__ += ["supervisor_command"]


def create_run(
    loaded: LoadedConfig,
    p: Plan,
    env: Mapping[str, str],
    settings: SupervisorSettings = SupervisorSettings(),
    *,
    facts: StartFacts = StartFacts(),
    trainer_env: Mapping[str, str] | None = None,
) -> Path:
    """Write a run directory completely, then make it visible with one rename (no half runs).

    Secret-looking keys (hub_token, *_token, *api_key*) go to a 0600 secrets.json only: config.yaml,
    plan.json, plan.txt, source.yaml and state.json never hold them in clear.

    ``p`` is a final plan (``run.prepare.make_plan``): its ``run_id`` names the folder, its ``memory_key``
    goes into the state; ``settings`` and ``facts`` are recorded in it too."""
    if p.run_id is None:
        raise ValueError("create_run: the plan names no run (plan it with ftlaunch.run.prepare.make_plan)")
    root = runs_root(env)
    home_problem(env)
    root.mkdir(parents=True, exist_ok=True)
    run_id = p.run_id
    public, secrets = split_secrets(p.config)
    p = Plan(**{**p.__dict__, "config": public})
    source_secrets = split_secrets(loaded.values)[1]
    source = redact_secret_text(loaded.source_path.read_bytes().decode(errors="replace"), source_secrets)
    plan_dict = p.to_dict()
    plan_dict["env"] = public_env(p.env)
    state = _initial_state(loaded, p, root, run_id, settings, facts, trainer_env, secrets)
    new = NewRun(
        source=source,
        config=dump_yaml(p.config, p.header),
        plan_text=plan_text(p),
        plan=plan_dict,
        hardware=p.hardware.to_dict(),
        state=state,
        secrets=secrets,
        files=p.files,  # the plan's files for the run folder (pre-downloaded hub datasets' dataset_info.json)
    )
    run_dir = create_folder(root, run_id, new)
    journal.note(run_dir, Event.CREATED, name=state.name, changes=len(p.changes))
    return run_dir


def _initial_state(
    loaded: LoadedConfig,
    p: Plan,
    root: Path,
    run_id: str,
    s: SupervisorSettings,
    facts: StartFacts,
    trainer_env: Mapping[str, str] | None,
    secrets: Mapping[str, Any],
) -> RunState:
    """The new run's state.json: the plan's figures, the supervisor's settings and the start's facts."""
    output_dir = str(p.config.get("output_dir", ""))
    return RunState(
        id=run_id,
        name=s.name or Path(output_dir).name or run_id,
        status=RunStatus.STARTING,
        created=now_iso(),
        attempt=0,
        source_config=str(loaded.source_path),
        overrides=tuple(redact_secret_text(o, secrets) for o in loaded.overrides),
        base_dir=str(loaded.base_dir),
        output_dir=output_dir,
        run_dir=str(root / run_id),
        gpu_model=p.hardware.gpu_model,
        gpu_count=p.hardware.gpu_count,
        world_size=p.world_size,
        global_batch=p.global_batch_target,
        micro_batch=p.micro_batch,
        accumulation=p.accumulation,
        **s.policy.state_fields(),  # the recovery policy, whole
        trainer_env=dict(public_env({**p.env, **(trainer_env or {})})),
        memory_key=p.memory_key,
        predicted_peak_gib=p.memory.peak_gib if p.memory and p.hardware.gpus else None,
        **facts.known(),  # what `train` found in the output_dir, the disk forecast, the schedule
    )


def new_run(
    loaded: LoadedConfig,
    p: Plan,
    env: Mapping[str, str],
    settings: SupervisorSettings = SupervisorSettings(),
    *,
    existing: Existing = Existing.REFUSE,
    facts: StartFacts = StartFacts(),
) -> tuple[Path, IO[str]]:
    """`train`: claim the output_dir, then create the run. The lock returned is held: pass it on to
    `start_detached` or `Supervisor(lock=...)`, so no second run can start in between."""
    lock, found = claim_output_dir(env, p, existing)
    try:
        run_dir = create_run(loaded, p, env, settings, facts=facts.joined(found))
        set_owner(lock, run_dir.name)  # a new run's id is known only once it exists
        if found.known():
            journal.note(run_dir, Event.OUTPUT_DIR_CLAIMED, **found.known())
    except BaseException:
        lock.close()
        raise
    return run_dir, lock


# ---------------------------------------------------------------- the one launch use case


def supervise_here(run_dir: Path, env: Mapping[str, str], lock: IO[str] | None, echo: bool, poll: float | None) -> int:
    """The run's supervisor in this process until the run ends: its exit code (the local engine's
    foreground, ``Local.here``)."""
    from ftlaunch.run.supervisor import Supervisor

    kw = {} if poll is None else {"poll": poll}
    return Supervisor(run_dir, env, echo=echo, lock=lock, **kw).run()


def supervise(
    run_dir: Path,
    env: Mapping[str, str],
    lock: IO[str] | None,
    *,
    foreground: bool = False,
    echo: bool = True,
    poll: float | None = None,
) -> Started:
    """Hand a created (or restarted) run, and the output_dir lock held for it, to its supervisor on this
    machine: here until the run ends (``foreground``), else detached in a new session."""
    if foreground:
        return Started(run_dir, exit_code=supervise_here(run_dir, env, lock, echo, poll))
    return Started(run_dir, pid=start_detached(run_dir, env, lock=lock))


def simulate_if_tight(p: Plan, simulate: bool | None, model_config: str | None, say: Callable[[str], None]) -> Plan:
    """A tight plan is checked on fake tensors before it runs (unless ``simulate`` is False)."""
    from ftlaunch.plan.memory.simulate import simulate_plan, simulation_line, simulation_wanted, with_simulation

    if not simulation_wanted(p, simulate):
        return p
    verdict = p.memory.verdict.value if p.memory else None
    say(f"plan is {verdict}: simulating two optimizer steps on fake tensors first (--no-simulate skips)")
    sim = simulate_plan(p, model_config)
    say(simulation_line(sim))
    return with_simulation(p, sim)


def start_run(
    request: PlanRequest,
    env: Mapping[str, str],
    settings: SupervisorSettings,
    *,
    engine: Engine | None = None,
    existing: Existing = Existing.REFUSE,
    simulate: bool | None = None,
    foreground: bool = False,
    echo: bool = True,
    poll: float | None = None,
    facts: StartFacts = StartFacts(),
    check: Callable[[Plan], None] | None = None,
    on_created: Callable[[Path, Plan], None] | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> Started:
    """`train` and `schedule run`, for every engine: plan the config for the engine's machine, have
    LLaMA-Factory's parser check it (run/preflight.py), forecast its disk use, simulate it when tight,
    claim its output_dir, create the run, then hand it to the engine (ftlaunch.run.engines).

    ``engine``: where the supervisor lives; default the local engine with ``foreground``, ``echo`` and
    ``poll`` (detached, or here until the run ends). ``settings``: `RunOptions.supervisor_settings()`;
    ``facts``: state fields known before the start (the schedule that starts it); ``check(plan)`` may
    refuse a plan before anything is written; ``on_created(run_dir, plan)`` runs once the run exists,
    before the engine starts it."""
    from ftlaunch.run.disk import disk_check
    from ftlaunch.run.notify import notice_forecast
    from ftlaunch.run.preflight import preflight
    from ftlaunch.run.preflight import require as require_preflight
    from ftlaunch.run.prepare import make_plan

    engine = engine if engine is not None else Local(foreground=foreground, echo=echo, poll=poll)
    if isinstance(engine, Local) and engine.here is None:
        engine = replace(engine, here=supervise_here)  # the supervisor, should it run in this process
    request = engine.request(request)
    loaded, p = make_plan(request, env)
    p = engine.adapt(p)  # the engine's final word (Slurm: CPU nodes, one process each): what is checked
    if check is not None:
        check(p)
    find_trainer(env)  # fail now, in the user's shell, rather than in the background (or in a queue)
    # LLaMA-Factory's own parser on the adapted config, in the trainer's Python (cached): exit 3 if it refuses.
    require_preflight(preflight(p, env, say=say))
    # Refused (exit 17) when one checkpoint cannot fit; a warning when the run will fill the disk. The
    # forecast goes into the state: the supervisor guards each save with it, wherever it runs.
    facts = facts.joined(disk_check(p, request.params, request.model_config, say))
    p = simulate_if_tight(p, simulate, request.model_config, say)
    facts = facts.joined(StartFacts(engine=engine.name))
    # Holds the output_dir's lock from here on, handed to the engine: exit 7 if it is taken.
    run_dir, lock = new_run(loaded, p, env, settings, existing=existing, facts=facts)
    try:
        if on_created is not None:
            on_created(run_dir, p)
    except BaseException:
        lock.close()
        raise
    notice_forecast(run_dir, env, facts)  # "the disk fills at step N": to the run's notification destinations too
    return engine.launch(Created(run_dir, p, lock), env)
