"""Regenerate ftlaunch/data/llamafactory_keys.json from the installed llamafactory.

The planner must never write a key llamafactory-cli rejects, and must never refuse a value it
accepts, yet must not import it: this list is that knowledge, frozen. For each training key it holds
the kinds of value LLaMA-Factory takes, read from its argument dataclasses:

- the field's annotation (``str | None`` is str, ``Union[dict, str]`` is dict|str, a str Enum or a
  Literal is str, ``list[str]`` is list; a class the YAML cannot hold is any);
- plus list where the dataclass's ``__post_init__`` passes the field through its ``split_arg``
  helper, which splits a string at commas and keeps a list as it is (``lora_target: [q_proj, v_proj]``
  and ``lora_target: q_proj,v_proj`` alike; finetuning_args.py:561-573, data_args.py:148-169 in
  0.9.5). Fields split with ``str.split`` (``adapter_name_or_path``) stay str: a list fails there.

HfArgumentParser.parse_dict (what llamafactory-cli uses for a YAML) converts nothing, so these kinds
are the whole contract. tests/plan/test_keys.py checks the list still matches the installed version.
Run: .venv/bin/python scripts/gen_llamafactory_keys.py
"""

import ast
import dataclasses
import enum
import inspect
import json
import pathlib
import sys
import textwrap
import types
import typing
from pathlib import Path

_UNIONS = (typing.Union, types.UnionType)


def kinds(tp) -> set[str]:
    """The kinds of YAML value an annotation admits: bool int float str list dict, or any."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in _UNIONS:
        out = set().union(*(kinds(a) for a in args)) if args else {"any"}
        return {"any"} if "any" in out else out
    if origin is typing.Literal:
        return {"bool" if type(a) is bool else "int" if type(a) is int else "str" for a in typing.get_args(tp)}
    if tp is typing.Any:
        return {"any"}
    for base, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if tp is base:
            return {name}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"str"}  # transformers and llamafactory turn the value's text into the member
    if tp is pathlib.Path or (isinstance(tp, type) and issubclass(tp, pathlib.PurePath)):
        return {"str"}
    if origin in (list, tuple, set) or tp in (list, tuple, set):
        return {"list"}
    if origin is dict or tp is dict:
        return {"dict"}
    return {"any"}


def kind(tp) -> str:
    """One word for an annotation: its kind, or any when it admits several (the v1 schema's form)."""
    found = kinds(tp)
    return next(iter(found)) if len(found) == 1 else "any"


def split_fields(cls: type) -> set[str]:
    """Fields that ``cls`` (or a base) passes through ``split_arg(self.NAME)`` in its __post_init__:
    a comma-separated string or a list, both taken."""
    out: set[str] = set()
    for klass in cls.__mro__:
        post = klass.__dict__.get("__post_init__")
        if post is None:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(post)))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "split_arg"
                and node.args
                and isinstance(node.args[0], ast.Attribute)
                and isinstance(node.args[0].value, ast.Name)
                and node.args[0].value.id == "self"
            ):
                out.add(node.args[0].attr)
    return out


def field_kinds(cls: type) -> dict[str, str]:
    """{field: "kind|kind"} for every init field of one of llamafactory's argument dataclasses."""
    hints = typing.get_type_hints(cls)
    split = split_fields(cls)
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        found = kinds(hints.get(f.name, f.type))
        if f.name in split and "any" not in found:
            found |= {"list", "str"}
        out[f.name] = "|".join(sorted(found))
    return out


def field_defaults(cls: type) -> dict:
    """{field: default} for every init field whose default is a plain value (no factory): what a key
    the config leaves out is, for the rules ftlaunch checks before the trainer (ftlaunch.plan.rules)."""
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(f.default, "value", f.default)  # a str Enum member: its text
        if f.init and (value is None or isinstance(value, (bool, int, float, str))):
            out[f.name] = value
    return out


def v1_kind(tp) -> str:
    """Kinds in the v1 schema: its plugin configs are dicts (PluginConfig), its choices StrEnums."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in _UNIONS and len(args) == 1:
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
    defaults: dict = {}
    for cls in parser._TRAIN_ARGS:
        keys.update(field_kinds(cls))
        defaults.update(field_defaults(cls))
    return {
        "llamafactory": metadata.version("llamafactory"),
        "keys": dict(sorted(keys.items())),
        "defaults": dict(sorted(defaults.items())),
        "v1": v1_schema(),
    }


if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "ftlaunch" / "data" / "llamafactory_keys.json"
    data = collect()
    if "--check" in sys.argv:
        print(json.dumps(data))
    else:
        out.write_text(json.dumps(data, indent=1) + "\n")
        n, n1 = len(data["keys"]), len(data["v1"]["keys"])
        print(f"wrote {n} keys (+{n1} v1) for llamafactory {data['llamafactory']} to {out}")
