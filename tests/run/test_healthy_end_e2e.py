"""Issue 31 case 2, rerun with the real llamafactory-cli on the tiny model (fp32 on the CPU).

(a) lr 1e4 with the upstream examples' `logging_steps: 10`, 40 steps: grad_norm 0 at every logged step.
(b) A model that dies in the last logging windows of a healthy run: from step K the real trainer's
optimizer steps at lr 1e4 (a sitecustomize written by the test, like tests/inject's OOM: the weights,
logs and checkpoints are the trainer's own). Once only: the rollback's attempt trains on healthy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import child_env, tiny_config, write_yaml
from .test_e2e_detached import ftl, status
from .test_e2e_health import max_abs

pytestmark = pytest.mark.e2e

JUMP = """
import importlib.abc, importlib.util, os, sys

FROM, MARK = int(os.environ["TEST_LR_JUMP_FROM_STEP"]), os.environ["TEST_LR_JUMP_ONCE"]


def _patch(mod):
    original = mod.Trainer.training_step

    def training_step(self, model, inputs, *args, **kwargs):
        if self.state.global_step + 1 >= FROM:  # the optimizer step of training step FROM and after
            open(MARK, "a").close()
            for group in self.optimizer.param_groups:
                group["lr"] = 1e4
        return original(self, model, inputs, *args, **kwargs)

    mod.Trainer.training_step = training_step


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if not os.path.exists(MARK):
    sys.meta_path.insert(0, _Finder())
"""


def run(tiny: Path, tmp_path: Path, env_extra: dict, **cfg) -> tuple:
    out = tmp_path / "out"
    path = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, **cfg))
    env = child_env(FTLAUNCH_HOME=str(tmp_path / "home"), **env_extra)
    r = ftl("train", str(path), "--foreground", "--json", env=env, timeout=500)
    info = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    return r, info, env, out


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_real_lr1e4_with_logging_steps_10_ends_diverged_not_succeeded(tiny, tmp_path):
    r, info, env, out = run(
        tiny, tmp_path, {}, learning_rate=1.0e4, logging_steps=10, max_steps=40, save_steps=10, warmup_steps=0
    )
    assert r.returncode == 14, r.stdout + r.stderr
    s = status(info["id"], env=env)
    assert s["status"] == "diverged" and s["health"] == "diverged" and s["attempt"] == 1
    div = [e for e in events(Path(info["run_dir"])) if e["event"] == "diverged" and "signal" in e]
    assert (div[0]["step"], div[0]["signal"]) == (10, "zero_grad_norm") and div[0]["values"]["consecutive"] >= 2
    assert "no clean checkpoint remains" in s["message"]
    assert not list(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()
    base = max_abs(tiny / "model")
    # the trainer is stopped at step 20's record (or finishes first, on a quick machine): checkpoint-10
    # is always there, set aside, and really blown up (torch says so)
    (ck10,) = out.glob("diverged-checkpoint-10-*")
    assert max_abs(ck10) > 100 * base


@pytest.mark.parametrize(
    ("logging_steps", "jump_from", "signal", "step"),
    [(1, 37, "zero_grad_norm", 38), (10, 38, "bad_weights", 40)],
    ids=["records-say-it", "only-the-weights-say-it"],
)
def test_real_late_blow_up_is_rolled_back_to_the_clean_checkpoint_30(
    tiny, tmp_path, logging_steps, jump_from, signal, step
):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(JUMP)
    mark = tmp_path / "jumped"
    r, info, env, out = run(
        tiny,
        tmp_path,
        {"PYTHONPATH": str(inject), "TEST_LR_JUMP_FROM_STEP": str(jump_from), "TEST_LR_JUMP_ONCE": str(mark)},
        learning_rate=1.0e-3,
        logging_steps=logging_steps,
        max_steps=40,
        save_steps=10,
    )
    assert mark.exists()  # the jump happened in the real trainer
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = Path(info["run_dir"])
    ev = events(run_dir)
    ends = [e for e in ev if e["event"] == "end_judged"]
    assert [e["healthy"] for e in ends] == [False, True]
    div = [e for e in ev if e["event"] == "diverged" and "signal" in e]
    assert [(e["step"], e["signal"]) for e in div] == [(step, signal)]
    rolled = [e for e in ev if e["event"] == "rolled_back"]
    assert len(rolled) == 1 and rolled[0]["resume_from"] == "checkpoint-30"
    assert rolled[0]["edits"] == {"learning_rate": 5e-4}
    s = status(info["id"], env=env)
    assert s["status"] == "succeeded" and s["step"] == 40 and s["attempt"] == 2
    # what the run ends with passes the scan; what the bad attempt saved was set aside, blown up
    base = max_abs(tiny / "model")
    assert max_abs(out) <= 100 * base and max_abs(out / "checkpoint-40") <= 100 * base
    (final,) = out.glob("diverged-final-*")
    (bad40,) = out.glob("*-checkpoint-40-*")
    assert max_abs(final) > 100 * base and max_abs(bad40) > 100 * base
    prefix = "badweights" if signal == "bad_weights" else "diverged"
    assert bad40.name.startswith(f"{prefix}-checkpoint-40-") and bad40.name in rolled[0]["message"]
