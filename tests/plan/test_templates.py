"""Golden tests: templates/adapted/ is exactly what the planner makes of templates/cluster/ today."""

from __future__ import annotations

import pytest
import yaml

from ftlaunch.plan.config import known_keys, read_header

from ..conftest import ROOT, needs_train_stack


def generated() -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_templates", ROOT / "scripts" / "gen_templates.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.outputs()


OUTPUTS = generated()


@needs_train_stack
@pytest.mark.parametrize("path", sorted(OUTPUTS), ids=lambda p: p.name)
def test_template_is_current(path):
    assert path.exists(), f"{path} missing: run scripts/gen_templates.py"
    assert path.read_text() == OUTPUTS[path], f"{path.name} is stale: run scripts/gen_templates.py"


@pytest.mark.parametrize("path", sorted(OUTPUTS), ids=lambda p: p.name)
def test_template_is_a_valid_llamafactory_config(path):
    text = path.read_text()
    data = yaml.safe_load(text)
    if data is None:  # a "does not fit" template: only comments with the alternatives
        assert "does not fit" in text and "LoRA" in text
        return
    assert set(data) <= set(known_keys())
    meta = read_header(text)
    assert (
        data["per_device_train_batch_size"] * data["gradient_accumulation_steps"] * meta["world_size"]
        == meta["global_batch"]
    )
