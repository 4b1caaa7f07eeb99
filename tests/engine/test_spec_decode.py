"""Speculative decoding: prompt lookup, lossless verification (greedy and sampled), adaptivity."""

from __future__ import annotations

import pytest
import torch

from ragspeed.engine.backends import build_engine
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.core.sampling import SamplingState
from ragspeed.engine.native.core.spec_decode import (
    AdaptiveController,
    NgramProposer,
    verify_greedy,
    verify_sampled,
)
from ragspeed.engine.native.core.spec_decode.rejection import target_probs
from ragspeed.engine.protocol import EngineError, GenerationRequest, SamplingParams
from tests.engine.conftest import assert_all_blocks_free, make_engine, speculate_every_step

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# Prompts with repeated spans, so prompt lookup finds matches from the first step.
PROMPTS = [
    tuple(range(10, 40)) + tuple(range(10, 20)),
    tuple(range(100, 120)) * 2 + (7, 8, 9),
    (5, 6, 7, 8) * 6 + tuple(range(200, 230)),
    tuple(range(300, 340)),
]


# ---------------------------------------------------------------- proposer and verification


def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    # suffix (1, 2, 3) matched at 0 and 5: the latest match wins, what followed it is proposed
    assert proposer.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 3) == [5, 6, 1]
    # the match ends 2 tokens before the end: the draft continues with period 5
    assert proposer.propose([1, 2, 3, 4, 9, 1, 2, 3], 7) == [4, 9, 1, 2, 3, 4, 9]
    assert proposer.propose([7, 5, 5, 5], 3) == [5, 5, 5]  # a 1-token loop
    # no 3- or 2-gram match: falls back to the 1-gram (4) -> what followed it
    assert proposer.propose([4, 7, 1, 2, 4], 2) == [7, 1]
    assert proposer.propose([1, 2, 3], 4) == []
    assert proposer.propose([1, 1], 0) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)


def _scan_ngram(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The reference: scan back for the latest earlier occurrence of the longest suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                extended = list(tokens)
                for j in range(k):
                    extended.append(extended[start + n + j])
                return extended[len(tokens) :]
    return []


def test_ngram_index_grows_with_the_request_and_proposes_what_a_scan_does():
    """The per-request index, extended step by step (several tokens at once after accepted
    drafts), against a scan of the whole sequence at every step; release drops it."""
    import random
    from types import SimpleNamespace

    rng = random.Random(0)
    proposer = NgramProposer()
    request = SimpleNamespace(request_id="r", all_token_ids=[rng.randrange(20) for _ in range(30)])
    for step in range(200):
        k = 1 + step % 5
        (incremental,) = proposer.propose_batch([request], [k])
        assert incremental == _scan_ngram(request.all_token_ids, k)
        copied = incremental[: rng.randrange(len(incremental) + 1)]  # accepted drafts
        request.all_token_ids += copied + [rng.randrange(20)]
    assert set(proposer._indexes) == {"r"}
    proposer.release("r")
    proposer.release("unknown")
    assert proposer._indexes == {}


def test_verify_greedy_accepts_the_agreeing_prefix_then_one_more():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 1.0
    assert verify_greedy(logits, (3, 5, 7)) == [3, 5, 7, 9]  # all accepted + bonus
    assert verify_greedy(logits, (3, 6, 7)) == [3, 5]  # recovered at the first miss
    assert verify_greedy(logits, (0, 5, 7)) == [3]


def test_adaptive_controller_follows_acceptance_and_pauses_after_misses():
    controller = AdaptiveController(4, max_verify_tokens=20, miss_limit=2, retry_after=3, smoothing=0.3)

    class R:  # any weak-referenceable object stands for a request
        pass

    request = R()
    assert controller.num_tokens(request) == 4
    controller.observe(request, 4, 1)  # ewma 1.0 -> 0.7 * 1 + 0.3 * 0.25 = 0.775
    assert controller.num_tokens(request) == 4  # ceil(3.1)
    controller.observe(request, 4, 0)  # 0.5425 -> ceil(2.17) = 3
    assert controller.num_tokens(request) == 3
    controller.observe(request, 3, 0)  # second miss in a row: pause 3 steps
    assert [controller.num_tokens(request) for _ in range(4)] == [0, 0, 0, 2]
    assert controller.batch_allows_at_most(4) and not controller.batch_allows_at_most(5)
    assert not controller.batch_allows([R() for _ in range(5)], [4] * 5)  # 5 * (1 + 4) > 20


def test_controller_speculates_while_the_measured_costs_say_it_pays():
    controller = AdaptiveController(4, max_verify_tokens=100, explore_every=1, smoothing=0.5)

    class R:
        pass

    batch = [R() for _ in range(8)]  # fresh requests: acceptance 1.0, 1 + 4 tokens expected
    # unmeasured: speculation first, then plain decoding, then whichever yields more
    assert controller.batch_allows(batch, [4] * 8) is True
    controller.observe_step(8, True, seconds=0.030)
    assert controller.batch_allows(batch, [4] * 8) is False
    controller.observe_step(8, False, seconds=0.010)
    # 8 * 5 tokens / 30 ms beats 8 tokens / 10 ms; while speculation wins, every (1 x 8 x 4)th
    # decision explores plain decoding
    assert [controller.batch_allows(batch, [4] * 8) for _ in range(32)] == [True] * 31 + [False]
    for request in batch:  # nothing accepted: 1 token per verification, speculation loses
        controller.observe(request, 4, 0)
        controller.observe(request, 4, 0)
    assert controller.batch_allows(batch, [0] * 8) is False  # paused: 1 token each
    controller.observe_step(8, True, seconds=0.100)
    assert controller.batch_allows(batch, [4] * 8) is False  # 8 * 1.0 tokens / 100 ms lose
    assert controller.batch_allows([R()], [4]) is True  # a smaller batch is measured on its own
    # a larger one takes the loss of the nearest smaller batch measured both ways
    assert controller.batch_allows([R() for _ in range(12)], [4] * 12) is False
    assert AdaptiveController(4, max_verify_tokens=10, adaptive=False).batch_allows([R()] * 50, [4] * 50)


def test_a_proposers_one_time_work_is_not_counted_as_the_steps_cost():
    """A draft's prefill of a new prompt (or an n-gram index of it) is reported as
    `setup_seconds` and left out of the step cost the controller compares."""
    from types import SimpleNamespace

    from ragspeed.engine.native.core.spec_decode.speculator import Speculator

    class Proposer:
        name = "once"
        setup_seconds = 0.0

        def propose_batch(self, requests, num_tokens):
            self.setup_seconds = 0.004
            return [[7] * k for k in num_tokens]

        def release(self, request_id):
            pass

    class Running:  # what the speculator reads of a running request
        prefill_only, num_tokens, num_computed_tokens, num_output_tokens = False, 10, 9, 1
        sampling = SimpleNamespace(
            params=SimpleNamespace(max_tokens=100, greedy=True, seed=None), processor=None
        )
        spec_token_ids: list[int] = []

    controller = AdaptiveController(4, max_verify_tokens=100)
    seen = []
    controller.observe_step = lambda n, speculated, seconds: seen.append((n, speculated, seconds))
    speculator = Speculator(Proposer(), controller)
    request = Running()
    speculator.propose([request], max_model_len=512)
    assert request.spec_token_ids == [7, 7, 7, 7]
    speculator.observe_step(0.006)
    assert seen == [(1, True, pytest.approx(0.002))]


def test_an_unlucky_verification_does_not_keep_speculation_off():
    """A request whose estimate one bad verification pushed below break-even drifts back
    toward the prior while unverified, and speculation resumes."""
    controller = AdaptiveController(4, max_verify_tokens=100, smoothing=0.5, explore_every=100)

    class R:
        pass

    steady, unlucky = R(), R()
    for _ in range(20):  # the prior learns acceptance 0.85
        controller.observe(steady, 20, 17)
    controller.observe_step(1, True, 0.0018)
    controller.observe_step(1, False, 0.0006)
    controller.num_tokens(unlucky)
    controller.observe(unlucky, 4, 0)  # ewma 0.85 -> ~0.43: 1.7 tokens for 3x the cost
    decisions = []
    for _ in range(30):
        k = controller.num_tokens(unlucky)
        decisions.append(controller.batch_allows([unlucky], [k]))
    assert decisions[0] is False and decisions[-1] is True
    assert decisions.index(True) < 15


# ---------------------------------------------------------------- greedy: identical output


class OracleProposer:
    """Proposes the reference continuation, with its third draft token wrong at every third
    position: long acceptances, rejections mid-draft and bonus tokens, all in one run."""

    name = "oracle"

    def __init__(self, prompts, outputs):
        self.references = {tuple(p): list(o) for p, o in zip(prompts, outputs)}

    def propose(self, token_ids, num_tokens):
        for prompt, output in self.references.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                pos = len(token_ids) - len(prompt)
                drafts = output[pos : pos + num_tokens]
                if pos % 3 == 0 and len(drafts) > 2:
                    drafts[2] = (drafts[2] + 1) % 384
                return drafts
        return []


def _run(path, prompts, params=GREEDY, speculative=None, oracle=None, **overrides):
    engine = make_engine(path, speculative=speculative, **overrides)
    if engine.speculator is not None:
        speculate_every_step(engine)
        if oracle is not None:
            engine.speculator.proposer = oracle
    requests = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    out = engine.generate(requests)
    assert_all_blocks_free(engine)
    return [out[f"r{i}"]["token_ids"] for i in range(len(prompts))], engine


@pytest.mark.parametrize("family, proposer", [("qwen3", "ngram"), ("llama", "oracle")])
def test_greedy_single_and_batched_identical_to_plain_decoding(tiny_checkpoints, family, proposer):
    path = tiny_checkpoints[family]
    plain, _ = _run(path, PROMPTS)
    oracle = OracleProposer(PROMPTS, plain) if proposer == "oracle" else None
    for prompts in ([PROMPTS[2]], PROMPTS):
        spec, engine = _run(path, prompts, speculative="ngram", oracle=oracle)
        assert spec == plain[: len(prompts)] if len(prompts) > 1 else spec == [plain[2]]
        stats = engine.stats()
        assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
        assert stats[f"spec_{proposer}_draft_tokens"] == stats["spec_draft_tokens"]
        assert 0 < stats["spec_acceptance_rate"] <= 1
        # every verification appended accepted + 1 tokens, the rest were plain decodes
        assert stats["spec_accepted_tokens"] <= stats["generation_tokens_total"]
        assert engine.num_steps < sum(len(ids) for ids in plain[: len(prompts)]) + len(prompts)


def test_greedy_identical_with_prefix_caching_chunked_prefill_and_preemption(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    plain, _ = _run(path, PROMPTS)
    oracle = OracleProposer(PROMPTS, plain)
    # chunked prefill: 16-token budget, drafts share it with prefill chunks
    chunked, engine = _run(path, PROMPTS, speculative="ngram", oracle=oracle, max_num_batched_tokens=16)
    assert chunked == plain and engine.stats()["spec_accepted_tokens"] > 0
    # preemption forced: a pool of 20 blocks x 8 tokens cannot hold 4 requests of ~80 tokens
    tight, engine = _run(
        path,
        PROMPTS,
        speculative="ngram",
        oracle=oracle,
        num_kv_cache_tokens=160,
        max_model_len=128,
    )
    assert tight == plain and engine.scheduler.num_preemptions > 0
    assert engine.stats()["spec_accepted_tokens"] > 0
    # prefix caching: the same prompts twice on one engine, the second round hits the cache
    engine = make_engine(path, speculative="ngram")
    speculate_every_step(engine)
    engine.speculator.proposer = oracle
    for round_ in range(2):
        out = engine.generate([GenerationRequest(f"c{round_}{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        assert [out[f"c{round_}{i}"]["token_ids"] for i in range(4)] == plain
    assert out["c10"]["num_cached_tokens"] > 0
    assert_all_blocks_free(engine)


def test_stop_token_inside_accepted_drafts_ends_the_request(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    plain, _ = _run(path, [PROMPTS[1]])
    stop = plain[0][12]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    want, _ = _run(path, [PROMPTS[1]], params)
    got, _ = _run(path, [PROMPTS[1]], params, speculative="ngram")
    assert got == want and got[0][-1] == stop


# ---------------------------------------------------------------- sampling: lossless


def _tiny_logits(hf_model, prompt, drafts) -> torch.Tensor:
    """The target's logits at the prompt's last token and each draft: [1 + k, vocab]."""
    ids = torch.tensor([list(prompt) + list(drafts)])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0]
    return logits[len(prompt) - 1 :].float()


def test_rejection_sampler_keeps_the_target_distribution(hf_models):
    from scipy.stats import chisquare

    state = SamplingState.create(
        SamplingParams(max_tokens=8, temperature=1.5, top_k=6), eos_token_ids=(), device="cpu"
    )
    prompt = PROMPTS[3][:12]
    logits0 = _tiny_logits(hf_models["llama"], prompt, ())
    p0 = target_probs(logits0, state)[0]
    # draft the target's second most likely token, then the most likely one after it
    x0 = int(p0.argsort(descending=True)[1])
    logits = _tiny_logits(hf_models["llama"], prompt, (x0,))
    x1 = int(logits[1].argmax())
    logits = _tiny_logits(hf_models["llama"], prompt, (x0, x1))
    probs = target_probs(logits, state)  # [3, vocab]
    generator = torch.Generator().manual_seed(0)
    num_samples = 6000
    first = torch.zeros(probs.shape[1])
    second = torch.zeros(probs.shape[1])
    for _ in range(num_samples):
        out = verify_sampled(logits, (x0, x1), state, generator)
        first[out[0]] += 1
        if out[0] == x0:
            second[out[1]] += 1
    support = p0 > 0
    assert int(support.sum()) == 6
    # first token ~ p0 (the draft accepted with p0(x0), else the residual)
    _, p_value = chisquare(first[support].numpy(), (probs[0][support] * num_samples).numpy())
    assert p_value > 1e-3
    # second token, given the first draft was accepted: ~ p1 (x1 accepted or recovered)
    support1 = probs[1] > 0
    n1 = second.sum()
    assert abs(n1 / num_samples - float(probs[0, x0])) < 0.03
    _, p_value = chisquare(second[support1].numpy(), (probs[1][support1] * n1).numpy())
    assert p_value > 1e-3
    assert first[~support].sum() == 0 and second[~support1].sum() == 0


def test_sampled_speculation_runs_and_frees_blocks(tiny_checkpoints):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    outs, engine = _run(tiny_checkpoints["llama"], PROMPTS, params, speculative="ngram")
    assert [len(ids) for ids in outs] == [30, 30, 30, 30]
    again, _ = _run(tiny_checkpoints["llama"], PROMPTS, params, speculative="ngram")
    assert again == outs  # seeded requests are reproducible with speculation too
    assert engine.stats()["spec_draft_tokens"] > 0


# ---------------------------------------------------------------- adaptivity and bad input


def test_large_batches_switch_speculation_off(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculative="ngram", num_speculative_tokens=4)
    engine.speculator.controller.max_verify_tokens = 10  # two decodes of 1 + 4 at most
    out = engine.generate([GenerationRequest(f"b{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    plain, _ = _run(path, PROMPTS)
    assert [out[f"b{i}"]["token_ids"] for i in range(4)] == plain
    stats = engine.stats()
    assert stats["spec_steps_switched_off"] > 0
    assert_all_blocks_free(engine)


def test_speculation_is_off_by_default(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    assert engine.speculator is None and "spec_draft_tokens" not in engine.stats()


def test_a_zoo_model_speculates_with_its_zoo_draft_when_none_is_given():
    from ragspeed.engine.native.core.spec_decode.draft import DraftProposer
    from ragspeed.engine.native.loading.model_zoo import DEMO_DRAFT_MODEL_NAME, DEMO_MODEL_NAME

    engine = make_engine(DEMO_MODEL_NAME, speculative="draft")
    assert isinstance(engine.speculator.proposer, DraftProposer)
    assert engine.speculator.proposer.loaded.path.name == DEMO_DRAFT_MODEL_NAME


def test_bad_speculation_settings_fail_at_start_up(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with pytest.raises(EngineError, match="needs a draft model") as err:
        make_engine(path, speculative="draft")
    assert err.value.param == "draft_model"
    assert f"ragspeed train-draft --target {path}" in str(err.value)
    with pytest.raises(EngineError, match="unknown speculative method 'medusa'"):
        make_engine(path, speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        make_engine(path, speculative="ngram", num_speculative_tokens=0)
    for backend in ("transformers", "openai"):
        with pytest.raises(ValueError, match=f"backend '{backend}' has none"):
            build_engine(EngineConfig(backend=backend, model=str(path), speculative="ngram"))


@pytest.mark.slow
def test_bench_spec_runs_on_the_demo_model(shared_data):
    from ragspeed.bench.spec import run_bench_spec

    result = run_bench_spec(
        data_path=shared_data / "nq_dev.jsonl",
        num_prompts=2,
        max_tokens=16,
        batch_max_tokens=4,
        repeats=1,
    )
    assert result["outputs_identical"] is True
    assert 0 <= result["ngram_acceptance"] <= 1 and result["batch16_ratio"] > 0
    assert result["ceiling_acceptance"] == 1.0 and result["ceiling_speedup"] > 0
    assert result["quantization"] == "gguf"  # serve's default path: the file's own blocks
    assert result["ceiling_verification_steps"] == pytest.approx(5 / result["ceiling_speedup"])


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_identical_whatever_the_batch_and_the_row_counts(tiny_checkpoints, quantization):
    """Verification batches of 4 x (1 + k) rows against plain decoding's 4 rows: products of
    decode-type steps run on the row-invariant blocked kernels on CPU, int8 included."""
    path = tiny_checkpoints["llama"]
    plain, _ = _run(path, PROMPTS, quantization=quantization)
    alone = [_run(path, [p], quantization=quantization)[0][0] for p in PROMPTS]
    assert alone == plain
    oracle = OracleProposer(PROMPTS, plain)
    spec, engine = _run(path, PROMPTS, speculative="ngram", oracle=oracle, quantization=quantization)
    assert spec == plain and engine.stats()["spec_accepted_tokens"] > 0
