"""bench prefill's accounting of where a prefill's time goes (ragspeed.bench.prefill_paths)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ragspeed.bench.prefill_paths import PRODUCTS_EVENT, _layer_flop, _products_recorded


def _model(num_layers: int = 2) -> SimpleNamespace:
    """Layers with the four projections of a decoder layer, as nn.Linear (in 4, out 6)."""

    def layer() -> SimpleNamespace:
        attn = SimpleNamespace(qkv_proj=nn.Linear(4, 6), o_proj=nn.Linear(4, 6))
        mlp = SimpleNamespace(gate_up_proj=nn.Linear(4, 6), down_proj=nn.Linear(4, 6))
        return SimpleNamespace(self_attn=attn, mlp=mlp)

    return SimpleNamespace(layers=[layer() for _ in range(num_layers)])


def test_every_projection_runs_in_the_products_range_and_gets_its_forward_back():
    model = _model()
    x = torch.ones(3, 4)
    linear = model.layers[1].mlp.down_proj
    expected = linear(x)
    with _products_recorded(model), profile(activities=[ProfilerActivity.CPU]) as profiler:
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            outputs = [p(x) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    recorded = outputs[-1]  # the last layer's down projection
    counts = {e.key: e.count for e in profiler.key_averages()}
    assert counts[PRODUCTS_EVENT] == 8  # 2 layers x 4 projections
    assert torch.equal(recorded, expected)
    assert "forward" not in vars(linear)  # the class's forward again


def test_a_layers_flop_counts_two_a_multiply_add():
    # 4 projections of 4 inputs x 6 outputs, on 10 rows
    assert _layer_flop(_model(), 10) == 4 * 2 * 10 * 4 * 6


def test_answers_on_each_setup_are_compared_with_the_first_setups(tmp_path):
    """The share of a setup's greedy answers equal to fp32 prefill's with SDPA's attention, on
    eval rag's prompts; a setup's KV is kept apart by its cache salt, so each computes its own
    prefill."""
    from ragspeed.bench.prefill_paths import Setup, identical_answers, rag_prompts
    from ragspeed.engine.native.loading.gguf import converted_copy
    from ragspeed.engine.native.models.linear import BLOCKS_PATHS, DENSE_PREFILL_PATHS
    from ragspeed.shipped_data import NQ_QUESTIONS
    from tests.engine.conftest import make_engine
    from tests.engine.tiny_gguf import write_tiny_gguf
    from tests.engine.tiny_models import build_tiny_checkpoint

    source = build_tiny_checkpoint("llama", tmp_path / "hf", seed=1)
    (tmp_path / "src").mkdir()
    gguf = write_tiny_gguf(source, tmp_path / "src" / "tiny.gguf", "Q4_1")
    engine = make_engine(converted_copy(gguf, tmp_path / "converted"), quantization="gguf")
    prompts = rag_prompts(engine.tokenizer, NQ_QUESTIONS, 2)
    assert len(prompts) == 2
    assert "who sings for the beast in the new movie" in engine.tokenizer.decode(prompts[0])
    prompts = [prompt[-60:] for prompt in prompts]  # the tiny model's context is short
    fp32, int16 = DENSE_PREFILL_PATHS[-1], BLOCKS_PATHS[1]
    again = Setup(fp32.__class__(**{**vars(fp32), "name": "again"}))
    assert identical_answers(engine, [Setup(fp32), again], prompts, 4) == {"again": 1.0}
    setups = [Setup(fp32, kernel=False), Setup(fp32), Setup(int16)]
    shares = identical_answers(engine, setups, prompts, max_tokens=4)
    assert list(shares) == ["fp32", "int16-blocks"] and all(0.0 <= s <= 1.0 for s in shares.values())
    assert engine.runner.prefill_kernel  # the last setup's attention: the kernel
