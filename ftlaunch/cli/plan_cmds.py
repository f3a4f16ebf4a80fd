"""The commands that look before anything runs: `plan`, `env` and `download`.

Each parses, calls one use case (make_plan, the hardware probe, prefetch_model) and renders.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import click

from ftlaunch.cli.options import env_now, plan_options, stderr_is_tty
from ftlaunch.cli.render import console, echo_json, err_console, plan_json
from ftlaunch.errors import DoesNotFitError


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@plan_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.option(
    "--simulate",
    is_flag=True,
    help="Also measure the chosen setup's peak on fake tensors (a child process with torch; 15-40 s).",
)
@click.option(
    "--check",
    is_flag=True,
    help="Also have LLaMA-Factory's own argument parser check the adapted config, the planned card emulated "
    "(what `train` does first; a child in the trainer's Python, ~7 s, cached). Exit 3 if it refuses.",
)
def plan(config: str, overrides: tuple[str, ...], as_json: bool, simulate: bool, check: bool, **kw: Any) -> None:
    """Show how CONFIG would be adapted to this machine; run nothing.

    \b
    Examples:
      ftlaunch plan examples/train_full/qwen3_full_sft.yaml learning_rate=2e-5
      ftlaunch plan cfg.yaml --gpu V100-32GB
      ftlaunch plan cfg.yaml --source-gpus 8 --json
      ftlaunch plan cfg.yaml --gpu V100-32GB --simulate      # also measure it on fake tensors
      ftlaunch plan cfg.yaml --gpu A100-80GBx4 --check       # would llamafactory-cli accept it there?
    """
    from ftlaunch.present.render import plan_renderables
    from ftlaunch.run.prepare import PlanRequest, PlanSettings, make_plan

    # a plan's request is its settings alone (not RunOptions: the supervisor's options are train's)
    settings = {f.name: kw[f.name] for f in fields(PlanSettings) if kw.get(f.name) is not None}
    req = PlanRequest(config=config, overrides=tuple(overrides), progress=stderr_is_tty(), **settings)
    try:
        _, p = make_plan(req, env_now())
    except DoesNotFitError as exc:
        if as_json:  # the whole object on stdout too; the error and table still go to stderr, exit 5
            echo_json({**exc.payload, "error": exc.message, "alternatives": exc.alternatives})
        raise
    sim = None
    if simulate:
        from ftlaunch.plan.memory.simulate import simulate_plan

        err_console.print("simulating two optimizer steps on fake tensors (a child process; 15-40 s on 2 cores) ...")
        sim = simulate_plan(p, req.model_config)
    verdict = None
    if check:
        from ftlaunch.run.preflight import preflight, refusal_error

        verdict = preflight(p, env_now(), say=lambda text: err_console.print(text, highlight=False, markup=False))
    if as_json:
        out = plan_json(p, sim)
        if verdict is not None:
            out["preflight"] = {
                k: getattr(verdict, k) for k in ("status", "message", "cached", "llamafactory", "where")
            }
        echo_json(out)
    else:
        for r in plan_renderables(p):
            console.print(r)
        if sim is not None:
            from ftlaunch.plan.memory.simulate import simulation_line

            console.print(simulation_line(sim), highlight=False)
        if verdict is not None and verdict.status == "ok":
            console.print(verdict.line(), highlight=False, markup=False)
    if verdict is not None and verdict.status == "refused":
        raise refusal_error(verdict)


@click.command("env")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable; feed it to --hardware elsewhere.")
@click.option(
    "--lock",
    "lock_run",
    is_flag=False,
    flag_value="",
    metavar="[RUN]",
    help="Print a pip requirements file that re-creates the environment RUN (default the latest) trained with.",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="--lock: write it to this file instead.")
@click.option("--diff", "diff_run", metavar="RUN", help="What differs between RUN's environment and RUN2's, or now's.")
@click.argument("run2", required=False)
def env_cmd(as_json: bool, lock_run: str | None, output: str | None, diff_run: str | None, run2: str | None) -> None:
    """What ftlaunch sees: GPUs, driver, RAM, disk, versions; a run's environment, locked or compared.

    Every attempt of a run records the trainer's environment (every installed distribution, CUDA,
    driver, GPUs) in <run_dir>/environment/. --lock pins it as `name==version` lines for pip;
    --diff RUN [RUN2] lists what changed, the packages that decide training first.

    \b
    Examples:
      ftlaunch env
      ftlaunch env --json > hw.json   # then elsewhere: ftlaunch plan cfg.yaml --hardware hw.json
      ftlaunch env --lock 20261130-1200 -o requirements-1200.txt
      ftlaunch env --diff 20261130-1200     # the run's environment against this machine's now
    """
    if lock_run is not None or diff_run is not None:
        _run_environment(as_json, lock_run, output, diff_run, run2)
        return
    if output or run2:
        raise click.UsageError("-o goes with --lock, RUN2 with --diff")
    from ftlaunch.present.render import hardware_renderables
    from ftlaunch.probe.hardware import probe

    hw = probe(env_now())
    if as_json:
        echo_json(hw.to_dict())
        return
    for r in hardware_renderables(hw):
        console.print(r)


def _run_environment(
    as_json: bool, lock_run: str | None, output: str | None, diff_run: str | None, run2: str | None
) -> None:
    """`env --lock [RUN]` and `env --diff RUN [RUN2]`."""
    from ftlaunch.files import write_text_atomic
    from ftlaunch.present.tables import Col, Grid
    from ftlaunch.run.environment import diff_of_runs, lock_of_run
    from ftlaunch.run.view import find_run

    if lock_run is not None and diff_run is not None:
        raise click.UsageError("--lock and --diff are separate commands")
    if lock_run is not None:
        if as_json or run2:
            raise click.UsageError("--lock writes a requirements file: no --json, one RUN")
        text = lock_of_run(find_run(env_now(), lock_run or None))
        if output:
            write_text_atomic(Path(output), text)
            err_console.print(f"wrote {output} ({len(text.splitlines())} lines)", highlight=False)
        else:
            click.echo(text, nl=False)
        return
    if output:
        raise click.UsageError("-o goes with --lock")
    other = find_run(env_now(), run2) if run2 else None
    (la, a), (lb, b), diff = diff_of_runs(find_run(env_now(), diff_run), other, env_now())
    if as_json:
        echo_json({"before": la, "after": lb, "hash_before": a.digest(), "hash_after": b.digest(), **diff.to_json()})
        return
    if not diff.changed:
        console.print(f"{la} and {lb}: the same environment (sha256 {a.digest()[:16]})", highlight=False)
        return
    # package names and versions whole; a system value (a path, a GPU name) wraps at / or spaces
    t = Grid(Col("kind", "prose"), Col("package"), Col(la, "path"), Col(lb, "path"), title=f"environment: {la} -> {lb}")
    for kind, rows in (("decides training", diff.deciding), ("other", diff.other), ("system", diff.system)):
        for d in rows:
            t.add_row(kind, d.what, *(str(x) if x is not None else "(none)" for x in (d.before, d.after)))
    console.print(t)


@click.command()
@click.argument("repo_id")
@click.option(
    "--mirror",
    default="auto",
    show_default=True,
    help="auto (probe the hub, then hf-mirror.com), hf, hf-mirror, modelscope, or a base URL.",
)
@click.option("--revision", help="Branch, tag or commit.")
@click.option("--repo-type", type=click.Choice(["model", "dataset"]), default="model", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print {path, endpoint, files, bytes, retries}.")
def download(repo_id: str, mirror: str, revision: str | None, repo_type: str, as_json: bool) -> None:
    """Download REPO_ID into the hub cache with retries and resume, then verify every file.

    \b
    Examples:
      ftlaunch download Qwen/Qwen2.5-1.5B-Instruct
      ftlaunch download Qwen/Qwen2.5-1.5B-Instruct --mirror hf-mirror --json
      ftlaunch download tatsu-lab/alpaca --repo-type dataset
    """
    from ftlaunch.hub.model import prefetch_model

    def on_retry(n: int, total: int, exc: BaseException, wait: float) -> None:
        err_console.print(f"[{n}/{total}] {type(exc).__name__}: retrying in {wait:.1f}s", highlight=False, markup=False)

    r = prefetch_model(
        repo_id,
        mirror,
        env_now(),
        revision=revision,
        progress=not as_json and sys.stderr.isatty(),
        on_retry=on_retry,
        repo_type=repo_type,
    )
    if as_json:
        echo_json({**r.to_dict(), "endpoint_reason": r.endpoint_reason})
        return
    click.echo(f"{repo_id}: {r.files} files, {r.bytes / 2**20:.1f} MiB from {r.endpoint} ({r.endpoint_reason})")
    click.echo(f"verified snapshot: {r.path}")
    click.echo(f"train offline with: model_name_or_path={r.path} and HF_HUB_OFFLINE=1")
