"""Adaptive speculation: how many draft tokens each request gets, and when to stop speculating.

Per request: an EWMA of its acceptance rate (accepted / drafted per verification, smoothing
0.15: one verification's rate swings between 0 and 1) sets k = ceil(ewma * max_k) in
[1, max_k]; a new request starts from the proposer's recent acceptance over all requests (1.0
before any verification), and a request's estimate drifts back toward that prior in each step
that does not verify it (`recovery`). After `miss_limit` verifications
in a row that accepted nothing, the request pauses speculation for `retry_after` steps, then
retries (one more miss pauses it again at once).

Per step: verification multiplies the target's work by (1 + k) per decode; at small batches
a step is overhead-bound and the extra queries are nearly free, at large ones they are not, and
proposing and verifying cost time per request besides. What a step costs is measured, not
modelled: per batch size (decodes in a step) the controller keeps the median wall time of the
latest decode-only steps with speculation and without (a median: one step stalled by a page
fault or another process must not switch speculation for long). What a step yields is
estimated per request: with acceptance a and k drafts, 1 + a + a^2 + ... + a^k tokens. A
step speculates when that yield over the speculative cost beats one token per decode over the
plain cost; a batch size not yet measured both ways is measured (speculation first, unless
it lost at the nearest smaller batch size measured both ways: a verification's extra rows cost
more in a larger batch, where the products are bound by arithmetic), and every
(`explore_every` x batch size)-th step at a batch size runs the other way (every
`plain_explore_factor` times that while speculation wins), to keep both costs fresh and to let
requests whose drafts started to pay show it. A hard cap remains: no
speculation when `num_decodes * (1 + max_k)` exceeds `max_verify_tokens`.
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass


@dataclass
class _RequestControl:
    ewma: float = 1.0  # optimistic start: the first verification uses max_k
    misses: int = 0  # verifications in a row with nothing accepted
    paused_steps: int = 0  # steps left without speculation


class AdaptiveController:
    def __init__(
        self,
        max_k: int,
        *,
        max_verify_tokens: int,
        smoothing: float = 0.15,
        miss_limit: int = 3,
        retry_after: int = 8,
        adaptive: bool = True,
        explore_every: int = 8,
        plain_explore_factor: int = 4,
        recovery: float = 0.1,
    ):
        if max_k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {max_k}")
        if max_verify_tokens < 1:
            raise ValueError(f"max_verify_tokens must be >= 1, got {max_verify_tokens}")
        self.max_k = max_k
        self.max_verify_tokens = max_verify_tokens
        self.smoothing = smoothing
        self.miss_limit = miss_limit
        self.retry_after = retry_after
        self.adaptive = adaptive
        self.explore_every = explore_every
        self.plain_explore_factor = plain_explore_factor
        self.recovery = recovery
        self.prior = 1.0  # acceptance EWMA over every request: where a new request starts
        # num_decodes -> ([plain], [speculative]) seconds of the latest decode-only steps
        self._costs: dict[int, tuple[deque[float], deque[float]]] = {}
        self._steps: dict[int, int] = {}  # num_decodes -> decisions taken at that batch size
        self._wins: dict[int, bool] = {}  # num_decodes -> whether speculation won its last comparison
        # Keyed by the Request object: state goes away with the request, nothing to clean up.
        self._control: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def batch_allows(self, decodes: list, num_tokens: list[int]) -> bool:
        """Whether this step's decodes (their requests, with the draft tokens `num_tokens`
        gave each) speculate; see the module docstring."""
        n = len(decodes)
        if not self.adaptive:
            return True
        if not self.batch_allows_at_most(n):
            return False
        plain, spec = (statistics.median(c) if c else None for c in self._costs.get(n, ((), ())))
        if spec is None or plain is None:
            smaller = [m for m in self._wins if m < n]
            if spec is None and smaller and not self._wins[max(smaller)]:
                self._drift_toward_prior(decodes)
                return False  # lost in a smaller batch: not worth a costly first measurement
            return spec is None  # measure speculation first, then plain decoding
        step = self._steps[n] = self._steps.get(n, 0) + 1
        expected = sum(map(self._expected_tokens, decodes, num_tokens))
        better = self._wins[n] = expected > n and expected / spec > n / plain
        # Exploring costs about a batch's worth of extra queries: rarer at larger batches, and
        # rarer while speculation wins: then it only refreshes the plain cost, which drifts
        # slowly, and each plain step gives up the tokens a verification would have yielded.
        # Speculation that loses is retried sooner: acceptance changes within a request, and
        # only a verification measures it.
        period = self.explore_every * n * (self.plain_explore_factor if better else 1)
        speculate = not better if step % period == 0 else better
        if not speculate:
            self._drift_toward_prior(decodes)
        return speculate

    def _drift_toward_prior(self, decodes: list) -> None:
        """Requests that go unverified this step: their acceptance estimates drift back toward
        the prior (their evidence ages). Without it, one unlucky verification could keep a
        request's estimate, and so speculation, down for many steps: an estimate pushed below
        the break-even gets no verification to correct it but the rare exploring steps."""
        for request in decodes:
            control = self._control.get(request)
            if control is not None:
                control.ewma += self.recovery * (self.prior - control.ewma)

    def batch_allows_at_most(self, num_decodes: int) -> bool:
        """The hard cap alone: `num_decodes` decodes with up to `max_k` drafts each fit."""
        return not self.adaptive or num_decodes * (1 + self.max_k) <= self.max_verify_tokens

    def observe_step(self, num_decodes: int, speculated: bool, seconds: float) -> None:
        """The wall time of a decode-only step (proposing included)."""
        if not self.adaptive or num_decodes == 0 or seconds <= 0:
            return
        costs = self._costs.setdefault(num_decodes, (deque(maxlen=8), deque(maxlen=8)))
        costs[speculated].append(seconds)

    def _expected_tokens(self, request, k: int) -> float:
        """Tokens a verification of k drafts appends: 1 + a + ... + a^k at acceptance a."""
        control = self._control.get(request)
        a = self.prior if control is None else control.ewma
        return sum(a**i for i in range(k + 1))

    def num_tokens(self, request) -> int:
        """Draft tokens for this request this step (0: not now). Counts down a pause."""
        if not self.adaptive:
            return self.max_k
        control = self._control.setdefault(request, _RequestControl(self.prior))
        if control.paused_steps > 0:
            control.paused_steps -= 1
            return 0
        return max(1, min(self.max_k, math.ceil(control.ewma * self.max_k)))

    def observe(self, request, num_draft: int, num_accepted: int) -> None:
        if not self.adaptive or num_draft == 0:
            return
        control = self._control.setdefault(request, _RequestControl(self.prior))
        rate = num_accepted / num_draft
        self.prior += 0.05 * (rate - self.prior)  # slower: a trend over many requests
        control.ewma = (1 - self.smoothing) * control.ewma + self.smoothing * rate
        if num_accepted:
            control.misses = 0
            return
        control.misses += 1
        if control.misses >= self.miss_limit:
            control.paused_steps = self.retry_after
            control.misses = self.miss_limit - 1
