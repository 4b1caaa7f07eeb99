"""The registry that maps `EngineConfig.speculative` to a proposer (proposer.py's protocols)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.core.spec_decode.draft import build_draft_proposer
from ragspeed.engine.native.core.spec_decode.ngram import NgramProposer
from ragspeed.engine.native.core.spec_decode.proposer import Proposer, TargetParts
from ragspeed.engine.protocol import EngineError


def _build_ngram(config: EngineConfig, target: TargetParts) -> Proposer:
    return NgramProposer()


def _build_draft(config: EngineConfig, target: TargetParts) -> Proposer:
    from ragspeed.engine.native.loading.model_zoo import ZOO_DRAFTS

    draft = config.draft_model or ZOO_DRAFTS.get(config.model)
    if not draft:
        raise EngineError(
            f"speculative='draft' needs a draft model and none ships for {config.model!r}: train one"
            f" with `ragspeed train-draft --target {config.model} --out DIR`"
            " and pass --draft-model DIR",
            param="draft_model",
        )
    return build_draft_proposer(replace(config, draft_model=draft), target)


# EngineConfig.speculative -> factory(config, target) of its proposer.
PROPOSERS: dict[str, Callable[[EngineConfig, TargetParts], Proposer]] = {
    "ngram": _build_ngram,
    "draft": _build_draft,
}


def build_proposer(config: EngineConfig, target: TargetParts) -> Proposer:
    factory = PROPOSERS.get(config.speculative or "")
    if factory is None:
        raise EngineError(
            f"unknown speculative method {config.speculative!r}; choose one of {', '.join(PROPOSERS)}",
            param="speculative",
        )
    return factory(config, target)
