"""Answer retention, achieved ratio and latency of compressors on a QA file (nq_dev, hotpot).

Retention: a gold answer survives in the kept text, normalised as in "Lost in the Middle"
(lower case, no punctuation, no articles, white space collapsed; substring match). Latency per
call: *cold* with the method's embedding cache emptied before the call, *warm* the same call
again right after (its passages seen before, as in a corpus that repeats). Cold latency is taken
at the first factor (4x) of each example, the headline; the other factors run warm unless
`cold_every_factor` (the cascade's transformer work does not depend on the rate). Tokens are
counted with the served model's tokenizer (`--model`, default smollm2-135m-instruct), as the
gateway counts budgets.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ragspeed.compression.base import Compressor, Tokenizer
from ragspeed.compression.budget import Budget
from ragspeed.document import Document

FACTORS = (4, 8, 16, 32)
_PUNCT = set(string.punctuation)


@dataclass(frozen=True)
class EvalExample:
    id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[Document, ...]


def load_examples(path: str | Path, limit: int | None = None) -> list[EvalExample]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data: no file at {path}")
    examples: list[EvalExample] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(examples) >= limit:
                break
            row = json.loads(line)
            docs = tuple(
                Document(id=str(i), text=d.get("text", ""), title=d.get("title", "") or "")
                for i, d in enumerate(row["documents"])
            )
            examples.append(
                EvalExample(str(row.get("id", len(examples))), row["question"], tuple(row["answers"]), docs)
            )
    return examples


@dataclass
class _FactorTally:
    """One method at one factor, summed over the examples as they run."""

    hits: int = 0  # examples whose kept text still holds a gold answer
    ratios: list[float] = field(default_factory=list)
    cold: list[float] = field(default_factory=list)  # seconds per call
    warm: list[float] = field(default_factory=list)
    compressed: int = 0  # tokens kept
    original: int = 0  # document tokens before compression


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def answer_retained(text: str, answers: Sequence[str]) -> bool:
    norm = normalize_answer(text)
    return any(normalize_answer(a) in norm for a in answers if normalize_answer(a))


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def evaluate(
    examples: Sequence[EvalExample],
    compressors: Mapping[str, Compressor],
    tokenizer: Tokenizer,
    *,
    factors: Sequence[int] = FACTORS,
    cold_every_factor: bool = False,
) -> dict:
    """Per method and factor: retention, ratio, cold/warm latency. Returns a nested dict.

    Per example and method: caches cleared, a cold call at the first factor, the same call
    warm, then the other factors warm (their cold latency too with `cold_every_factor`, at the
    cost of a transformer pass each)."""
    results: dict = {}
    for name, compressor in compressors.items():
        clear = getattr(compressor, "clear_caches", None)
        stats = {f: _FactorTally() for f in factors}
        for ex in examples:
            for k, factor in enumerate(factors):
                s = stats[factor]
                if clear is not None and (k == 0 or cold_every_factor):
                    clear()
                    t = time.perf_counter()
                    result = compressor.compress(
                        ex.question, ex.documents, Budget(tokenizer, rate=1.0 / factor)
                    )
                    s.cold.append(time.perf_counter() - t)
                t = time.perf_counter()
                result = compressor.compress(ex.question, ex.documents, Budget(tokenizer, rate=1.0 / factor))
                s.warm.append(time.perf_counter() - t)
                if clear is None:  # nothing cached: every call is cold
                    s.cold.append(s.warm[-1])
                s.hits += answer_retained(result.text, ex.answers)
                s.ratios.append(result.ratio)
                s.compressed += result.num_compressed_tokens
                s.original += result.num_original_tokens
        per_factor = {}
        for factor, s in stats.items():
            per_factor[factor] = {
                "retention": s.hits / len(examples),
                "ratio": s.original / max(s.compressed, 1),  # pooled over examples
                "ratio_median": statistics.median(s.ratios),
                # Document tokens in the served model's tokenizer, summed over the examples.
                "original_tokens": s.original,
                "compressed_tokens": s.compressed,
                "latency_p50_ms": 1000 * _percentile(s.cold, 0.5),
                "latency_p95_ms": 1000 * _percentile(s.cold, 0.95),
                "latency_warm_p50_ms": 1000 * _percentile(s.warm, 0.5),
                "latency_warm_p95_ms": 1000 * _percentile(s.warm, 0.95),
            }
        results[name] = per_factor
    return results


def flatten(results: dict, default_method: str = "coarse-to-fine", fast_method: str = "fast") -> dict:
    """Flat JSON: `<method>_<metric>_<factor>x` for all, plus headline keys
    (`retention_4x`, `ratio_4x`, `latency_p50_ms`, `latency_warm_p50_ms` for the default method;
    `fast_retention_4x`, `fast_latency_p50_ms` for the fast one)."""
    flat: dict = {}
    for method, per_factor in results.items():
        for factor, m in per_factor.items():
            for key, value in m.items():
                if not math.isnan(value):
                    flat[f"{method}_{key}_{factor}x"] = round(value, 4)
    for prefix, method in (("", default_method), ("fast_", fast_method)):
        per_factor = results.get(method)
        if not per_factor:
            continue
        for factor, m in per_factor.items():
            flat[f"{prefix}retention_{factor}x"] = round(m["retention"], 4)
            flat[f"{prefix}ratio_{factor}x"] = round(m["ratio"], 4)
        head = per_factor.get(4) or next(iter(per_factor.values()))
        for key in ("latency_p50_ms", "latency_p95_ms", "latency_warm_p50_ms", "latency_warm_p95_ms"):
            flat[f"{prefix}{key}"] = round(head[key], 2)
    return flat


def format_table(results: dict) -> str:
    header = f"{'method':<16}{'rate':>6}{'retention':>10}{'ratio':>7}{'cold p50':>10}{'cold p95':>10}{'warm p50':>10}{'warm p95':>10}"
    lines = [header, "-" * len(header)]
    for method, per_factor in results.items():
        for factor, m in per_factor.items():
            cold = (
                ""
                if math.isnan(m["latency_p50_ms"])
                else f"{m['latency_p50_ms']:>8.1f}ms{m['latency_p95_ms']:>8.1f}ms"
            )
            lines.append(
                f"{method:<16}{str(factor) + 'x':>6}{m['retention']:>10.3f}{m['ratio']:>7.2f}{cold:>20}"
                f"{m['latency_warm_p50_ms']:>8.1f}ms{m['latency_warm_p95_ms']:>8.1f}ms"
            )
    return "\n".join(lines)
