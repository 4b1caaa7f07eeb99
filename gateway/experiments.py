"""Live A/B experiments in the gateway: weighted, sticky arm assignment and per-arm figures.

An experiment file (settings key `experiment: path.yaml`):

    name: compression-4x
    sticky_by: user          # user (the request's `user` field), api_key (hash of the bearer key) or none
    holdout: {share: 0.05}   # optional: a stable share of callers served with no treatment
    arms:
      control: {weight: 1, ragspeed: {compression: false}}
      compressed: {weight: 1, ragspeed: {compression: {rate: 0.25}}}
      int8: {weight: 1, engine: {quantization: int8}}   # this arm owns an engine of its own

Terms:

- *arm*: per-request options the gateway controls (`ragspeed`: the same object clients send;
  the arm's keys win over the client's) and optionally `engine`: settings options that, applied to
  the server's settings, build a second engine that serves only this arm.
- *sticky*: a caller's arm is a pure function of a hash of (experiment name, caller key), so the
  same caller always lands in the same arm while weights stay the same; callers with no key are
  assigned at random.
- *holdout*: a share of callers picked by a hash that does not depend on the experiment name, so
  the same callers are held out of every experiment; they get the server's plain defaults
  (compression off, the main engine) and are reported as the arm named `holdout`.
- *override*: the `x-ragspeed-arm` header names the arm (or `holdout`) for one request.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import deque
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from ragspeed.engine.protocol import EngineClient
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.limits import ASGIApp, Receive, Scope, Send, header
from ragspeed.gateway.protocol import ChatCompletionRequest, RagspeedOptions
from ragspeed.gateway.yaml_settings import ArmError, YamlDoc, check_settings, read_yaml

ARM_HEADER = "x-ragspeed-arm"
DEFAULT_ARM = "default"  # the arm of every request while no experiment runs
HOLDOUT_ARM = "holdout"
STICKY_BY = ("user", "api_key", "none")
_HOLDOUT_SALT = "ragspeed-holdout"
_ARM_KEYS = ("weight", "ragspeed", "engine")
_TOP_KEYS = ("name", "sticky_by", "holdout", "arms")
_WINDOW = 10_000  # latencies kept per arm for percentiles


@dataclass(frozen=True)
class ExperimentArm:
    name: str
    weight: float
    ragspeed: Mapping[str, Any] = field(default_factory=dict)  # overlay on the request's `ragspeed`
    engine: Mapping[str, Any] = field(default_factory=dict)  # Settings overrides; empty: main engine

    def apply(self, req: ChatCompletionRequest) -> ChatCompletionRequest:
        if not self.ragspeed:
            return req
        own = req.ragspeed.model_dump(exclude_unset=True) if req.ragspeed else {}
        options = RagspeedOptions.model_validate({**own, **self.ragspeed})
        return req.model_copy(update={"ragspeed": options})


@dataclass(frozen=True)
class ExperimentSpec:
    name: str
    arms: tuple[ExperimentArm, ...]
    sticky_by: str = "user"
    holdout_share: float = 0.0

    @property
    def arm_names(self) -> tuple[str, ...]:
        names = tuple(a.name for a in self.arms)
        return names + ((HOLDOUT_ARM,) if self.holdout_share > 0 else ())


HOLDOUT = ExperimentArm(HOLDOUT_ARM, 0.0, ragspeed={"compression": False})


def _number(
    doc: YamlDoc, path: tuple[str, ...], value: Any, *, low: float, high: float | None = None
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise doc.error(path, f"must be a number (got {value!r})")
    if value < low or (high is not None and value > high):
        raise doc.error(path, f"must lie in [{low}, {high if high is not None else 'inf'}] (got {value!r})")
    return float(value)


def load_experiment(path: str | Path, base_settings: Mapping[str, Any] | None = None) -> ExperimentSpec:
    """Read and check an experiment file; every problem is an ArmError naming file, line and key."""
    doc = read_yaml(path)
    data = doc.data
    for key in data:
        if key not in _TOP_KEYS:
            raise doc.error((key,), f"unknown key; expected one of {', '.join(_TOP_KEYS)}")
    name = data.get("name") or Path(path).stem
    if not isinstance(name, str):
        raise doc.error(("name",), "must be a string")
    sticky_by = data.get("sticky_by", "user")
    if sticky_by not in STICKY_BY:
        raise doc.error(("sticky_by",), f"must be one of {', '.join(STICKY_BY)} (got {sticky_by!r})")
    share = 0.0
    if data.get("holdout") is not None:
        holdout = data["holdout"]
        if not isinstance(holdout, dict) or set(holdout) - {"share"}:
            raise doc.error(("holdout",), "must be a mapping {share: 0..1}")
        share = _number(doc, ("holdout", "share"), holdout.get("share", 0.0), low=0.0, high=0.5)
    arms_data = data.get("arms")
    if not isinstance(arms_data, dict) or not arms_data:
        raise doc.error(("arms",), "must map arm names to {weight, ragspeed, engine}")
    arms = []
    for arm_name, spec in arms_data.items():
        where = ("arms", str(arm_name))
        if str(arm_name) == HOLDOUT_ARM:
            raise doc.error(where, f"'{HOLDOUT_ARM}' is reserved for the holdout")
        if not isinstance(spec, dict):
            raise doc.error(where, "must be a mapping {weight, ragspeed, engine}")
        for key in spec:
            if key not in _ARM_KEYS:
                raise doc.error(where + (key,), f"unknown key; expected one of {', '.join(_ARM_KEYS)}")
        weight = _number(doc, where + ("weight",), spec.get("weight", 1.0), low=0.0)
        ragspeed = spec.get("ragspeed") or {}
        try:
            RagspeedOptions.model_validate(ragspeed)
        except ValidationError as exc:
            loc = tuple(str(p) for p in exc.errors()[0]["loc"] if str(p) in _keys(ragspeed))
            raise doc.error(where + ("ragspeed",) + loc, exc.errors()[0]["msg"]) from exc
        engine = spec.get("engine") or {}
        if not isinstance(engine, dict):
            raise doc.error(where + ("engine",), "must be a mapping of Settings keys")
        if engine:
            check_settings(doc, {**(base_settings or {}), **engine}, where + ("engine",))
        arms.append(ExperimentArm(str(arm_name), weight, dict(ragspeed), dict(engine)))
    if not sum(a.weight for a in arms) > 0:
        raise doc.error(("arms",), "the arms' weights must sum to a positive number")
    return ExperimentSpec(name, tuple(arms), sticky_by, share)


def _keys(value: Any) -> set[str]:
    if not isinstance(value, dict):
        return set()
    return set(value) | {k for v in value.values() for k in _keys(v)}


def _unit_hash(salt: str, key: str) -> float:
    """A uniform number in [0, 1) from (salt, key): 60 bits of SHA-256."""
    digest = hashlib.sha256(f"{salt}\0{key}".encode()).hexdigest()
    return int(digest[:15], 16) / 16**15


# ---------------------------------------------------------------- request hints


@dataclass(frozen=True)
class ArmHints:
    """What the assignment needs from the HTTP request beyond the body."""

    override: str | None = None  # the x-ragspeed-arm header
    api_key_hash: str | None = None  # sha256 of the bearer key; the key itself is never kept


_current_hints: ContextVar[ArmHints] = ContextVar("ragspeed_arm_hints", default=ArmHints())  # noqa: B039 (frozen)


def current_hints() -> ArmHints:
    return _current_hints.get()


class ArmHintsMiddleware:
    """Reads the override header and the bearer key's hash into a context variable for the pipeline."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        override = header(scope, ARM_HEADER.encode())
        authorization = header(scope, b"authorization") or ""
        scheme, _, key = authorization.partition(" ")
        key_hash = (
            hashlib.sha256(key.strip().encode()).hexdigest()
            if scheme.lower() == "bearer" and key.strip()
            else None
        )
        token = _current_hints.set(ArmHints(override.strip() if override else None, key_hash))
        try:
            await self.app(scope, receive, send)
        finally:
            _current_hints.reset(token)


# ---------------------------------------------------------------- live state


class ArmFigures:
    """Counts and a window of recent latencies for one arm."""

    def __init__(self) -> None:
        self.assigned = 0
        self.completed = 0
        self.ttft_ms: deque[float] = deque(maxlen=_WINDOW)
        self.tpot_ms: deque[float] = deque(maxlen=_WINDOW)
        self.e2e_ms: deque[float] = deque(maxlen=_WINDOW)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"assigned": self.assigned, "completed": self.completed}
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            values = np.asarray(getattr(self, name), dtype=np.float64)
            out[name] = (
                {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 90, 99)}
                if values.size
                else None
            )
        return out


class LiveExperiment:
    """One running experiment: assigns arms and collects per-arm figures. Built in the lifespan."""

    def __init__(self, spec: ExperimentSpec, *, seed: int | None = None):
        self.spec = spec
        self.started_at = int(time.time())
        self._rng = random.Random(seed)
        self._arms = {a.name: a for a in spec.arms}
        if spec.holdout_share > 0:
            self._arms[HOLDOUT_ARM] = HOLDOUT
        self._figures = {name: ArmFigures() for name in self._arms}
        total = sum(a.weight for a in spec.arms)
        self._cumulative = []  # (upper bound in [0, 1], arm)
        acc = 0.0
        for arm in spec.arms:
            acc += arm.weight / total
            self._cumulative.append((acc, arm))

    def sticky_key(self, user: str | None, hints: ArmHints) -> str | None:
        by_user, by_key = user or None, (f"key:{hints.api_key_hash}" if hints.api_key_hash else None)
        if self.spec.sticky_by == "user":
            return by_user or by_key
        if self.spec.sticky_by == "api_key":
            return by_key or by_user
        return None

    def assign(self, user: str | None, hints: ArmHints) -> ExperimentArm:
        if hints.override is not None:
            arm = self._arms.get(hints.override)
            if arm is None:
                raise APIError(
                    400,
                    f"unknown arm '{hints.override}' in the {ARM_HEADER} header; "
                    f"experiment '{self.spec.name}' has {', '.join(self._arms)}",
                    param=ARM_HEADER,
                    code="unknown_arm",
                )
        else:
            key = self.sticky_key(user, hints)
            if self.spec.holdout_share > 0:
                u = _unit_hash(_HOLDOUT_SALT, key) if key is not None else self._rng.random()
                if u < self.spec.holdout_share:
                    self._figures[HOLDOUT_ARM].assigned += 1
                    return HOLDOUT
            u = _unit_hash(self.spec.name, key) if key is not None else self._rng.random()
            arm = next((a for bound, a in self._cumulative if u < bound), self._cumulative[-1][1])
        self._figures[arm.name].assigned += 1
        return arm

    def observe(self, arm: str, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> None:
        figures = self._figures.get(arm)
        if figures is None:
            return
        figures.completed += 1
        for values, seconds in (
            (figures.ttft_ms, ttft_s),
            (figures.tpot_ms, tpot_s),
            (figures.e2e_ms, e2e_s),
        ):
            if seconds is not None:
                values.append(seconds * 1000)

    def summary(self) -> dict[str, Any]:
        total = sum(a.weight for a in self.spec.arms)
        arms = {}
        for name, arm in self._arms.items():
            share = (
                (arm.weight / total) * (1 - self.spec.holdout_share)
                if name != HOLDOUT_ARM
                else self.spec.holdout_share
            )
            arms[name] = {
                "weight": arm.weight,
                "share": round(share, 6),
                "ragspeed": dict(arm.ragspeed),
                "engine": dict(arm.engine),
                **self._figures[name].summary(),
            }
        return {
            "name": self.spec.name,
            "object": "experiment",
            "sticky_by": self.spec.sticky_by,
            "holdout_share": self.spec.holdout_share,
            "started_at": self.started_at,
            "arms": arms,
        }


@dataclass(frozen=True)
class ArmEngines:
    """Which arm serves a request, and on which engine: the arm's own where it has one, else
    the server's (every request, while no experiment runs)."""

    engine: EngineClient  # the server's
    experiment: LiveExperiment | None = None
    arm_engines: Mapping[str, EngineClient] = field(default_factory=dict)  # arms with an engine

    def choose(self, req: ChatCompletionRequest) -> tuple[ChatCompletionRequest, str, EngineClient]:
        """The request as its arm serves it (the arm's per-request options win over the
        client's), the arm's name and its engine."""
        if self.experiment is None:
            return req, DEFAULT_ARM, self.engine
        arm = self.experiment.assign(req.user, current_hints())
        return arm.apply(req), arm.name, self.arm_engines.get(arm.name, self.engine)


def build_live_experiment(path: str | Path, base_settings: Mapping[str, Any]) -> LiveExperiment:
    """The lifespan's entry point; raises ArmError (a ValueError) for a bad file."""
    return LiveExperiment(load_experiment(path, base_settings))


__all__ = [
    "ARM_HEADER",
    "HOLDOUT_ARM",
    "ArmError",
    "ArmHints",
    "ArmHintsMiddleware",
    "ExperimentArm",
    "ExperimentSpec",
    "LiveExperiment",
    "build_live_experiment",
    "current_hints",
    "load_experiment",
]
