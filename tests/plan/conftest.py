"""The llamafactory child server the tests that ask the installed LLaMA-Factory share (tests/lfchild.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..conftest import have_llamafactory
from ..estimate.test_e2e_estimate import make_env
from ..lfchild import LlamaFactoryChild


@pytest.fixture(scope="session")
def lf_child(tmp_path_factory) -> Iterator[LlamaFactoryChild]:
    if not have_llamafactory():
        pytest.skip("the train extra (llamafactory) is not installed")
    tmp = tmp_path_factory.mktemp("lfchild")
    # the environment each test gets (no real home, hub or GPU); each run passes its test's own on top
    child = LlamaFactoryChild({**make_env(tmp), "DISABLE_VERSION_CHECK": "1"}, tmp)
    yield child
    child.close()
