"""Admission by expected time to first token: refuse at arrival what the load would make miss
its deadline.

A request is handed to its engine unless the work queued ahead of it is predicted to make its
first token miss its deadline (`ragspeed.deadline_ms`, else the server's `ttft_deadline_ms`);
then it is refused at once with 429 and a `Retry-After`, instead of queueing past the point
where its client gives up (and its prefill is wasted). 429 is for load only: a request's size
is never a reason for it (a size limit, `max_prompt_tokens`, is a 400 that names it).

The model is one first-come first-served server of prefill work, which is what the native
engine's scheduler is (continuous batching runs the decodes of requests past their first token
beside the prefills, in one token budget a step; batch requests yield to interactive ones):

- a request's *work* is its prompt tokens the engine does not hold yet (the engine's
  `estimate_new_tokens`, else the whole prompt);
- its *service time* is `a + b * work`: `a` a step's fixed cost, `b` seconds a token, both
  fitted by exponentially weighted least squares on the service times observed, where one is
  the time from the later of a request's admission and the previous first token to its own
  first token (so concurrent decodes, and everything else that slows prefill, are in the fit);
- the *work ahead* of a request (its *backlog*) is the service time of every admitted request
  still waiting for its first token, less the time already spent on the oldest of them. A
  request streaming its answer is not ahead: its decodes share each step with the prefills,
  and what they cost is in the fit and the correction.

Predicted TTFT = (time since arrival (preparation, compression) + backlog + own service time)
x *correction*, where the correction is a running estimate of the `CORRECTION_QUANTILE`
quantile of actual over uncorrected TTFT, learnt from every first token: what the model
misses (slots held by long decodes, steps slowed by other work) is measured, not guessed, and
an admitted request meets its deadline at that quantile. It starts cautious
(`CORRECTION_START`): a burst at start-up is judged before any first token came back. Its
*time alone* is the same prediction without the backlog: what it takes on an idle server.

The rule: a request is refused when its predicted TTFT passes both its deadline and its time
alone plus `MIN_WAIT_SHARE` of its deadline; that is, when the work ahead of it makes it late,
by more than a request that needs its whole deadline alone may still wait. So a lone request
on an idle server is always served, however long it takes; one that meets its deadline alone
is refused only when the work ahead pushes it past; one that misses it alone is served late
behind at most `MIN_WAIT_SHARE` of its deadline of other work, and refused (to retry once that
work is done: `Retry-After` is the work ahead past what it tolerates) behind more, so that of a
burst of such requests the first is served and the rest refused, not all.

At arrival, before any preparation (compression, tokenization), the request's own work is not
known yet: the check there counts the backlog and the service of the smallest of the last
`RECENT_WORK` admitted requests, so that a request of the usual size is refused before its
preparation (within a few milliseconds), and only one larger than that after it. That is
sound: the work ahead a request tolerates only shrinks as its own work grows, so one refused
sized at a lower bound of its work would be refused at its real size too. A request that
passed it is *preparing* until it is admitted or refused: the arrival checks after it count it
ahead too (at that smallest size), so that a burst whose preparations overlap is judged at
arrival, not one by one after each preparation, when the refusal comes late and the
preparation is wasted. An entry nobody admits or forgets (a client gone before its stream
started) leaves after `PREPARING_TTL_S`.

Before anything was observed the prediction is None, and the request is admitted; the app
times a few prefills at start-up (`calibrate`) so that the first burst is already judged.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ragspeed.engine.protocol import PRIORITY_BATCH, EngineClient, GenerationRequest, SamplingParams
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.limits import retry_after

_DECAY = 0.9  # weight of the fit's past against each new observation
CORRECTION_QUANTILE = 0.99  # the target is a p99: an admitted request meets its deadline 99 times in 100
# The correction's first value: cautious, for the burst judged before any first token came
# back (a start-up's timings are of an idle engine); it comes down as first tokens arrive.
CORRECTION_START = 2.0
_CORRECTION_STEP = 0.1  # log-step of the quantile estimate
_CORRECTION_BOUNDS = (0.5, 8.0)
# Of its deadline, the work ahead that a request may always wait behind: one that needs its
# whole deadline alone, or more, is still served behind this much (a request of the usual size
# is not held to it: it waits behind whatever still lets it meet its deadline).
MIN_WAIT_SHARE = 0.1
RECENT_WORK = 32  # admitted requests whose smallest work stands for an arrival's own
PREPARING_TTL_S = 30.0  # a preparing entry older than this is forgotten


@dataclass
class ServiceFit:
    """Exponentially weighted least squares of service seconds on work tokens: `a + b * x`."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        for name in ("weight", "sum_x", "sum_y", "sum_xx", "sum_xy"):
            setattr(self, name, getattr(self, name) * _DECAY)
        self.weight += 1.0
        self.sum_x += tokens
        self.sum_y += seconds
        self.sum_xx += tokens * tokens
        self.sum_xy += tokens * seconds

    @property
    def ready(self) -> bool:
        return self.weight > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b): seconds a request, seconds a token; both >= 0."""
        if not self.ready:
            raise ValueError("no service time observed yet")
        spread = self.weight * self.sum_xx - self.sum_x**2
        if spread > 1e-9 * max(1.0, self.weight * self.sum_xx):
            b = (self.weight * self.sum_xy - self.sum_x * self.sum_y) / spread
            a = (self.sum_y - b * self.sum_x) / self.weight
            if b > 0 and a >= 0:
                return a, b
        if self.sum_x > 0:  # one size of work seen, or a fit out of bounds: all of it per token
            return 0.0, self.sum_y / self.sum_x
        return self.sum_y / self.weight, 0.0

    def seconds(self, tokens: float) -> float:
        a, b = self.coefficients()
        return a + b * tokens


@dataclass
class QuantileTracker:
    """A running estimate of the `quantile` of a positive quantity: each observation above it
    raises it by `step * quantile` in log space, each one at or below lowers it by
    `step * (1 - quantile)`, so it settles where that share of observations lies below."""

    quantile: float = CORRECTION_QUANTILE
    value: float = 1.0
    step: float = _CORRECTION_STEP
    bounds: tuple[float, float] = _CORRECTION_BOUNDS

    def observe(self, x: float) -> None:
        up = x > self.value
        self.value *= math.exp(self.step * (self.quantile if up else self.quantile - 1))
        self.value = min(max(self.value, self.bounds[0]), self.bounds[1])


@dataclass(eq=False)
class Ticket:
    """One admitted request, until its first token (or its end)."""

    admission: TTFTAdmission
    tokens: int
    priority: int
    arrived_at: float
    admitted_at: float
    uncorrected_s: float | None  # the model's prediction from arrival, before the correction
    predicted_s: float | None  # what was compared with the deadline; None: no fit yet
    done: bool = False

    def first_token(self) -> None:
        self.admission._served(self)

    def release(self) -> None:
        """The request ended: with its first token (already counted) or without one."""
        self.admission._drop(self)


@dataclass
class TTFTAdmission:
    """The predictor and the ledger of admitted requests that wait for their first token.
    Lives on the event loop; `clock` (perf_counter seconds, as StageTimer) is injectable."""

    default_deadline_s: float | None
    clock: Callable[[], float] = time.perf_counter
    fit: ServiceFit = field(default_factory=ServiceFit)
    correction: QuantileTracker = field(default_factory=lambda: QuantileTracker(value=CORRECTION_START))
    _waiting: list[Ticket] = field(default_factory=list)  # admission order
    _recent_work: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_WORK))
    # arrival time -> (priority, a lower bound of its work where its preparation learnt one)
    _preparing: dict[float, tuple[int, int | None]] = field(default_factory=dict)
    _last_served: float = float("-inf")

    # ------------------------------------------------------------------ prediction

    def deadline_s(self, deadline_ms: float | None, priority: int) -> float | None:
        """A request's TTFT deadline: its own, else the server's for interactive requests;
        batch requests have none unless they ask."""
        if deadline_ms is not None:
            return deadline_ms / 1000
        return None if priority == PRIORITY_BATCH else self.default_deadline_s

    def backlog_s(self, priority: int) -> float:
        """Predicted seconds until the engine starts on a request of `priority` admitted now."""
        if not self.fit.ready:
            return 0.0
        ahead = [t for t in self._waiting if _ahead(t.priority, priority)]
        if not ahead:
            return 0.0
        total = sum(self.fit.seconds(t.tokens) for t in ahead)
        head = ahead[0]
        if head is not self._waiting[0]:
            return total  # a batch request is the one being served: no progress on these
        spent = self.clock() - max(head.admitted_at, self._last_served)
        return max(0.0, total - min(spent, self.fit.seconds(head.tokens)))

    def _uncorrected_s(self, tokens: int, priority: int, arrived_at: float) -> float | None:
        if not self.fit.ready:
            return None
        return (self.clock() - arrived_at) + self.backlog_s(priority) + self.fit.seconds(tokens)

    def _judge(self, deadline_s: float | None, alone_s: float, ahead_s: float, arrived_at: float) -> float:
        """The predicted TTFT of a request whose uncorrected time alone is `alone_s` behind
        `ahead_s` seconds of work; APIError 429 when that work makes it late (the rule of the
        module docstring): past its deadline and past its corrected time alone plus
        `MIN_WAIT_SHARE` of its deadline."""
        alone_s *= self.correction.value
        predicted = alone_s + ahead_s * self.correction.value
        if deadline_s is not None:
            tolerated = max(deadline_s, alone_s + MIN_WAIT_SHARE * deadline_s)
            if predicted > tolerated:
                raise self._refusal(predicted, deadline_s, alone_s, tolerated, arrived_at)
        return predicted

    def predict_s(self, tokens: int, priority: int, arrived_at: float) -> float | None:
        """Predicted TTFT from `arrived_at` of a request of `tokens` work admitted now."""
        uncorrected = self._uncorrected_s(tokens, priority, arrived_at)
        return None if uncorrected is None else uncorrected * self.correction.value

    # ------------------------------------------------------------------ admission

    def check_arrival(
        self,
        deadline_s: float | None,
        priority: int,
        arrived_at: float,
        tokens: int | None = None,
        stage_s: float = 0.0,
    ) -> None:
        """At arrival, before any preparation: refuse when the backlog and the requests that
        arrived before this one and are still in preparation make this one late (the rule of
        the module docstring); else this request is preparing until `admit` or `forget_arrival`.
        A request's service while it prepares: that of `tokens`, a lower bound of its work that
        its preparation learnt on the way (checked again before an expensive stage, whose
        expected `stage_s` seconds come first), else the smallest recent request's."""
        if deadline_s is not None and self.fit.ready:
            smallest = self.fit.seconds(min(self._recent_work)) if self._recent_work else 0.0
            preparing = sum(
                smallest if work is None else self.fit.seconds(work)
                for a, (p, work) in self._preparing_now().items()
                if a < arrived_at and _ahead(p, priority)
            )
            own = smallest if tokens is None else self.fit.seconds(tokens)
            elapsed = self.clock() - arrived_at + stage_s
            self._judge(deadline_s, elapsed + own, self.backlog_s(priority) + preparing, arrived_at)
        self._preparing[arrived_at] = (priority, tokens)

    def forget_arrival(self, arrived_at: float) -> None:
        """The request that arrived at `arrived_at` left before its admission (or has none)."""
        self._preparing.pop(arrived_at, None)

    def _preparing_now(self) -> dict[float, tuple[int, int | None]]:
        horizon = self.clock() - PREPARING_TTL_S
        for arrived_at in [a for a in self._preparing if a < horizon]:
            del self._preparing[arrived_at]
        return self._preparing

    def admit(self, tokens: int, priority: int, arrived_at: float, deadline_s: float | None) -> Ticket:
        """A ticket for a request of `tokens` work, or APIError 429 when the work ahead of it
        makes it late (the rule of the module docstring; `deadline_s` None: never refused).
        Requests still preparing are not ahead of it: they will be admitted after."""
        self.forget_arrival(arrived_at)
        uncorrected: float | None = None
        predicted: float | None = None
        if self.fit.ready:
            alone = (self.clock() - arrived_at) + self.fit.seconds(tokens)
            ahead = self.backlog_s(priority)
            uncorrected = alone + ahead
            predicted = self._judge(deadline_s, alone, ahead, arrived_at)
        self._recent_work.append(tokens)
        ticket = Ticket(self, tokens, priority, arrived_at, self.clock(), uncorrected, predicted)
        self._waiting.append(ticket)
        return ticket

    def _served(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        now = self.clock()
        self.fit.observe(ticket.tokens, now - max(ticket.admitted_at, self._last_served))
        if ticket.uncorrected_s:
            self.correction.observe((now - ticket.arrived_at) / ticket.uncorrected_s)
        self._last_served = now
        self._forget(ticket)

    def _drop(self, ticket: Ticket) -> None:
        if not ticket.done:
            self._forget(ticket)

    def _forget(self, ticket: Ticket) -> None:
        ticket.done = True
        self._waiting.remove(ticket)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def snapshot(self) -> dict[str, float]:
        """The model for /metrics: seconds a request, seconds a token (absent before any fit)
        and the correction."""
        if not self.fit.ready:
            return {"correction": self.correction.value}
        a, b = self.fit.coefficients()
        return {"step_seconds": a, "seconds_per_token": b, "correction": self.correction.value}

    def _refusal(
        self, predicted_s: float, deadline_s: float, alone_s: float, tolerated_s: float, arrived_at: float
    ) -> APIError:
        deadline = f"this request's deadline of {deadline_s:g} s (ragspeed.deadline_ms or ttft_deadline_ms)"
        if tolerated_s > deadline_s:  # it needs about its deadline alone: it is late for the work ahead
            deadline = f"{deadline}, and the {alone_s:.1f} s it would take on an idle server"
        return APIError(
            429,
            f"the server predicts a time to first token of {predicted_s:.1f} s, past {deadline}: "
            f"{predicted_s - alone_s:.1f} s of it is the work queued ahead; retry later",
            code="ttft_deadline",
            headers={
                # When enough of the work ahead is done for it to be admitted.
                "Retry-After": retry_after(predicted_s - tolerated_s),
                # The server's own time to this answer, for clients that time refusals.
                "x-ragspeed-refused-after-ms": f"{(self.clock() - arrived_at) * 1000:.3f}",
            },
        )

    # ------------------------------------------------------------------ start-up

    async def calibrate(self, engine: EngineClient, sizes: tuple[int, ...] = (16, 64, 384)) -> None:
        """Time prefills of `sizes` tokens (never cached: a salt of their own) and feed the fit,
        so that the first burst after start-up is judged too. The first size warms up."""
        vocab = len(engine.tokenizer)
        for index, size in enumerate(sizes):
            size = min(size, max(1, engine.max_model_len - 2))
            request = GenerationRequest(
                request_id=f"calibrate-{index}-{time.monotonic_ns()}",
                prompt_token_ids=tuple((17 + 7919 * i) % vocab for i in range(size)),
                sampling=SamplingParams(max_tokens=1, temperature=0.0),
                cache_salt=f"ragspeed-calibration-{time.monotonic_ns()}",
            )
            t0 = self.clock()
            async for _ in engine.generate(request):
                pass
            if index > 0:
                self.fit.observe(size, self.clock() - t0)


def _ahead(other: int, priority: int) -> bool:
    """Whether work of priority `other` is served before a request of `priority`: batch work
    yields to interactive work."""
    return priority == PRIORITY_BATCH or other != PRIORITY_BATCH


def estimate_new_tokens(engine: EngineClient, request: GenerationRequest) -> int:
    """The prompt tokens `engine` would compute for `request` (its own estimate where it has
    one: the native engine subtracts its cached prefix and stored documents)."""
    estimate: Any = getattr(engine, "estimate_new_tokens", None)
    return len(request.prompt_token_ids) if estimate is None else int(estimate(request))
