"""Arms: named `ragspeed serve` configurations, read from YAML with line numbers for every error.

Two layouts are accepted:

    # baseline.yaml: one arm, named by the file's stem (or by a `name:` key)
    engine: transformers
    enable_prefix_caching: false

    # arms.yaml: several arms, one section each; `--arm arms.yaml` takes all of them,
    # `--arm arms.yaml:full` only the section `full`
    arms:
      baseline: {engine: transformers}
      full: {engine: native, quantization: int8, request: {ragspeed: {compression: {rate: 0.25}}}}

Keys are `gateway.settings.Settings` fields (dashes or underscores), plus `request`: a mapping
merged into every chat request body sent to that arm (per-request options the gateway controls,
such as `ragspeed.compression`). Everything is checked before any server starts or request is sent:
an unknown key or a bad value is an `ArmError` naming the file, the line and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ragspeed.gateway.protocol import ChatCompletionRequest
from ragspeed.gateway.settings import Settings

# The keys of an arm that are not Settings fields.
REQUEST_KEY = "request"
NAME_KEY = "name"
SECTIONS_KEY = "arms"


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


@dataclass(frozen=True)
class Arm:
    name: str
    source: str  # "FILE" or "FILE:SECTION", for messages
    settings: Mapping[str, Any]  # Settings keys for `ragspeed serve --config`
    request: Mapping[str, Any] = field(default_factory=dict)  # merged into every request body


def check_settings(doc: YamlDoc, values: dict[str, Any], prefix: tuple[str, ...] = ()) -> None:
    """Unknown Settings keys and bad values → ArmError with the file, line and key."""
    for key in values:
        if key not in Settings.model_fields:
            raise doc.error(prefix + (key,), "unknown option (not a `ragspeed serve` setting)")
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else next(iter(values), "?")
        raise doc.error(prefix + (key,), f"{err['msg']} (got {err.get('input')!r})") from exc
    from ragspeed.engine.backends import BACKENDS

    if settings.engine not in BACKENDS:
        raise doc.error(prefix + ("engine",),
                        f"unknown engine {settings.engine!r}; choose one of {', '.join(BACKENDS)}")


def check_request(doc: YamlDoc, request: Any, prefix: tuple[str, ...]) -> dict[str, Any]:
    """A per-request overlay must be a valid part of a chat request body."""
    if not isinstance(request, dict):
        raise doc.error(prefix, "must be a mapping of chat request fields")
    for key in request:
        if key not in ChatCompletionRequest.model_fields or key in ("messages", "stream"):
            raise doc.error(prefix + (key,), "unknown or reserved chat request field")
    try:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **request})
    except ValidationError as exc:
        loc = tuple(str(p) for p in exc.errors()[0]["loc"])
        # Pydantic puts union branch names in the path; keep the part that names keys of ours.
        keys = [p for p in loc if p in _all_keys(request)]
        raise doc.error(prefix + tuple(keys), exc.errors()[0]["msg"]) from exc
    return request


def _all_keys(value: Any) -> set[str]:
    if not isinstance(value, dict):
        return set()
    keys = set(value)
    for v in value.values():
        keys |= _all_keys(v)
    return keys


def _arm_from(doc: YamlDoc, name: str, values: Any, prefix: tuple[str, ...], source: str) -> Arm:
    if not isinstance(values, dict):
        raise doc.error(prefix or (name,), "an arm must be a mapping of settings")
    values = dict(values)
    request = check_request(doc, values.pop(REQUEST_KEY, {}) or {}, prefix + (REQUEST_KEY,))
    check_settings(doc, values, prefix)
    return Arm(name=name, source=source, settings=values, request=request)


def load_arms(spec: str) -> list[Arm]:
    """`FILE` (one arm, or every section under `arms:`) or `FILE:SECTION`."""
    path, _, section = spec.partition(":") if not Path(spec).is_file() else (spec, "", "")
    doc = read_yaml(path)
    if SECTIONS_KEY in doc.data:
        sections = doc.data[SECTIONS_KEY]
        if not isinstance(sections, dict) or not sections:
            raise doc.error((SECTIONS_KEY,), "must map arm names to settings")
        extra = sorted(set(doc.data) - {SECTIONS_KEY})
        if extra:
            raise doc.error((extra[0],), "unknown top-level key beside `arms`")
        names = [section] if section else list(sections)
        if section and section not in sections:
            raise ArmError(f"{path}: no arm section '{section}' (has {', '.join(sections)})")
        return [_arm_from(doc, str(n), sections[n], (SECTIONS_KEY, str(n)), f"{path}:{n}") for n in names]
    if section:
        raise ArmError(f"{path}: has no `arms:` sections, so '{section}' cannot be selected")
    values = dict(doc.data)
    name = str(values.pop(NAME_KEY, None) or Path(path).stem)
    return [_arm_from(doc, name, values, (), str(path))]


def load_all_arms(specs: list[str]) -> list[Arm]:
    """Every arm of every spec, in order; names must be unique."""
    arms: list[Arm] = []
    for spec in specs:
        arms.extend(load_arms(spec))
    seen: dict[str, str] = {}
    for arm in arms:
        if arm.name in seen:
            raise ArmError(f"two arms are named '{arm.name}' ({seen[arm.name]} and {arm.source}); "
                           "rename one with a `name:` key")
        seen[arm.name] = arm.source
    if len(arms) < 1:
        raise ArmError("give at least one --arm")
    return arms


def with_overrides(arms: list[Arm], assignments: list[str]) -> list[Arm]:
    """Apply `KEY=VALUE` settings (values parsed as YAML) to every arm, e.g. `model=bench-135m`."""
    if not assignments:
        return arms
    overrides: dict[str, Any] = {}
    for text in assignments:
        key, sep, value = text.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ArmError(f"--set {text!r}: expected KEY=VALUE")
        if key not in Settings.model_fields:
            raise ArmError(f"--set {text!r}: unknown option '{key}' (not a `ragspeed serve` setting)")
        overrides[key] = yaml.safe_load(value) if value.strip() else None
    out = []
    for arm in arms:
        settings = {**arm.settings, **overrides}
        try:
            Settings(**settings)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ArmError(f"--set {err['loc'][0] if err['loc'] else ''}: {err['msg']}") from exc
        out.append(Arm(arm.name, arm.source, settings, arm.request))
    return out
