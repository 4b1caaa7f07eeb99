"""Stall-free batching in the engine (tiny model): beside decodes, prefill chunks shrink to
what the step's time budget allows; alone, a prefill keeps the token budget; the tokens are
those of the token budget alone."""

from __future__ import annotations

from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import assert_all_blocks_free, make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
STREAM = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)  # outlives the prefill


def run_with_a_stream(engine) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """A long prompt alone, then another while the first decodes: each step's (decode tokens,
    prefill tokens), and each request's tokens."""
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        if not out.is_empty:
            steps.append((len(out.decodes), out.num_prefill_tokens))
        return out

    engine.scheduler.schedule = recorded
    tokens: dict[str, list[int]] = {"first": [], "second": []}
    engine.add_request(GenerationRequest("first", tuple(range(10, 130)), STREAM))
    while not tokens["first"]:
        for out in engine.step():
            tokens[out.request_id].extend(out.delta.token_ids)
    engine.add_request(GenerationRequest("second", tuple(range(20, 120)), GREEDY))
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.delta.token_ids)
    engine.scheduler.schedule = schedule
    return tokens, steps


def test_prefill_chunks_shrink_beside_decodes(tiny_checkpoints):
    # A time budget no step meets: beside a decode, a prefill gets its minimum, one block.
    engine = make_engine(tiny_checkpoints["llama"], max_num_batched_tokens=64, tpot_target_ms=1e-6)
    tokens, steps = run_with_a_stream(engine)
    assert steps[:2] == [(0, 64), (0, 56)]  # alone: the token budget, 120 = 64 + 56
    # second's 100 tokens beside first's decodes: 12 chunks of a block (8), then 4
    assert steps[2 : 2 + 13] == [(1, 8)] * 12 + [(1, 4)]
    assert engine.scheduler.step_time.seconds_per_prefill_token is not None
    assert_all_blocks_free(engine)

    reference = make_engine(tiny_checkpoints["llama"], max_num_batched_tokens=64, tpot_target_ms=None)
    ref_tokens, ref_steps = run_with_a_stream(reference)
    assert ref_steps[2] == (1, 63)  # the token budget alone: today's behaviour
    assert tokens == ref_tokens
