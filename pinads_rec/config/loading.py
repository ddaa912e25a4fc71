"""YAML -> the schema's dataclasses: type checks on the way in, ``extends:`` resolved, ``--set``
overrides applied, then the semantic checks (``checks.validate``). Every error names the key's dotted
path; overrides use the same paths: ``--set model.dcn.num_layers=3 --set train.lr=0.01``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence

import yaml

from pinads_rec.config.checks import validate
from pinads_rec.config.schema import ExperimentConfig
from pinads_rec.config_base import ConfigError


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, List, Sequence):
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {str(k): _convert(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported config type {tp}")  # a bug in this module, not the user's


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or '<root>'}: expected a mapping, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"{where}: unknown key (valid keys here: {sorted(names)})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = f"{path}.{f.name}" if path else f.name
        if f.name in raw and "value_class" in f.metadata:
            kwargs[f.name] = _settings_map(raw[f.name], f.metadata["value_class"], sub)
        elif f.name in raw:
            kwargs[f.name] = _convert(raw[f.name], hints[f.name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub}: required key is missing")
    return cls(**kwargs)


def _settings_map(raw: Any, value_class: Any, path: str) -> Dict[str, Any]:
    """A map whose keys pick their values' classes (``value_class(key)``: a registered encoder's
    settings, ``SequenceEncoderConfig.settings``): each value built as that class."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(raw).__name__}")
    out = {}
    for key, value in raw.items():
        try:
            cls = value_class(str(key))
        except ConfigError as e:
            raise ConfigError(f"{path}.{key}: {e}") from None
        out[str(key)] = _build(cls, value, f"{path}.{key}")
    return out


def _yaml_problem(error: yaml.YAMLError) -> str:
    """yaml's error in one line: what is wrong and where (its own message spans several, with a caret)."""
    problem = getattr(error, "problem", None) or str(error).strip().splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def _set_override(raw: dict, assignment: str) -> None:
    """``a.b.c=value``. A list of named mappings is entered by an element's name or index:
    ``features.sequence_groups.pins.max_length=1000`` (or ``features.sequence_groups.0.max_length``)."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r}: expected key.path=value")
    key, text = assignment.split("=", 1)
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError as e:
        problem = _yaml_problem(e)
        raise ConfigError(f"override {key.strip()}: the value {text!r} is not valid YAML ({problem})") from None
    node = raw
    parts = key.strip().split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            nxt = node[_list_index(node, part, key, ".".join(parts[:i]))]
        else:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
        if not isinstance(nxt, (dict, list)):
            raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a mapping")
        node = nxt
    if isinstance(node, list):
        node[_list_index(node, parts[-1], key, ".".join(parts[:-1]))] = value
    else:
        node[parts[-1]] = value


def _list_index(items: list, part: str, key: str, where: str) -> int:
    """The index of ``part`` in a list: a number, or the name of one of its mappings."""
    if part.isdigit():
        if int(part) >= len(items):
            raise ConfigError(f"override {key}: {where} has {len(items)} elements, no index {part}")
        return int(part)
    names = [x.get("name") for x in items if isinstance(x, dict)]
    if part not in names:
        raise ConfigError(f"override {key}: {where} has no element named {part!r} (names: {names})")
    return names.index(part)


def _merge(base: Any, over: Any) -> Any:
    """``over`` on top of ``base``, mapping by mapping (lists and values replace)."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in over.items()}}
    return over


def from_dict(raw: Dict[str, Any], overrides: Sequence[str] = ()) -> ExperimentConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>: expected a mapping of sections, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)  # overrides must not write into the caller's dicts
    for assignment in overrides:
        _set_override(raw, assignment)
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("sequence_groups"), dict):
        # A group's encoder: its own keys over model.sequence's.
        shared = model.get("sequence") or {}
        model["sequence_groups"] = {
            g: _merge(shared, over) if isinstance(over, dict) else over for g, over in model["sequence_groups"].items()
        }
    cfg = _build(ExperimentConfig, raw, "")
    validate(cfg)
    return cfg


def read_yaml(path: str | Path, _seen: Sequence[Path] = ()) -> Dict[str, Any]:
    """A config file's mapping, with ``extends: <file>`` resolved: that file's mapping (a path
    relative to this file's directory; it may extend another) under this one's, mappings merged and
    lists and values replaced -- a config states only what differs from the one it extends."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a YAML file") from None
    except OSError as e:  # unreadable: permissions, a broken mount
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not text (a YAML file is)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(raw, dict) or "extends" not in raw:
        return raw
    raw = dict(raw)
    base = Path(raw.pop("extends"))
    base = base if base.is_absolute() else path.parent / base
    if base.resolve() in [p.resolve() for p in (*_seen, path)]:
        raise ConfigError(f"{path}: extends {base}, which extends it back")
    return _merge(read_yaml(base, (*_seen, path)), raw)


def load(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Load a YAML config (``extends:`` resolved: ``read_yaml``), apply ``key.path=value``
    overrides, validate; ConfigError names the key."""
    raw = read_yaml(path)
    try:
        return from_dict(raw, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_dict(cfg: ExperimentConfig) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def saved_as_today(saved: Dict[str, Any]) -> Dict[str, Any]:
    """A config a run or checkpoint saved, as today's code holds it: a key added since takes its
    default (not a difference); a key since removed or renamed leaves the dict as saved."""
    try:
        return to_dict(from_dict(saved))
    except ConfigError:
        return saved


# --------------------------------------------------------------------------------------------
# Overrides on a command line.
# --------------------------------------------------------------------------------------------

# `key.path=value` assignments separated by commas or whitespace; a comma inside a value (a YAML
# list such as [a,b]) is kept because a split only happens before another `key=`.
_OVERRIDE_SPLIT = re.compile(r"[,\s]+(?=[A-Za-z_][\w.\-]*=)")


def split_overrides(text: Optional[str]) -> List[str]:
    """Several overrides in one argument (as the TorchX components take them):
    ``"a.b=1, c=[x,y]"`` -> ``["a.b=1", "c=[x,y]"]``."""
    if not text or not text.strip():
        return []
    return [part for part in _OVERRIDE_SPLIT.split(text.strip().strip(",")) if part]


def add_overrides_flag(parser, help: str) -> None:
    """The commands' repeatable ``--set KEY=VALUE`` (into ``args.overrides``) on an argparse parser."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)
