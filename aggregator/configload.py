"""Loads the aggregator's YAML configuration into ``aggregator.config.Config``, or says what is wrong.

Every key has a default, so no file (or an empty one) is the default configuration. A file is
checked completely before the aggregator starts: an unknown key (a typo that would otherwise be
silently ignored), a value of the wrong type, a key given twice, or a number that is NaN or
infinite is a ``ConfigError`` naming the file, the key path (``health.probation_seconds``) and,
where YAML knows it, the line.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from agent.errors import ConfigError
from aggregator.config import Config, detectors_config

__all__ = ["configured", "load_config", "parse_config"]

# msgspec ends a ValidationError with "- at `$.health.probation_seconds`" (or "`key` in `$`").
_AT_PATH = re.compile(r"\s+-\s+at\s+`([^`]*)`(?:\s+in\s+`([^`]*)`)?$")


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice instead of keeping the last one silently."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key (a list as key): the generic path reports it
            continue
        if first is not None:
            raise _DuplicateKey(
                None,
                None,
                f"key {key!r} is given twice (first on line {first.start_mark.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _key_path(msgspec_path: str) -> str:
    """``$.health.probation_seconds`` -> ``health.probation_seconds``; ``$`` -> the top level."""
    path = msgspec_path.removeprefix("$").removeprefix(".")
    return path or "the top level"


def _explain(exc: msgspec.ValidationError) -> str:
    text = str(exc).replace("Object contains unknown field", "unknown key")
    match = _AT_PATH.search(text)
    if match is None:  # msgspec names no path for a problem at the top level
        return f"at the top level: {text}"
    what = text[: match.start()]
    if match.group(2) is not None:  # "Expected `str` - at `key` in `$.health`": the key itself
        return f"at {_key_path(match.group(2))}: keys must be strings ({what})"
    return f"at {_key_path(match.group(1))}: {what}"


def _non_finite(data: object, path: str = "") -> str | None:
    """The key path of the first NaN or infinite number (YAML's .nan and .inf), if any."""
    if isinstance(data, float) and not math.isfinite(data):
        return path or "the top level"
    if isinstance(data, dict):
        for key, value in data.items():
            found = _non_finite(value, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found = _non_finite(value, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def parse_config(text: str, source: str) -> Config:
    """Parse YAML ``text`` into a ``Config``; ``source`` names it in error messages."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds plain data only
    except _DuplicateKey as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else 0
        raise ConfigError(f"config file {source} line {line}: {exc.problem}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise ConfigError(f"config file {source}{where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {source}: not valid YAML: {exc}") from None
    if data is None:
        return Config()
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {source}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    bad = _non_finite(data)
    if bad is not None:
        raise ConfigError(f"config file {source}: at {bad}: must be a finite number, not NaN or infinity")
    detectors_config()  # the detectors: section's type, before msgspec resolves Config's fields
    try:
        return msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config file {source}: {_explain(exc)}") from None


def load_config(path: Path | None) -> Config:
    """The configuration in the YAML file at ``path``; the defaults when ``path`` is None."""
    if path is None:
        return Config()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    return parse_config(text, str(path))


def configured(path: Path | None, key: str) -> bool:
    """Whether the file at ``path`` (already loaded by ``load_config``) sets the dotted ``key``
    (``fleet.interval_seconds``) itself, rather than leaving it to its default."""
    if path is None:
        return False
    data: Any = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True
