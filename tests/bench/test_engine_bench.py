"""`ragspeed bench engine`: its attention-share figure and the option that picks its lengths."""

from __future__ import annotations

import pytest

from ragspeed.bench.engine import _NativeContender, attention_line, fit_lengths, parse_lengths
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.llm_engine import LLMEngine
from tests.engine.tiny_models import build_tiny_checkpoint


def test_lengths_parse_from_a_comma_list_and_none_from_an_empty_one():
    assert parse_lengths("2048, 8192") == (2048, 8192)
    assert parse_lengths("") == ()
    with pytest.raises(ValueError, match="integers separated by commas, got '2k'"):
        parse_lengths("2k")


def test_a_length_leaves_the_output_token_room_in_the_context():
    assert fit_lengths((8192, 2048), 8192) == (2048, 8191)
    assert fit_lengths((8192, 9000), 8192) == (8191,)


def test_the_attention_line_names_each_length():
    figures = {"attention_share_2048": 0.213, "attention_share_8191": 0.4836}
    assert attention_line(figures, (2048, 8191)) == "attention share of TTFT 2,048: 21.3%, 8,191: 48.4%"


def test_the_attention_share_of_a_prefill_comes_from_the_profiler_event(tmp_path):
    path = build_tiny_checkpoint("llama", tmp_path / "llama", seed=1)
    config = EngineConfig(model=str(path), max_model_len=256, num_kv_cache_tokens=1024, block_size=8)
    contender = _NativeContender(LLMEngine(config))
    share, ttft = contender.attention_share(tuple(range(2, 102)))  # one chunk of 100 queries
    assert 0.0 < share < 1.0
    assert ttft > 0.0
