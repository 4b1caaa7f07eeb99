"""Speculative decoding in the native engine: proposers, lossless verification, adaptivity.

Terms (used throughout the package):
- *draft tokens*: the k tokens a proposer guesses will follow a request's last token;
- *verification*: one target forward over `[last token, draft_1 .. draft_k]` (1 + k queries of
  the request, inside the step's flat batch) gives the target's distribution at k + 1 positions;
- *accepted tokens*: the longest prefix of the drafts the target agrees with (greedy: equal to
  its argmax; sampling: kept by the rejection sampler);
- *bonus token*: sampled from the target after ALL k drafts were accepted (position k + 1);
- *recovered token*: sampled from the residual distribution at the first rejected position;
  so every verification appends accepted + 1 tokens (1 <= appended <= k + 1);
- *acceptance rate*: accepted / drafted tokens; *mean accepted length*: accepted tokens per
  verification (without the bonus/recovered token).
Draft tokens never enter `all_token_ids` nor the prefix cache until accepted.
"""

from ragspeed.engine.native.core.spec_decode.controller import AdaptiveController
from ragspeed.engine.native.core.spec_decode.draft import DraftProposer
from ragspeed.engine.native.core.spec_decode.ngram import NgramProposer
from ragspeed.engine.native.core.spec_decode.proposer import (
    PerRequestProposer,
    Proposer,
    TargetParts,
    TokenProposer,
)
from ragspeed.engine.native.core.spec_decode.registry import PROPOSERS, build_proposer
from ragspeed.engine.native.core.spec_decode.rejection import verify_greedy, verify_sampled
from ragspeed.engine.native.core.spec_decode.speculator import Speculator, build_speculator
from ragspeed.engine.native.core.spec_decode.stats import SpecStats

__all__ = [
    "PROPOSERS",
    "AdaptiveController",
    "DraftProposer",
    "NgramProposer",
    "PerRequestProposer",
    "Proposer",
    "SpecStats",
    "Speculator",
    "TargetParts",
    "TokenProposer",
    "build_proposer",
    "build_speculator",
    "verify_greedy",
    "verify_sampled",
]
