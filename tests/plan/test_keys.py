"""The frozen list of llamafactory keys matches the llamafactory that is installed."""

from __future__ import annotations

import json

import pytest

from ..conftest import ROOT, child_env, have_llamafactory


@pytest.mark.skipif(not have_llamafactory(), reason="the train extra (llamafactory) is not installed")
def test_known_keys_match_installed_llamafactory(lf_child):
    r = lf_child.run(
        [str(ROOT / "scripts" / "gen_llamafactory_keys.py"), "--check"],
        env=child_env(DISABLE_VERSION_CHECK="1"),
        check=True,
    )
    live = json.loads(r.stdout.strip().splitlines()[-1])
    frozen = json.loads((ROOT / "ftlaunch" / "data" / "llamafactory_keys.json").read_text())
    assert live["llamafactory"] == frozen["llamafactory"]
    assert live["keys"] == frozen["keys"], "run scripts/gen_llamafactory_keys.py"
    assert live["defaults"] == frozen["defaults"], "run scripts/gen_llamafactory_keys.py"
