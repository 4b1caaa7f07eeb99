"""The proposer protocols, and what a proposer may read of its target (`TargetParts`).

Two shapes of proposer:
- `Proposer` (what the `Speculator` calls): drafts for a whole batch of running decodes in one
  call (`propose_batch`), so a model-based proposer runs one flat forward per draft step for
  all of them; `release` frees what it keeps for a request (the draft model's KV blocks) when
  the request finishes, aborts or is preempted.
- `TokenProposer`: a stateless per-request guesser over token ids (a test's oracle). It serves
  through `PerRequestProposer`, which loops over the batch and keeps nothing.
Prompt lookup (ngram.py) is a `Proposer`: it keeps an n-gram index per request. The registry
(registry.py) maps `EngineConfig.speculative` to a proposer's factory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ragspeed.engine.native.core.model_runner import ModelRunner
from ragspeed.prompt_cache.manager import KVCacheManager


class TokenProposer(Protocol):
    name: str

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens to follow `token_ids` (prompt + output so far);
        [] when it has no guess (then the request decodes normally this step)."""
        ...


@runtime_checkable
class Proposer(Protocol):
    name: str

    def propose_batch(self, requests: Sequence, num_tokens: Sequence[int]) -> list[list[int]]:
        """Drafts for each running decode request (engine.native.core.request.Request), up to
        `num_tokens[i]` of them for `requests[i]`; [] where there is no guess."""
        ...

    def release(self, request_id: str) -> None:
        """The request left the running set (finished, aborted, preempted): drop its state.
        Unknown ids are ignored."""
        ...

    # Optional: `setup_seconds`, the time the latest `propose_batch` spent on one-time work
    # for requests new to it (the Speculator does not count it as the step's cost).


class PerRequestProposer:
    """A `TokenProposer` as a batch `Proposer`: one call per request, no state to release."""

    def __init__(self, proposer: TokenProposer):
        self.proposer = proposer
        self.name = proposer.name

    def propose_batch(self, requests: Sequence, num_tokens: Sequence[int]) -> list[list[int]]:
        return [self.proposer.propose(r.all_token_ids, k) for r, k in zip(requests, num_tokens)]

    def release(self, request_id: str) -> None:
        pass


@dataclass(frozen=True)
class TargetParts:
    """What a proposer may read of the target it drafts for."""

    runner: ModelRunner
    manager: KVCacheManager
    tokenizer: Any
    vocab_size: int
    max_model_len: int


def as_batch_proposer(proposer: Proposer | TokenProposer) -> Proposer:
    return proposer if isinstance(proposer, Proposer) else PerRequestProposer(proposer)
