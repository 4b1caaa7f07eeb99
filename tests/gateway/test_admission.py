"""Admission by predicted time to first token: the service-time fit, the ledger, the rule (a
request is refused for the work ahead of it, never for its own size), and, in-process over the
fake engine, a request refused with 429 while another holds the engine. A real server over a
slow engine: test_admission_server.py."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from ragspeed.compression.sentence_compressor import SentenceCompressor
from ragspeed.engine.protocol import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from ragspeed.gateway.admission import (
    CORRECTION_START,
    MIN_WAIT_SHARE,
    PREPARING_TTL_S,
    QuantileTracker,
    ServiceFit,
    TTFTAdmission,
)
from ragspeed.gateway.errors import APIError
from tests.gateway.fake_engine import Reply, Stall
from tests.gateway.inprocess import fake_settings, metric, serve

FIXED = QuantileTracker(step=0.0)  # a correction that stays 1.0: the model's figures exactly


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_fit_recovers_a_step_cost_and_a_cost_per_token():
    fit = ServiceFit()
    for tokens in (10, 500, 100, 2000, 50):
        fit.observe(tokens, 0.04 + 0.002 * tokens)
    a, b = fit.coefficients()
    assert a == pytest.approx(0.04, rel=1e-6) and b == pytest.approx(0.002, rel=1e-6)
    assert fit.seconds(1000) == pytest.approx(2.04)


def test_one_size_of_work_is_all_cost_per_token_and_nothing_seen_is_no_fit():
    fit = ServiceFit()
    assert not fit.ready
    with pytest.raises(ValueError):
        fit.coefficients()
    fit.observe(100, 0.5)
    fit.observe(100, 0.7)
    a, b = fit.coefficients()
    assert a == 0.0 and b == pytest.approx((0.5 * 0.9 + 0.7) / (100 * 0.9 + 100))  # the newer weighs more


def test_the_fit_follows_the_recent_past():
    fit = ServiceFit()
    for _ in range(30):
        fit.observe(100, 0.1)
        fit.observe(400, 0.4)
    for _ in range(30):  # the engine got 3x slower (other work on the cores)
        fit.observe(100, 0.3)
        fit.observe(400, 1.2)
    assert fit.coefficients()[1] == pytest.approx(0.003, rel=0.05)


def served(admission: TTFTAdmission, clock: Clock, tokens: int, seconds: float) -> None:
    ticket = admission.admit(tokens, PRIORITY_INTERACTIVE, clock.now, None)
    clock.now += seconds
    ticket.first_token()
    ticket.release()


def test_nothing_observed_admits_without_a_prediction():
    admission = TTFTAdmission(1.0, clock=Clock())
    ticket = admission.admit(10_000, PRIORITY_INTERACTIVE, 0.0, 1.0)
    assert ticket.predicted_s is None
    admission.check_arrival(1.0, PRIORITY_INTERACTIVE, 0.0)


def test_requests_ahead_are_counted_and_one_past_its_deadline_is_refused():
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock, correction=FIXED)
    served(admission, clock, 100, 0.2)
    served(admission, clock, 1000, 2.0)  # 2 ms a token
    first = admission.admit(1000, PRIORITY_INTERACTIVE, clock.now, 10.0)
    assert first.predicted_s == pytest.approx(2.0)
    for _ in range(3):
        admission.admit(1000, PRIORITY_INTERACTIVE, clock.now, 10.0)
    assert admission.backlog_s(PRIORITY_INTERACTIVE) == pytest.approx(8.0)
    arrived = clock.now - 0.5  # half a second of preparation already spent
    with pytest.raises(APIError) as refused:
        admission.admit(1000, PRIORITY_INTERACTIVE, arrived, 10.0)  # 0.5 + 8 + 2 > 10
    assert refused.value.status_code == 429 and refused.value.code == "ttft_deadline"
    assert refused.value.headers == {"Retry-After": "1", "x-ragspeed-refused-after-ms": "500.000"}
    assert refused.value.message == (
        "the server predicts a time to first token of 10.5 s, past this request's deadline of 10 s "
        "(ragspeed.deadline_ms or ttft_deadline_ms): 8.0 s of it is the work queued ahead; retry later"
    )
    assert admission.num_waiting == 4  # the refused one holds nothing
    clock.now += 1.5  # the engine worked on the oldest: 1.5 s of its 2 s are done
    assert admission.backlog_s(PRIORITY_INTERACTIVE) == pytest.approx(6.5)
    admission.admit(1000, PRIORITY_INTERACTIVE, clock.now, 10.0)


def test_a_request_is_never_refused_for_its_own_size():
    """On an idle server a request that alone takes 30 s is served against a 10 s deadline, at
    arrival (sized as the smallest recent request or by a lower bound of its work) and at
    admission; so is one behind at most a tenth of its deadline of work ahead."""
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock, correction=FIXED)
    served(admission, clock, 15_000, 30.0)  # 2 ms a token; the smallest recent request 30 s
    admission.check_arrival(10.0, PRIORITY_INTERACTIVE, clock.now)
    admission.check_arrival(10.0, PRIORITY_INTERACTIVE, clock.now, tokens=15_000, stage_s=2.0)
    ticket = admission.admit(15_000, PRIORITY_INTERACTIVE, clock.now - 1.0, 10.0)
    assert ticket.predicted_s == pytest.approx(31.0)
    clock.now += 30.0
    ticket.first_token()  # streaming now: its decodes are not ahead of the next one
    behind = admission.admit(10_000, PRIORITY_INTERACTIVE, clock.now, 10.0)  # 20 s alone
    assert behind.predicted_s == pytest.approx(20.0)
    clock.now += 19.2  # 0.8 s of its prefill left: ahead of the next, within a tenth of 10 s
    assert MIN_WAIT_SHARE == 0.1
    last = admission.admit(15_000, PRIORITY_INTERACTIVE, clock.now, 10.0)
    assert last.predicted_s == pytest.approx(30.8)


def test_a_large_request_behind_more_than_a_tenth_of_its_deadline_is_refused_for_load():
    """A burst of requests that each take 12 s alone against a 10 s deadline: the first is
    admitted; the next, 12 s behind it, is refused with a Retry-After of the work ahead past
    the tenth of its deadline it may wait; then one 0.9 s behind is admitted."""
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock, correction=FIXED)
    served(admission, clock, 6000, 12.0)  # 2 ms a token
    first = admission.admit(6000, PRIORITY_INTERACTIVE, clock.now, 10.0)
    assert first.predicted_s == pytest.approx(12.0)
    with pytest.raises(APIError) as refused:
        admission.check_arrival(10.0, PRIORITY_INTERACTIVE, clock.now)  # sized as the first
    assert refused.value.status_code == 429
    assert refused.value.headers["Retry-After"] == "11"  # 24 s, 13 s tolerated
    assert refused.value.message == (
        "the server predicts a time to first token of 24.0 s, past this request's deadline of 10 s "
        "(ragspeed.deadline_ms or ttft_deadline_ms), and the 12.0 s it would take on an idle "
        "server: 12.0 s of it is the work queued ahead; retry later"
    )
    with pytest.raises(APIError):
        admission.admit(6000, PRIORITY_INTERACTIVE, clock.now, 10.0)
    clock.now += 10.5
    with pytest.raises(APIError):
        admission.admit(6000, PRIORITY_INTERACTIVE, clock.now, 10.0)  # 1.5 s ahead: 13.5 s
    clock.now += 0.6
    admission.admit(6000, PRIORITY_INTERACTIVE, clock.now, 10.0)  # 0.9 s ahead: 12.9 s


def test_at_arrival_the_backlog_and_the_smallest_recent_request_are_counted():
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock, correction=FIXED)
    served(admission, clock, 1000, 2.0)  # 2 ms a token
    for _ in range(4):
        admission.admit(1000, PRIORITY_INTERACTIVE, clock.now, None)
    assert admission.backlog_s(PRIORITY_INTERACTIVE) == pytest.approx(8.0)
    # 8 s ahead and 2 s of its own, if it is as small as the smallest recent request.
    admission.check_arrival(10.0, PRIORITY_INTERACTIVE, clock.now)
    admission.forget_arrival(clock.now)  # (preparing requests are counted too: see below)
    with pytest.raises(APIError) as refused:
        admission.check_arrival(9.5, PRIORITY_INTERACTIVE, clock.now)
    assert "predicts a time to first token of 10.0 s" in refused.value.message
    assert refused.value.headers["Retry-After"] == "1"
    admission.check_arrival(None, PRIORITY_INTERACTIVE, clock.now)  # no deadline: nothing to miss
    admission.forget_arrival(clock.now)
    admission.admit(100, PRIORITY_INTERACTIVE, clock.now, None)  # a small one was admitted
    admission.check_arrival(9.5, PRIORITY_INTERACTIVE, clock.now)  # 8.2 s ahead, 0.2 s its own
    admission.forget_arrival(clock.now)
    for _ in range(2):
        admission.admit(1000, PRIORITY_INTERACTIVE, clock.now, None)
    with pytest.raises(APIError) as refused:
        admission.check_arrival(12.0, PRIORITY_INTERACTIVE, clock.now)  # 12.2 s ahead alone
    assert refused.value.headers["Retry-After"] == "1"


def test_requests_still_preparing_are_counted_at_arrival_until_admitted_or_forgotten():
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock, correction=FIXED)
    served(admission, clock, 1000, 2.0)  # 2 ms a token, 2 s a request of the smallest size
    arrivals = [clock.now + i * 0.001 for i in range(5)]
    for arrived_at in arrivals[:4]:  # 4 preparing at once, none admitted yet
        clock.now = arrived_at
        admission.check_arrival(10.0, PRIORITY_INTERACTIVE, arrived_at)
    clock.now = arrivals[4]
    with pytest.raises(APIError) as refused:  # 4 x 2 s preparing ahead, 2 s its own
        admission.check_arrival(9.9, PRIORITY_INTERACTIVE, arrivals[4])
    assert "predicts a time to first token of 10.0 s" in refused.value.message
    admission.check_arrival(10.0, PRIORITY_BATCH, arrivals[4])  # a batch one asks no deadline
    admission.forget_arrival(arrivals[4])
    admission.forget_arrival(arrivals[0])  # one failed its preparation
    ticket = admission.admit(1000, PRIORITY_INTERACTIVE, arrivals[1], None)  # now a ticket
    assert admission.num_waiting == 1
    admission.check_arrival(9.9, PRIORITY_INTERACTIVE, clock.now)  # 3 x 2 s ahead, 2 s its own
    clock.now += PREPARING_TTL_S + 1  # the entries nobody admitted or forgot expire
    ticket.release()  # its client left
    admission.check_arrival(2.0, PRIORITY_INTERACTIVE, clock.now)


def test_checked_again_with_its_own_work_only_earlier_arrivals_count_ahead():
    """Before compressing, the preparation knows a lower bound of the request's work: its own
    service is that work's, later arrivals count it by that work, requests still preparing that
    arrived after it are not ahead, and the stage it is about to run comes first."""
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock, correction=FIXED)
    served(admission, clock, 100, 0.2)  # 2 ms a token; the smallest recent request 0.2 s
    first, later = clock.now, clock.now + 0.001
    admission.check_arrival(10.0, PRIORITY_INTERACTIVE, first)
    clock.now = later
    admission.check_arrival(10.0, PRIORITY_INTERACTIVE, later)
    admission.check_arrival(10.0, PRIORITY_INTERACTIVE, first, tokens=4000)  # 8 s of its own
    with pytest.raises(APIError) as refused:
        admission.check_arrival(10.0, PRIORITY_INTERACTIVE, later, tokens=1100)  # 8 + 2.2 s
    assert "predicts a time to first token of 10.2 s" in refused.value.message
    admission.check_arrival(10.0, PRIORITY_INTERACTIVE, later, tokens=900)  # 8 + 1.8 s
    with pytest.raises(APIError):
        admission.check_arrival(10.0, PRIORITY_INTERACTIVE, later, tokens=900, stage_s=0.5)
    admission.check_arrival(10.0, PRIORITY_INTERACTIVE, later, tokens=900, stage_s=0.1)


def test_batch_requests_wait_behind_interactive_ones_and_have_no_deadline_by_default():
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock, correction=FIXED)
    served(admission, clock, 1000, 2.0)
    for _ in range(4):
        admission.admit(1000, PRIORITY_BATCH, clock.now, None)
    assert admission.deadline_s(None, PRIORITY_BATCH) is None
    assert admission.deadline_s(None, PRIORITY_INTERACTIVE) == 10.0
    assert admission.deadline_s(500, PRIORITY_BATCH) == 0.5
    assert admission.backlog_s(PRIORITY_INTERACTIVE) == 0.0  # batch work yields
    assert admission.backlog_s(PRIORITY_BATCH) == pytest.approx(8.0)
    interactive = admission.admit(1000, PRIORITY_INTERACTIVE, clock.now, 10.0)
    assert interactive.predicted_s == pytest.approx(2.0)
    clock.now += 1.0  # time spent on the batch request at the head is no progress on this one
    assert admission.backlog_s(PRIORITY_INTERACTIVE) == pytest.approx(2.0)
    assert admission.backlog_s(PRIORITY_BATCH) == pytest.approx(9.0)


def test_a_ticket_released_without_a_first_token_teaches_nothing():
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock, correction=FIXED)
    served(admission, clock, 1000, 2.0)
    before = admission.fit.coefficients()
    ticket = admission.admit(1000, PRIORITY_INTERACTIVE, clock.now, None)
    clock.now += 60.0
    ticket.release()
    ticket.release()  # twice is harmless
    assert admission.num_waiting == 0 and admission.fit.coefficients() == before


def test_service_time_counts_from_the_previous_first_token():
    """Two requests admitted at once: the second's service time starts at the first's token."""
    clock = Clock()
    admission = TTFTAdmission(None, clock=clock)
    one = admission.admit(500, PRIORITY_INTERACTIVE, clock.now, None)
    two = admission.admit(500, PRIORITY_INTERACTIVE, clock.now, None)
    clock.now += 1.0
    one.first_token()
    clock.now += 1.0
    two.first_token()
    assert admission.fit.coefficients() == (0.0, pytest.approx(0.002))


def test_the_correction_settles_at_its_quantile_of_actual_over_predicted():
    tracker = QuantileTracker(quantile=0.9, step=0.05)
    ratios = [1.0 + i / 100 for i in range(100)]  # uniform on [1, 2): the 90th percentile is 1.9
    rng = random.Random(0)
    for _ in range(4000):
        tracker.observe(rng.choice(ratios))
    assert tracker.value == pytest.approx(1.9, abs=0.06)


def test_ttfts_longer_than_predicted_raise_later_predictions():
    """The model predicts 3 s (1 s of preparation, 2 s of prefill) and every request takes
    4.5 s from arrival to first token (a slot held by decodes, say): from its cautious start
    the correction settles at 1.5."""
    clock = Clock()
    admission = TTFTAdmission(10.0, clock=clock)
    served(admission, clock, 1000, 2.0)
    start = admission.predict_s(1000, PRIORITY_INTERACTIVE, clock.now)
    assert start == pytest.approx(2.0 * CORRECTION_START, rel=0.01)
    for _ in range(200):
        arrived = clock.now
        clock.now += 1.0
        ticket = admission.admit(1000, PRIORITY_INTERACTIVE, arrived, None)
        assert ticket.uncorrected_s == pytest.approx(3.0)
        clock.now += 3.5
        ticket.first_token()
        admission.fit = ServiceFit()  # keep the model where it was: 2 s a request
        admission.fit.observe(1000, 2.0)
    assert admission.correction.value == pytest.approx(1.5, rel=0.1)
    assert admission.predict_s(1000, PRIORITY_INTERACTIVE, clock.now) == pytest.approx(3.0, rel=0.1)
    assert admission.snapshot()["correction"] == admission.correction.value


# ---------------------------------------------------------------------- in-process


@pytest.mark.anyio
async def test_a_request_that_would_miss_its_deadline_is_refused_at_once(fake):
    """One request takes 0.3 s to its first token (so the fit knows the engine), a second, with
    a long deadline of its own, is held in the engine; a third, whose predicted TTFT passes the
    0.4 s deadline, is refused with 429 and Retry-After without reaching the engine; with a long
    deadline it is admitted, and the response and /metrics carry the prediction."""
    async with serve(fake_settings(ttft_deadline_ms=400)) as client:
        first = Stall(at=0)
        held = Stall(at=0)
        fake.engine.script(Reply(stall=first), Reply(stall=held), Reply())
        body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 2}
        teacher = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        await first.reached.wait()
        await asyncio.sleep(0.3)
        first.release.set()
        taught = await teacher
        assert taught.status_code == 200 and taught.json()["ragspeed"]["predicted_ttft_ms"] is None
        patient_body = {**body, "ragspeed": {"deadline_ms": 60_000}}
        # 600 tokens: its prefill's predicted time does not run out while the test goes on.
        long_body = {**patient_body, "messages": [{"role": "user", "content": "sky " * 300}]}
        holder = asyncio.create_task(client.post("/v1/chat/completions", json=long_body))
        await held.reached.wait()
        refused = await client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "ttft_deadline"
        assert int(refused.headers["retry-after"]) >= 1
        assert len(fake.engine.requests) == 2
        patient = asyncio.create_task(client.post("/v1/chat/completions", json=patient_body))
        await asyncio.sleep(0.05)
        held.release.set()
        assert (await holder).status_code == 200
        admitted = await patient
        assert admitted.status_code == 200
        assert admitted.json()["ragspeed"]["predicted_ttft_ms"] > 400
        metrics = (await client.get("/metrics")).text
    assert metric(metrics, "ragspeed_ttft_refused_requests_total", stage="arrival") == 1.0
    assert metric(metrics, "ragspeed_ttft_refused_requests_total", stage="admission") is None
    assert metric(metrics, "ragspeed_time_to_first_token_predicted_seconds_count") == 2.0
    assert metric(metrics, "ragspeed_admission_seconds_per_token") > 0


@pytest.mark.anyio
async def test_deadline_and_priority_are_validated(fake):
    async with serve(fake_settings()) as client:
        for options, param in (({"deadline_ms": 0}, "deadline_ms"), ({"priority": "urgent"}, "priority")):
            response = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "ragspeed": options},
            )
            assert response.status_code == 400, options
            assert param in response.json()["error"]["message"] + str(response.json()["error"]["param"])
        batch = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "ragspeed": {"priority": "batch"}},
        )
    assert batch.status_code == 200
    assert fake.engine.requests[-1].priority == PRIORITY_BATCH


async def taught(client, fake) -> dict:
    """One request whose first token takes 0.3 s, so the admission knows the engine; the next
    reply is scripted plain. Returns the request's body."""
    first = Stall(at=0)
    fake.engine.script(Reply(stall=first), Reply())
    body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 2}
    teacher = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await first.reached.wait()
    await asyncio.sleep(0.3)
    first.release.set()
    assert (await teacher).status_code == 200
    return body


async def holding(client, fake, num_tokens: int) -> tuple[Stall, asyncio.Task]:
    """A request of about `num_tokens` prompt tokens held in the engine before its first token, with
    a long deadline of its own: work ahead of the requests that follow it."""
    stall = Stall(at=0)
    fake.engine.replies.appendleft(Reply(stall=stall))
    body = {
        "messages": [{"role": "user", "content": "sky " * (num_tokens // 2)}],
        "max_tokens": 2,
        "ragspeed": {"deadline_ms": 3_600_000},
    }
    task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await stall.reached.wait()
    return stall, task


async def corrected_seconds_per_token(client) -> float:
    """The admission's fitted seconds a token times its correction (its step cost is 0 after
    one request taught it), from /metrics."""
    metrics = (await client.get("/metrics")).text
    per_token = metric(metrics, "ragspeed_admission_seconds_per_token")
    assert metric(metrics, "ragspeed_admission_step_seconds") == 0.0 and per_token is not None
    return per_token * metric(metrics, "ragspeed_admission_correction")


LONG_DOCUMENTS = [
    " ".join(
        "sunlight scatters off nitrogen molecules in the upper atmosphere over the ocean".split()[
            (i + j) % 12
        ]
        for j in range(300)
    )
    for i in range(10)
]  # 6,500 tokens of the demo tokenizer


@pytest.mark.anyio
async def test_a_compressed_request_the_work_ahead_makes_late_is_refused_before_compressing(fake):
    """Behind a request of 600 tokens held in the engine, a request of ten long documents
    with a deadline of 1,000 tokens' time passes the check at arrival (sized as the smallest
    recent request: 600 + a few tokens' time) but not the one before compression, sized by the
    compressed documents' budget (over 3,000 tokens alone, 600 ahead of it, more than a tenth
    of its deadline): 429, and no document was compressed. Alone, it is served."""
    async with serve(fake_settings(ttft_deadline_ms=10_000)) as client:
        body = await taught(client, fake)
        held, holder = await holding(client, fake, 600)
        deadline_ms = 1_000 * await corrected_seconds_per_token(client) * 1000
        compressed = {
            **body,
            "documents": LONG_DOCUMENTS,
            "ragspeed": {"compression": {"method": "bm25", "rate": 0.5}, "deadline_ms": deadline_ms},
        }
        refused = await client.post("/v1/chat/completions", json=compressed)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "ttft_deadline"
        assert "it would take on an idle server" in refused.json()["error"]["message"]
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "ragspeed_document_tokens_total") is None  # nothing compressed
        assert metric(metrics, "ragspeed_ttft_refused_requests_total", stage="arrival") == 1.0
        assert len(fake.engine.requests) == 2
        held.release.set()
        assert (await holder).status_code == 200
        # Nothing ahead now: served, however long it takes alone.
        assert (await client.post("/v1/chat/completions", json=compressed)).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("fails", [False, True])
async def test_a_compressed_request_is_judged_again_only_when_it_sends_more_than_forecast(
    fake, monkeypatch, fails
):
    """A request with a deadline of 1 s is judged before its compression with nothing ahead;
    while it compresses, a request of 600 tokens is admitted and held in the engine, ahead of
    it. Compressed to its forecast, it is admitted without a second judgement (its prediction
    passes its deadline); when the compression fails open (the whole documents go in, more
    tokens than forecast), it is judged again at its real size: 429, at admission."""
    entered, proceed = threading.Event(), threading.Event()
    compress = SentenceCompressor.compress

    def held_compress(self, *args):
        entered.set()
        assert proceed.wait(30)
        if fails:
            raise RuntimeError("the compressor broke")
        return compress(self, *args)

    monkeypatch.setattr(SentenceCompressor, "compress", held_compress)
    async with serve(fake_settings(ttft_deadline_ms=10_000)) as client:
        body = await taught(client, fake)
        compressed = {
            **body,
            "documents": LONG_DOCUMENTS[:2],
            "ragspeed": {"compression": {"method": "bm25", "rate": 0.5}, "deadline_ms": 1_000},
        }
        task = asyncio.create_task(client.post("/v1/chat/completions", json=compressed))
        assert await asyncio.to_thread(entered.wait, 30)
        held, holder = await holding(client, fake, 600)
        proceed.set()
        response = await task
        held.release.set()
        assert (await holder).status_code == 200
        metrics = (await client.get("/metrics")).text
    if fails:
        assert response.status_code == 429 and response.json()["error"]["code"] == "ttft_deadline"
        assert metric(metrics, "ragspeed_ttft_refused_requests_total", stage="admission") == 1.0
        assert metric(metrics, "ragspeed_compression_failures_total") == 1.0
    else:
        assert response.status_code == 200
        report = response.json()["ragspeed"]["compression"]
        assert not report["failed"] and report["skipped_reason"] is None
        assert response.json()["ragspeed"]["predicted_ttft_ms"] > 1_000
        assert metric(metrics, "ragspeed_ttft_refused_requests_total") is None
