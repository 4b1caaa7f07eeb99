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

Keys are `ragspeed serve` options by their flat names (`gateway.settings.OPTIONS`; dashes or
underscores), plus `request`: a mapping merged into every chat request body sent to that arm
(per-request options the gateway controls, such as `ragspeed.compression`). Everything is
checked before any server starts or request is sent: an unknown key or a bad value is an
`ArmError` naming the file, the line and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ragspeed.gateway.protocol import ChatCompletionRequest
from ragspeed.gateway.settings import OPTIONS, Settings, option_path
from ragspeed.gateway.yaml_settings import ArmError, YamlDoc, check_settings, read_yaml

# The keys of an arm that are not Settings fields.
REQUEST_KEY = "request"
NAME_KEY = "name"
SECTIONS_KEY = "arms"


@dataclass(frozen=True)
class Arm:
    name: str
    source: str  # "FILE" or "FILE:SECTION", for messages
    settings: Mapping[str, Any]  # Settings keys for `ragspeed serve --config`
    request: Mapping[str, Any] = field(default_factory=dict)  # merged into every request body


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
            raise ArmError(
                f"two arms are named '{arm.name}' ({seen[arm.name]} and {arm.source}); "
                "rename one with a `name:` key"
            )
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
        if key not in OPTIONS:
            raise ArmError(f"--set {text!r}: unknown option '{key}' (not a `ragspeed serve` setting)")
        overrides[key] = yaml.safe_load(value) if value.strip() else None
    out = []
    for arm in arms:
        settings = {**arm.settings, **overrides}
        try:
            Settings(**settings)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ArmError(f"--set {option_path(err['loc'])[0] if err['loc'] else ''}: {err['msg']}") from exc
        out.append(Arm(arm.name, arm.source, settings, arm.request))
    return out
