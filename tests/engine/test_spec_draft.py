"""Speculative decoding with a draft model: identical greedy output, both pools freed, bad input,
and a tiny distillation run."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from ragspeed.engine.backends import build_engine
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.core.spec_decode import DraftProposer
from ragspeed.engine.native.loading.loader import load_model
from ragspeed.engine.protocol import EngineError, GenerationRequest, SamplingParams
from tests.engine.conftest import assert_all_blocks_free, make_engine, speculate_every_step
from tests.engine.tiny_models import build_tiny_checkpoint, build_tokenizer


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and two OpenMP threads on a CPU shared
    with other jobs can spin-wait for each other (measured 100x slower under load)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [tuple(range(10 + 7 * i, 10 + 7 * i + 5 + 9 * i)) for i in range(8)]  # 5 .. 68 tokens


@pytest.fixture(scope="module")
def drafts(tiny_checkpoints, tmp_path_factory) -> dict:
    """Draft checkpoints for the tiny llama target (same tokenizer): 'self' is the target itself
    (every draft accepted), 'half' is its first layer only (some accepted), 'other' a different
    random model (most rejected)."""
    root = tmp_path_factory.mktemp("drafts")
    target = tiny_checkpoints["llama"]
    # The target truncated to its first layer (same embeddings, final norm and LM head).
    half = shutil.copytree(target, root / "half")
    config = json.loads((half / "config.json").read_text())
    (half / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    weights = load_file(str(target / "model.safetensors"))
    save_file(
        {k: v for k, v in weights.items() if "layers.1." not in k},
        str(half / "model.safetensors"),
        metadata={"format": "pt"},
    )
    other = build_tiny_checkpoint("llama", root / "other", seed=7)
    return {"self": target, "half": half, "other": other}


def assert_both_pools_free(engine) -> None:
    assert_all_blocks_free(engine)
    draft = engine.speculator.proposer
    draft.manager.check_invariants()
    assert draft.manager.num_free_blocks == draft.manager.num_blocks
    assert not draft._states


def _run(path, prompts, draft_path=None, params=GREEDY, draft_quantization=None, **overrides):
    """Greedy runs with the draft unquantized unless asked: exact acceptance figures."""
    speculative = (
        dict(speculative="draft", draft_model=str(draft_path), draft_quantization=draft_quantization)
        if draft_path
        else {}
    )
    engine = make_engine(path, **speculative, **overrides)
    if engine.speculator is not None:
        # Speculate in every step: these tests check the mechanism, not the measured switch
        # (a draft as big as the target, "self", never pays and would be switched off).
        engine.speculator.controller.adaptive = False
    requests = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    out = engine.generate(requests)
    if engine.speculator is not None:
        assert_both_pools_free(engine)
    else:
        assert_all_blocks_free(engine)
    return [out[f"r{i}"]["token_ids"] for i in range(len(prompts))], engine


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    outs, _ = _run(tiny_checkpoints["llama"], PROMPTS)
    return outs


@pytest.mark.parametrize("draft", ["self", "half", "other"])
@pytest.mark.parametrize("draft_quantization", [None, "int8"])
def test_greedy_single_and_batched_identical_to_plain_decoding(
    tiny_checkpoints, drafts, plain, draft, draft_quantization
):
    path = tiny_checkpoints["llama"]
    single, engine = _run(path, [PROMPTS[3]], drafts[draft], draft_quantization=draft_quantization)
    assert single == [plain[3]]
    batched, engine = _run(path, PROMPTS, drafts[draft], draft_quantization=draft_quantization)
    assert batched == plain
    stats = engine.stats()
    assert stats["spec_draft_draft_tokens"] == stats["spec_draft_tokens"] > 0
    if draft == "self" and draft_quantization is None:
        assert stats["spec_acceptance_rate"] == 1.0
        assert engine.num_steps < 24 // 5 * 2 + 6  # 5 tokens per verification, k = 4
    elif draft == "self":  # the target's own weights in int8 mostly agree with it
        assert stats["spec_acceptance_rate"] > 0.8
    elif draft == "half":
        assert 0.0 < stats["spec_acceptance_rate"] < 1.0


def test_draft_quantization_auto_is_int8_on_a_cpu(tiny_checkpoints, drafts):
    from ragspeed.engine.native.compute.quant import Int8Linear
    from ragspeed.engine.native.core.spec_decode.draft import draft_quantization

    base = EngineConfig(speculative="draft", draft_model="d")
    assert draft_quantization(base) == "int8"
    assert draft_quantization(replace(base, draft_quantization="none")) is None
    assert draft_quantization(replace(base, device="cuda", quantization="int8")) == "int8"
    assert draft_quantization(replace(base, device="cuda")) is None
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculative="draft", draft_model=str(drafts["half"]))
    draft_model = engine.speculator.proposer.model
    assert isinstance(draft_model.lm_head, Int8Linear)
    assert not isinstance(engine.loaded.model.lm_head, Int8Linear)  # the target stays unquantized
    with pytest.raises(EngineError, match="unknown quantization 'int4'") as err:
        make_engine(path, speculative="draft", draft_model=str(drafts["half"]), draft_quantization="int4")
    assert err.value.param == "draft_quantization"


def test_greedy_identical_with_chunked_prefill_preemption_and_prefix_caching(tiny_checkpoints, drafts, plain):
    path, draft = tiny_checkpoints["llama"], drafts["half"]
    chunked, engine = _run(path, PROMPTS, draft, max_num_batched_tokens=16)
    assert chunked == plain and engine.stats()["spec_accepted_tokens"] > 0
    # 24 blocks x 8 tokens cannot hold 8 requests of up to ~92 tokens: preemption
    tight, engine = _run(path, PROMPTS, draft, num_kv_cache_tokens=192, max_model_len=128)
    assert tight == plain and engine.scheduler.num_preemptions > 0
    assert engine.stats()["spec_accepted_tokens"] > 0
    # prefix caching: the same prompts twice on one engine, the second round hits the cache
    engine = make_engine(path, speculative="draft", draft_model=str(draft))
    for round_ in range(2):
        out = engine.generate([GenerationRequest(f"c{round_}{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        assert [out[f"c{round_}{i}"]["token_ids"] for i in range(8)] == plain
    assert out["c17"]["num_cached_tokens"] > 0
    assert_both_pools_free(engine)


@pytest.mark.parametrize("min_confidence", [0.0, 0.5])
def test_fused_draft_steps_propose_what_the_step_by_step_loop_does(drafts, min_confidence):
    """Drafts 2 .. k in one kernel call (`_fused_steps`) against the Python loop of steps."""
    from types import SimpleNamespace

    loaded = load_model(drafts["half"], max_model_len=256)
    proposers = [
        DraftProposer(loaded, num_blocks=64, block_size=8, device="cpu", min_confidence=min_confidence)
        for _ in range(2)
    ]
    proposers[1].fused_steps = False
    requests = [SimpleNamespace(request_id=f"r{i}", all_token_ids=list(p)) for i, p in enumerate(PROMPTS[:4])]
    for round_ in range(3):  # the next round accepts the first two drafts of each request
        k = [4, 2, 5, 1]
        first, second = (p.propose_batch(requests, k) for p in proposers)
        assert first == second
        lengths = [len(d) for d in first]
        if min_confidence == 0.0:
            assert lengths == k
        else:  # a draft below the confidence ends its request's drafting
            assert all(1 <= n <= wanted for n, wanted in zip(lengths, k))
        for request, proposed in zip(requests, first):
            request.all_token_ids += proposed[:2] + [7 + round_]
    assert proposers[0].fused_steps and loaded.model._fused_decoder().greedy


def test_draft_pool_exhausted_means_no_drafts_not_preemption(tiny_checkpoints, drafts, plain):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculative="draft", draft_model=str(drafts["self"]))
    speculate_every_step(engine)
    # 12 blocks x 8 tokens: room for the drafts of one or two requests at a time
    engine.speculator.proposer = DraftProposer(
        load_model(drafts["self"], max_model_len=256), num_blocks=12, block_size=8, device="cpu"
    )
    out = engine.generate([GenerationRequest(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    assert [out[f"r{i}"]["token_ids"] for i in range(8)] == plain
    assert engine.scheduler.num_preemptions == 0
    stats = engine.stats()
    assert 0 < stats["spec_verifications"] < stats["generation_tokens_total"] - 8
    assert_both_pools_free(engine)


def test_low_confidence_ends_a_draft_early(tiny_checkpoints, drafts, plain):
    path = tiny_checkpoints["llama"]
    counts = []
    for min_confidence in (0.0, 0.5):
        engine = make_engine(path, speculative="draft", draft_model=str(drafts["half"]))
        engine.speculator.controller.adaptive = False  # k = 4 whenever the draft is confident
        engine.speculator.proposer = DraftProposer(
            load_model(drafts["half"], max_model_len=256),
            num_blocks=512,
            block_size=8,
            device="cpu",
            min_confidence=min_confidence,
        )
        out = engine.generate([GenerationRequest(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        assert [out[f"r{i}"]["token_ids"] for i in range(8)] == plain
        stats = engine.stats()
        counts.append(stats["spec_draft_tokens"] / stats["spec_verifications"])
        assert_both_pools_free(engine)
    assert counts[0] > 3.5 and 1.0 <= counts[1] < 0.8 * counts[0], counts


def test_abort_frees_the_draft_blocks(tiny_checkpoints, drafts):
    engine = make_engine(tiny_checkpoints["llama"], speculative="draft", draft_model=str(drafts["half"]))
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(GenerationRequest(f"a{i}", prompt, GREEDY))
    for _ in range(4):
        engine.step()
    draft = engine.speculator.proposer
    assert draft.manager.num_free_blocks < draft.manager.num_blocks
    for i in range(3):
        assert engine.abort(f"a{i}").delta.finish_reason == "abort"
    assert_both_pools_free(engine)


def test_seeded_sampling_is_reproducible(tiny_checkpoints, drafts):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    path, draft = tiny_checkpoints["llama"], drafts["half"]
    first, engine = _run(path, PROMPTS[:4], draft, params)
    again, _ = _run(path, PROMPTS[:4], draft, params)
    assert again == first and [len(ids) for ids in first] == [20] * 4
    assert engine.stats()["spec_accepted_tokens"] > 0


def test_draft_with_another_tokenizer_fails_at_start_up(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama"]
    bad = build_tiny_checkpoint("llama", tmp_path / "bad", seed=2)
    build_tokenizer(vocab_size=300).save_pretrained(bad)  # fewer merges: other ids
    with pytest.raises(EngineError, match="does not share the tokenizer") as err:
        make_engine(path, speculative="draft", draft_model=str(bad))
    assert err.value.param == "draft_model"
    assert str(bad) in str(err.value) and str(path) in str(err.value)
    assert "vocabularies differ" in str(err.value)
    # same vocabulary, another eos token
    shutil.copy(path / "tokenizer.json", bad / "tokenizer.json")
    tokenizer = build_tokenizer()
    tokenizer.eos_token = "<s>"
    tokenizer.save_pretrained(bad)
    with pytest.raises(EngineError, match="eos_token_id differs"):
        make_engine(path, speculative="draft", draft_model=str(bad))
    with pytest.raises(EngineError, match="needs a draft model"):
        make_engine(path, speculative="draft")
    for backend in ("transformers", "openai"):
        config = EngineConfig(backend=backend, model=str(path), speculative="draft", draft_model=str(path))
        with pytest.raises(ValueError, match=f"backend '{backend}' has none"):
            build_engine(config)


# ---------------------------------------------------------------- distillation


@pytest.fixture(scope="module")
def tiny_demo_target(tmp_path_factory):
    """A 2-layer Llama with the demo tokenizer (4,096 tokens, chat template), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ragspeed.engine.native.loading.model_zoo import resolve_model

    demo = resolve_model("ragspeed-demo")
    path = tmp_path_factory.mktemp("tiny-demo")
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(f"{demo}/{name}", path / name)
    return path


@pytest.fixture(scope="module")
def small_data(shared_data, tmp_path_factory):
    """40 passages and the first 3 WikiText articles of ../shared/data."""
    path = tmp_path_factory.mktemp("data")
    lines = (shared_data / "wiki_passages.txt").read_text().splitlines()
    (path / "wiki_passages.txt").write_text("\n".join(lines[:40]) + "\n")
    articles, kept = 0, []
    for line in (shared_data / "wikitext2_raw_test.txt").read_text().splitlines():
        if line.startswith(" = ") and not line.startswith(" = = "):
            articles += 1
        if articles > 3:
            break
        kept.append(line)
    (path / "wikitext2_raw_test.txt").write_text("\n".join(kept) + "\n")
    return path


def _tiny_recipe(**overrides):
    """A distillation recipe small enough for a test: one layer, short rows, a few prompts."""
    from ragspeed.training.distill import DistillRecipe, TrainingConfig

    recipe = DistillRecipe(
        num_hidden_layers=1,
        init_from_layers=(0,),
        batch_size=2,
        prompt_tokens=16,
        max_new_tokens=16,
        max_chat_passages=1,
        generation_batch=8,
        num_eval_prompts=4,
        training=TrainingConfig(
            learning_rate=1e-2, min_learning_rate=1e-3, warmup_steps=2, log_every=5, num_threads=1
        ),
    )
    return replace(recipe, **overrides)


def test_tiny_distillation_writes_a_loadable_draft_and_lowers_the_kd_loss(
    tiny_demo_target, small_data, tmp_path
):
    from ragspeed.training.distill import distill_draft

    recipe = _tiny_recipe(seq_len=128)
    out = tmp_path / "draft"
    figures = distill_draft(
        tiny_demo_target,
        out,
        data_dir=small_data,
        minutes=1.0,
        max_steps=30,
        recipe=recipe,
        log=lambda _: None,
    )
    assert figures["steps"] == 30 and figures["num_continuations"] > 0
    assert figures["final_kd_loss"] < 0.8 * figures["first_kd_loss"]
    assert 0.0 <= figures["heldout_greedy_agreement"] <= 1.0
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert "final KD loss" in (out / "README.md").read_text()
    # the folder serves as a draft of its target
    engine = make_engine(tiny_demo_target, speculative="draft", draft_model=str(out))
    assert engine.speculator.proposer.loaded.arch.num_layers == 1
    request = GenerationRequest("d", (1, 100, 200, 300), GREEDY)
    result = engine.generate([request])
    plain = make_engine(tiny_demo_target).generate([request])
    assert result["d"]["token_ids"] == plain["d"]["token_ids"]
    assert_both_pools_free(engine)


@pytest.mark.slow
def test_bench_spec_runs_the_draft_contender(shared_data):
    from ragspeed.bench.spec import run_bench_spec

    result = run_bench_spec(
        data_path=shared_data / "nq_dev.jsonl",
        num_prompts=2,
        max_tokens=16,
        batch_max_tokens=4,
        repeats=1,
    )
    assert result["draft_outputs_identical"] is True
    assert result["draft_acceptance"] > 0 and result["draft_speedup"] > 0
    assert result["draft_rag_outputs_identical"] is True and result["draft_rag_speedup"] > 0


@pytest.fixture(scope="module")
def small_rag_data(small_data, shared_data, tmp_path_factory):
    """small_data and the first 12 questions of nq_dev.jsonl."""
    path = tmp_path_factory.mktemp("rag-data")
    for name in ("wiki_passages.txt", "wikitext2_raw_test.txt"):
        shutil.copy(small_data / name, path / name)
    lines = (shared_data / "nq_dev.jsonl").read_text().splitlines()
    (path / "nq_dev.jsonl").write_text("\n".join(lines[:12]) + "\n")
    return path


def test_tiny_distillation_with_a_sub_vocabulary_head_and_rag_answers(
    tiny_demo_target, small_rag_data, tmp_path
):
    from transformers import AutoTokenizer

    from ragspeed.training.distill import distill_draft

    recipe = _tiny_recipe(seq_len=320, draft_vocab_size=512, max_rag_documents=1, num_heldout_rag=4)
    out = tmp_path / "draft"
    figures = distill_draft(
        tiny_demo_target,
        out,
        data_dir=small_rag_data,
        minutes=1.0,
        max_steps=10,
        recipe=recipe,
        log=lambda _: None,
    )
    assert figures["draft_vocab_size"] == 512 and figures["target_vocab_size"] == 4096
    assert figures["continuations_by_kind"]["rag"] > 0 and figures["num_eval_prompts"] == 4
    assert 0.0 < figures["heldout_sub_vocab_coverage"] <= 1.0
    assert figures["heldout_greedy_agreement"] <= figures["heldout_sub_vocab_coverage"]
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 512 and config["tie_word_embeddings"] is False
    weights = load_file(str(out / "model.safetensors"))
    d2t = weights["d2t"].tolist()
    assert weights["d2t"].dtype == torch.int64 and d2t == sorted(set(d2t)) and len(d2t) == 512
    assert set(AutoTokenizer.from_pretrained(tiny_demo_target).all_special_ids) <= set(d2t)
    assert tuple(weights["lm_head.weight"].shape) == (512, 32)
    assert tuple(weights["model.embed_tokens.weight"].shape) == (4096, 32)
    assert "sub-vocabulary of 512 of the target's 4,096 tokens" in " ".join(
        (out / "README.md").read_text().split()
    )
    # the folder serves as a draft of its target; every draft is a target id of the map
    engine = make_engine(tiny_demo_target, speculative="draft", draft_model=str(out))
    assert engine.speculator.proposer.loaded.model.lm_head.out_features == 512
    request = GenerationRequest("d", (1, 100, 200, 300), GREEDY)
    result = engine.generate([request])
    plain = make_engine(tiny_demo_target).generate([request])
    assert result["d"]["token_ids"] == plain["d"]["token_ids"]
    assert_both_pools_free(engine)


def test_the_sub_vocabulary_ranks_continuations_and_text_alike_and_keeps_special_tokens():
    from ragspeed.training.distill import frequency_sub_vocab, interleave

    continuations = [[5, 5, 5, 9], [9, 5]]  # 5: 4/6, 9: 2/6
    texts = [[7, 7, 7, 7, 7, 7, 7, 3], [3, 5]]  # 7: 7/10, 3: 2/10, 5: 1/10
    assert frequency_sub_vocab(continuations, texts, 3) == (5, 7, 9)  # 5: 0.77, 7: 0.70, 9: 0.33, 3: 0.20
    assert frequency_sub_vocab(continuations, texts, 3, always=(2, 0)) == (0, 2, 5)
    assert frequency_sub_vocab(continuations, texts, 9) == (3, 5, 7, 9)  # only tokens seen
    assert interleave([list("aaaaaa"), list("bb")], (0.6, 0.4)) == list("abaabaaa")
    assert interleave([list("aaa"), []], (0.6, 0.4)) == list("aaa")
