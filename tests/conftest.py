"""Shared fixtures. Tests never touch the real home or GPU: FTLAUNCH_HOME and HF caches go to tmp."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Vendored copies of the shared corpus (see tests/data/corpus/README.md): tests read nothing outside the repo.
CORPUS = ROOT / "tests" / "data" / "corpus"
EXAMPLES = CORPUS / "llamafactory-examples"
# Upstream examples LLaMA-Factory 0.9.5 itself refuses as written ("Some keys are not used by the
# HfArgumentParser"), or that are no training config: ftlaunch's own "unknown key" refusal of them is
# right. tests/plan/test_upstream_examples.py holds them to LLaMA-Factory's parser and lists them.
UPSTREAM_REFUSED = {
    "examples/extras/fp8/llama3_fp8_fsdp_sft.yaml": "fsdp_transformer_layer_cls_to_wrap",
    "examples/ktransformers/train_lora/deepseek_v3_lora_sft_kt.yaml": "kt_config",
    "examples/ktransformers/train_lora/deepseek_v3_int8_lora_sft_kt.yaml": "kt_config",
    "examples/ktransformers/train_lora/qwen3vlmoe_lora_sft_kt.yaml": "kt_config",
    "examples/ktransformers/train_lora/qwen3_5moe_lora_sft_kt.yaml": "kt_config",
    "examples/megatron/qwen2_vl_full.yaml": "Megatron keys",
    "examples/megatron/qwen3_moe_full.yaml": "Megatron keys",
    "examples/megatron_bridge/llama3_sft.yaml": "Megatron keys",
    "examples/extras/multi_tokens/tokens_cfg.yaml": "not a training config",
}


def upstream_training_examples() -> list[str]:
    """The v0 training examples LLaMA-Factory 0.9.5 accepts as written (paths under EXAMPLES)."""
    return sorted(
        rel
        for p in (EXAMPLES / "examples").rglob("*.yaml")
        if not {"accelerate", "v1"} & set(p.parts)  # v1 (USE_V1) configs: tests/plan/test_v1.py
        and (rel := str(p.relative_to(EXAMPLES))) not in UPSTREAM_REFUSED
    )


MODEL_CONFIGS = CORPUS / "model-configs"


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    home = tmp_path / "ftlaunch-home"
    monkeypatch.setenv("FTLAUNCH_HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # never a real GPU from tests
    monkeypatch.delenv("FTLAUNCH_LLAMAFACTORY_CLI", raising=False)
    return home


def venv_bin() -> Path:
    return Path(sys.executable).parent


def have_llamafactory() -> bool:
    return (venv_bin() / "llamafactory-cli").exists() or shutil.which("llamafactory-cli") is not None


TRAIN_STACK = ("llamafactory", "torch", "transformers", "datasets", "matplotlib")


def missing_train_stack() -> list[str]:
    """What of the `train` extra (and what it brings) this Python lacks, plus llamafactory-cli."""
    missing = [name for name in TRAIN_STACK if importlib.util.find_spec(name) is None]
    return missing + ([] if have_llamafactory() else ["llamafactory-cli"])


# A test that needs the trainer's stack skips, saying what is missing, in a venv without the train
# extra (pip install -e '.[dev]' only), instead of failing there.
needs_train_stack = pytest.mark.skipif(
    bool(missing_train_stack()),
    reason=f"needs the train extra (pip install -e '.[train]'): missing {', '.join(missing_train_stack())}",
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """A tiny LLaMA model + alpaca dataset made locally (scripts/make_tiny.py)."""
    if not have_llamafactory():
        pytest.skip("the train extra (llamafactory) is not installed")
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny.py"), str(out)], check=True, capture_output=True)
    return out


def tiny_config(tiny: Path, out_dir: Path, **over) -> dict:
    cfg = {
        "model_name_or_path": str(tiny / "model"),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "alpaca_tiny",
        "dataset_dir": str(tiny / "data"),
        "template": "default",
        "cutoff_len": 128,
        "max_samples": 64,
        "preprocessing_num_workers": 1,
        "dataloader_num_workers": 0,
        "output_dir": str(out_dir),
        "logging_steps": 1,
        "save_steps": 4,
        "overwrite_output_dir": True,
        "report_to": "none",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1.0e-4,
        "num_train_epochs": 1.0,
        "lr_scheduler_type": "cosine",
        "bf16": True,
        "seed": 42,
    }
    cfg.update(over)
    return cfg


def write_yaml(path: Path, cfg: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(extra)
    return env


# ---------------------------------------------------------------- the fast lane's order (issue 32)
# The fast lane gives a whole file to a worker (--dist loadfile). xdist would hand out the files with
# the most tests first, and the files of a few long tests (real supervisors, stall limits) last, so the
# lane ended waiting on one worker. The files go out longest first instead: seconds each took in one
# fast-lane run on this 2-core machine (a file not listed: 0.01 s a test). An estimate only orders.
# The files that use the lf_child fixture (tests/plan/conftest.py) go to one worker together: it
# imports llamafactory once per worker (~10 s of CPU), not once in each worker that meets one of them.
LF_CHILD_FILES = "the files that use lf_child"
FILE_SECONDS = {
    LF_CHILD_FILES: 25,
    "tests/run/test_races.py": 39,
    "tests/run/test_stall_phases.py": 31,
    "tests/cli/test_watch.py": 18,
    "tests/run/test_one_output_dir_rule.py": 18,
    "tests/run/test_healthy_end_small_points.py": 17,
    "tests/run/test_orphans.py": 16,
    "tests/run/test_notify.py": 15,
    "tests/schedule/test_schedule.py": 13,
    "tests/plan/test_modelspec.py": 12,
    "tests/run/test_reliability.py": 12,
    "tests/run/test_health.py": 11,
    "tests/run/test_guard.py": 11,
    "tests/cli/test_newcomer.py": 10,
    "tests/run/test_environment.py": 8,
    "tests/cli/test_messages.py": 7,
    "tests/hub/test_hub.py": 6,
    "tests/plan/test_planner.py": 6,
    "tests/run/test_notify_smtp.py": 6,
    "tests/run/test_slurm.py": 5,
    "tests/run/test_notify_file.py": 5,
    "tests/cli/test_numeric_bounds.py": 5,
    # issue 40's files, from this round's fast lane (2174 tests, 138 s)
    "tests/run/test_torn_optimizer.py": 23,
    "tests/run/test_notify_deadline.py": 15,
    "tests/cli/test_bounded_reads.py": 11,
    "tests/run/test_healthy_end.py": 8,
    "tests/cli/test_bundle_output.py": 7,
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    def uses_lf_child(path: str) -> bool:
        try:
            return "lf_child" in (config.rootpath / path).read_text()
        except OSError:
            return False

    class LongestFirst(OrderedDict):
        """xdist's work queue (scope -> its tests): the next unit it pops is the longest left."""

        def popitem(self, last: bool = True):
            scope = max(self, key=lambda s: FILE_SECONDS.get(s, 0.01 * len(self[s])))
            return scope, self.pop(scope)

    class Scheduling(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = LongestFirst()
            self._lf_child: dict[str, bool] = {}

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            if path not in self._lf_child:
                self._lf_child[path] = uses_lf_child(path)
            return LF_CHILD_FILES if self._lf_child[path] else path

    return Scheduling(config, log)
