"""The engine-side glue: propose drafts before a step, verify them after the forward pass.

`propose` sets `request.spec_token_ids` on running decode requests (the scheduler schedules
them as 1 + k query tokens when the budget and the pool allow, else drops them), asking the
proposer once for the whole batch; `verify` turns a request's 1 + k rows of logits into the
tokens to append, and feeds the controller and the counters; `release` (called by the
scheduler when a request finishes, aborts or is preempted) lets the proposer free its state.
"""

from __future__ import annotations

import torch

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.core.request import Request
from ragspeed.engine.native.core.spec_decode.controller import AdaptiveController
from ragspeed.engine.native.core.spec_decode.proposer import (
    Proposer,
    TargetParts,
    TokenProposer,
    as_batch_proposer,
)
from ragspeed.engine.native.core.spec_decode.registry import build_proposer
from ragspeed.engine.native.core.spec_decode.rejection import verify_greedy, verify_sampled
from ragspeed.engine.native.core.spec_decode.stats import SpecStats


class Speculator:
    def __init__(self, proposer: Proposer | TokenProposer, controller: AdaptiveController):
        self.proposer = proposer
        self.controller = controller
        self.stats = SpecStats()
        # The latest propose(): its decodes and whether they speculated, for observe_step().
        self._num_decodes = 0
        self._speculated = False
        self._setup_seconds = 0.0  # the proposer's one-time work in this step (not its cost)

    @property
    def proposer(self) -> Proposer:
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | TokenProposer) -> None:
        # A per-request proposer (prompt lookup, a test's oracle) is wrapped to serve batches.
        self._proposer = as_batch_proposer(proposer)

    def release(self, request: Request) -> None:
        self._proposer.release(request.request_id)

    def propose(self, running: list[Request], max_model_len: int, *, num_waiting: int = 0) -> None:
        decodes = [r for r in running if not r.prefill_only and r.num_tokens - r.num_computed_tokens == 1]
        if num_waiting or len(decodes) < len(running):
            # Prompts wait or are being prefilled: drafts would take the step's token budget
            # from them (decodes are scheduled first), delaying their first tokens.
            for request in decodes:
                request.spec_token_ids = []
            self._num_decodes = 0
            return
        # Every decode's k is asked for each step (that counts its pauses down), before the
        # step decides whether to speculate at all.
        wanted = [self.controller.num_tokens(r) for r in decodes]
        allowed = self.controller.batch_allows(decodes, wanted)
        within_cap = self.controller.batch_allows_at_most(len(decodes))
        self._num_decodes, self._speculated = len(decodes), allowed
        if decodes and not allowed:
            self.stats.num_steps_switched_off += 1
        batch: list[Request] = []
        num_tokens: list[int] = []
        for request, k in zip(decodes, wanted):
            request.spec_token_ids = []
            if request.sampling.processor is not None:
                # Its logits are processed (a grammar, penalties): drafts would be verified
                # against other distributions than it samples from, so it decodes plainly.
                continue
            # Seeded sampling must give the same text for the same seed, and verification
            # draws random numbers differently from plain sampling: such requests cannot follow
            # a switch that depends on measured times, only the hard cap.
            if not (allowed or (within_cap and _seeded_sampling(request))):
                continue
            # Appending accepted + 1 tokens must stay within max_tokens and the context.
            room = min(
                request.sampling.params.max_tokens - request.num_output_tokens - 1,
                max_model_len - request.num_tokens,
            )
            k = min(k, room)
            if k > 0:
                batch.append(request)
                num_tokens.append(k)
        if not allowed and batch:
            self._num_decodes = 0  # a mixed step measures neither way
        self._setup_seconds = 0.0
        if batch:
            for request, drafts in zip(batch, self._proposer.propose_batch(batch, num_tokens)):
                request.spec_token_ids = drafts
            self._setup_seconds = getattr(self._proposer, "setup_seconds", 0.0)

    def observe_step(self, seconds: float) -> None:
        """A step of decodes only (no prefill chunk) took `seconds`, proposing included. What
        the proposer spent on requests new to it (a draft's prefill of their prompts, an n-gram
        index of them) is a one-time cost, like a prefill, not what speculating costs a step:
        counted in, a new request's draft prefill would make that step look several times
        dearer than a speculative step is, and switch speculation off for the next steps."""
        self.controller.observe_step(self._num_decodes, self._speculated, seconds - self._setup_seconds)

    def verify(
        self,
        request: Request,
        draft_token_ids: tuple[int, ...],
        logits: torch.Tensor,
        generator: torch.Generator,
    ) -> list[int]:
        """logits [1 + k, vocab] -> the tokens to append (1 .. k + 1 of them)."""
        if request.sampling.params.greedy:
            tokens = verify_greedy(logits, draft_token_ids)
        else:
            tokens = verify_sampled(
                logits, draft_token_ids, request.sampling, request.sampling.generator or generator
            )
        num_accepted = len(tokens) - 1
        self.stats.record(len(draft_token_ids), num_accepted)
        self.controller.observe(request, len(draft_token_ids), num_accepted)
        return tokens

    def metrics(self) -> dict[str, float]:
        return self.stats.as_dict(self.proposer.name)


def _seeded_sampling(request: Request) -> bool:
    params = request.sampling.params
    return not params.greedy and params.seed is not None


def build_speculator(config: EngineConfig, target: TargetParts) -> Speculator | None:
    """None when speculation is off (the default)."""
    if config.speculative is None:
        return None
    proposer = build_proposer(config, target)
    k = config.num_speculative_tokens
    # A quarter of the step budget: 128 query tokens by default, batch 25 at k = 4. A small
    # model's step stays overhead-bound at such batches even with 1 + k queries per decode;
    # bigger models reach their compute knee sooner, and there the measured step costs
    # (controller.py) switch speculation off before this cap does. Requests whose drafts miss
    # lower their own k.
    controller = AdaptiveController(k, max_verify_tokens=max(1 + k, config.max_num_batched_tokens // 4))
    return Speculator(proposer, controller)
