"""Regenerate templates/adapted/ from templates/cluster/: what ftlaunch makes of each cluster config.

Each cluster config (written for 8 GPUs, as LLaMA-Factory ships them) is planned for named cards;
the adapted YAML carries the plan's table as comments. tests/plan/test_templates.py checks these files
are exactly what the planner produces today (golden tests).
Run: .venv/bin/python scripts/gen_templates.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
SOURCE_GPUS = 8
HOST_RAM_GIB = 128.0  # fixed, so the files do not depend on the machine that made them
# (cluster config, card, model config.json that sizes it)
PAIRS = [
    ("qwen3_lora_sft_ds3", "T4", "models/qwen3-4b/config.json"),
    ("qwen3_lora_sft", "V100-32GB", "models/qwen3-4b/config.json"),
    ("qwen3_lora_sft", "RTX4090", "models/qwen3-4b/config.json"),
    ("qwen3_full_sft", "A100-80GB", "models/qwen3-4b/config.json"),
    ("qwen3_full_sft", "H100-80GBx4", "models/qwen3-4b/config.json"),
]


def render(name: str, card: str, model_config: str) -> str:
    from ftlaunch.errors import DoesNotFitError
    from ftlaunch.plan.change import REMOVED
    from ftlaunch.plan.config import HEADER_MARK, dump_yaml
    from ftlaunch.run.prepare import PlanRequest, make_plan

    req = PlanRequest(
        config=f"cluster/{name}.yaml",
        gpu=card,
        source_gpus=SOURCE_GPUS,
        model_config=str(TEMPLATES / model_config),
        cwd=str(TEMPLATES),
        host_ram_gib=HOST_RAM_GIB,
    )
    try:
        _, p = make_plan(req, {})
    except DoesNotFitError as exc:
        lines = [
            f"# ftlaunch plan cluster/{name}.yaml --gpu {card} --source-gpus {SOURCE_GPUS}: does not fit",
            f"# {exc.message}",
        ]
        lines += [f"#   {a['option']}: peak {a['peak_gib']:.1f} GiB, fits: {a['fits']}" for a in exc.alternatives]
        return "\n".join(lines) + "\n"
    body = dump_yaml(p.config, p.header)
    header, rest = body.split("\n", 1)
    assert header.startswith(HEADER_MARK)
    cmd = f"ftlaunch plan cluster/{name}.yaml --gpu {card} --source-gpus {SOURCE_GPUS} --host-ram {HOST_RAM_GIB:g}"
    notes = [
        f"# Made by: {cmd}",
        f"# global batch {p.global_batch_source} -> {p.global_batch_target} = {p.micro_batch} micro x "
        f"{p.accumulation} accum x {p.world_size} device(s); precision {p.precision}",
    ]
    if p.env:
        notes.append("# trainer env: " + " ".join(f"{k}={v}" for k, v in sorted(p.env.items())))
    if p.memory:
        m = p.memory
        notes.append(f"# predicted peak {m.peak_gib:.1f} GiB of {m.capacity_gib:.0f} GiB ({m.headroom:.0%} headroom)")
    for c in p.changes:
        new = "(removed)" if c.new == REMOVED else c.new
        notes.append(f"# {c.key}: {c.old} -> {new}: {c.reason}")
    text = header + "\n" + "\n".join(notes) + "\n" + rest
    import ftlaunch

    # Machine-specific absolute paths would make the golden files differ per checkout.
    text = text.replace(str(Path(ftlaunch.__file__).resolve().parent) + "/", "<ftlaunch>/")
    return text.replace(str(TEMPLATES.resolve()) + "/", "")


def outputs() -> dict[Path, str]:
    return {
        TEMPLATES / "adapted" / f"{name}.{card}.yaml": render(name, card, model_config)
        for name, card, model_config in PAIRS
    }


if __name__ == "__main__":
    stale = []
    for path, text in outputs().items():
        if "--check" in sys.argv:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("stale:", *stale, sep="\n  ")
        sys.exit(1)
