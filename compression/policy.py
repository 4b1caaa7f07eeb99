"""When to compress, and what to do when compressing fails.

Break-even: compressing costs time before the prefill starts; it pays when the prefill time it
saves is larger:

    saved_s = (1 - rate) * num_document_tokens * prefill_s_per_token  >  compression_s

so below `break_even_tokens(...)` document tokens the documents go through untouched. The
default `min_document_tokens` (256) is a CPU's break-even with a margin: a ~135M-parameter
model prefills in a few ms per token and a coarse-to-fine compression at 4x takes a few hundred
ms cold (tens of ms warm, its embeddings cached), which puts the break-even near 160 document
tokens cold; the margin is there because a short context is also where compression risks the
most quality for the least gain. On a GPU (prefill near 0.1 ms per token) the break-even is
thousands of tokens: set it per deployment.

Fail open: a compressor error never fails the request. The uncompressed documents go through,
`PolicyOutcome.failed` is set, and the gateway counts it in a metric. Bad input
(`CompressionError`: a bad rate or target) is not a compressor failure: it is re-raised, a 400.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ragspeed.compression.base import (
    CompressedDocument,
    CompressionError,
    CompressionResult,
    Compressor,
    Document,
    Tokenizer,
    as_documents,
    count_tokens,
)
from ragspeed.compression.budget import Budget
from ragspeed.compression.sentences import split_sentences

logger = logging.getLogger(__name__)

DEFAULT_MIN_DOCUMENT_TOKENS = 256


def break_even_tokens(compression_s: float, prefill_s_per_token: float, rate: float) -> float:
    """Document tokens above which compressing at `rate` saves more prefill than it costs
    (an integer, or infinity when it never pays)."""
    if not 0 < rate <= 1:
        raise CompressionError(f"rate must be in (0, 1], got {rate!r}", "rate")
    if rate == 1 or prefill_s_per_token <= 0:
        return math.inf
    return math.ceil(compression_s / ((1 - rate) * prefill_s_per_token))


@dataclass(frozen=True)
class CompressionPolicy:
    min_document_tokens: int = DEFAULT_MIN_DOCUMENT_TOKENS
    fail_open: bool = True


@dataclass(frozen=True)
class PolicyOutcome:
    result: CompressionResult
    compressed: bool  # the compressor ran and its result is used
    skipped_reason: str | None = None  # "below_break_even" | "compressor_error" | None
    failed: bool = False  # the compressor raised; the uncompressed documents went through
    error: str | None = None


def passthrough(
    method: str, documents: Sequence[Document], tokenizer: Tokenizer, elapsed_s: float
) -> CompressionResult:
    docs = as_documents(documents)
    out = []
    for doc in docs:
        n = count_tokens(tokenizer, doc.text)
        units = tuple(split_sentences(doc.text))
        out.append(CompressedDocument(doc, units, tuple(range(len(units))), n, n))
    total = sum(d.num_original_tokens for d in out)
    return CompressionResult(method, tuple(out), total, total, elapsed_s, total)


def apply_policy(
    policy: CompressionPolicy,
    compressor: Compressor,
    question: str,
    documents: Sequence[Document],
    budget: Budget,
) -> PolicyOutcome:
    start = time.perf_counter()
    docs = as_documents(documents)
    tokenizer = budget.tokenizer
    num_tokens = sum(count_tokens(tokenizer, d.text) for d in docs)
    # Check the parameters even when we will not compress: a bad rate is a 400 either way.
    num_budget = budget.document_tokens(num_tokens)
    # A target that the documents already fit is no reason to compress either.
    if num_tokens < policy.min_document_tokens or (
        budget.target_tokens is not None and budget.rate is None and num_tokens <= num_budget
    ):
        return PolicyOutcome(
            passthrough(compressor.name, docs, tokenizer, time.perf_counter() - start),
            compressed=False,
            skipped_reason="below_break_even",
        )
    try:
        result = compressor.compress(question, docs, budget)
    except CompressionError:
        raise
    except Exception as exc:  # fail open: any compressor fault lets the documents through
        if not policy.fail_open:
            raise
        logger.exception("compressor %s failed; passing the documents through", compressor.name)
        return PolicyOutcome(
            passthrough(compressor.name, docs, tokenizer, time.perf_counter() - start),
            compressed=False,
            skipped_reason="compressor_error",
            failed=True,
            error=f"{type(exc).__name__}: {exc}",
        )
    return PolicyOutcome(result, compressed=True)
