"""ragspeed compression: question-aware context compression under a token budget.

from ragspeed.compression import Budget, Document, build_compressor
compressor = build_compressor("coarse-to-fine")
result = compressor.compress(question, documents, Budget(tok, rate=0.25))
"""

from ragspeed.compression.base import (
    CompressedDocument,
    CompressionError,
    CompressionResult,
    Compressor,
    Document,
    Tokenizer,
    count_tokens,
)
from ragspeed.compression.budget import Budget

__all__ = [
    "Budget",
    "CompressedDocument",
    "CompressionError",
    "CompressionResult",
    "Compressor",
    "Document",
    "Tokenizer",
    "count_tokens",
]

from ragspeed.compression.policy import CompressionPolicy, PolicyOutcome, apply_policy, break_even_tokens  # noqa: E402
from ragspeed.compression.registry import COMPRESSORS, DEFAULT_METHOD, build_compressor  # noqa: E402

__all__ += [
    "COMPRESSORS",
    "DEFAULT_METHOD",
    "CompressionPolicy",
    "PolicyOutcome",
    "apply_policy",
    "break_even_tokens",
    "build_compressor",
]
