"""What a compressor works to (`Budget`), and turning its `rate` / `target_tokens` into a
document-token budget, checking them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragspeed.compression.base import Tokenizer

DEFAULT_RATE = 0.25  # 4x when the caller gives neither a rate nor a target


def resolve_budget(
    num_document_tokens: int,
    *,
    rate: float | None,
    target_tokens: int | None,
    protected_tokens: int = 0,
    protected_document_tokens: int = 0,
) -> int:
    """Document tokens the compressor may keep.

    `rate` is a fraction of the document tokens; `target_tokens` is a budget for the whole
    prompt, of which `protected_tokens` are already spent. Documents the caller marked protected
    are kept whole: their `protected_document_tokens` come out of either budget. With both, the
    tighter one wins.
    Raises CompressionError naming the parameter for bad values.
    """
    from ragspeed.compression.base import CompressionError

    if isinstance(protected_tokens, bool) or not isinstance(protected_tokens, int) or protected_tokens < 0:
        raise CompressionError(
            f"protected_tokens must be an integer >= 0, got {protected_tokens!r}", "protected_tokens"
        )
    budgets: list[int] = []
    if rate is not None:
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or not 0 < rate <= 1
        ):
            raise CompressionError(f"rate must be in (0, 1], got {rate!r}", "rate")
        budgets.append(int(math.floor(rate * num_document_tokens)) - protected_document_tokens)
    if target_tokens is not None:
        if isinstance(target_tokens, bool) or not isinstance(target_tokens, int):
            raise CompressionError(
                f"target_tokens must be an integer, got {target_tokens!r}", "target_tokens"
            )
        num_protected = protected_tokens + protected_document_tokens
        if target_tokens < num_protected:
            raise CompressionError(
                f"target_tokens ({target_tokens}) is below the protected tokens ({num_protected})",
                "target_tokens",
            )
        budgets.append(target_tokens - num_protected)
    if not budgets:
        budgets.append(int(math.floor(DEFAULT_RATE * num_document_tokens)) - protected_document_tokens)
    return max(0, min(budgets))


@dataclass(frozen=True)
class Budget:
    """What a compressor works to: the target model's tokenizer, and how much to keep (`rate`
    of the document tokens, or `target_tokens` for the whole prompt, `protected_tokens` of which
    are already spent)."""

    tokenizer: Tokenizer
    rate: float | None = None
    target_tokens: int | None = None
    protected_tokens: int = 0

    def document_tokens(self, num_document_tokens: int, protected_document_tokens: int = 0) -> int:
        """`resolve_budget` for these documents."""
        return resolve_budget(
            num_document_tokens,
            rate=self.rate,
            target_tokens=self.target_tokens,
            protected_tokens=self.protected_tokens,
            protected_document_tokens=protected_document_tokens,
        )
