"""Writes docs/user-configs.md: every training config users wrote (tests/data/user_configs) planned for the
catalog's cards, with LLaMA-Factory's parser on the original and on the adapted config (issue 30).

The cases, their classes and the table are tests/plan/test_user_configs.py's (``collect``, ``render``); this
script runs them once in a temporary home and writes the result. The test does not compare the document: rerun
this after a planner change.

    .venv/bin/python scripts/user_configs_table.py            # writes docs/user-configs.md
    .venv/bin/python scripts/user_configs_table.py --print    # prints it instead
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "user-configs.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the table instead of writing the doc")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.plan.test_user_configs import collect, isolated_env, render

    with tempfile.TemporaryDirectory(prefix="ftlaunch-user-configs-") as tmp:
        run = collect(Path(tmp), isolated_env(Path(tmp)))
        text = render(run)
    if args.print:
        print(text)
    else:
        DOC.write_text(text)
        print(f"wrote {DOC.relative_to(ROOT)}: {len(run.cases)} cases", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
