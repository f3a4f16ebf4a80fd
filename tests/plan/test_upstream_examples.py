"""Every training example of LLaMA-Factory's examples tree x the catalog's cards, held to LLaMA-Factory's own
parser and to ftlaunch's invariants (issue 21).

Each example is planned as `train` plans it (``--gpu CARD --source-gpus 8``, ``--params`` from the model's
name), written as `train` writes config.yaml, and parsed by llamafactory 0.9.5's ``get_train_args`` in ONE
child (ftlaunch.run.preflight.check_configs) with the plan's env and the card emulated there only; packages the
target machine would have (deepspeed, galore_torch, ...) are taken as installed. Then, per (example, card):

  llamafactory   LLaMA-Factory accepts the adapted config (else its message, verbatim)
  global-batch   micro x accumulation x world as LLaMA-Factory sees them (from the env) = the plan's claim
  world-size     the world LLaMA-Factory sees = the plan's, and the env says the same (NPROC_PER_NODE, ...)
  recipe-keys    the method keys (stage, finetuning_type, dataset, template, lora_*, ...) are kept
  idempotent     planning the adapted YAML again with the same command changes nothing

A case that ends in "does not fit" (exit 5), in ftlaunch's "cannot train on" this card (exit 4), or in
ftlaunch's "unknown key" refusal of an example LLaMA-Factory 0.9.5 itself refuses for those keys (written
for a newer LLaMA-Factory or for mcore_adapter; the source is parsed in the same child) is listed, not
failed. The summary table (card -> passed / refused-by-LF / does-not-fit / ftlaunch error / invariant) is
printed; FTLAUNCH_EXAMPLES_REPORT=FILE also writes every case as JSON.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftlaunch.errors import DoesNotFitError, FtlaunchError, HardwareError
from ftlaunch.plan.config import dump_yaml
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.planner import Plan
from ftlaunch.run.preflight import card_of, check_configs, child_item
from ftlaunch.run.prepare import PlanRequest, make_plan

from ..conftest import EXAMPLES, have_llamafactory

pytestmark = pytest.mark.e2e

CARDS = ["V100-32GB", "T4", "RTX4090", "A100-80GB", "A100-80GBx4", "H100-80GBx8", "none"]
SOURCE_GPUS = 8
# The method: what ftlaunch may never change on its own (numerics like precision or batch split may change).
RECIPE_KEYS = {
    "stage",
    "finetuning_type",
    "dataset",
    "eval_dataset",
    "template",
    "model_name_or_path",
    "adapter_name_or_path",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "lr_scheduler_type",
    "warmup_ratio",
    "cutoff_len",
    "quantization_bit",
    "quantization_method",
    "additional_target",
    "mixture_of_depths",
    "use_galore",
    "use_apollo",
    "use_badam",
    "use_adam_mini",
    "use_muon",
    "use_dora",
    "use_rslora",
    "use_llama_pro",
    "use_asft_loss",
    "use_dft_loss",
    "use_eaft_loss",
    "pissa_init",
    "pissa_convert",
    "train_on_prompt",
    "mask_history",
    "packing",
    "neat_packing",
}
RECIPE_PREFIXES = ("lora_", "pref_", "galore_", "apollo_", "badam_", "freeze_", "oft_", "loraplus_", "kto_", "dft_")
# Example folders that hold no training config (inference, merging, accelerate's own configs).
NOT_TRAINING = {"inference", "merge_lora", "accelerate"}


def training_examples() -> list[str]:
    out = []
    for p in sorted((EXAMPLES / "examples").rglob("*.yaml")):
        rel = p.relative_to(EXAMPLES)
        if NOT_TRAINING & set(rel.parts):
            continue
        data = yaml.safe_load(p.read_text())
        if isinstance(data, dict) and ("stage" in data or rel.parts[1] == "v1"):
            out.append(str(rel))
    return out


_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[bB](?![a-zA-Z])")
_KNOWN = {"deepseek-v3": "671B", "deepseek-v2-lite": "16B"}


def params_for(values: dict[str, Any]) -> str:
    """The model's size from its name (Qwen3-4B -> 4B, 30B-A3B -> 30B); 7B when the name says nothing."""
    name = str(values.get("model_name_or_path") or values.get("model") or "")
    for key, size in _KNOWN.items():
        if key in name.lower():
            return size
    for part in re.split(r"[/_]", name):
        m = _SIZE.search(part.replace("-", " "))
        if m:
            return f"{m.group(1)}B"
    return "7B"


@dataclass
class Case:
    example: str
    card: str
    outcome: str = "planned"  # planned | does-not-fit | cannot-run-here | source-refused-by-LF | ftlaunch-error
    message: str | None = None
    plan: Plan | None = None
    lf: dict[str, Any] | None = None
    problems: dict[str, str] = field(default_factory=dict)  # rule -> what went wrong

    @property
    def label(self) -> str:
        return f"{self.example} @ {self.card}"


def _one_line(exc: FtlaunchError) -> str:
    problems = getattr(exc, "problems", None)
    text = "; ".join(problems) if problems else exc.message.replace("\n", " ")
    return f"exit {int(exc.exit_code)}: {text}"


def _request(config: str, card: str, params: str, cwd: Path) -> PlanRequest:
    # a CPU plan is checked against host RAM: a fixed 64 GiB, so the tally does not depend on this machine's
    host = 64.0 if card == "none" else None
    return PlanRequest(config=config, gpu=card, source_gpus=SOURCE_GPUS, params=params, cwd=str(cwd), host_ram_gib=host)


def _plan(case: Case, env: dict[str, str], adapted_dir: Path) -> None:
    values = yaml.safe_load((EXAMPLES / case.example).read_text())
    params = params_for(values)
    try:
        _, p = make_plan(_request(case.example, case.card, params, EXAMPLES), env)
    except DoesNotFitError as exc:
        case.outcome, case.message = "does-not-fit", exc.message.splitlines()[0]
        return
    except HardwareError as exc:
        if not exc.message.startswith("cannot train on"):
            raise
        # ftlaunch's own refusal of a method the card cannot run at all (QLoRA on the CPU): legitimate too.
        case.outcome, case.message = "cannot-run-here", _one_line(exc)
        return
    except FtlaunchError as exc:
        case.outcome, case.message = "ftlaunch-error", _one_line(exc)
        return
    except Exception as exc:  # a crash is an ftlaunch error too, named as such
        case.outcome, case.message = "ftlaunch-error", f"crash {type(exc).__name__}: {exc}"
        return
    case.plan = p
    # recipe keys kept
    lost = []
    for key, old in values.items():
        if key in RECIPE_KEYS or key.startswith(RECIPE_PREFIXES):
            if key not in p.config:
                lost.append(f"{key} removed")
            elif p.config[key] != old and not (isinstance(old, str) and str(p.config[key]).endswith(old)):
                lost.append(f"{key}: {old!r} -> {p.config[key]!r}")  # (a resolved path keeps its tail)
    if lost:
        case.problems["recipe-keys"] = "; ".join(lost)
    # idempotent: the adapted YAML (as train writes it), planned again with the same command
    adapted = adapted_dir / (re.sub(r"[^\w.]+", "_", case.label) + ".yaml")
    adapted.write_text(dump_yaml(p.config, p.header))
    try:
        _, p2 = make_plan(_request(str(adapted), case.card, params, adapted_dir), env)
    except FtlaunchError as exc:
        case.problems["idempotent"] = f"re-plan fails: {_one_line(exc)}"
        return
    diffs = [f"{c.key}: {c.old!r} -> {c.new!r}" for c in p2.changes]
    if p2.env != p.env:
        diffs.append(f"env {p.env} -> {p2.env}")
    if p2.global_batch_target != p.global_batch_target:
        diffs.append(f"global batch {p.global_batch_target} -> {p2.global_batch_target}")
    if diffs:
        case.problems["idempotent"] = "; ".join(diffs)


def _judge(case: Case, result: dict[str, Any]) -> None:
    p = case.plan
    assert p is not None
    case.lf = result
    if result["verdict"] == "refused":
        case.problems["llamafactory"] = f"refused-by-LF: {result['message']} [{result.get('where')}]"
        return
    if result["verdict"] != "ok":
        case.problems["llamafactory"] = f"check error {result.get('exception')}: {result['message']}"
        return
    if result["global_batch"] != p.global_batch_target:
        case.problems["global-batch"] = (
            f"LLaMA-Factory launches {result['micro_batch']} x {result['accumulation']} x {result['world_size']}"
            f" = {result['global_batch']}, the plan claims {p.global_batch_target}"
        )
    env_world = int(p.env.get("NPROC_PER_NODE", "0") or 0) * int(p.env.get("NNODES", "1") or 1)
    wrong = []
    if result["world_size"] != p.world_size:
        wrong.append(f"LLaMA-Factory sees world {result['world_size']}, the plan says {p.world_size}")
    if env_world and env_world != p.world_size:
        wrong.append(f"env NPROC_PER_NODE x NNODES = {env_world}, the plan's world is {p.world_size}")
    if wrong:
        case.problems["world-size"] = "; ".join(wrong) + f" (env {p.env})"


@pytest.fixture(scope="module")
def cases(tmp_path_factory, request) -> list[Case]:
    if not have_llamafactory():
        pytest.skip("the train extra (llamafactory) is not installed")
    tmp = tmp_path_factory.mktemp("examples")
    env = {
        **os.environ,
        "FTLAUNCH_HOME": str(tmp / "home"),
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "XDG_CACHE_HOME": str(tmp / "cache"),
        "MPLCONFIGDIR": str(tmp / "mpl"),
    }
    env.pop("FTLAUNCH_LLAMAFACTORY_CLI", None)
    adapted = tmp / "adapted"
    adapted.mkdir()
    t0 = time.monotonic()
    all_cases = [Case(ex, card) for ex in training_examples() for card in CARDS]
    for case in all_cases:
        _plan(case, env, adapted)
    t_plan = time.monotonic() - t0
    planned = [c for c in all_cases if c.plan is not None]
    items = [child_item(c.label, c.plan, env) for c in planned]
    # An example ftlaunch refuses for keys it does not know: does LLaMA-Factory 0.9.5 itself refuse the source
    # (written for a newer LLaMA-Factory, or for mcore_adapter)? Then that refusal is right: listed, not failed.
    unknown = sorted(
        {c.example for c in all_cases if c.outcome == "ftlaunch-error" and "unknown key" in str(c.message)}
    )
    h100 = card_of(catalog_hardware("H100-80GB"))
    sources = [
        {"id": f"source:{ex}", "yaml": (EXAMPLES / ex).read_text(), "env": _source_env(ex), "card": h100}
        for ex in unknown
    ]
    out = check_configs(items + sources, env, assume_packages=True, timeout=900)
    for case, result in zip(planned, out["results"], strict=False):
        _judge(case, result)
    source_verdicts = {r["id"].removeprefix("source:"): r for r in out["results"][len(items) :]}
    for case in all_cases:
        r = source_verdicts.get(case.example)
        if case.outcome == "ftlaunch-error" and r and "are not used by the HfArgumentParser" in str(r.get("message")):
            case.outcome = "source-refused-by-LF"
            case.message = f"{case.message} | LLaMA-Factory 0.9.5 on the source: {r['message']}"
    _report(request, all_cases, t_plan, out["seconds"])
    return all_cases


def _source_env(example: str) -> dict[str, str]:
    return {"USE_V1": "1"} if Path(example).parts[1] == "v1" else {}


def _report(request, all_cases: list[Case], t_plan: float, t_child: float) -> None:
    rows = defaultdict(Counter)
    for c in all_cases:
        if c.outcome != "planned":
            rows[c.card][c.outcome] += 1
        elif "llamafactory" in c.problems:
            rows[c.card]["refused-by-LF" if "refused-by-LF" in c.problems["llamafactory"] else "check-error"] += 1
        elif c.problems:
            rows[c.card]["invariant"] += 1
        else:
            rows[c.card]["passed"] += 1
    cols = [
        "passed",
        "refused-by-LF",
        "does-not-fit",
        "cannot-run-here",
        "source-refused-by-LF",
        "ftlaunch-error",
        "invariant",
        "check-error",
    ]
    lines = [
        f"upstream examples x cards: {len(all_cases)} cases ({len(all_cases) // len(CARDS)} examples x {len(CARDS)}"
        f" cards); planning {t_plan:.1f} s, LLaMA-Factory's parser (one child) {t_child:.1f} s",
        f"{'card':<12}" + "".join(f"{c:>21}" for c in cols),
    ]
    for card in CARDS:
        lines.append(f"{card:<12}" + "".join(f"{rows[card][c]:>21}" for c in cols))
    messages = Counter()
    for c in all_cases:
        if c.outcome == "does-not-fit":
            messages[f"{c.outcome}: {_generic(str(c.message).split(' on ')[0])} on {c.card}"] += 1
        elif c.outcome != "planned":
            messages[f"{c.outcome}: {c.message}"] += 1
        for rule, what in c.problems.items():
            messages[f"{rule}: {_generic(what)}"] += 1
    lines.append("distinct outcomes (count):")
    lines += [f"  {n:>4}  {m}" for m, n in messages.most_common()]
    text = "\n".join(lines)
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is not None and capman is not None:
        with capman.global_and_fixture_disabled():  # the table shows with -q, passing or not
            tr.write_line("")
            for line in lines:
                tr.write_line(line)
    path = os.environ.get("FTLAUNCH_EXAMPLES_REPORT")
    if path:
        Path(path).write_text(
            json.dumps(
                {
                    "summary": text,
                    "cases": [
                        {
                            "example": c.example,
                            "card": c.card,
                            "outcome": c.outcome,
                            "message": c.message,
                            "problems": c.problems,
                            "env": c.plan.env if c.plan else None,
                            "claimed_global_batch": c.plan.global_batch_target if c.plan else None,
                            "lf": c.lf,
                        }
                        for c in all_cases
                    ],
                },
                indent=1,
            )
        )


def _generic(what: str) -> str:
    """A problem with its numbers and paths blurred, to count distinct rules."""
    what = re.sub(r"/\S+/", ".../", what)
    return re.sub(r"\d+", "N", what)[:200]


def _failures(cases: list[Case], rule: str) -> list[str]:
    return [f"{c.label}: {c.problems[rule]}" for c in cases if rule in c.problems]


def test_the_tree_is_all_there(cases):
    examples = {c.example for c in cases}
    assert len(examples) >= 70, "the vendored examples tree (tests/data/corpus/llamafactory-examples) is incomplete"
    assert any(e.startswith("examples/v1/") for e in examples)


def test_every_example_plans_or_does_not_fit(cases):
    # "does not fit" (exit 5) and "cannot train on" this card (exit 4: QLoRA on the CPU) are legitimate ends,
    # listed in the summary; anything else is ftlaunch's failure.
    bad = [f"{c.label}: {c.message}" for c in cases if c.outcome == "ftlaunch-error"]
    assert not bad, f"{len(bad)} cases end in an ftlaunch error:\n" + "\n".join(bad)


def test_llamafactory_accepts_every_adapted_config(cases):
    bad = _failures(cases, "llamafactory")
    assert not bad, f"{len(bad)} adapted configs LLaMA-Factory's own parser refuses:\n" + "\n".join(bad)


def test_global_batch_as_launched_is_the_plans_claim(cases):
    bad = _failures(cases, "global-batch")
    assert not bad, f"{len(bad)} cases launch another global batch than claimed:\n" + "\n".join(bad)


def test_env_matches_the_planned_world_size(cases):
    bad = _failures(cases, "world-size")
    assert not bad, f"{len(bad)} cases run another world than planned:\n" + "\n".join(bad)


def test_recipe_keys_are_kept(cases):
    bad = _failures(cases, "recipe-keys")
    assert not bad, f"{len(bad)} cases change the method:\n" + "\n".join(bad)


def test_planning_the_adapted_config_again_changes_nothing(cases):
    bad = _failures(cases, "idempotent")
    assert not bad, f"{len(bad)} adapted configs change when planned again:\n" + "\n".join(bad)
