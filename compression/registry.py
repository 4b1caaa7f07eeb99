"""Compression methods by name: `build_compressor("coarse-to-fine", rate=...)`.

| method | what runs per request | use |
|---|---|---|
| coarse-to-fine (default) | static + BM25 over all units, MiniLM (int8) over a few candidate documents | quality |
| fast | static embeddings + BM25 only | latency-critical |
| llmlingua2 | LLMLingua-2 token classifier (needs `model_path`) | token-level contender |
| bm25 | BM25 over sentences | baseline |
| top-docs | coarse-to-fine's scores, whole documents kept | reusable KV (document cache) |
| first-docs | the first documents that fit | baseline |
| identity | nothing | control arm |

Options shared by the embedding methods: `cache` (an EmbeddingCache, to share one between
compressors) or `cache_size` (entries, default 100,000), `order` ("original" | "edges"),
`static_model_path`, `minilm_path`, `quantize` (int8 MiniLM, default True).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ragspeed.compression.base import CompressionError, Compressor
from ragspeed.compression.identity import IdentityCompressor
from ragspeed.compression.scoring.bm25 import BM25Scorer
from ragspeed.compression.scoring.embedding_cache import EmbeddingCache
from ragspeed.compression.scoring.position import PositionScorer
from ragspeed.compression.sentence_compressor import SentenceCompressor

DEFAULT_METHOD = "coarse-to-fine"
DEFAULT_CACHE_SIZE = 100_000


def _cache(options: dict[str, Any]) -> EmbeddingCache:
    cache = options.pop("cache", None)
    size = options.pop("cache_size", DEFAULT_CACHE_SIZE)
    return cache if cache is not None else EmbeddingCache(size)


def _static_scorer(options: dict[str, Any], cache: EmbeddingCache):
    from ragspeed.compression.scoring.static_bm25 import StaticBM25Scorer
    from ragspeed.compression.scoring.static_encoder import StaticEncoder

    encoder = options.pop("static_encoder", None) or StaticEncoder(
        options.pop("static_model_path", None), cache=cache
    )
    return StaticBM25Scorer(
        encoder,
        doc_weight=options.pop("static_doc_weight", 1.0),
        bm25_weight=options.pop("bm25_weight", 0.3),
    )


def _build_fast(options: dict[str, Any]) -> Compressor:
    cache = _cache(options)
    scorer = _static_scorer(options, cache)
    return SentenceCompressor("fast", scorer, order=options.pop("order", "original"))


def _cascade_scorer(options: dict[str, Any]):
    from ragspeed.compression.scoring.cascade import CascadeScorer
    from ragspeed.compression.scoring.minilm_encoder import MiniLMEncoder

    cache = _cache(options)
    cheap = _static_scorer(options, cache)
    fine = options.pop("minilm_encoder", None) or MiniLMEncoder(
        options.pop("minilm_path", None), quantize=options.pop("quantize", True), cache=cache
    )
    return CascadeScorer(
        cheap,
        fine,
        num_candidate_docs=options.pop("num_candidate_docs", 4),
        candidate_bm25_weight=options.pop("candidate_bm25_weight", 1.0),
        doc_weight=options.pop("doc_weight", 1.5),
        fine_bm25_weight=options.pop("fine_bm25_weight", 0.3),
    )


def _build_coarse_to_fine(options: dict[str, Any]) -> Compressor:
    scorer = _cascade_scorer(options)
    return SentenceCompressor("coarse-to-fine", scorer, order=options.pop("order", "original"))


def _build_top_docs(options: dict[str, Any]) -> Compressor:
    from ragspeed.compression.document_selector import DocumentSelector

    scorer = _cascade_scorer(options)
    return DocumentSelector("top-docs", scorer, order=options.pop("order", "original"))


def _build_llmlingua2(options: dict[str, Any]) -> Compressor:
    from ragspeed.compression.llmlingua2 import LLMLingua2Compressor

    return LLMLingua2Compressor(options.pop("model_path", None), device=options.pop("device", "cpu"))


def _build_bm25(options: dict[str, Any]) -> Compressor:
    return SentenceCompressor("bm25", BM25Scorer(), order=options.pop("order", "original"))


def _build_first_docs(options: dict[str, Any]) -> Compressor:
    return SentenceCompressor("first-docs", PositionScorer(), order="original")


def _build_identity(options: dict[str, Any]) -> Compressor:
    return IdentityCompressor()


COMPRESSORS: dict[str, Callable[[dict[str, Any]], Compressor]] = {
    "coarse-to-fine": _build_coarse_to_fine,
    "fast": _build_fast,
    "llmlingua2": _build_llmlingua2,
    "bm25": _build_bm25,
    "top-docs": _build_top_docs,
    "first-docs": _build_first_docs,
    "identity": _build_identity,
}

# What a server offers unless told otherwise: every method that needs no model of the caller's
# (llmlingua2 needs a local model folder).
OFFERED_METHODS: tuple[str, ...] = ("coarse-to-fine", "fast", "bm25", "top-docs", "first-docs", "identity")


# Options a caller may offer to any method (a shared embedding cache, the output order); a
# method that has no use for them ignores them.
_OFFERED_TO_ALL = ("cache", "order")


def build_compressor(method: str = DEFAULT_METHOD, **options: Any) -> Compressor:
    """A compressor by name. Unknown methods and unknown options are errors naming them."""
    factory = COMPRESSORS.get(method)
    if factory is None:
        raise CompressionError(
            f"unknown compression method {method!r}; known: {sorted(COMPRESSORS)}", "method"
        )
    compressor = factory(options)  # factories pop what they use
    for offered in _OFFERED_TO_ALL:
        options.pop(offered, None)
    if options:
        raise CompressionError(f"unknown options for {method!r}: {sorted(options)}", "options")
    return compressor
