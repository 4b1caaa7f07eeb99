"""`ragspeed bench engine`: its attention share, its lengths option and the native weights it runs."""

from __future__ import annotations

import pytest

from ragspeed.bench.engine import (
    EngineBenchOptions,
    _NativeContender,
    attention_line,
    bench_engine,
    fit_lengths,
    parse_lengths,
)
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.core.factory import build_llm_engine
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
    contender = _NativeContender(build_llm_engine(config))
    share, ttft = contender.attention_share(tuple(range(2, 102)))  # one chunk of 100 queries
    assert 0.0 < share < 1.0
    assert ttft > 0.0


def test_the_native_engine_runs_on_the_weights_asked_for(tmp_path, capsys):
    path = build_tiny_checkpoint("llama", tmp_path / "llama", seed=1)
    sizes = dict(num_requests=2, prompt_len=16, output_len=4, ttft_prompt_len=32, repeats=1, threads=1)
    off = dict(attention_lens=(), with_transformers=False, with_llamacpp=False)
    int8 = bench_engine(str(path), options=EngineBenchOptions(quantization="int8", **sizes, **off))
    fp32 = bench_engine(
        str(path), options=EngineBenchOptions(quantization=None, tpot_target_ms=None, **sizes, **off)
    )
    assert (int8["quantization"], fp32["quantization"]) == ("int8", "none")
    assert (int8["tpot_target_ms"], fp32["tpot_target_ms"]) == (50.0, None)
    # int8 reads 1.0625 bytes a weight, fp32 4: the bound is the weights' bytes over bandwidth.
    assert int8["weight_bytes_per_token"] < fp32["weight_bytes_per_token"] / 2
    assert int8["tpot_ms"] > 0 and int8["native_tokens_per_s"] > 0
    # After the 32-token prompt a token also reads the context's keys and values.
    assert int8["tpot_32_ms"] > 0 and int8["tpot_32_bound_ms"] > int8["tpot_bound_ms"]
    # The step shapes, and the stream of a served engine on the same weights (a child server).
    assert int8["verification_steps_16"] > 0 and int8["verification_steps_32"] > 0
    assert int8["chunk_beside_decode_ratio"] > 0 and int8["served_tpot_ms"] > 0
    assert int8["served_tpot_over_tpot"] == int8["served_tpot_ms"] / int8["tpot_ms"]
    assert fp32["served_tpot_ms"] > 0  # its server without a step budget: --tpot-target-ms none
    out = capsys.readouterr().out
    assert "native weights int8" in out and "step budget 50 ms" in out and "step budget off" in out
    assert "verification of 1 + 4 rows: after 16 tokens" in out and "served TPOT at batch 1" in out


def test_the_step_budget_option_parses_milliseconds_or_none():
    from ragspeed.bench.engine import _parse_budget

    assert (_parse_budget("50"), _parse_budget("12.5"), _parse_budget("None")) == (50.0, 12.5, None)
    for bad, message in (("0", "must be > 0"), ("-3", "must be > 0"), ("fast", "milliseconds or 'none'")):
        with pytest.raises(ValueError, match=message):
            _parse_budget(bad)


def test_the_options_name_the_first_size_out_of_range():
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        EngineBenchOptions(repeats=0).check()
    with pytest.raises(ValueError, match="long_output_len must be >= 2"):
        EngineBenchOptions(long_output_len=1).check()
    with pytest.raises(ValueError, match="attention_len must be >= 1, got 0"):
        EngineBenchOptions(attention_lens=(2048, 0)).check()
