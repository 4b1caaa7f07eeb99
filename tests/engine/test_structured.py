"""Structured outputs and logits processing in the native engine, on a tiny seeded model: the
output always matches its constraint (whatever the random weights prefer), ends where the
constraint is complete, and a free request beside constrained ones samples as it would alone."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from ragspeed.engine.native.core.logits_process import LogitsProcessor
from ragspeed.engine.native.core.sampler import Sampler
from ragspeed.engine.native.core.sampling import SamplingState
from ragspeed.engine.protocol import EngineError, GenerationRequest, SamplingParams, StructuredOutput
from tests.engine.conftest import assert_all_blocks_free, make_engine, speculate_every_step

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return make_engine(tiny_checkpoints["llama"])


def _request(request_id: str, structured: StructuredOutput | None = None, **sampling) -> GenerationRequest:
    params = SamplingParams(**{"max_tokens": 40, "temperature": 0.0, **sampling}, structured=structured)
    return GenerationRequest(request_id, (5, 9, 12, 40, 7), params)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_their_constraints(engine, temperature):
    requests = [
        _request(
            "json", StructuredOutput("json_schema", json.dumps(SCHEMA)), temperature=temperature, seed=1
        ),
        _request("regex", StructuredOutput("regex", "[0-9]{3}-[a-c]{2}"), temperature=temperature, seed=2),
        _request("choice", StructuredOutput("choice", '["alpha", "beta"]'), temperature=temperature, seed=3),
        _request("grammar", StructuredOutput("grammar", 'start: "x" ("y" | "z")'), temperature=temperature),
    ]
    out = engine.generate(requests)
    jsonschema.validate(json.loads(out["json"]["text"]), SCHEMA)
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", out["regex"]["text"])
    assert out["choice"]["text"] in ("alpha", "beta")
    assert out["grammar"]["text"] in ("xy", "xz")
    assert {r["finish_reason"] for r in out.values()} == {"stop"}  # complete: the engine ended them
    assert_all_blocks_free(engine)


def test_a_cut_output_finishes_with_length(engine):
    request = _request("cut", StructuredOutput("regex", "[0-9]{30}"), max_tokens=3)
    out = engine.generate([request])["cut"]
    assert out["finish_reason"] == "length" and re.fullmatch("[0-9]+", out["text"])


def test_a_free_request_beside_constrained_ones_samples_as_alone(engine):
    alone = engine.generate([_request("free", max_tokens=12)])["free"]["token_ids"]
    mixed = engine.generate(
        [
            _request("c1", StructuredOutput("regex", "[a-z ]{12}"), max_tokens=12),
            _request("free", max_tokens=12),
            _request("c2", StructuredOutput("json_object"), max_tokens=12, frequency_penalty=1.0),
        ]
    )
    assert mixed["free"]["token_ids"] == alone


@pytest.mark.parametrize(
    "structured, message",
    [
        (StructuredOutput("json_schema", '{"type": "object", "properties": 5}'), "json_schema"),
        (StructuredOutput("json_schema", "[1, 2]"), "a JSON Schema must be a JSON object"),
        (StructuredOutput("regex", "[0-9"), "regex"),
        (StructuredOutput("choice", "[]"), "non-empty list"),
        (StructuredOutput("grammar", "start: undefined_rule"), "grammar"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused(engine, structured, message):
    with pytest.raises(EngineError, match=re.escape(message)) as refused:
        engine.add_request(_request("bad", structured))
    assert refused.value.param in ("response_format", "structured_outputs")
    assert not engine.has_unfinished()


def test_compiled_grammars_are_kept_by_constraint(engine):
    structured = StructuredOutput("regex", "[0-9]{4}")
    engine.grammars.compile.cache_clear()
    engine.grammars.compile(structured)
    engine.grammars.compile(StructuredOutput("regex", "[0-9]{4}"))
    info = engine.grammars.compile.cache_info()
    assert (info.hits, info.misses) == (1, 1)


def test_penalties_and_bias_on_literal_logits():
    params = SamplingParams(
        frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0, logit_bias=((4, -3.0), (0, 1.0))
    )
    processor = LogitsProcessor(params, prompt_token_ids=[1], matcher=None)
    for token in (2, 2, 3):
        processor.accept(token)
    logits = np.array([1.0, 4.0, 2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    processor(logits)
    # token 1: in the prompt only -> repetition 4 / 2; token 2: output twice -> 2 / 2 - 0.5 * 2 - 0.25;
    # token 3: once, negative -> -1 * 2 - 0.5 - 0.25; tokens 0 and 4: biased.
    assert logits.tolist() == [2.0, 2.0, -0.25, -2.75, -2.5, 3.0]


def test_the_sampler_leaves_the_logits_it_is_given_unchanged():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    before = logits.clone()
    biased = SamplingParams(temperature=0.0, logit_bias=((0, 100.0),))
    states = [
        SamplingState.create(biased, (), "cpu", LogitsProcessor(biased, [], None)),
        SamplingState.create(SamplingParams(temperature=0.0), (), "cpu"),
    ]
    assert Sampler("cpu")(logits, states) == [0, 0]
    assert torch.equal(logits, before)  # raw logprobs are taken from these


class _Repeater:
    """Drafts the last token again, k times: something to verify at every step."""

    name = "repeater"

    def propose(self, token_ids, num_tokens):
        return [token_ids[-1]] * num_tokens


def test_processed_rows_decode_plainly_beside_speculating_ones(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    biased = _request("biased", max_tokens=16, ignore_eos=True, logit_bias=((7, 5.0),))
    plain = make_engine(path).generate([biased])["biased"]["token_ids"]
    engine = make_engine(path, speculative="ngram")
    speculate_every_step(engine)
    engine.speculator.proposer = _Repeater()
    out = engine.generate([biased])
    assert out["biased"]["token_ids"] == plain
    assert engine.stats()["spec_draft_tokens"] == 0  # the processed row got no drafts
    out = engine.generate(
        [
            _request("biased2", max_tokens=16, ignore_eos=True, logit_bias=((7, 5.0),)),
            _request("free", max_tokens=16, ignore_eos=True),
        ]
    )
    assert out["biased2"]["token_ids"] == plain
    assert engine.stats()["spec_draft_tokens"] > 0  # the free row beside it speculated
    assert_all_blocks_free(engine)
