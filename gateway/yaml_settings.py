"""YAML settings files with a line number for every key, checked against `Settings`' options.

The live experiment file (gateway.experiments) and the offline A/B runner's arm files
(ragspeed.ab.arms) both read `ragspeed serve` settings from YAML; every problem is an `ArmError`
naming the file, the line and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ragspeed.gateway.settings import OPTIONS, Settings, option_path


class ArmError(ValueError):
    """An arm file that cannot be used; the message reads `FILE:LINE: key 'KEY': problem`."""


@dataclass(frozen=True)
class YamlDoc:
    """A parsed YAML mapping with the 1-based line of every key, by key path."""

    path: Path
    data: dict[str, Any]
    lines: Mapping[tuple[str, ...], int]

    def line(self, *key_path: str) -> int:
        # Fall back to the closest enclosing key that has a line.
        for n in range(len(key_path), 0, -1):
            if key_path[:n] in self.lines:
                return self.lines[key_path[:n]]
        return 1

    def error(self, key_path: tuple[str, ...], problem: str) -> ArmError:
        return ArmError(f"{self.path}:{self.line(*key_path)}: key '{'.'.join(key_path)}': {problem}")


def _key_lines(node: yaml.Node, prefix: tuple[str, ...], out: dict[tuple[str, ...], int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = str(key_node.value).replace("-", "_")
            out[prefix + (key,)] = key_node.start_mark.line + 1
            _key_lines(value_node, prefix + (key,), out)


def _normalise_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k).replace("-", "_"): _normalise_keys(v) for k, v in value.items()}
    return value


def read_yaml(path: str | Path) -> YamlDoc:
    """Read a YAML mapping; dashes in keys become underscores (as in CLI flags)."""
    path = Path(path)
    if not path.is_file():
        raise ArmError(f"{path}: file not found")
    text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise ArmError(f"{path}:{line}: not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ArmError(f"{path}:1: must hold a mapping of option names to values")
    lines: dict[tuple[str, ...], int] = {}
    if node is not None:
        _key_lines(node, (), lines)
    return YamlDoc(path, _normalise_keys(data), lines)


def check_settings(doc: YamlDoc, values: dict[str, Any], prefix: tuple[str, ...] = ()) -> None:
    """Unknown option names and bad values → ArmError with the file, line and key."""
    for key in values:
        if key not in OPTIONS:
            raise doc.error(prefix + (key,), "unknown option (not a `ragspeed serve` setting)")
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(option_path(err["loc"])[0]) if err["loc"] else next(iter(values), "?")
        raise doc.error(prefix + (key,), f"{err['msg']} (got {err.get('input')!r})") from exc
    from ragspeed.engine.backends import BACKENDS

    backend = settings.engine.backend
    if backend not in BACKENDS:
        raise doc.error(
            prefix + ("engine",), f"unknown engine {backend!r}; choose one of {', '.join(BACKENDS)}"
        )
