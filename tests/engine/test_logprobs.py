"""Logprobs: the raw log_softmax at each sampled token, top alternatives, nothing unasked."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from ragspeed.engine.native.core.logprobs import token_logprobs
from ragspeed.engine.protocol import EngineError, GenerationRequest, SamplingParams, TokenLogprob
from tests.engine.conftest import (
    assert_all_blocks_free,
    hf_greedy,
    make_engine,
    speculate_every_step,
)

PROMPT = tuple(range(10, 50))


@pytest.fixture(scope="module")
def llama_engine(tiny_checkpoints):
    return make_engine(tiny_checkpoints["llama"])


def _hf_logprobs(hf_model, prompt, output) -> torch.Tensor:
    """log_softmax of transformers' logits at the prompt's last token and each output token
    but the last: the distributions the output tokens were drawn from, [len(output), vocab]."""
    ids = torch.tensor([list(prompt) + list(output[:-1])])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, len(prompt) - 1 :].float()
    return logits.log_softmax(dim=-1)


def test_token_logprobs_of_known_logits():
    # row 0: probabilities 1/8, 3/8, 4/8; row 1: uniform over 3 tokens
    logits = torch.tensor([[0.0, math.log(3), math.log(4)], [5.0, 5.0, 5.0]])
    out = token_logprobs(logits, rows=[1, 0], token_ids=[2, 1], num_top=[0, 2])
    assert out[0] == TokenLogprob(2, pytest.approx(math.log(1 / 3)), ())
    assert out[1].token_id == 1 and out[1].logprob == pytest.approx(math.log(3 / 8))
    assert [t for t, _ in out[1].top] == [2, 1]
    assert [lp for _, lp in out[1].top] == pytest.approx([math.log(4 / 8), math.log(3 / 8)])
    assert token_logprobs(logits, [], [], []) == []


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_log_softmax_of_transformers_logits(llama_engine, hf_models, temperature):
    params = SamplingParams(
        max_tokens=8, temperature=temperature, top_k=20, seed=3, ignore_eos=True, logprobs=3
    )
    out = llama_engine.generate([GenerationRequest("lp", PROMPT, params)])["lp"]
    tokens, logprobs = out["token_ids"], out["logprobs"]
    assert len(logprobs) == len(tokens) == 8
    assert [lp.token_id for lp in logprobs] == tokens
    # The raw distribution, whatever the temperature and top-k the tokens were drawn with.
    reference = _hf_logprobs(hf_models["llama"], PROMPT, tokens)  # [8, vocab]
    want = reference.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    assert [lp.logprob for lp in logprobs] == pytest.approx(want.tolist(), abs=1e-4)
    top_values, top_ids = reference.topk(3, dim=-1)
    for lp, ids, values in zip(logprobs, top_ids.tolist(), top_values.tolist()):
        assert [t for t, _ in lp.top] == ids
        assert [v for _, v in lp.top] == pytest.approx(values, abs=1e-4)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob <= 0.0
        if temperature == 0.0:  # greedy: the sampled token is the most likely one
            assert lp.top[0] == (lp.token_id, lp.logprob)
    assert_all_blocks_free(llama_engine)


def test_no_logprobs_unless_asked_and_greedy_tokens_unchanged(llama_engine):
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    alone = llama_engine.generate([GenerationRequest("a", PROMPT, plain)])["a"]
    assert "logprobs" not in alone
    # One request asks, one does not, in the same batch.
    llama_engine.add_request(GenerationRequest("b", PROMPT, with_lp))
    llama_engine.add_request(GenerationRequest("c", PROMPT[::-1], plain))
    deltas: dict[str, list] = {"b": [], "c": []}
    while llama_engine.has_unfinished():
        for out in llama_engine.step():
            deltas[out.request_id].append(out.delta)
    assert all(d.logprobs is None for d in deltas["c"])
    assert all(len(d.logprobs) == len(d.token_ids) == 1 for d in deltas["b"])
    assert all(d.logprobs[0].top == () for d in deltas["b"])  # logprobs=0: no alternatives
    assert [t for d in deltas["b"] for t in d.token_ids] == alone["token_ids"]
    assert_all_blocks_free(llama_engine)


@pytest.mark.parametrize("value", [-1, 21, 2.5, True])
def test_bad_logprobs_name_the_parameter(llama_engine, value):
    with pytest.raises(EngineError) as err:
        llama_engine.add_request(GenerationRequest("bad", PROMPT, SamplingParams(logprobs=value)))
    assert err.value.param == "logprobs"
    assert not llama_engine.has_unfinished()


class _Oracle:
    """Proposes the plain output, one draft in three wrong: accepted drafts, recovered and bonus
    tokens all occur."""

    name = "oracle"

    def __init__(self, prompt, output):
        self.prompt, self.output = list(prompt), list(output)

    def propose(self, token_ids, num_tokens):
        pos = len(token_ids) - len(self.prompt)
        drafts = self.output[pos : pos + num_tokens]
        if len(drafts) > 2:
            drafts[2] = (drafts[2] + 1) % 384
        return drafts


def test_speculative_decoding_reports_the_target_logprobs(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = make_engine(path).generate([GenerationRequest("p", PROMPT, params)])["p"]
    engine = make_engine(path, speculative="ngram")
    speculate_every_step(engine)
    engine.speculator.proposer = _Oracle(PROMPT, plain["token_ids"])
    spec = engine.generate([GenerationRequest("s", PROMPT, params)])["s"]
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert spec["token_ids"] == plain["token_ids"]
    assert [lp.token_id for lp in spec["logprobs"]] == spec["token_ids"]
    assert [lp.logprob for lp in spec["logprobs"]] == pytest.approx(
        [lp.logprob for lp in plain["logprobs"]], abs=1e-4
    )
    assert [[t for t, _ in lp.top] for lp in spec["logprobs"]] == [
        [t for t, _ in lp.top] for lp in plain["logprobs"]
    ]
    assert_all_blocks_free(engine)


class _GreedyProposer:
    """Drafts the target's own greedy continuation (transformers): most drafts are accepted."""

    name = "greedy"

    def __init__(self, hf_model):
        self.hf_model = hf_model

    def propose(self, token_ids, num_tokens):
        return hf_greedy(self.hf_model, list(token_ids), num_tokens)


def test_sampled_speculation_reports_the_raw_target_logprobs(tiny_checkpoints, hf_models):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculative="ngram")
    speculate_every_step(engine)
    engine.speculator.proposer = _GreedyProposer(hf_models["llama"])
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=5, ignore_eos=True, logprobs=1)
    out = engine.generate([GenerationRequest("s", PROMPT, params)])["s"]
    assert engine.stats()["spec_accepted_tokens"] > 0
    tokens = out["token_ids"]
    reference = _hf_logprobs(hf_models["llama"], PROMPT, tokens)
    want = reference.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    assert [lp.logprob for lp in out["logprobs"]] == pytest.approx(want.tolist(), abs=1e-4)
    assert [lp.top[0][0] for lp in out["logprobs"]] == reference.argmax(dim=-1).tolist()
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("backend", ["transformers", "openai"])
def test_backends_without_logprobs_refuse_them_by_name(backend):
    from ragspeed.engine.backends import build_engine
    from ragspeed.engine.config import EngineConfig, UpstreamConfig

    engine = build_engine(EngineConfig(backend=backend, model="unused"), UpstreamConfig(urls=("http://x",)))
    request = GenerationRequest("r", PROMPT, SamplingParams(logprobs=2))
    with pytest.raises(EngineError) as err:
        asyncio.run(anext(engine.generate(request)))
    assert err.value.param == "logprobs" and backend in err.value.message
