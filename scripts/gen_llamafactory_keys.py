"""Regenerate ftlaunch/data/llamafactory_keys.json from the installed llamafactory.

The planner must never write a key llamafactory-cli rejects, yet must not import it: this list is
that knowledge, frozen. tests/plan/test_keys.py checks it still matches the installed version.
Run: .venv/bin/python scripts/gen_llamafactory_keys.py
"""

import dataclasses
import json
import sys
import typing
from pathlib import Path


def kind(tp) -> str:
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        kinds = sorted({kind(a) for a in args})
        return kinds[0] if len(kinds) == 1 else "any"
    if origin is typing.Literal:
        return "str"
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    if tp is str:
        return "str"
    if origin in (list, tuple) or tp in (list, tuple):
        return "list"
    if origin is dict or tp is dict:
        return "dict"
    return "any"


def collect() -> dict:
    from importlib import metadata

    from llamafactory.hparams import parser

    keys: dict[str, str] = {}
    for cls in parser._TRAIN_ARGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                keys[f.name] = kind(hints.get(f.name, f.type))
    return {"llamafactory": metadata.version("llamafactory"), "keys": dict(sorted(keys.items()))}


if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "ftlaunch" / "data" / "llamafactory_keys.json"
    data = collect()
    if "--check" in sys.argv:
        print(json.dumps(data))
    else:
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {len(data['keys'])} keys for llamafactory {data['llamafactory']} to {out}")
