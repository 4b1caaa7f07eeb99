"""The fidelity gate: which document-cache policy a server applies by default to a model.

Placing stored document KV (engine.native.core.document_kv) approximates attention: a placed document does
not see the documents before it. So a policy other than exact prefill is a model's default only
where it was measured to keep that model's answers (docs/architecture.md, contract 8). Terms, all against
*full prefill* (the same prompt with no document reuse), on the same questions:

- *identical*: the share of greedy answers whose token ids equal full prefill's;
- *top-1 agreement*: teacher-forced along full prefill's answer (each answer token fed in turn),
  the share of positions whose most likely next token is full prefill's;
- *KL*: the mean KL(full || policy) of those next-token distributions (nats), from the top 20.

A *measurement* (`FidelityResult`) is what `ragspeed bench fidelity` wrote for one model: one
`PolicyFigures` per repair policy. It is kept in a JSON file named by the model's *fidelity key*
(`fidelity_key`: a sha256 of the engine's fingerprint, engine.native.core.prefix_store, and of its prefill
path, which changes the arithmetic), beside the compiled kernels (`result_path`). Measuring
takes minutes on a 2-core CPU, too long for start-up: the server only reads the file.

The *choice* (`choose_default`): among the measured policies that pass `FIDELITY_GATE` and take
less than `max_ttft_ratio` (0.8) of full prefill's warm time to first token, the cheapest (lowest warm time to first token); none passing, or no measurement for this key: exact
prefill (no document reuse unless a request asks for it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ragspeed.engine.protocol import DocumentCacheOptions
from ragspeed.gateway.protocol import DocumentCacheIn, RagspeedOptions
from ragspeed.gateway.settings import EngineSettings

logger = logging.getLogger(__name__)

RESULT_VERSION = 1
EXACT = "exact"  # the name of full prefill among a measurement's policies


@dataclass(frozen=True)
class PolicyFigures:
    """One repair policy measured against full prefill (`name`: `reuse`, `sink@16`,
    `blend@15`, ...; `options`: its DocumentCacheOptions fields)."""

    name: str
    options: Mapping[str, Any]  # policy, num_tokens, ratio, glue
    num_questions: int
    identical: float  # share of greedy answers identical to full prefill's
    top1_agreement: float  # teacher-forced, over every position of full prefill's answers
    kl_mean: float  # nats, teacher-forced, mean over the same positions
    ttft_warm_ms: float  # median, documents stored and placed in another order
    ttft_cold_ms: float | None = None  # median, documents seen for the first time

    def document_cache_options(self) -> DocumentCacheOptions:
        return DocumentCacheOptions(**self.options)


@dataclass(frozen=True)
class FidelityGate:
    min_identical: float = 0.95
    min_top1_agreement: float = 0.99
    # A repair that saves less than this share of full prefill's warm TTFT is not worth any
    # approximation (blend@100 recomputes every token: faithful, and about as slow as exact).
    max_ttft_ratio: float = 0.8

    def failures(self, figures: PolicyFigures) -> list[str]:
        """What `figures` miss, in words; empty when they pass."""
        missed = []
        if figures.identical < self.min_identical:
            missed.append(f"identical answers {figures.identical:.1%} < {self.min_identical:.0%}")
        if figures.top1_agreement < self.min_top1_agreement:
            missed.append(f"top-1 agreement {figures.top1_agreement:.1%} < {self.min_top1_agreement:.0%}")
        return missed


# The documented threshold (docs/document-cache.md): nearly every answer as full prefill gives it.
FIDELITY_GATE = FidelityGate()


@dataclass(frozen=True)
class FidelityResult:
    """A `bench fidelity` measurement of one model (by its fidelity key)."""

    key: str
    model: str
    measured_at: str  # ISO date and time
    machine: str  # the CPU and its capabilities
    num_questions: int
    policies: tuple[PolicyFigures, ...]
    data: str = ""
    ttft_exact_ms: float | None = None  # full prefill's median TTFT in the same run
    version: int = RESULT_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> FidelityResult:
        """Raises ValueError (or KeyError, TypeError) for a record of another shape."""
        if record.get("version") != RESULT_VERSION:
            raise ValueError(f"fidelity result version {record.get('version')!r}, not {RESULT_VERSION}")
        policies = tuple(PolicyFigures(**p) for p in record["policies"])
        return cls(**{**record, "policies": policies})


def fidelity_key(fingerprint: Mapping[str, Any], prefill_path: str | None) -> str:
    """sha256 of what a fidelity measurement depends on: the model, tokenizer, KV layout and
    dtype, quantization (the engine fingerprint) and the prefill path's arithmetic."""
    payload = json.dumps({"fingerprint": fingerprint, "prefill": prefill_path}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def engine_fidelity_key(llm_engine: Any) -> str:
    """The fidelity key of a native `LLMEngine`."""
    from ragspeed.engine.native.core.prefix_store import engine_fingerprint

    weights = getattr(llm_engine, "weights", None) or {}
    return fidelity_key(engine_fingerprint(llm_engine), weights.get("prefill"))


def default_results_dir() -> Path:
    """Beside the compiled kernels (engine.native.compute.cpu_kernels.build.cache_dir), as the prefill probe's
    measurements are."""
    from ragspeed.engine.native.compute.cpu_kernels.build import cache_dir

    return cache_dir()


def result_path(key: str, directory: Path | None = None) -> Path:
    return (directory or default_results_dir()) / f"fidelity-{key[:32]}.json"


def write_result(result: FidelityResult, directory: Path | None = None) -> Path:
    """Write atomically (a reader never sees half a file); returns the path."""
    path = result_path(result.key, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
        json.dump(result.to_json(), out, indent=2)
    os.replace(out.name, path)
    return path


def read_result(key: str, directory: Path | None = None) -> FidelityResult | None:
    """The measurement for `key`; None when there is none, or it cannot be read (logged)."""
    path = result_path(key, directory)
    if not path.is_file():
        return None
    try:
        result = FidelityResult.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("fidelity result %s cannot be read (%s): ignored", path, exc)
        return None
    if result.key != key:
        logger.warning("fidelity result %s is for another model: ignored", path)
        return None
    return result


@dataclass(frozen=True)
class DocumentCacheDefault:
    """The document-cache policy of requests that do not ask, and why."""

    options: DocumentCacheOptions | None  # None: exact prefill
    policy: str  # the chosen policy's name, or EXACT
    reason: str
    figures: Mapping[str, Any] = field(default_factory=dict)  # the chosen policy's, or the best's

    def describe(self) -> str:
        return f"document cache default: {self.policy} ({self.reason})"

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "reason": self.reason, "figures": dict(self.figures)}


def _figures(p: PolicyFigures) -> dict[str, Any]:
    return {
        "policy": p.name,
        "num_questions": p.num_questions,
        "identical": round(p.identical, 4),
        "top1_agreement": round(p.top1_agreement, 4),
        "kl_mean": round(p.kl_mean, 4),
        "ttft_warm_ms": round(p.ttft_warm_ms, 1),
    }


def choose_default(result: FidelityResult | None, gate: FidelityGate = FIDELITY_GATE) -> DocumentCacheDefault:
    """The cheapest measured policy that passes `gate`; else exact prefill, with the reason."""
    if result is None:
        return DocumentCacheDefault(
            None, EXACT, "no fidelity measurement for this model: run `ragspeed bench fidelity`"
        )
    # A policy hardly faster than full prefill (a control that recomputes every token) never serves.
    exact_ms = result.ttft_exact_ms if result.ttft_exact_ms is not None else float("inf")
    candidates: Sequence[PolicyFigures] = sorted(
        (p for p in result.policies if p.name != EXACT and p.ttft_warm_ms < gate.max_ttft_ratio * exact_ms),
        key=lambda p: p.ttft_warm_ms,
    )
    passing = [p for p in candidates if not gate.failures(p)]
    if passing:
        chosen = passing[0]
        return DocumentCacheDefault(
            chosen.document_cache_options(),
            chosen.name,
            f"passes the fidelity gate on {chosen.num_questions} questions, measured {result.measured_at}",
            _figures(chosen),
        )
    if not candidates:
        return DocumentCacheDefault(None, EXACT, f"no repair policy measured ({result.measured_at})")
    best = max(candidates, key=lambda p: (p.identical, p.top1_agreement))
    return DocumentCacheDefault(
        None,
        EXACT,
        f"no repair policy passes the fidelity gate (measured {result.measured_at}; best {best.name}: "
        + "; ".join(gate.failures(best))
        + ")",
        _figures(best),
    )


def settings_default(options: EngineSettings, engine: Any) -> DocumentCacheDefault:
    """`server_default` for the server's document cache options and its main engine (an
    `EngineClient`; only the native one, `.engine`, reuses document KV)."""
    try:
        llm_engine = getattr(engine, "engine", None)
    except Exception:  # a backend whose engine is not there
        llm_engine = None
    return server_default(options.document_cache, options.document_cache_options(), llm_engine)


def server_default(
    mode: str, configured: DocumentCacheOptions, llm_engine: Any | None, directory: Path | None = None
) -> DocumentCacheDefault:
    """The server's default for `--document-cache` `mode` (auto, on, off): `configured` is the
    settings' policy (what `on` applies); `llm_engine` the native engine (None: a backend
    that does not reuse document KV). Logged: the start-up line says what was chosen and why."""
    if mode == "off":
        chosen = DocumentCacheDefault(None, EXACT, "--document-cache off")
    elif llm_engine is None or getattr(llm_engine, "documents", None) is None:
        chosen = DocumentCacheDefault(None, EXACT, "this engine does not reuse document KV")
    elif mode == "on":
        chosen = DocumentCacheDefault(configured, configured.policy, "--document-cache on: not gated")
    else:
        key = engine_fidelity_key(llm_engine)
        chosen = choose_default(read_result(key, directory))
        chosen = DocumentCacheDefault(
            chosen.options, chosen.policy, f"{chosen.reason}; fidelity key {key[:12]}", chosen.figures
        )
    logger.info(chosen.describe() + (f": {dict(chosen.figures)}" if chosen.figures else ""))
    return chosen


@dataclass(frozen=True)
class RequestDocumentCache:
    """The document KV reuse each request gets: its `ragspeed.document_cache` (a policy, true,
    or false: exact prefill) over the server's policy; absent, the server's `document_cache`
    decides, for documents that went uncompressed (after top-docs selection reuse lost 0.09 of
    accuracy against the selection alone): auto, the gate's choice for this model (`gated`:
    exact prefill unless a policy measured faithful); on, `configured`; off, exact prefill."""

    mode: str  # the document_cache option: auto, on or off
    configured: DocumentCacheOptions  # the document_cache_* options' policy
    gated: DocumentCacheDefault | None = None  # the server's default (`settings_default`)

    def document_cache(
        self, options: RagspeedOptions | None, *, compressed: bool = False
    ) -> DocumentCacheOptions | None:
        """The options of a request with these `ragspeed` options; None: exact prefill."""
        asked = options.document_cache if options is not None else None
        configured, gated = self.configured, self.gated
        default = {
            "on": configured,
            "auto": gated.options if gated is not None else None,
        }.get(self.mode)
        if asked is False or (asked is None and (default is None or compressed)):
            return None
        if asked is None:
            return default
        given = asked if isinstance(asked, DocumentCacheIn) else DocumentCacheIn()
        base = default or configured
        return DocumentCacheOptions(
            policy=given.policy or base.policy,
            num_tokens=base.num_tokens if given.tokens is None else given.tokens,
            ratio=base.ratio if given.ratio is None else given.ratio,
            glue=given.glue or base.glue,
        )
