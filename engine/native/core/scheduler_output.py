"""What one scheduler step hands the model runner: the chunks it computes.

A *chunk* is tokens of one request computed in the step: a contiguous span of its
`all_token_ids` (a prefill chunk, a decode, a decode with draft tokens), or, for an assembled
request (engine.native.core.document_kv), its fresh tokens at scattered positions. The step's flat batch
holds the decodes first, then the other chunks (engine.native.core.model_runner). This module sits below
both the scheduler that makes these and the runner that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from ragspeed.engine.native.core.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `start .. start + num_tokens` of a request's `all_token_ids`, computed this step;
    or, for a scattered chunk, the tokens at `positions` (ascending, the last prompt token last:
    an assembled request's fresh tokens)."""

    request: Request
    start: int
    num_tokens: int  # query tokens, draft tokens included
    block_table: tuple[int, ...]
    # Speculative decoding: draft tokens queried after the request's last token (a decode of
    # 1 + k queries, verified by engine.native.core.spec_decode); their KV is written but not committed.
    draft_token_ids: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()  # a scattered chunk's query positions

    @property
    def context_len(self) -> int:
        return self.positions[-1] + 1 if self.positions else self.start + self.num_tokens

    @property
    def num_real_tokens(self) -> int:
        """Query tokens that are in `all_token_ids` (all but the drafts)."""
        return self.num_tokens - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last token, so the step samples after it."""
        return (
            self.context_len - len(self.draft_token_ids) == self.request.num_tokens
            and not self.request.prefill_only
        )


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: tuple[ScheduledChunk, ...]  # chunks of one token, first in the flat batch
    prefills: tuple[ScheduledChunk, ...]  # chunks of several queries (decodes with drafts too)
    preempted: tuple[str, ...] = ()

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def num_prefill_tokens(self) -> int:
        """Query tokens of prefill chunks (a decode's drafts are decode tokens)."""
        return sum(c.num_tokens for c in self.prefills if not c.draft_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass(frozen=True)
class TokenSequence:
    """Token ids computed outside the scheduler (a draft's tokens and drafts so far, a quality
    window), as a chunk's request: the model runner reads only what this has of a `Request`
    (its tokens, `prefill_only`)."""

    all_token_ids: list[int]
    prefill_only: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def chunk(self, start: int, num_tokens: int, block_table: tuple[int, ...]) -> ScheduledChunk:
        """Tokens `start .. start + num_tokens` of this sequence, for a model runner."""
        return ScheduledChunk(cast("Request", self), start, num_tokens, block_table)
