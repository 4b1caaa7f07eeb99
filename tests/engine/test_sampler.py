"""Sampling filters and per-request seeds."""

from __future__ import annotations

import torch

from ragspeed.engine.native.core.sampler import Sampler
from ragspeed.engine.native.core.sampling import SamplingState
from ragspeed.engine.protocol import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.1, 4.0, 3.9]])


def states(*params: SamplingParams) -> list[SamplingState]:
    return [SamplingState.create(p, (), "cpu") for p in params]


def test_greedy_is_argmax():
    sampler = Sampler("cpu")
    assert sampler(LOGITS, states(*[SamplingParams(temperature=0.0)] * 2)) == [1, 2]


def test_greedy_reads_a_reused_logits_buffer_afresh():
    """A step buffer's logits come back as the same tensor with new values, and with more rows
    as another tensor: each call reads what the tensor holds now."""
    sampler = Sampler("cpu")
    greedy = states(*[SamplingParams(temperature=0.0)] * 2)
    buffer = LOGITS.clone()
    assert sampler(buffer, greedy) == [1, 2]
    buffer.copy_(LOGITS.flip(1))
    assert sampler(buffer, greedy) == [2, 1]
    assert sampler(buffer, greedy) == [2, 1]
    wider = torch.cat([LOGITS, LOGITS.flip(0)])
    assert sampler(wider, greedy * 2) == [1, 2, 2, 1]
    assert sampler(buffer[:1], greedy[:1]) == [2]


def test_filters_that_leave_one_token_act_greedy():
    sampler = Sampler("cpu", seed=1)
    for params in (
        SamplingParams(temperature=5.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=0.01),
        SamplingParams(temperature=1.0, min_p=0.999),
    ):
        for _ in range(20):
            assert sampler(LOGITS, states(params, params)) == [1, 2]


def test_top_k_and_top_p_keep_only_the_head():
    sampler = Sampler("cpu", seed=3)
    seen_k, seen_p = set(), set()
    for _ in range(200):
        seen_k.add(sampler(LOGITS[:1], states(SamplingParams(temperature=10.0, top_k=2)))[0])
        # probs of row 1 at T=1: tokens 2 and 3 carry ~0.96; top_p 0.9 keeps exactly them
        seen_p.add(sampler(LOGITS[1:], states(SamplingParams(top_p=0.9)))[0])
    assert seen_k == {1, 2}
    assert seen_p == {2, 3}


def test_frequencies_follow_the_softmax():
    sampler = Sampler("cpu", seed=0)
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    params = states(SamplingParams(temperature=1.0, seed=11))
    draws = [sampler(logits, params)[0] for _ in range(3000)]
    freqs = [draws.count(i) / len(draws) for i in range(3)]
    assert [round(f, 1) for f in freqs] == [0.2, 0.5, 0.3]


def test_a_seed_gives_the_same_draws_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = states(params)
    together = states(SamplingParams(temperature=1.0), params)
    sampler = Sampler("cpu")
    logits = torch.zeros(1, 50)
    draws_alone = [sampler(logits, alone)[0] for _ in range(10)]
    draws_batched = [sampler(logits.repeat(2, 1), together)[1] for _ in range(10)]
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 3
