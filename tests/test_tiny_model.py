"""The suite's randomness is explicit (issue 36): scripts/make_tiny.py seeds its data (random.Random(0)),
its tokenizer (trained on that data) and its weights (torch.manual_seed(0)), so the tiny model every
real-trainer test uses comes out byte for byte the same each time it is made."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.e2e


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_the_tiny_model_is_the_same_every_time_it_is_made(tiny, tmp_path):
    again = tmp_path / "again"
    script = ROOT / "scripts" / "make_tiny.py"
    subprocess.run([sys.executable, str(script), str(again)], check=True, capture_output=True)
    first, second = digests(tiny), digests(again)
    assert {"model/model.safetensors", "model/tokenizer.json", "data/alpaca_tiny.json"} <= set(second)
    # the session's copy may have gained files since (caches); every file the script makes is the same
    assert {name: first.get(name) for name in second} == second
