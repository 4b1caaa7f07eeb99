"""The proposer protocol and the registry that maps `EngineConfig.speculative` to a proposer."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from engine.config import EngineConfig
from engine.protocol import EngineError


class Proposer(Protocol):
    name: str

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens to follow `token_ids` (prompt + output so far);
        [] when it has no guess (then the request decodes normally this step)."""
        ...


def _build_ngram(config: EngineConfig, engine) -> Proposer:
    from engine.spec_decode.ngram import NgramProposer

    return NgramProposer()


def _build_draft(config: EngineConfig, engine) -> Proposer:
    if not config.draft_model:
        raise EngineError(
            "speculative='draft' needs a draft model: pass --draft-model PATH", param="draft_model"
        )
    raise EngineError(
        "speculative='draft' (a draft-model proposer) is not implemented in the native engine yet;"
        " use --speculative ngram",
        param="speculative",
    )


# EngineConfig.speculative -> factory(config, engine) of its proposer.
PROPOSERS: dict[str, Callable[[EngineConfig, object], Proposer]] = {
    "ngram": _build_ngram,
    "draft": _build_draft,
}


def build_proposer(config: EngineConfig, engine) -> Proposer:
    factory = PROPOSERS.get(config.speculative)
    if factory is None:
        raise EngineError(
            f"unknown speculative method {config.speculative!r}; choose one of"
            f" {', '.join(PROPOSERS)}",
            param="speculative",
        )
    return factory(config, engine)
