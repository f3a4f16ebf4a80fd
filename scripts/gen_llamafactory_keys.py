"""Regenerate ftlaunch/data/llamafactory_keys.json from the installed llamafactory.

The planner must never write a key llamafactory-cli rejects, yet must not import it: this list is
that knowledge, frozen. tests/plan/test_keys.py checks it still matches the installed version.
Run: .venv/bin/python scripts/gen_llamafactory_keys.py
"""

import dataclasses
import enum
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


def v1_kind(tp) -> str:
    """Kinds in the v1 schema: its plugin configs are dicts (PluginConfig), its choices StrEnums."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        tp = args[0]
    if isinstance(tp, type) and issubclass(tp, dict):
        return "dict"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "str"
    return kind(tp)


def v1_schema() -> dict:
    """The keys of the v1 trainer (`USE_V1=1`: llamafactory/v1/config/arg_parser.py::get_args) and the
    values of its choice keys."""
    from llamafactory.v1.config.data_args import DataArguments
    from llamafactory.v1.config.model_args import ModelArguments
    from llamafactory.v1.config.sample_args import SampleArguments
    from llamafactory.v1.config.training_args import TrainingArguments

    keys: dict[str, str] = {}
    choices: dict[str, list[str]] = {}
    for cls in (ModelArguments, DataArguments, TrainingArguments, SampleArguments):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                tp = hints.get(f.name, f.type)
                keys[f.name] = v1_kind(tp)
                if isinstance(tp, type) and issubclass(tp, enum.Enum):
                    choices[f.name] = [str(m.value) for m in tp]
    return {"keys": dict(sorted(keys.items())), "choices": dict(sorted(choices.items()))}


def collect() -> dict:
    from importlib import metadata

    from llamafactory.hparams import parser

    keys: dict[str, str] = {}
    for cls in parser._TRAIN_ARGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init:
                keys[f.name] = kind(hints.get(f.name, f.type))
    return {"llamafactory": metadata.version("llamafactory"), "keys": dict(sorted(keys.items())), "v1": v1_schema()}


if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "ftlaunch" / "data" / "llamafactory_keys.json"
    data = collect()
    if "--check" in sys.argv:
        print(json.dumps(data))
    else:
        out.write_text(json.dumps(data, indent=1) + "\n")
        n, n1 = len(data["keys"]), len(data["v1"]["keys"])
        print(f"wrote {n} keys (+{n1} v1) for llamafactory {data['llamafactory']} to {out}")
