"""Adaptive speculation: how many draft tokens each request gets, and when to stop speculating.

Per request: an EWMA of its acceptance rate (accepted / drafted per verification) sets
k = ceil(ewma * max_k) in [1, max_k]. After `miss_limit` verifications in a row that accepted
nothing, the request pauses speculation for `retry_after` steps, then retries (one more miss
pauses it again at once).

Per step: verification multiplies the target's work by (1 + k) per decode. At small batches a
decode step is overhead-bound, so the extra queries are nearly free; at large batches they are
not, and the rejected ones are pure loss. Speculation is therefore switched off for a step when
`num_decodes * (1 + max_k)` exceeds `max_verify_tokens`.
"""

from __future__ import annotations

import math
import weakref
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
        smoothing: float = 0.3,
        miss_limit: int = 3,
        retry_after: int = 8,
        adaptive: bool = True,
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
        # Keyed by the Request object: state goes away with the request, nothing to clean up.
        self._control: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def batch_allows(self, num_decodes: int) -> bool:
        return not self.adaptive or num_decodes * (1 + self.max_k) <= self.max_verify_tokens

    def num_tokens(self, request) -> int:
        """Draft tokens for this request this step (0: not now). Counts down a pause."""
        if not self.adaptive:
            return self.max_k
        control = self._control.setdefault(request, _RequestControl())
        if control.paused_steps > 0:
            control.paused_steps -= 1
            return 0
        return max(1, min(self.max_k, math.ceil(control.ewma * self.max_k)))

    def observe(self, request, num_draft: int, num_accepted: int) -> None:
        if not self.adaptive or num_draft == 0:
            return
        control = self._control.setdefault(request, _RequestControl())
        rate = num_accepted / num_draft
        control.ewma = (1 - self.smoothing) * control.ewma + self.smoothing * rate
        if num_accepted:
            control.misses = 0
            return
        control.misses += 1
        if control.misses >= self.miss_limit:
            control.paused_steps = self.retry_after
            control.misses = self.miss_limit - 1
