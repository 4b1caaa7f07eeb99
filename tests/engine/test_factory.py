"""The engine from parts: the factory's stages, the engine over the parts it is given, and the
draft model on a runner and manager of its own."""

from __future__ import annotations

from transformers import AutoTokenizer

from ragspeed.engine.native.core.factory import build_kv, load_model_for
from ragspeed.engine.native.core.llm_engine import LLMEngine
from ragspeed.engine.native.core.model_runner import ModelRunner
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import assert_all_blocks_free, engine_config, make_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = tuple(range(10, 30))


def test_the_engine_steps_on_the_parts_it_is_given(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    config = engine_config(path, num_kv_cache_tokens=256)
    loaded = load_model_for(config, num_threads=1)
    runner, manager = build_kv(config, loaded, num_threads=1)
    assert manager.num_blocks == runner.kv_pool.num_blocks == 256 // 8
    assert runner.num_threads == 1
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    engine = LLMEngine(config, loaded=loaded, tokenizer=tokenizer, runner=runner, manager=manager)
    assert engine.runner is runner and engine.kv_pool is runner.kv_pool
    assert engine.manager is manager and engine.scheduler.manager is manager
    assert engine.prefill_choice is None and engine.weights["prefill"] is None  # no choice given

    out = engine.generate([GenerationRequest("r", PROMPT, GREEDY)])["r"]["token_ids"]
    built = make_engine(path).generate([GenerationRequest("r", PROMPT, GREEDY)])["r"]["token_ids"]
    assert out == built and len(out) == 8
    assert_all_blocks_free(engine)


def test_the_draft_runs_on_its_own_runner_and_manager(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculative="draft", draft_model=str(path), draft_quantization=None)
    draft = engine.speculator.proposer
    assert isinstance(draft.runner, ModelRunner) and draft.runner is not engine.runner
    assert draft.runner.kv_pool is not engine.kv_pool and draft.manager is not engine.manager
    assert draft.manager.num_blocks == engine.manager.num_blocks == draft.runner.kv_pool.num_blocks
    engine.use_threads(1)
    assert draft.runner.num_threads == engine.runner.num_threads == 1
    engine.speculator.controller.adaptive = False
    out = engine.generate([GenerationRequest("r", PROMPT, GREEDY)])["r"]["token_ids"]
    assert out == make_engine(path).generate([GenerationRequest("r", PROMPT, GREEDY)])["r"]["token_ids"]
    assert engine.stats()["spec_acceptance_rate"] == 1.0  # the target drafting for itself
