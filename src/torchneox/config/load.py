"""YAML files -> one merged mapping (GPT-NeoX's rules) -> a typed, validated NeoXConfig.

GPT-NeoX's rules: every file is a mapping of keys; hyphens in top-level keys read as
underscores; a key may be given by only one file. ``--set KEY=VALUE`` overrides win over the
files, and dotted keys reach into dicts (``optimizer.params.lr=3e-4``).
"""

from __future__ import annotations

import copy
import os
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from torchneox.base.errors import ConfigError, did_you_mean
from torchneox.config.checker import OVERRIDE
from torchneox.config.fields import Status
from torchneox.config.numbers import Mismatch as _Mismatch
from torchneox.config.numbers import to_float as _to_float
from torchneox.config.numbers import to_int as _to_int
from torchneox.config.schema import KEYS, NeoXConfig
from torchneox.config.validate import validate


@dataclass
class LoadedConfig:
    """A config with the memory of where each key came from."""

    config: NeoXConfig
    origin: dict[str, str] = field(default_factory=dict)
    """Top-level key (and dotted path of a nested override) -> the file or '--set' that gave it."""
    files: list[str] = field(default_factory=list)

    def given(self, name: str) -> bool:
        return name in self.origin

    def source(self, name: str) -> str:
        return self.origin.get(name, "defaults")


class _NeoXYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated inside one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            k = self.construct_object(key_node, deep=True)
            if k in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {k!r} appears twice in one mapping (first on line {seen[k] + 1})",
                    key_node.start_mark,
                )
            seen[k] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_NeoXYamlLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = e.problem or e.context or "invalid YAML"
        raise ConfigError(f"YAML syntax error: {problem}", source=where) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"YAML syntax error: {e}", source=source) from None


def read_file(path: str | Path) -> dict[str, Any]:
    """One config file as a mapping with normalised top-level keys."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("no such config file", source=source) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a config file", source=source) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file ({e})", source=source) from None
    data = parse_yaml(text, source)
    if data is None or data == {}:
        raise ConfigError(
            "the config file is empty (no keys); give it GPT-NeoX keys, or leave it out",
            source=source,
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"a config file must be a mapping of keys to values, not a {type(data).__name__}",
            source=source,
        )
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"key {raw_key!r} is not a name", source=source)
        name = raw_key.replace("-", "_")
        if name in out:
            raise ConfigError(
                f"given twice in this file (as {name!r} and with hyphens)", source=source, key=name
            )
        out[name] = value
    return out


def merge_files(paths: Sequence[str | Path]) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge files; a key given by two files is an error naming both."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path in paths:
        for name, value in read_file(path).items():
            if name in origin:
                raise ConfigError(
                    f"given in both {origin[name]} and {path}; keep it in one file "
                    f"(or use --set {name}=... to override)",
                    key=name,
                )
            values[name] = value
            origin[name] = str(path)
    return values, origin


def parse_override(spec: str) -> tuple[list[str], Any]:
    """'a.b=VALUE' -> (['a', 'b'], VALUE parsed as a YAML scalar or flow value)."""
    name, sep, text = spec.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"{spec!r} is not KEY=VALUE", source=OVERRIDE)
    path = [p.strip() for p in name.strip().split(".")]
    path[0] = path[0].replace("-", "_")
    if any(not p for p in path):
        raise ConfigError(f"{name!r} has an empty part", source=OVERRIDE)
    return path, parse_yaml(text, f"{OVERRIDE} {name}") if text.strip() else None


def apply_overrides(values: dict[str, Any], origin: dict[str, str], specs: Iterable[str]) -> None:
    for spec in specs:
        path, value = parse_override(spec)
        top = path[0]
        if len(path) == 1:
            values[top] = value
            origin[top] = OVERRIDE
            continue
        if top in KEYS and not _holds_mapping(KEYS[top].type):
            raise ConfigError(
                f"cannot set {'.'.join(path)}: {top} is not a mapping", source=OVERRIDE
            )
        node = values.get(top)
        if node is None:
            node = values[top] = {}
        elif not isinstance(node, dict):
            raise ConfigError(
                f"cannot set {'.'.join(path)}: {top} is a {type(node).__name__}, not a mapping",
                source=OVERRIDE,
            )
        else:
            node = values[top] = _deep_copy_dicts(node)
        for part in path[1:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(
                    f"cannot set {'.'.join(path)}: {part} is not a mapping", source=OVERRIDE
                )
            node = child
        node[path[-1]] = value
        origin.setdefault(top, OVERRIDE)
        origin[".".join(path)] = OVERRIDE


def _holds_mapping(tp: Any) -> bool:
    if typing.get_origin(tp) is dict:
        return True
    return any(
        _holds_mapping(a)
        for a in typing.get_args(tp)
        if typing.get_origin(tp) in (typing.Union, types.UnionType)
    )


def _deep_copy_dicts(node: dict) -> dict:
    return {k: _deep_copy_dicts(v) if isinstance(v, dict) else v for k, v in node.items()}


# ---------------------------------------------------------------------------- types


def describe_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (list, typing.List):  # noqa: UP006
        (item,) = typing.get_args(tp) or (Any,)
        return "a list" + ("" if item is Any else f" of {_plural(item)}")
    if origin in (dict, typing.Dict):  # noqa: UP006
        return "a mapping"
    if origin in (typing.Union, types.UnionType):
        options = [describe_type(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(options)
    return getattr(tp, "__name__", str(tp))


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(
        tp, describe_type(tp)
    )


def coerce(value: Any, tp: Any) -> Any:
    """``value`` converted to ``tp``, or _Mismatch. Strings like '1e-5' count as numbers."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except _Mismatch:
                continue
        raise _Mismatch
    if value is None:
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        return _to_int(value)
    if tp is float:
        return _to_float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise _Mismatch
    if origin is list:
        if not isinstance(value, list | tuple):
            raise _Mismatch
        (item,) = typing.get_args(tp) or (Any,)
        return [coerce(v, item) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return value
    raise AssertionError(f"unhandled config type {tp!r}")


def _literal_choices(tp: Any) -> tuple[str, ...]:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if typing.get_origin(arg) is Literal:
                return typing.get_args(arg)
    return ()


def convert(name: str, value: Any, source: str) -> Any:
    """Type-check one top-level key, with an error that shows what is allowed."""
    spec = KEYS[name]
    try:
        return coerce(value, spec.type)
    except _Mismatch:
        pass
    choices = _literal_choices(spec.type)
    if choices and isinstance(value, str):
        raise ConfigError(
            f"{value!r} is not one of {', '.join(map(str, choices))}{did_you_mean(value, choices)}",
            source=source,
            key=name,
        )
    quoted = ""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        quoted = f" (a string: write {value.strip()} without quotes)"
    raise ConfigError(
        f"expected {describe_type(spec.type)}, got {value!r}{quoted}", source=source, key=name
    )


# ---------------------------------------------------------------------------- build


def _is_unset(value: Any, default: Any) -> bool:
    return value == default or value is None or value is False or value in ({}, [])


def build(values: dict[str, Any], origin: dict[str, str]) -> NeoXConfig:
    config = NeoXConfig()
    refused: ConfigError | None = None
    for name, value in values.items():
        source = origin.get(name, OVERRIDE)
        if name not in KEYS:
            raise ConfigError(f"unknown key{did_you_mean(name, KEYS)}", source=source, key=name)
        converted = convert(name, value, source)
        spec = KEYS[name]
        if spec.info.status is Status.UNSUPPORTED and not _is_unset(converted, spec.default):
            refused = refused or ConfigError(spec.info.why, source=source, key=name)
        config.set(name, converted)
    if refused is not None:
        raise refused
    return config


def load_mapping(
    values: dict[str, Any], source: str, overrides: Iterable[str] = ()
) -> LoadedConfig:
    """A config given as a mapping (a converter's output, say) instead of files."""
    values = {k.replace("-", "_"): v for k, v in values.items()}
    origin = dict.fromkeys(values, source)
    apply_overrides(values, origin, overrides)
    config = build(values, origin)
    validate(config, origin)
    return LoadedConfig(config, origin, [source])


DATA_PATH_KEYS = tuple(
    f"{side}{split}_{label}data_paths"
    for side in ("", "pos_", "neg_")
    for split in ("train", "valid", "test")
    for label in ("", "label_")
) + tuple(f"{split}_reward_data_paths" for split in ("train", "valid", "test"))
PATH_KEYS = (
    "save",
    "load",
    "save_hf",
    "data_path",
    *DATA_PATH_KEYS,
    "vocab_file",
    "merge_file",
    "log_dir",
    "tensorboard_dir",
    "memory_profiling_path",
    "sample_input_file",
    "rollout_prompts",
    "reward_model",
    "sample_output_file",
    "eval_tasks_include_path",
    "hostfile",
)


def with_absolute_paths(loaded: LoadedConfig) -> LoadedConfig:
    """The same config with every file and folder it was given made absolute (relative to the
    current directory, which is what they meant): a checkpoint's config then works from any
    folder (generate, eval, convert to-hf with its tokenizer)."""

    def absolute(value: Any) -> Any:
        if isinstance(value, str) and value and "://" not in value:
            return os.path.abspath(os.path.expanduser(value))
        return value

    config = copy.deepcopy(loaded.config)
    for name in PATH_KEYS:
        if name in loaded.origin:
            value = config.get(name)
            config.set(
                name, [absolute(v) for v in value] if isinstance(value, list) else absolute(value)
            )
    return LoadedConfig(config, dict(loaded.origin), list(loaded.files))


def load_config(paths: Sequence[str | Path], overrides: Iterable[str] = ()) -> LoadedConfig:
    """Read, merge, override, type-check and validate. Raises ConfigError."""
    if not paths:
        raise ConfigError("no config file given")
    values, origin = merge_files(paths)
    apply_overrides(values, origin, overrides)
    config = build(values, origin)
    validate(config, origin)
    return LoadedConfig(config, origin, [str(p) for p in paths])
