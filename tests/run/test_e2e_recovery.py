"""Recovery end to end: a real torch.OutOfMemoryError inside the real trainer, recovered by ftlaunch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import child_env, tiny_config, write_yaml
from .test_e2e_detached import INJECT, ftl, status, trainer_steps

pytestmark = pytest.mark.e2e


def losses(out: Path) -> dict[int, float]:
    """Loss per step, the last record of each step (a resumed run logs some steps twice)."""
    d = {}
    for line in (out / "trainer_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("loss") is not None:
            d[rec["current_steps"]] = rec["loss"]
    return d


@pytest.fixture(scope="module")
def baseline(tiny, tmp_path_factory):
    """An uninterrupted run at micro-batch 1 x accumulation 8: the loss curve to match."""
    out = tmp_path_factory.mktemp("base") / "out"
    cfg = write_yaml(
        out.parent / "c.yaml",
        tiny_config(tiny, out, per_device_train_batch_size=1, gradient_accumulation_steps=8, max_steps=8, save_steps=4),
    )
    r = ftl("train", str(cfg), "--foreground", "--json", env=child_env(FTLAUNCH_HOME=str(out.parent / "home")))
    assert r.returncode == 0, r.stdout + r.stderr
    return losses(out)


@pytest.mark.parametrize("from_step", [0, 4], ids=["oom-at-first-step", "oom-after-checkpoint"])
def test_oom_shrinks_micro_batch_keeps_global_batch_and_finishes(tiny, tmp_path, baseline, from_step):
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "c.yaml",
        tiny_config(tiny, out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=8, save_steps=4),
    )
    env = child_env(PYTHONPATH=INJECT, FTLAUNCH_TEST_OOM_ABOVE="1", FTLAUNCH_TEST_OOM_FROM_STEP=str(from_step))
    r = ftl("train", str(cfg), "--foreground", "--json", env=env, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)
    s = status(run["id"])
    assert s["status"] == "succeeded"
    assert s["micro_batch"] <= 1 and s["micro_batch"] * s["accumulation"] == 8  # global batch kept
    run_dir = Path(run["run_dir"])
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    retries = [e["message"] for e in events if e["event"] == "retry"]
    # The plan sizes the CPU micro-batch by host RAM (issue 30): the per-device batch of 8 starts whole,
    # so the ladder is 8 -> 4 -> 2 -> 1 (the config's own 4 x 2 was kept before there was a host verdict).
    assert s["micro_batch"] == 1 and len(retries) == 3 and retries[0].startswith("[1/4] OOM"), retries
    assert "micro-batch 4 x accumulation 2" in retries[0] and "micro-batch 1 x accumulation 8" in retries[-1]
    if from_step:
        assert "from checkpoint-4" in retries[0]
    steps = trainer_steps(out)
    assert sorted(set(steps)) == list(range(1, 9))  # the global step is continuous
    got = losses(out)
    for step in range(1, 9):
        assert got[step] == pytest.approx(baseline[step], abs=2e-3), (step, got[step], baseline[step])
    # the plan learns: the same config on the same machine now starts from micro-batch 1
    p = ftl("plan", str(cfg), "--json")
    plan = json.loads(p.stdout)
    assert plan["config"]["per_device_train_batch_size"] == 1
    assert any("worked" in c["reason"] for c in plan["changes"])


def test_no_recover_fails_at_first_oom(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, per_device_train_batch_size=2, max_steps=4))
    env = child_env(PYTHONPATH=INJECT, FTLAUNCH_TEST_OOM_ABOVE="1")
    r = ftl("train", str(cfg), "--foreground", "--no-recover", env=env)
    assert r.returncode == 1
    s = json.loads(ftl("status", "--json").stdout)
    assert s["status"] == "failed" and s["failure_kind"] == "cuda_oom" and s["attempt"] == 1


def test_config_error_is_not_retried(tiny, tmp_path):
    out = tmp_path / "out"
    # A template that does not exist: llamafactory raises a ValueError once it loads the data (its
    # argument parser, which the preflight runs, does not check it; an unknown dataset name is now
    # refused before the start: tests/plan/test_values.py).
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, template="no_such_template", max_steps=4))
    r = ftl("train", str(cfg), "--foreground")
    assert r.returncode == 1
    s = json.loads(ftl("status", "--json").stdout)
    assert s["failure_kind"] == "config_error" and s["attempt"] == 1, s
    assert "not retried" in s["message"]


def test_resume_with_a_new_learning_rate_really_trains_at_it(tiny, tmp_path):
    # llamafactory restores the lr from the checkpoint on resume; ftlaunch writes the new one into it.
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "c.yaml",
        tiny_config(tiny, out, per_device_train_batch_size=2, max_steps=8, save_steps=2,
                    lr_scheduler_type="constant", learning_rate=1e-3),
    )  # fmt: skip
    env = child_env(PYTHONPATH=INJECT, FTLAUNCH_TEST_OOM_ABOVE="1", FTLAUNCH_TEST_OOM_FROM_STEP="4")
    assert ftl("train", str(cfg), "--foreground", "--no-recover", env=env).returncode == 1
    run_id = json.loads(ftl("status", "--json").stdout)["id"]
    r = ftl("resume", run_id, "--foreground", "learning_rate=2.5e-4", "per_device_train_batch_size=1",
            "gradient_accumulation_steps=4", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines() if '"loss"' in x]
    before = {rec["current_steps"]: rec["lr"] for rec in records[:4]}
    after = {rec["current_steps"]: rec["lr"] for rec in records[4:]}
    assert set(before.values()) == {1e-3}, before
    assert after and all(v == pytest.approx(2.5e-4) for v in after.values()), after
    assert list(out.glob("rolledback-checkpoint-4-*")), "the original checkpoint is kept"
