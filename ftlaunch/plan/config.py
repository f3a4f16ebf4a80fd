"""Reading, validating and writing LLaMA-Factory training configs.

Loading is llamafactory-cli's own (``hparams/parser.py::read_args``, 0.9.5): ``OmegaConf.load`` of
the YAML (``OmegaConf.create`` of a JSON file), ``OmegaConf.from_cli`` of the ``key=value``
overrides, ``OmegaConf.merge`` and ``OmegaConf.to_container``, so every value reaches the planner
as the trainer will see it (``1e-5`` a float, ``2024-01-01`` text, ``${...}`` left as written).
Relative paths are resolved against the directory llamafactory-cli would resolve them from (the
current directory) and written back absolute, so the adapted YAML runs from anywhere.

Validation collects every problem and raises one ``ConfigError``; the key schema it checks against
(the shipped key lists, value kinds and bounds) is ``ftlaunch.plan.keyschema``, shared with v1.
OmegaConf is imported when a config is loaded, not with this module: commands that never read a
config do not pay for it.
"""

from __future__ import annotations

import difflib
import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from ftlaunch.errors import ConfigError
from ftlaunch.files import CONFIG_LIMIT, JSON_LIMIT, read_user_bytes, read_user_text
from ftlaunch.plan.flags import truthy
from ftlaunch.plan.keyschema import known_keys as known_keys  # re-exported: the key list, as before
from ftlaunch.plan.keyschema import looks_like_path, validate_keys, validate_values
from ftlaunch.plan.keyschema import shipped_keys as shipped_keys
from ftlaunch.plan.rules import config_refusals, missing_refusals

# The header written into adapted YAMLs. A comment, because llamafactory rejects unknown keys;
# planning reads it back so that re-planning an adapted config changes nothing.
HEADER_MARK = "# ftlaunch-plan: "

# Keys that hold filesystem paths, resolved from the current directory as llamafactory would.
PATH_KEYS = (
    "model_name_or_path",
    "adapter_name_or_path",
    "deepspeed",
    "dataset_dir",
    "media_dir",
    "output_dir",
    "logging_dir",
    "tokenized_path",
    "cache_dir",
    "resume_from_checkpoint",
    "export_dir",
)
# Of those, keys that may instead name a hub repo: only made absolute when the path exists.
MAYBE_HUB_KEYS = ("model_name_or_path", "adapter_name_or_path")


@dataclass(frozen=True)
class LoadedConfig:
    """A merged config plus what we learnt while loading it."""

    values: dict[str, Any]
    source_path: Path
    base_dir: Path
    overrides: tuple[str, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)  # from an ftlaunch header, if any
    warnings: tuple[str, ...] = ()
    v1: bool = False  # a config of LLaMA-Factory's v1 trainer (USE_V1=1): ftlaunch.plan.v1


def parse_value(text: str) -> Any:
    """An override value as ``OmegaConf.from_cli`` parses it (YAML scalar rules; empty is None).

    A value that does not parse as YAML (``[1``) raises ConfigError, as llamafactory-cli would fail."""
    values, problems = parse_overrides([f"value={text}"])
    if problems:
        raise ConfigError(problems)
    return values["value"]


def _from_cli(items: Sequence[str]) -> tuple[list[Any], list[str]]:
    """(one OmegaConf node per well-formed ``key=value`` item, problems) in the order given."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    nodes: list[Any] = []
    problems: list[str] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if key.startswith("--"):
            problems.append(f"override {item!r}: llamafactory-cli takes `key=value` after the YAML, not `--key value`")
            continue
        if not sep or not key:
            problems.append(f"override {item!r} is not of the form key=value")
            continue
        if "." in key:
            problems.append(f"override {item!r}: nested keys are not llamafactory training arguments")
            continue
        try:
            nodes.append(OmegaConf.from_cli([f"{key}={raw}"]))
        except (yaml.YAMLError, ValueError, OmegaConfBaseException) as exc:  # llamafactory-cli stops here too
            problems.append(f"override {item!r} does not parse: {_one_line(exc)}")
    return nodes, problems


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def parse_overrides(items: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """(the overrides merged as llamafactory-cli merges them, problems)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    nodes, problems = _from_cli(items)
    try:
        merged = OmegaConf.to_container(OmegaConf.merge(*nodes)) if nodes else {}
    except OmegaConfBaseException as exc:  # e.g. a=1 then a={b: 2}
        return {}, [*problems, f"overrides cannot be merged: {_one_line(exc)}"]
    return dict(merged), problems


def read_header(text: str) -> dict[str, Any]:
    for line in text.splitlines()[:5]:
        if line.startswith(HEADER_MARK):
            try:
                meta = json.loads(line[len(HEADER_MARK) :])
            except json.JSONDecodeError:
                return {}
            return meta if isinstance(meta, dict) else {}
    return {}


@dataclass(frozen=True)
class _Scalar:
    """A YAML file whose whole content is one scalar (a word, a number, true)."""

    value: Any


def _yaml_scalar(text: str) -> _Scalar | None:
    """The file's one scalar, when it holds nothing else (None: a mapping, a list, empty, or no YAML)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return None if value is None or isinstance(value, (dict, list)) else _Scalar(value)


# OmegaConf's YAML loader (omegaconf/_yaml.py::get_yaml_loader, 2.4): PyYAML's safe loader (libyaml's
# when built), plus floats without a dot (1e-5), minus timestamps (2024-01-01 stays text), and a
# duplicate key refused. Restated here so that a plain config loads without importing omegaconf;
# anything past plain (anchors, aliases, merge keys, tags, keys that are not text) goes to OmegaConf
# itself, and tests/plan/test_config.py holds the two to the same values on every vendored config.
_OMEGACONF_FLOAT = r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$"""  # compiled when first loading (a command that reads no config skips it)
_BEYOND_PLAIN = ("&", "*", "!", "<<")  # anchors, aliases, tags, merge keys: OmegaConf's own loader decides


@cache
def _plain_loader() -> type:
    class PlainLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        def flatten_mapping(self, node: Any) -> Any:
            seen: set[str] = set()
            for key_node, _ in node.value:
                if key_node.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                    if key_node.value in seen:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping",
                            node.start_mark,
                            f"found duplicate key {key_node.value}",
                            key_node.start_mark,
                        )
                    seen.add(key_node.value)
            return super().flatten_mapping(node)

    PlainLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(_OMEGACONF_FLOAT, re.X), list("-+0123456789.")
    )
    PlainLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in PlainLoader.yaml_implicit_resolvers.items()
    }
    return PlainLoader


def _is_plain(value: Any) -> bool:
    """Values OmegaConf.create and to_container give back as they are: text keys, JSON-like leaves."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def _plain_mapping(text: str, *, json_file: bool) -> dict[str, Any] | None:
    """The config as OmegaConf would load it, when it is a plain mapping of two or more keys or of one
    key with a value; None for anything else (OmegaConf is then asked, and its errors are the ones
    said)."""
    try:
        if json_file:
            data = json.loads(text)
        elif any(mark in text for mark in _BEYOND_PLAIN):
            return None
        else:
            data = yaml.load(text, Loader=_plain_loader())  # noqa: S506 (a safe loader)
    except (yaml.YAMLError, ValueError):
        return None
    if not isinstance(data, dict) or not data or not _is_plain(data):
        return None
    if len(data) == 1 and next(iter(data.values())) is None:
        return None  # a file holding one word: OmegaConf's path says what it is
    return data


def _load_with_omegaconf(
    path: str | Path, src_abs: Path, text: str, overrides: Sequence[str]
) -> tuple[dict[str, Any], list[str]]:
    """(the config merged with its overrides, the overrides' problems) as llamafactory-cli's
    read_args makes it: OmegaConf.load (create for JSON), from_cli, merge, to_container. Raises
    ConfigError for a file that is no mapping of keys."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        if src_abs.suffix == ".json":
            data = json.loads(text)
            node = OmegaConf.create(data) if isinstance(data, dict) else _yaml_scalar(text) or data
        else:
            node = OmegaConf.load(io.StringIO(text, newline=None))  # the text read once, bounded
    except OSError as exc:  # OmegaConf refuses a number or true/false as the whole file: "Invalid loaded object type"
        node = _yaml_scalar(text)
        if node is None:
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except (yaml.YAMLError, ValueError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{path} does not parse: {exc}") from None
    # OmegaConf reads a file holding only `just a string` as {"just a string": None}: say what it is.
    if isinstance(node, DictConfig) and len(node) == 1 and next(iter(node.values())) is None:
        node = _yaml_scalar(text) or node
    if isinstance(node, _Scalar):
        raise ConfigError(
            f"{path} holds a {'JSON' if src_abs.suffix == '.json' else 'YAML'} scalar ({node.value!r}), "
            "not a mapping of keys",
            hint="a training config is lines of `key: value` (e.g. `stage: sft`), one key per line",
        )
    if node is None or (isinstance(node, DictConfig) and len(node) == 0):
        raise ConfigError(
            f"{path} is empty: there is nothing to train",
            hint="a training config names at least model_name_or_path, stage, dataset and output_dir",
        )
    if not isinstance(node, DictConfig):
        kind = "list" if OmegaConf.is_list(node) else type(node).__name__
        raise ConfigError(f"{path} must be a mapping of key: value, not {kind}")
    over, problems = _from_cli(overrides)
    try:
        merged = dict(OmegaConf.to_container(OmegaConf.merge(node, *over)))
    except OmegaConfBaseException as exc:  # llamafactory-cli would stop here too
        raise ConfigError(problems + [f"overrides cannot be merged into {path}: {_one_line(exc)}"]) from None
    return merged, problems


def load_config(
    path: str | Path, overrides: Sequence[str] = (), cwd: str | Path | None = None, *, use_v1: bool = False
) -> LoadedConfig:
    """Load, merge and resolve a config. Raises ConfigError listing every problem.

    ``use_v1``: USE_V1 is set for the trainer, so the config is checked in the v1 schema; without it a
    config with v1-only keys and no v0 one is recognised as v1 too (ftlaunch.plan.v1.schema_of)."""
    base = Path(cwd) if cwd is not None else Path.cwd()
    src = Path(path)
    src_abs = src if src.is_absolute() else base / src
    if src_abs.suffix not in {".yaml", ".yml", ".json"}:
        raise ConfigError(
            f"{path}: llamafactory-cli reads a .yaml, .yml or .json config",
            hint="pass the training config first, then key=value overrides",
        )
    try:  # UTF-8, as llamafactory-cli reads it (OmegaConf.load); a FIFO, /dev/zero or a huge file is refused
        text = read_user_text(src_abs, limit=CONFIG_LIMIT, what=f"config file {path}", error=ConfigError)
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"config file {path} does not exist") from None
    plain = None if overrides else _plain_mapping(text, json_file=src_abs.suffix == ".json")
    if plain is not None:  # what OmegaConf would give, without importing it (~0.1 s of a plan)
        merged, problems = plain, []
    else:
        merged, problems = _load_with_omegaconf(path, src_abs, text, overrides)
    from ftlaunch.plan import v1  # when a config is loaded (v1 never imports config: keyschema is shared)

    is_v1, mixed = v1.schema_of(merged, use_v1)
    if is_v1:
        problems += v1.validate(merged)
    else:
        problems += mixed or validate_keys(merged)
        problems += validate_values(merged)
        problems += [f"{rule.name}: {rule}" for rule in config_refusals(merged)]
    if problems:
        raise ConfigError(problems)
    return LoadedConfig(
        values=merged,
        source_path=src_abs.resolve(),
        base_dir=base.resolve(),
        overrides=tuple(overrides),
        meta=read_header(text),
        v1=is_v1,
    )


_SECRET_KEY = re.compile(r"(^hub_token$|_token$|api_key|_secret$|webhook_url$)", re.I)


def is_secret_key(key: str) -> bool:
    """hub_token, ms_hub_token, hf_hub_token, swanlab_api_key, swanlab_lark_secret (and its webhook
    URL, which is a credential too), ...: values never written in clear."""
    return bool(_SECRET_KEY.search(str(key)))


def secret_override(item: str) -> tuple[str, str] | None:
    """(key, value) of a ``key=value`` override whose key is secret-looking, else None."""
    key, eq, value = str(item).partition("=")
    key = key.strip().lstrip("+~")
    return (key, value) if eq and is_secret_key(key) and value not in ("", "null") else None


def mask_override(item: str) -> str:
    """A ``key=value`` override as it may be shown or stored: a secret's value is ***."""
    return f"{str(item).partition('=')[0]}=***" if secret_override(item) else item


def split_secrets(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(public, secret): secret-looking keys with a value, apart from the rest."""
    secret = {k: v for k, v in values.items() if is_secret_key(k) and v not in (None, "")}
    return {k: v for k, v in values.items() if k not in secret}, secret


def redact_secret_text(text: str, secrets: Mapping[str, Any]) -> str:
    """Text (a YAML file, an override) with every secret value replaced by ***."""
    for v in secrets.values():
        if len(str(v)) >= 4:
            text = text.replace(str(v), "***")
    return text


def what_if_reason(req: Any) -> str | None:
    """Why a plan request is a what-if whose local paths need not exist on this machine, or None.

    ``req`` is a plan request (ftlaunch.run.prepare.PlanRequest: gpu, hardware_file, model_config,
    params, mirror, strict_files). A plan for another machine (``--gpu``, ``--hardware``), or of a model
    sized without its weights (``--model-config``, ``--params``, the hub), plans a config written
    elsewhere: its model, adapter, DeepSpeed JSON and checkpoint paths are the author's. A command
    that starts training here (``strict_files``) never is one."""
    if getattr(req, "strict_files", True):
        return None
    for attr, words in (
        ("gpu", "a what-if for --gpu {}"),
        ("hardware_file", "a what-if for the machine in --hardware {}"),
        ("model_config", "the model is sized by --model-config {}"),
        ("params", "the model is sized by --params {}"),
        ("mirror", "the model is sized from the hub (--mirror {})"),
    ):
        value = getattr(req, attr, None)
        if value is not None:
            return words.format(value)
    return None


def _path_here(v: str, base_dir: Path) -> Path:
    p = Path(os.path.expanduser(v))
    return p if p.is_absolute() else base_dir / p


def _model_or_adapter(key: str, v: str, base_dir: Path) -> tuple[str, str | None]:
    """(the value with every local path made absolute, the first local path that is missing).

    ``adapter_name_or_path`` may name several adapters, comma-separated (model_args.py:211 splits it);
    each is a local folder or a hub repo id."""
    parts = [part.strip() for part in v.split(",")] if key == "adapter_name_or_path" else [v]
    out = []
    for part in parts:
        absolute = _path_here(part, base_dir)
        if absolute.exists():
            out.append(str(absolute.resolve()))
        elif looks_like_path(part):
            return v, part
        else:
            out.append(part)  # a hub repo id
    return ",".join(out), None


def resolve_paths(
    values: Mapping[str, Any], base_dir: Path, *, strict: bool = True, what_if: str | None = None
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Make path keys absolute. Returns (values, problems, warnings).

    strict: a missing dataset_info.json is a problem (train) rather than a warning (plan); a plan also
    warns of LLaMA-Factory's refusal of a config without a model or a dataset to train on.
    what_if: why the plan is for elsewhere (:func:`what_if_reason`); then a model, adapter, DeepSpeed
    JSON or checkpoint path that is not on this machine is a warning naming it, not a problem.
    """
    out = dict(values)
    problems: list[str] = []
    # a plan of a config that lacks its model or dataset still shows the rest; the trainer refuses it
    warnings: list[str] = [] if strict else [f"{rule.name}: {rule}" for rule in missing_refusals(values)]

    def missing(key: str, message: str) -> None:
        if what_if is None:
            problems.append(message)
        else:
            warnings.append(f"{message} on this machine: planned anyway, as {what_if}; `train` here would refuse it")

    for key in PATH_KEYS:
        v = out.get(key)
        if not isinstance(v, str) or not v:
            continue
        if key == "dataset_dir" and (v == "ONLINE" or v.startswith("REMOTE:")):
            continue  # llamafactory's markers for hub datasets, not folders
        absolute = _path_here(v, base_dir)
        if key in MAYBE_HUB_KEYS:
            out[key], gone = _model_or_adapter(key, v, base_dir)
            if gone is not None:
                missing(key, f"{key}: local path {gone} does not exist")
            continue
        if key == "deepspeed":
            if v.lstrip().startswith("{"):
                continue  # inline JSON
            if not absolute.exists():  # a FIFO or a device there is refused by load_deepspeed
                # a what-if reads the ZeRO stage from the file's name (plan.memory.setup.deepspeed_stage)
                missing(key, f"deepspeed: file {v} does not exist (resolved to {absolute})")
                continue
        if key == "resume_from_checkpoint" and not absolute.exists():
            missing(key, f"resume_from_checkpoint: {v} does not exist")
            continue
        out[key] = str(absolute.resolve()) if absolute.exists() else str(absolute)
    # dataset_info.json: llamafactory reads it from dataset_dir (default "data") unless ONLINE.
    if out.get("dataset") or out.get("eval_dataset"):
        ddir = out.get("dataset_dir", "data")
        if isinstance(ddir, str) and ddir != "ONLINE" and not ddir.startswith("REMOTE:"):
            ddir_abs = Path(ddir) if Path(ddir).is_absolute() else base_dir / ddir
            info = ddir_abs / "dataset_info.json"
            if not info.exists():  # a FIFO or a device there is refused by undefined_datasets
                msg = f"dataset_dir: {info} does not exist (needed for dataset {out.get('dataset')!r})"
                (problems if strict else warnings).append(msg)
            else:
                if not _saved_tokenized(out, base_dir):
                    problems += undefined_datasets(out, info)
                if "dataset_dir" not in out or out["dataset_dir"] != str(ddir_abs.resolve()):
                    out["dataset_dir"] = str(ddir_abs.resolve())
    return out, problems, warnings


def dataset_names(value: Any) -> list[str]:
    """``dataset`` / ``eval_dataset`` as llamafactory splits it (data_args.py: commas, stripped)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [item.strip() for item in value.split(",")]
    if isinstance(value, (list, tuple)):
        return [str(item).strip() for item in value]
    return [str(value)]


def _saved_tokenized(values: Mapping[str, Any], base_dir: Path) -> bool:
    """A saved ``tokenized_path`` is loaded instead of the named datasets (llamafactory data/loader.py)."""
    tp = values.get("tokenized_path")
    return isinstance(tp, str) and bool(tp) and (Path(tp) if Path(tp).is_absolute() else base_dir / tp).is_dir()


def undefined_datasets(values: Mapping[str, Any], info_path: Path) -> list[str]:
    """Names in ``dataset`` / ``eval_dataset`` that ``info_path`` (a dataset_info.json) does not define:
    llamafactory raises "Undefined dataset NAME in dataset_info.json" for each (data/parser.py), once the
    model has loaded. A hub dataset is named through dataset_dir ONLINE or a dataset_info.json entry
    with hf_hub_url / ms_hub_url, not by its id here."""
    try:
        info = json.loads(read_user_bytes(info_path, limit=JSON_LIMIT, what=str(info_path), error=ConfigError))
    except ConfigError as exc:  # not a regular file, too big: listed with the config's other problems
        return [f"dataset_dir: {exc.problems[0]} ({exc.hint})"]
    except (OSError, ValueError) as exc:
        return [f"dataset_dir: {info_path} cannot be read as JSON: {_one_line(exc)}"]
    if not isinstance(info, dict):
        return [f"dataset_dir: {info_path} must hold a JSON object of dataset names"]
    problems = []
    for key in ("dataset", "eval_dataset"):
        for name in dataset_names(values.get(key)):
            if name not in info:
                close = difflib.get_close_matches(name, [str(k) for k in info], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(
                    f"{key}: {name!r} is not defined in {info_path}{hint}; llamafactory would fail with "
                    f"'Undefined dataset {name} in dataset_info.json' (for a hub dataset id set dataset_dir: ONLINE)"
                )
    return problems


def training_problems(values: Mapping[str, Any]) -> list[str]:
    """What stops a config from training at all, for the commands that start a training run."""
    if "do_train" in values and values["do_train"] is not None and not truthy(values["do_train"]):
        return [
            f"key 'do_train' is {values['do_train']!r}: llamafactory would not train (only evaluate or "
            "predict), and this command starts a training run; set do_train: true"
        ]
    return []


def load_deepspeed(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """The DeepSpeed config named by ``deepspeed`` (a path or inline JSON), or None (none named, or a
    file that is not on this machine: resolve_paths has refused it, or warned of it in a what-if)."""
    v = values.get("deepspeed")
    if not v:
        return None
    if isinstance(v, dict):
        return v
    text = str(v)
    try:
        if text.lstrip().startswith("{"):
            return json.loads(text)
        return json.loads(read_user_bytes(text, limit=JSON_LIMIT, what=f"deepspeed: {text}", error=ConfigError))
    except (FileNotFoundError, NotADirectoryError):
        return None  # resolve_paths refused it, or warned (a what-if plan: the stage comes from the name)
    except (OSError, ValueError) as exc:  # bytes that are not UTF-8 are a ValueError too
        raise ConfigError(f"deepspeed: {text} is not a readable JSON file: {exc}") from None


def dump_yaml(values: Mapping[str, Any], header: Mapping[str, Any] | None = None) -> str:
    body = yaml.safe_dump(dict(values), sort_keys=False, default_flow_style=False, allow_unicode=True)
    if header is None:
        return body
    return HEADER_MARK + json.dumps(dict(header), sort_keys=True) + "\n" + body
