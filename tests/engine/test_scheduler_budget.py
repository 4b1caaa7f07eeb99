"""The step's time budget (stall-free batching) and the waiting queue's priority order, on
literal token lists over a real KVCacheManager (no model, no clock: step times are fed in)."""

from __future__ import annotations

import pytest

from ragspeed.engine.native.core.request import Request, RequestStatus
from ragspeed.engine.native.core.sampling import SamplingState
from ragspeed.engine.native.core.scheduler import Scheduler, StepTimeModel
from ragspeed.engine.protocol import PRIORITY_BATCH, PRIORITY_INTERACTIVE, GenerationRequest, SamplingParams
from ragspeed.prompt_cache.manager import KVCacheManager

# Binary fractions, so that every figure below is exact.
DECODE_S = 1 / 64  # a step of decodes alone
PER_TOKEN_S = 1 / 1024  # a prefill token
BUDGET_S = 1 / 16  # the step's time budget: 48 prefill tokens beside the decodes


def make_request(request_id: str, num_prompt: int, priority: int = PRIORITY_INTERACTIVE) -> Request:
    params = SamplingParams(max_tokens=64, temperature=0.0)
    prompt = tuple(range(100 + len(request_id), 100 + len(request_id) + num_prompt))
    return Request(
        GenerationRequest(request_id, prompt, params, priority=priority),
        SamplingState.create(params, (), "cpu"),
        detokenizer=None,
    )


def finish_step(scheduler: Scheduler, output, next_token: int = 7) -> None:
    scheduler.update_computed(output)
    for chunk in output.chunks:
        if chunk.samples:
            chunk.request.all_token_ids.append(next_token)


def sizes(output) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_tokens) for c in output.chunks]


def measured_model() -> StepTimeModel:
    model = StepTimeModel()
    model.observe(1, 0, DECODE_S)
    model.observe(0, 512, 512 * PER_TOKEN_S)
    return model


def budget_scheduler(model: StepTimeModel | None = None, *, step_seconds: float | None = BUDGET_S, **kw):
    manager = KVCacheManager(256, 4, enable_caching=False)
    return Scheduler(
        manager,
        max_num_seqs=8,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512),
        step_seconds=step_seconds,
        step_time=model if model is not None else measured_model(),
        min_prefill_tokens=4,
        **kw,
    )


def start_decoding(scheduler: Scheduler, request_id: str = "d") -> Request:
    """A request past its prefill: from the next step on, it decodes."""
    request = make_request(request_id, 4)
    scheduler.add(request)
    finish_step(scheduler, scheduler.schedule())
    return request


# ------------------------------------------------------------------ the step-time model


def test_step_time_model_fits_the_decode_part_and_the_prefill_rate():
    model = StepTimeModel()
    assert model.prefill_tokens_within(BUDGET_S) is None  # nothing measured: no limit
    model.observe(2, 0, DECODE_S)
    assert model.decode_seconds == DECODE_S
    assert model.prefill_tokens_within(BUDGET_S) is None  # decodes alone say nothing of prefill
    model.observe(0, 512, 512 * PER_TOKEN_S)  # a prefill alone: 1/1024 s a token
    assert model.seconds_per_prefill_token == PER_TOKEN_S
    assert model.prefill_tokens_within(BUDGET_S) == 48  # (1/16 - 1/64) * 1024
    # Beside decodes, 48 tokens took 1/16 + 1/32 s: what the decodes do not explain, 5/64 s,
    # is 5/3072 s a token; from now on steps beside decodes decide.
    model.observe(1, 48, BUDGET_S + 1 / 32)
    assert model.seconds_per_prefill_token == 5 / 3072
    assert model.prefill_tokens_within(BUDGET_S) == 28  # 3/64 / (5/3072) = 28.8
    model.observe(1, 28, 0.0)  # a step faster than its decodes: no negative cost
    assert model.seconds_per_prefill_token == pytest.approx(0.7 * 5 / 3072)


def test_each_thread_count_has_its_costs_and_an_unmeasured_one_scales_anothers():
    """Compression borrows one of the engine's two threads for a while: the steps then run on
    one, and a chunk sized by two threads' cost would take twice the budget."""
    model = StepTimeModel(threads=2)
    model.observe(1, 0, DECODE_S)
    model.observe(1, 48, DECODE_S + 48 * PER_TOKEN_S)
    assert model.prefill_tokens_within(BUDGET_S) == 48
    model.threads = 1
    assert model.decode_seconds == DECODE_S  # not measured on one thread: two threads' figure
    assert model.seconds_per_prefill_token == 2 * PER_TOKEN_S
    assert model.prefill_tokens_within(BUDGET_S) == 24
    model.observe(1, 0, 2 * DECODE_S)  # measured on one thread: its own from now on
    model.observe(1, 24, 2 * DECODE_S + 24 * 3 * PER_TOKEN_S)
    assert model.decode_seconds == 2 * DECODE_S
    assert model.seconds_per_prefill_token == pytest.approx(3 * PER_TOKEN_S)
    model.threads = 2  # the thread came back: two threads' costs, untouched
    assert model.decode_seconds == DECODE_S and model.seconds_per_prefill_token == PER_TOKEN_S


def test_chunks_sized_from_the_model_converge_on_the_budget():
    """A prefill pass costs a fixed 1/32 s plus 1/2048 s a token beside the decodes; the model
    cannot tell the two apart, yet the chunk it gives settles where the step takes the budget."""
    model = StepTimeModel()
    model.observe(1, 0, DECODE_S)
    model.observe(0, 512, 1 / 32 + 512 / 2048)
    for _ in range(40):
        chunk = model.prefill_tokens_within(BUDGET_S)
        model.observe(1, chunk, DECODE_S + 1 / 32 + chunk / 2048)
    assert model.prefill_tokens_within(BUDGET_S) in (31, 32)  # 1/64 + 1/32 + 32/2048 = 1/16


# ------------------------------------------------------------------ the time budget


def test_a_step_with_decodes_sizes_its_prefill_chunk_to_the_time_budget():
    scheduler = budget_scheduler()
    start_decoding(scheduler)
    scheduler.add(make_request("p", 200))
    out = scheduler.schedule()
    assert sizes(out) == [("d", 1), ("p", 48)]
    finish_step(scheduler, out)
    out = scheduler.schedule()
    assert sizes(out) == [("d", 1), ("p", 48)]  # the running prefill: the same limit


def test_a_step_without_decodes_keeps_the_whole_token_budget():
    scheduler = budget_scheduler()
    scheduler.add(make_request("p", 600))
    assert sizes(scheduler.schedule()) == [("p", 512)]


@pytest.mark.parametrize(
    ("model", "step_seconds"),
    [(StepTimeModel(), BUDGET_S), (measured_model(), None)],
    ids=["not-measured-yet", "no-time-budget"],
)
def test_without_a_measured_rate_or_a_time_budget_the_token_budget_decides(model, step_seconds):
    scheduler = budget_scheduler(model, step_seconds=step_seconds)
    start_decoding(scheduler)
    scheduler.add(make_request("p", 600))
    assert sizes(scheduler.schedule()) == [("d", 1), ("p", 511)]


def test_prefill_chunks_share_the_time_budget_and_admissions_stop_when_it_is_spent():
    scheduler = budget_scheduler()
    start_decoding(scheduler)
    scheduler.add(make_request("p", 40))
    finish_step(scheduler, scheduler.schedule())  # p: its whole prompt, within the 48
    scheduler.add(make_request("q", 100))
    scheduler.add(make_request("r", 100))
    out = scheduler.schedule()
    # p decodes now; q takes all 48 tokens the budget leaves; r waits
    assert sizes(out) == [("d", 1), ("p", 1), ("q", 48)]
    assert [r.request_id for r in scheduler.waiting] == ["r"]


def test_a_prefill_always_gets_its_minimum_chunk():
    model = measured_model()
    model.observe(4, 0, 1.0)  # the decodes alone overrun the budget
    scheduler = budget_scheduler(model)
    start_decoding(scheduler)
    scheduler.add(make_request("p", 100))
    assert sizes(scheduler.schedule()) == [("d", 1), ("p", 4)]


def test_the_token_budget_caps_the_time_budget():
    model = StepTimeModel()
    model.observe(1, 0, DECODE_S)
    model.observe(0, 512, 512 / 2**20)  # very fast prefill: ~48k tokens fit in the time
    scheduler = budget_scheduler(model, max_num_batched_tokens=64)
    start_decoding(scheduler)
    scheduler.add(make_request("p", 100))
    assert sizes(scheduler.schedule()) == [("d", 1), ("p", 63)]


# ------------------------------------------------------------------ priority


def test_batch_requests_wait_behind_interactive_ones():
    scheduler = budget_scheduler(max_num_batched_tokens=8)
    for name, priority in (("b1", PRIORITY_BATCH), ("i1", PRIORITY_INTERACTIVE), ("b2", PRIORITY_BATCH)):
        scheduler.add(make_request(name, 8, priority))
    scheduler.add(make_request("i2", 8))
    assert [r.request_id for r in scheduler.waiting] == ["i1", "i2", "b1", "b2"]
    assert sizes(scheduler.schedule()) == [("i1", 8)]


def test_a_batch_request_is_overtaken_at_most_max_overtakes_times():
    scheduler = budget_scheduler(max_overtakes=2)
    scheduler.add(make_request("b", 8, PRIORITY_BATCH))
    for name in ("i1", "i2", "i3", "i4"):
        scheduler.add(make_request(name, 8))
    # i1 and i2 overtook b; from then on b holds its place, as an interactive request would
    assert [r.request_id for r in scheduler.waiting] == ["i1", "i2", "b", "i3", "i4"]
    scheduler.add(make_request("b2", 8, PRIORITY_BATCH))
    scheduler.add(make_request("i5", 8))
    assert [r.request_id for r in scheduler.waiting] == ["i1", "i2", "b", "i3", "i4", "i5", "b2"]


def test_running_batch_requests_are_not_preempted_for_priority():
    manager = KVCacheManager(4, 4, enable_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    batch = make_request("batch", 12, PRIORITY_BATCH)
    scheduler.add(batch)
    finish_step(scheduler, scheduler.schedule())  # batch holds 3 of the 4 blocks
    scheduler.add(make_request("i", 8))  # needs 2 blocks: it waits for them
    out = scheduler.schedule()
    assert sizes(out) == [("batch", 1)]
    assert out.preempted == ()
    assert [r.request_id for r in scheduler.waiting] == ["i"]


def test_a_preempted_batch_request_goes_back_to_the_front():
    manager = KVCacheManager(4, 4, enable_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, max_overtakes=8)
    first, batch = make_request("first", 8), make_request("batch", 8, PRIORITY_BATCH)
    scheduler.add(first)
    scheduler.add(batch)
    finish_step(scheduler, scheduler.schedule())  # 2 blocks each: the pool is full
    out = scheduler.schedule()  # first's decode needs a 3rd block: batch, the latest, goes
    assert out.preempted == ("batch",)
    scheduler.add(make_request("i", 4))
    assert [r.request_id for r in scheduler.waiting] == ["batch", "i"]
    assert batch.status is RequestStatus.WAITING
