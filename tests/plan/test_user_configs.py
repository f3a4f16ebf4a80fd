"""Training configs users wrote (tests/data/user_configs: pasted into LLaMA-Factory issues or committed in other
repositories, not LLaMA-Factory's examples) x the catalog's cards, held to LLaMA-Factory's own parser and to
ftlaunch's invariants (issue 30, "your own corpus of real configs").

Each config is planned as `ftlaunch plan CONFIG --gpu CARD --source-gpus N --model-config|--params ...` plans it
(in-process, ``make_plan``; `none` with --host-ram HOST_RAM_GIB), from a stand-in LLaMA-Factory checkout (a
temporary folder holding the vendored examples/ tree and the users' own DeepSpeed JSONs where their configs name
them). Every case is classified:

  planned                exit 0, warning of nothing but NOT_COUNTED (how this test plans, not the config)
  planned with warning   exit 0 with other warnings (listed in docs/user-configs.md)
  refused (exit N)       ftlaunch refuses: N is the exit code it maps to (3 config, 4 hardware, 5 does not fit)

The originals (every case) and the adapted configs (as `train` writes config.yaml) are parsed by LLaMA-Factory
0.9.5's ``get_train_args`` in ONE child (ftlaunch.run.preflight.check_configs), the card emulated there. A case
fails on

  traceback       planning raised anything but an FtlaunchError
  llamafactory    LLaMA-Factory refuses the adapted config where it accepts the original on the same card
  cannot-start    LLaMA-Factory refuses an adapted config (plan exit 0) for a reason the original does not have
  global-batch    the global batch changes with no warning saying so, or LLaMA-Factory launches another one than
                  the plan claims
  precision       bf16/pure_bf16/tf32 or FlashAttention-2/3 on a card that cannot run them (any of them, or
                  fp16/fp8, with no GPU)
  stricter        a config refusal (exit 3) of an original LLaMA-Factory accepts on that card

Cases whose class an item of issue 30 says is wrong are listed in KNOWN_WRONG with the class they should have,
planner bugs this corpus found in FOUND_HERE; each is xfail (strict=False) while wrong, and passes once fixed.
scripts/user_configs_table.py writes the result table to docs/user-configs.md: this test does not compare it,
because the classes move as those fixes land; rerun the script after a planner change.
"""

from __future__ import annotations

import os
import re
import shutil
import textwrap
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftlaunch.errors import FtlaunchError
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.planner import Plan
from ftlaunch.run.preflight import card_of, check_configs, child_item
from ftlaunch.run.prepare import PlanRequest, make_plan

from ..conftest import EXAMPLES, MODEL_CONFIGS, ROOT, have_llamafactory

pytestmark = pytest.mark.e2e

USER_CONFIGS = ROOT / "tests" / "data" / "user_configs"
CARDS = ("V100-32GB", "T4", "RTX4090", "A100-80GB", "A100-80GBx4", "none")
# Compute capability of each card (the catalog's): bf16 and FlashAttention-2 need 8.0, FlashAttention-3 9.0.
CC = {"V100-32GB": (7, 0), "T4": (7, 5), "RTX4090": (8, 9), "A100-80GB": (8, 0), "A100-80GBx4": (8, 0)}
# Warnings that say how this test plans, not what the config does, and so do not make a case "with warning":
# the user's data folder is not on this machine; a model sized by --params has guessed shapes.
NOT_COUNTED = (
    re.compile(r"^dataset_dir: .* does not exist \(needed for dataset"),
    re.compile(r"^model size from --params \S+ \(shapes guessed\)$"),
)
# A YAML that does not load: llamafactory-cli stops in OmegaConf.load (the child reports it as no verdict).
_YAML_ERRORS = {"ScannerError", "ParserError", "ComposerError", "ConstructorError", "ReaderError"}


@dataclass(frozen=True)
class Source:
    """One vendored config and what its header says: how to size its model, the GPUs it was written for and
    the DeepSpeed JSON to put where it names one."""

    name: str
    model_config: str | None = None
    params: str | None = None
    source_gpus: int = 1
    deepspeed_file: str | None = None

    @property
    def path(self) -> Path:
        return USER_CONFIGS / self.name


def sources() -> list[Source]:
    out = []
    for p in sorted(USER_CONFIGS.glob("*.yaml")):
        head = dict(re.findall(r"^# (sizing|deepspeed-file): (.+)$", p.read_text(), re.M))
        sizing = dict(w.split("=", 1) for w in head.get("sizing", "").split() if "=" in w)
        out.append(
            Source(
                p.name,
                model_config=sizing.get("model-config"),
                params=sizing.get("params"),
                source_gpus=int(sizing.get("source-gpus", 1)),
                deepspeed_file=head.get("deepspeed-file"),
            )
        )
    return out


@dataclass
class Case:
    source: Source
    card: str
    cls: str = "planned"  # planned | planned with warning | refused (exit N) | traceback
    reason: str | None = None  # the refusal, or the warnings that made it "with warning"
    plan: Plan | None = None
    lf: dict[str, Any] | None = None  # LLaMA-Factory on the adapted config
    lf_source: dict[str, Any] | None = None  # LLaMA-Factory on the original, same card
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.source.name} @ {self.card}"


@dataclass
class Run:
    cases: list[Case]
    plan_seconds: float
    child_seconds: float
    llamafactory: str | None
    root: Path  # the stand-in LLaMA-Factory checkout the configs were planned from


def _one_line(exc: FtlaunchError) -> str:
    problems = getattr(exc, "problems", None)
    text = "; ".join(problems) if problems else exc.message.replace("\n", " ")
    return re.sub(r"\s+", " ", text).strip()


def lf_root(work: Path, srcs: list[Source]) -> Path:
    """A stand-in for the LLaMA-Factory checkout the configs were run from: examples/ (vendored) and each
    user's DeepSpeed JSON where the config names it."""
    root = work / "LLaMA-Factory"
    root.mkdir()
    (root / "examples").symlink_to(EXAMPLES / "examples", target_is_directory=True)
    for s in srcs:
        if not s.deepspeed_file:
            continue
        named = yaml.safe_load(s.path.read_text())["deepspeed"]
        origin = (
            EXAMPLES / s.deepspeed_file if s.deepspeed_file.startswith("examples/") else USER_CONFIGS / s.deepspeed_file
        )
        (root / named).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(origin, root / named)
    return root


# `--gpu none` trains on the CPU of the machine that plans, so its RAM (and what other processes hold of it now)
# would make the table depend on where it is made: the CPU case is planned for a what-if host of this size.
HOST_RAM_GIB = 64.0


def _request(s: Source, card: str, root: Path) -> PlanRequest:
    mc = str(MODEL_CONFIGS / s.model_config / "config.json") if s.model_config else None
    return PlanRequest(
        config=str(s.path),
        gpu=card,
        source_gpus=s.source_gpus,
        params=s.params,
        model_config=mc,
        cwd=str(root),
        host_ram_gib=HOST_RAM_GIB if card == "none" else None,
    )


def plan_case(case: Case, env: Mapping[str, str], root: Path) -> None:
    try:
        _, p = make_plan(_request(case.source, case.card, root), env)
    except FtlaunchError as exc:
        case.cls, case.reason = f"refused (exit {int(exc.exit_code)})", _one_line(exc)
        return
    except Exception as exc:  # a traceback: the one outcome never allowed
        case.cls, case.reason = "traceback", f"{type(exc).__name__}: {exc}"
        return
    case.plan = p
    said = [w for w in p.warnings if not any(r.match(w) for r in NOT_COUNTED)]
    if said:
        case.cls, case.reason = "planned with warning", " | ".join(said)


def source_text(s: Source, root: Path) -> str:
    """The original as llamafactory-cli would read it from ``root``: only a relative deepspeed path is made
    absolute (the child parses in a folder of its own)."""
    text = s.path.read_text()
    try:
        ds = yaml.safe_load(text).get("deepspeed")
    except (yaml.YAMLError, AttributeError):
        return text
    if isinstance(ds, str) and ds and not os.path.isabs(ds):
        text = re.sub(rf"^deepspeed:\s*[\"']?{re.escape(ds)}[\"']?", f"deepspeed: {root / ds}", text, flags=re.M)
    return text


def judge(case: Case) -> None:
    """The invariants of a planned case, against what LLaMA-Factory saw."""
    p, lf, src = case.plan, case.lf, case.lf_source or {}
    assert p is not None and lf is not None
    if lf["verdict"] != "ok" and src.get("verdict") == "ok":
        case.problems["llamafactory"] = f"{lf['verdict']}: {lf.get('message')} [{lf.get('where')}]"
    elif lf["verdict"] == "refused" and lf.get("message") != src.get("message"):
        # a plan (exit 0) that cannot start, for a reason that is not the original's own
        case.problems["cannot-start"] = (
            f"LLaMA-Factory refuses it: {lf.get('message')} (the original: {src.get('message')})"
        )
    if lf["verdict"] == "ok" and lf["global_batch"] != p.global_batch_target:
        case.problems["global-batch"] = (
            f"LLaMA-Factory launches {lf['micro_batch']} x {lf['accumulation']} x {lf['world_size']}"
            f" = {lf['global_batch']}, the plan claims {p.global_batch_target}"
        )
    if p.global_batch_target != p.global_batch_source and not any("global batch" in w for w in p.warnings):
        case.problems["global-batch"] = f"global batch {p.global_batch_source} -> {p.global_batch_target}, unsaid"
    bad = illegal_choices(p.config, case.card)
    if bad:
        case.problems["precision"] = "; ".join(bad)


def illegal_choices(config: Mapping[str, Any], card: str) -> list[str]:
    """Precision and attention the card cannot run (LLaMA-Factory/transformers refuse some; others fail at
    the first kernel)."""
    on = {k for k in ("bf16", "pure_bf16", "fp16", "fp8", "tf32") if config.get(k) is True}
    attn = str(config.get("flash_attn") or "auto")
    bad = []
    if card == "none":
        bad += [f"{k}: true with no GPU" for k in sorted(on)]
        bad += [f"flash_attn: {attn} with no GPU"] if attn in ("fa2", "fa3") else []
        return bad
    cc = CC[card]
    if cc < (8, 0):  # bf16 and TF32 are Ampere's (transformers: "--tf32 requires Ampere or a newer GPU arch")
        bad += [f"{k}: true on compute capability {cc}" for k in sorted(on & {"bf16", "pure_bf16", "tf32"})]
        bad += [f"flash_attn: {attn} on compute capability {cc}"] if attn in ("fa2", "fa3") else []
    if attn == "fa3" and cc < (9, 0):
        bad.append(f"flash_attn: fa3 on compute capability {cc}")
    if "fp8" in on and cc < (8, 9):
        bad.append(f"fp8: true on compute capability {cc}")
    return bad


def collect(work: Path, env: Mapping[str, str]) -> Run:
    """Plan every config for every card, parse originals and adapted configs in one LLaMA-Factory child."""
    srcs = sources()
    root = lf_root(work, srcs)
    t0 = time.monotonic()
    cases = [Case(s, card) for s in srcs for card in CARDS]
    for case in cases:
        plan_case(case, env, root)
    t_plan = time.monotonic() - t0
    planned = [c for c in cases if c.plan is not None]
    items = [child_item(c.label, c.plan, env) for c in planned]
    cards = {card: card_of(catalog_hardware(card)) for card in CARDS}
    originals = [
        {"id": f"source:{c.label}", "yaml": source_text(c.source, root), "env": {}, "card": cards[c.card]}
        for c in cases
    ]
    out = check_configs(items + originals, env, assume_packages=True, timeout=900)
    adapted, source = out["results"][: len(items)], out["results"][len(items) :]
    for c, r in zip(cases, source, strict=True):
        if r.get("verdict") == "error" and r.get("exception") in _YAML_ERRORS:
            r = {**r, "verdict": "refused", "message": f"the YAML does not load: {r.get('message')}"}
        c.lf_source = r
    for c, r in zip(planned, adapted, strict=True):
        c.lf = r
        judge(c)
    for c in cases:
        if c.cls == "refused (exit 3)" and (c.lf_source or {}).get("verdict") == "ok":
            c.problems["stricter"] = f"ftlaunch refuses what LLaMA-Factory accepts: {c.reason}"
    return Run(cases, t_plan, out["seconds"], out.get("llamafactory"), root)


def isolated_env(tmp: Path) -> dict[str, str]:
    """This process's environment with ftlaunch's home and the caches in ``tmp``, offline, no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "FTLAUNCH_LLAMAFACTORY_CLI"}
    folders = {"FTLAUNCH_HOME": "home", "HF_HOME": "hf", "XDG_CACHE_HOME": "cache", "MPLCONFIGDIR": "mpl"}
    env.update({k: str(tmp / v) for k, v in folders.items()})
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return env


# ---------------------------------------------------------------- known to be wrong today (issue 30)


@dataclass(frozen=True)
class Known:
    """A class issue 30 says is wrong: ``right(case)`` holds for the class the case should have. A case for which
    it does not hold today is xfail (strict=False) in test_known_wrong_today; when the fix lands it holds."""

    item: str
    expected: str
    right: Callable[[Case], bool]
    applies: Callable[[Case], bool] = lambda c: True
    explains: tuple[str, ...] = ()  # the invariant rules a case breaks because of it (left to this xfail)


def _not_refused_for_the_model_path(c: Case) -> bool:
    return not (c.cls.startswith("refused") and "local path" in str(c.reason) and "does not exist" in str(c.reason))


def _refused_before_the_child(words: str) -> Callable[[Case], bool]:
    return lambda c: c.cls == "refused (exit 3)" and words.lower() in str(c.reason).lower()


def _optimizer_sized_as(name: str) -> Callable[[Case], bool]:
    def right(c: Case) -> bool:
        mem = c.plan.memory if c.plan is not None else None
        return mem is not None and name in mem.optimizer.lower()

    return right


def _host_memory_verdict(c: Case) -> bool:
    return c.plan is None or c.plan.memory is not None


_NAMES_A_PATH = re.compile(r"^(?:model|adapter)_name_or_path:\s*\n?\s*[\"']?(?:/|\./|\.\./|~)", re.M)
MODEL_PATH = Known(
    "item 1: a what-if plan refuses a model/adapter path that is not on this machine",
    "planned with a warning naming the path (or refused for another reason)",
    _not_refused_for_the_model_path,
    explains=("stricter",),
)
NO_GPU_MEMORY = Known(
    "item 2: no memory check without a GPU (--gpu none plans with memory: null)",
    "a host-RAM verdict: planned with it, or refused (exit 5)",
    _host_memory_verdict,
    applies=lambda c: c.card == "none",
)
# config -> what issue 30 says is wrong with its class today (model paths: every config naming a local one)
KNOWN_WRONG: dict[str, list[Known]] = {}
for _s in sources():
    KNOWN_WRONG[_s.name] = [NO_GPU_MEMORY]
    if _NAMES_A_PATH.search(_s.path.read_text()):
        KNOWN_WRONG[_s.name].append(MODEL_PATH)
KNOWN_WRONG["31-qwen15-moe-badam-with-lora-21k.yaml"].append(
    Known(
        "item 6: LoRA with BAdam plans with exit 0; only LLaMA-Factory's parser (the --check child) refuses it",
        "refused (exit 3): LoRA cannot be used with GaLore, APOLLO or BAdam",
        _refused_before_the_child("BAdam"),
        applies=lambda c: c.plan is not None or "BAdam" in str(c.reason),
        explains=("cannot-start",),
    )
)
KNOWN_WRONG["35-qwen-7b-pt-lora-own-ds-fixed-batch.yaml"] += [
    Known(
        "item 7: a user's DeepSpeed JSON that fixes the micro-batch and accumulation is kept while they change",
        "an adapted config LLaMA-Factory accepts: the JSON's batch numbers adapted too (or 'auto')",
        lambda c: c.lf is not None and c.lf.get("verdict") == "ok",
        applies=lambda c: c.plan is not None and bool(c.plan.config.get("deepspeed")),
        explains=("cannot-start", "llamafactory"),
    ),
    Known(
        "item 7: the numbers of a user's DeepSpeed JSON are not read for the source global batch",
        "global batch 128 at the source (the JSON's 16 x 8 on one GPU)",
        lambda c: c.plan is not None and c.plan.global_batch_source == 128,
        applies=lambda c: c.plan is not None,
    ),
]
KNOWN_WRONG["34-llama2-70b-galore-z3-offload-8xa800.yaml"] += [
    Known(
        "item 6 (rules before the child): GaLore under DeepSpeed plans with exit 0; LLaMA-Factory refuses it",
        "refused (exit 3): GaLore is incompatible with DeepSpeed",
        _refused_before_the_child("GaLore"),
        applies=lambda c: c.plan is not None and bool(c.plan.config.get("deepspeed")),
    ),
    Known(
        "item 5: GaLore is sized as full AdamW",
        "optimizer states sized as GaLore's projected moments",
        _optimizer_sized_as("galore"),
        applies=lambda c: c.plan is not None and c.plan.memory is not None,
    ),
]
KNOWN_WRONG["30-qwen15-7b-badam-pt-z3-fp32.yaml"].append(
    Known(
        "item 5: BAdam is sized as full AdamW",
        "optimizer states sized as one BAdam block's",
        _optimizer_sized_as("badam"),
        applies=lambda c: c.plan is not None and c.plan.memory is not None,
    )
)


# Planner bugs this corpus found that issue 30 does not list: (config, card) -> {rule: what}. The invariant tests
# leave these out and test_found_here_today marks each xfail (strict=False) while it is still there.
FOUND_HERE: dict[tuple[str, str], dict[str, str]] = {}  # the tf32 one (07 on none) is fixed: plan/planner.py


def unexpected(c: Case, rule: str) -> bool:
    """``rule`` is broken by ``c`` and no known item (issue 30's, or found here) accounts for it."""
    if rule not in c.problems or rule in FOUND_HERE.get((c.source.name, c.card), {}):
        return False
    return not any(rule in k.explains for k in known_wrong(c))


def known_wrong(c: Case) -> list[Known]:
    """The issue-30 items this case's class is wrong by today."""
    return [k for k in KNOWN_WRONG.get(c.source.name, []) if k.applies(c) and not k.right(c)]


# ---------------------------------------------------------------- the table (docs/user-configs.md)

CLASSES = (
    "planned",
    "planned with warning",
    "refused (exit 3)",
    "refused (exit 4)",
    "refused (exit 5)",
    "traceback",
)
_CELL = {
    "planned": "ok",
    "planned with warning": "warn",
    "refused (exit 3)": "3",
    "refused (exit 4)": "4",
    "refused (exit 5)": "5",
    "traceback": "TRACEBACK",
}


def _clean(text: str, run: Run) -> str:
    """A message without this machine's paths (the checkout, the temporary LLaMA-Factory root)."""
    text = str(text).replace(str(run.root.resolve()), "<LLaMA-Factory>").replace(str(run.root), "<LLaMA-Factory>")
    text = text.replace(str(ROOT) + "/", "")
    return re.sub(r"\s+", " ", text).replace("|", "\\|").strip()


def _lf_cell(r: Mapping[str, Any] | None) -> str:
    if r is None:
        return "–"
    return {"ok": "ok", "refused": "✗"}.get(str(r.get("verdict")), "?")


def _grouped(pairs: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """(card, text) pairs -> the cards sharing each text, in first-seen order."""
    out: dict[str, list[str]] = {}
    for card, text in pairs:
        out.setdefault(text, []).append(card)
    return [(cards, text) for text, cards in out.items()]


def _bullets(by_config: Mapping[str, list[Case]], said: Callable[[Case], list[str]]) -> list[str]:
    """One line per config and text, naming the cards that share the text."""
    out = []
    for name, cases in by_config.items():
        for cards, text in _grouped([(c.card, t) for c in cases for t in said(c)]):
            out.append(f"- **{name.removesuffix('.yaml')}** ({', '.join(cards)}): {text}")
    return out


def render(run: Run) -> str:
    by_config: dict[str, list[Case]] = {}
    for c in run.cases:
        by_config.setdefault(c.source.name, []).append(c)
    n = len(by_config)
    intro = (
        f"{n} training configs that users wrote (tests/data/user_configs/: each file names its source and any edit,"
        " its README.md is the index) are planned for "
        + ", ".join(f"`{c}`" for c in CARDS)
        + " as `ftlaunch plan CONFIG --gpu CARD --source-gpus N --model-config FILE|--params P` plans them (N: the"
        f" GPUs the config was written for; `none` with `--host-ram {HOST_RAM_GIB:g}`, so that the CPU case does not"
        " depend on the machine that makes the table), from a stand-in LLaMA-Factory checkout that holds"
        " LLaMA-Factory's examples/ and the users' own DeepSpeed JSONs. tests/plan/test_user_configs.py plans the"
        f" same cases and holds them to LLaMA-Factory {run.llamafactory}'s own parser (on the original and on the"
        " adapted config, one child), to a global batch kept or announced, and to precision and attention the card"
        " can run."
    )
    classes = (
        "Classes: **planned** (exit 0), **planned with warning** (exit 0 and a warning other than the two every"
        " what-if plan of these configs carries: the data folder is not on this machine, and shapes guessed from"
        " `--params`), **refused (exit N)** (3: the config, 4: the hardware cannot run the method, 5: does not fit)."
    )
    lines = [
        "# Training configs users wrote, planned for the catalog's cards",
        "",
        "Generated by `scripts/user_configs_table.py`: do not edit by hand; rerun it after a planner change.",
        "",
        textwrap.fill(intro, 110),
        "",
        textwrap.fill(classes, 110),
        "",
        "## Cases per class per card",
        "",
        "| card | " + " | ".join(CLASSES) + " |",
        "|---|" + "---:|" * len(CLASSES),
    ]
    for card in (*CARDS, "all"):
        got = [c.cls for c in run.cases if card in (c.card, "all")]
        lines.append(f"| {card} | " + " | ".join(str(got.count(k)) for k in CLASSES) + " |")
    lines += [
        "",
        "## Every case",
        "",
        "ftlaunch: `ok` planned, `warn` planned with warning, `3`/`4`/`5` refused with that exit code; `†` the",
        "class is wrong today by an item of issue 30, `‡` a planner bug this corpus found (both listed below).",
        "LLaMA-Factory: its parser on the adapted config / on the original, card by card in the order of the",
        "columns (`ok`, `✗` refused, `–` nothing adapted).",
        "",
        "| config | " + " | ".join(CARDS) + " | LLaMA-Factory, adapted / original |",
        "|---|" + "---|" * len(CARDS) + "---|",
    ]
    for name, cases in by_config.items():
        cells = [
            _CELL[c.cls]
            + (" †" if known_wrong(c) else "")
            + (
                " ‡"
                if any(unexpected(c, r) or r in c.problems for r in FOUND_HERE.get((c.source.name, c.card), {}))
                else ""
            )
            for c in cases
        ]
        lf = " ".join(f"{_lf_cell(c.lf)}/{_lf_cell(c.lf_source)}" for c in cases)
        lines.append(f"| {name.removesuffix('.yaml')} | " + " | ".join(cells) + f" | {lf} |")
    lines += ["", "## Every refusal, with its reason", ""]
    lines += _bullets(
        by_config, lambda c: [f"{c.cls}: {_clean(c.reason, run)}"] if c.cls != "planned" and not c.plan else []
    )
    lines += ["", "## Warnings of the plans with warning", ""]
    lines += _bullets(by_config, lambda c: [_clean(c.reason, run)] if c.cls == "planned with warning" else [])
    lines += [
        "",
        "## LLaMA-Factory's refusals",
        "",
        "Of the original (as its author would run `llamafactory-cli train` on that card) and of the adapted",
        "config ftlaunch writes. A refusal of both for the same reason is the config's own; any other refusal of",
        "an adapted config fails the test, unless a known item below accounts for it.",
        "",
    ]
    lines += _bullets(
        by_config,
        lambda c: [
            f"{which}: {_clean(r.get('message'), run)}"
            for which, r in (("original", c.lf_source), ("adapted", c.lf))
            if r and r.get("verdict") != "ok"
        ],
    )
    lines += [
        "",
        "## Known wrong today (issue 30)",
        "",
        "Cases whose class an item of issue 30 says is wrong; test_known_wrong_today marks them xfail until the fix",
        "lands (then the row disappears when this table is made again).",
        "",
        "| config | item | cards | the class it should have |",
        "|---|---|---|---|",
    ]
    rows: dict[tuple[str, str], list[str]] = {}
    expected: dict[str, str] = {}
    for c in run.cases:
        for k in known_wrong(c):
            rows.setdefault((c.source.name, k.item), []).append(c.card)
            expected[k.item] = k.expected
    for (name, item), cards in rows.items():
        lines.append(f"| {name.removesuffix('.yaml')} | {item} | {', '.join(cards)} | {expected[item]} |")
    if not rows:
        lines.append("| (none) | | | |")
    lines += [
        "",
        "## Planner bugs this corpus found (not in issue 30)",
        "",
        "test_found_here_today marks each xfail while it is there.",
        "",
        "| config | card | what | today |",
        "|---|---|---|---|",
    ]
    for (name, card), rules in sorted(FOUND_HERE.items()):
        case = next(c for c in run.cases if c.source.name == name and c.card == card)
        for rule, what in sorted(rules.items()):
            if rule in case.problems:
                today = _clean(case.problems[rule], run)
            else:
                today = "fixed" if case.plan is not None else f"not shown: {case.cls}"
            lines.append(f"| {name.removesuffix('.yaml')} | {card} | {rule}: {what} | {today} |")
    lines += [
        "",
        f"{len(run.cases)} cases; LLaMA-Factory's parser read "
        f"{sum(1 for c in run.cases if c.lf) + sum(1 for c in run.cases if c.lf_source)} configs in one child.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    if not have_llamafactory():
        pytest.skip("the train extra (llamafactory) is not installed")
    tmp = tmp_path_factory.mktemp("user-configs")
    return collect(tmp, isolated_env(tmp))


def _failures(run: Run, rule: str) -> list[str]:
    return [f"{c.label}: {c.problems[rule]}" for c in run.cases if unexpected(c, rule)]


def test_the_corpus_is_there():
    srcs = sources()
    assert len(srcs) >= 30
    for s in srcs:
        head = s.path.read_text().split("\n", 1)[0]
        assert head.startswith("# Source: "), f"{s.name} names no source"
        assert bool(s.model_config) != bool(s.params), f"{s.name}: size the model by model-config or params"
        if s.model_config:
            assert (MODEL_CONFIGS / s.model_config / "config.json").is_file(), s.name
        if s.deepspeed_file:
            origin = EXAMPLES if s.deepspeed_file.startswith("examples/") else USER_CONFIGS
            assert (origin / s.deepspeed_file).is_file(), s.name
    index = (USER_CONFIGS / "README.md").read_text()
    missing = [s.name for s in srcs if s.name.removesuffix(".yaml") not in index]
    assert not missing, f"not in tests/data/user_configs/README.md: {missing}"


def test_no_traceback(run):
    bad = [f"{c.label}: {c.reason}" for c in run.cases if c.cls == "traceback"]
    assert not bad, "planning raised:\n" + "\n".join(bad)


def test_llamafactory_accepts_what_it_accepted(run):
    bad = _failures(run, "llamafactory")
    assert not bad, "LLaMA-Factory refuses the adapted config, not the original:\n" + "\n".join(bad)


def test_the_child_judged_every_config(run):
    # "error" is the emulation failing, not a verdict: it would hide the comparison above
    bad = [
        f"{c.label}: {r.get('exception')}: {r.get('message')}"
        for c in run.cases
        for r in (c.lf, c.lf_source)
        if r is not None and r.get("verdict") == "error"
    ]
    assert not bad, "\n".join(bad)


def test_no_silent_global_batch_change(run):
    bad = _failures(run, "global-batch")
    assert not bad, "\n".join(bad)


def test_precision_and_attention_legal_for_the_card(run):
    bad = _failures(run, "precision")
    assert not bad, "\n".join(bad)


def test_planned_configs_can_start(run):
    # LLaMA-Factory refuses an adapted config (exit 0 from plan) for a reason the original does not have
    bad = _failures(run, "cannot-start")
    assert not bad, "\n".join(bad)


def test_not_stricter_than_llamafactory(run):
    # a config refusal (exit 3) of an original LLaMA-Factory accepts on the same card; the model-path refusals
    # of issue 30 item 1 are counted by test_known_wrong_today
    bad = _failures(run, "stricter")
    assert not bad, "\n".join(bad)


def test_refusals_say_why(run):
    bad = [c.label for c in run.cases if c.cls.startswith("refused") and not c.reason]
    assert not bad


KNOWN_CASES = [(name, k) for name, ks in sorted(KNOWN_WRONG.items()) for k in ks]


@pytest.mark.parametrize(
    ("name", "known"), KNOWN_CASES, ids=[f"{n[:2]}-{k.item.split(':')[0].replace(' ', '')}" for n, k in KNOWN_CASES]
)
def test_known_wrong_today(run, name, known):
    wrong = [_today(c) for c in run.cases if c.source.name == name and known.applies(c) and not known.right(c)]
    if wrong:
        pytest.xfail(f"issue 30 {known.item}; expected: {known.expected}; today: " + " || ".join(wrong))


def _today(c: Case) -> str:
    said = [f"{c.card}: {c.cls}"]
    if c.plan is None:
        said.append(str(c.reason))
    else:
        said.append(f"global batch {c.plan.global_batch_source} -> {c.plan.global_batch_target}")
    if c.lf and c.lf.get("verdict") != "ok":
        said.append(f"LLaMA-Factory on the adapted config: {c.lf.get('message')}")
    return "; ".join(said)


FOUND_CASES = [(name, card, rule) for (name, card), rules in sorted(FOUND_HERE.items()) for rule in sorted(rules)]


@pytest.mark.parametrize(("name", "card", "rule"), FOUND_CASES, ids=[f"{n[:2]}-{c}-{r}" for n, c, r in FOUND_CASES])
def test_found_here_today(run, name, card, rule):
    case = next(c for c in run.cases if c.source.name == name and c.card == card)
    if rule in case.problems:
        pytest.xfail(f"{FOUND_HERE[(name, card)][rule]}: {case.problems[rule]}")
