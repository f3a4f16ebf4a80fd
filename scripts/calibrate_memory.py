"""Calibrate the memory formulas against the simulator (ftlaunch/plan/memory/simulate.py) at full depth.

Runs each configuration below through ``python -m ftlaunch.plan.memory.simulate`` (fake tensors, real
transformers model code, real autograd and optimizer; one at a time, ~1.5-3 min each on 2 cores),
stores the simulated tensor peaks in tests/data/memory_calibration.json (kept between runs: a
configuration already measured is not simulated again) and writes the table, with each row's error,
into docs/memory-model.md between the calibration markers. tests/plan/test_memory_calibration.py holds
the formulas to the stored figures.

Run: .venv/bin/python scripts/calibrate_memory.py [--only-docs] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftlaunch.plan.memory.peak import estimate  # noqa: E402
from ftlaunch.plan.memory.setup import TrainSetup  # noqa: E402
from ftlaunch.plan.modelspec import spec_from_config  # noqa: E402

DATA = ROOT / "tests" / "data" / "memory_calibration.json"
DOCS = ROOT / "docs" / "memory-model.md"
MODELS = ROOT / "tests" / "data" / "corpus" / "model-configs"
BEGIN = "<!-- calibration:begin (scripts/calibrate_memory.py writes this table) -->"
END = "<!-- calibration:end -->"

# transformers' Qwen2MoeConfig defaults are the Qwen1.5-MoE-A2.7B shape (60 experts, top-4,
# a shared expert): the MoE row, written out so the row does not depend on transformers' defaults.
QWEN2_MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}

F, L, Z = "full", "lora", "freeze"
FUSED, FOREACH = "adamw_torch_fused", "adamw_torch"
# (model, finetuning_type, dtype, optimizer, checkpointing, attention, micro-batch, accumulation, cutoff)
# Most important first: the seed case, the upstream example, the T4 case; then one axis at a time.
ROWS: list[tuple[str, str, str, str, bool, str, int, int, int]] = [
    ("qwen2.5-1.5b", F, "fp16", FUSED, True, "sdpa", 1, 1, 1024),
    ("qwen2.5-1.5b", F, "fp16", FUSED, True, "sdpa", 1, 2, 1024),
    ("qwen2.5-1.5b", F, "fp16", FOREACH, True, "sdpa", 1, 2, 1024),
    ("qwen3-4b", F, "bf16", FUSED, True, "sdpa", 1, 2, 2048),
    ("llama3-8b", F, "fp16", FUSED, True, "sdpa", 1, 1, 1024),
    ("qwen2.5-1.5b", F, "fp16", FUSED, False, "sdpa", 1, 1, 1024),
    ("qwen2.5-1.5b", F, "fp16", FUSED, True, "sdpa", 4, 2, 1024),
    ("qwen2.5-7b", L, "bf16", FUSED, True, "sdpa", 2, 1, 2048),
    ("qwen2.5-1.5b", L, "bf16", FUSED, True, "sdpa", 4, 1, 2048),
    ("qwen2.5-1.5b", L, "fp16", FUSED, False, "sdpa", 2, 1, 1024),
    ("qwen2.5-1.5b", L, "bf16", FUSED, True, "eager", 2, 1, 2048),
    ("qwen2.5-1.5b", Z, "bf16", FUSED, True, "sdpa", 2, 1, 2048),
    ("qwen2.5-1.5b", Z, "bf16", FUSED, False, "sdpa", 2, 2, 1024),
    ("qwen2.5-1.5b", "pure_bf16", "bf16", FUSED, True, "sdpa", 2, 1, 2048),
    ("qwen2.5-1.5b", F, "bf16", FOREACH, True, "sdpa", 1, 1, 4096),
    ("qwen2.5-1.5b", F, "bf16", FUSED, True, "eager", 1, 1, 2048),
    ("qwen2.5-1.5b", F, "bf16", FUSED, False, "eager", 1, 1, 1024),
    ("qwen2.5-1.5b", L, "bf16", FUSED, True, "sdpa", 16, 1, 512),
    ("qwen2.5-1.5b", L, "bf16", FUSED, True, "sdpa", 1, 1, 8192),
    ("qwen2.5-1.5b", F, "bf16", FUSED, True, "sdpa", 8, 1, 512),
    ("qwen3-4b", L, "bf16", FUSED, True, "sdpa", 4, 2, 1024),
    ("qwen3-4b", "pure_bf16", "bf16", FUSED, True, "sdpa", 1, 1, 2048),
    ("qwen3-4b", Z, "fp16", FOREACH, False, "sdpa", 1, 1, 2048),
    ("llama3-8b", L, "bf16", FUSED, True, "sdpa", 2, 1, 2048),
    ("llama3-8b", L, "fp16", FOREACH, False, "sdpa", 1, 2, 1024),
    ("qwen2.5-7b", Z, "bf16", FUSED, True, "sdpa", 4, 1, 1024),
    ("qwen2.5-7b", "pure_bf16", "bf16", FUSED, True, "sdpa", 1, 1, 4096),
    ("qwen2.5-1.5b", L, "bf16", FOREACH, True, "sdpa", 8, 2, 1024),
    ("qwen2.5-1.5b", L, "bf16", FUSED, False, "eager", 1, 1, 4096),
    ("qwen2-moe", L, "bf16", FUSED, True, "sdpa", 1, 1, 1024),
    ("qwen2-moe", "pure_bf16", "bf16", FUSED, True, "sdpa", 1, 1, 1024),  # fp32 experts: not simulable
    ("qwen2.5-1.5b", F, "fp16", FUSED, True, "sdpa", 2, 2, 2048),
]
# Held out: added after the formulas were corrected with the rows above, and not used to fit them.
HELD_OUT: list[tuple[str, str, str, str, bool, str, int, int, int]] = [
    ("qwen2.5-7b", F, "bf16", FUSED, True, "sdpa", 1, 2, 2048),
    ("llama3-8b", F, "bf16", FUSED, True, "sdpa", 2, 2, 4096),
    ("qwen3-4b", F, "fp16", FUSED, False, "sdpa", 1, 1, 1024),
    ("qwen3-4b", F, "bf16", FUSED, False, "sdpa", 1, 2, 1024),
    ("qwen2.5-1.5b", F, "bf16", FOREACH, False, "sdpa", 4, 2, 512),
    ("qwen2.5-1.5b", F, "fp16", FUSED, True, "sdpa", 16, 1, 512),
    ("llama3-8b", "pure_bf16", "bf16", FUSED, True, "sdpa", 2, 2, 2048),
    ("qwen3-4b", L, "fp16", FUSED, False, "eager", 2, 2, 2048),
    ("qwen2.5-7b", L, "fp16", FOREACH, True, "eager", 4, 1, 1024),
    ("llama3-8b", Z, "bf16", FUSED, False, "sdpa", 2, 1, 2048),
    ("qwen2.5-1.5b", Z, "fp16", FUSED, True, "eager", 8, 1, 1024),
    ("qwen2-moe", L, "bf16", FUSED, False, "sdpa", 2, 2, 512),  # fp16 grouped_mm: CUDA only
]


def model_config(name: str) -> dict:
    if name == "qwen2-moe":
        return dict(QWEN2_MOE)
    return json.loads((MODELS / name / "config.json").read_text())


def setup_of(row: tuple) -> TrainSetup:
    _model, ft, dtype, optim, ckpt, attn, mb, acc, cutoff = row
    pure = ft == "pure_bf16"
    return TrainSetup(
        finetuning_type="full" if pure else ft,
        pure_bf16=pure,
        compute_dtype=dtype,
        optimizer=optim,
        gradient_checkpointing=ckpt,
        attn_impl=attn,
        micro_batch=mb,
        accumulation=acc,
        seq_len=cutoff,
        lora_rank=8,
        lora_target="all",
        freeze_trainable_layers=2,
    )


def row_key(row: tuple) -> str:
    model, ft, dtype, optim, ckpt, attn, mb, acc, cutoff = row
    return f"{model}|{ft}|{dtype}|{optim}|{'ckpt' if ckpt else 'no-ckpt'}|{attn}|b{mb}|acc{acc}|s{cutoff}"


def load() -> dict:
    if DATA.exists():
        return json.loads(DATA.read_text())
    return {"about": "", "rows": []}


def save(data: dict) -> None:
    data["about"] = (
        "Simulated tensor peaks (GiB) from scripts/calibrate_memory.py: ftlaunch.plan.memory.simulate, full depth, two "
        "optimizer steps, fake cpu device with autocast; torch/transformers/peft versions per row."
    )
    tmp = DATA.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(DATA)


def formula_gib(entry: dict) -> float:
    spec = spec_from_config(entry["model_config"])
    return estimate(spec, TrainSetup(**entry["setup"])).tensors_gib


def _summary(name: str, errors: list[float]) -> str:
    return (
        f"{name}: {len(errors)} rows, median error {statistics.median(errors):+.1%}, "
        f"worst over {max(errors):+.1%}, worst under {min(errors):+.1%}"
    )


def table(data: dict) -> str:
    rows = [r for r in data["rows"] if r.get("simulated_gib")]
    lines = [
        "| # | set | model | method | dtype | optimizer | ckpt | attn | micro x accum | cutoff "
        "| simulated GiB | formula GiB | error | sim s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors: dict[str, list[float]] = {}
    for i, r in enumerate(rows, 1):
        model, ft, dtype, optim, ckpt, attn, mb, acc, cutoff = r["key"].split("|")
        f = formula_gib(r)
        err = f / r["simulated_gib"] - 1
        part = r.get("set", "fit")
        errors.setdefault(part, []).append(err)
        lines.append(
            f"| {i} | {part} | {model} | {ft} | {dtype} | {optim} | {ckpt} | {attn} | {mb[1:]} x {acc[3:]} | "
            f"{cutoff[1:]} | {r['simulated_gib']:.2f} | {f:.2f} | {err:+.1%} | {r.get('seconds', 0):.0f} |"
        )
    for r in data["rows"]:
        if not r.get("simulated_gib"):
            why = r.get("error") or ", ".join(r.get("unsupported") or [])
            lines.append(f"| - | `{r['key']}` | not simulated: {why} |")
    if errors:
        every = [e for errs in errors.values() for e in errs]
        lines.append("")
        lines.append("Formula tensor peak vs simulated (positive = the formula predicts more):")
        lines.append("")
        lines.append(f"- {_summary('all', every)}")
        for part, errs in errors.items():
            lines.append(f"- {_summary(part, errs)}")
    return "\n".join(lines)


def write_docs(data: dict) -> None:
    text = DOCS.read_text()
    block = f"{BEGIN}\n{table(data)}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOCS.write_text(text)


def versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("torch", "transformers", "peft"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def main() -> None:
    from ftlaunch.plan.memory.simulate import run_child

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only-docs", action="store_true", help="re-render the docs table from the stored figures")
    ap.add_argument("--limit", type=int, default=None, help="simulate at most N new rows")
    args = ap.parse_args()
    data = load()
    if not args.only_docs:
        done = {r["key"] for r in data["rows"]}
        held = {row_key(row) for row in HELD_OUT}
        todo = [row for row in ROWS + HELD_OUT if row_key(row) not in done][: args.limit]
        for n, row in enumerate(todo, 1):
            cfg = model_config(row[0])
            setup = setup_of(row)
            start = time.monotonic()
            res = run_child(cfg, setup)
            entry = {
                "key": row_key(row),
                "set": "held-out" if row_key(row) in held else "fit",
                "model_config": cfg,
                "setup": asdict(setup),
                "simulated_gib": res.peak_gib,
                "by_kind_bytes": res.by_kind_bytes,
                "seconds": round(time.monotonic() - start, 1),
                "versions": versions(),
                "unsupported": list(res.unsupported),
                "error": res.error,
            }
            data["rows"].append(entry)
            save(data)
            f = formula_gib(entry) if res.peak_gib else None
            err = f"{f / res.peak_gib - 1:+.1%}" if f else "-"
            print(
                f"[{n}/{len(todo)}] {entry['key']}: sim {res.peak_gib} GiB, formula {f and round(f, 2)}, "
                f"error {err}, {entry['seconds']:.0f} s {res.error or ''}",
                flush=True,
            )
    write_docs(data)


if __name__ == "__main__":
    main()
