"""Drafts with a sub-vocabulary head (a `d2t` map): target ids in and out, identical greedy
output with and without the CPU kernels, the target's distribution kept when sampling, and
maps that do not fit their target refused at start-up."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from ragspeed import environment
from ragspeed.engine.native.compute.cpu_kernels.build import load_library
from ragspeed.engine.native.core.sampling import SamplingState
from ragspeed.engine.native.core.spec_decode import DraftProposer, verify_sampled
from ragspeed.engine.native.core.spec_decode.rejection import target_probs, verify_sampled_q
from ragspeed.engine.native.loading.loader import load_model
from ragspeed.engine.protocol import EngineError, GenerationRequest, SamplingParams
from tests.engine.conftest import assert_all_blocks_free, make_engine
from tests.engine.tiny_models import VOCAB_SIZE, build_sub_vocab_draft, build_tiny_checkpoint


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread (see test_spec_draft.py)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [tuple(range(10 + 7 * i, 10 + 7 * i + 5 + 9 * i)) for i in range(6)]  # 5 .. 50 tokens
EVEN_IDS = tuple(range(0, VOCAB_SIZE, 2))  # a 192-token sub-vocabulary


@pytest.fixture(scope="module")
def sub_drafts(tiny_checkpoints, tmp_path_factory) -> dict:
    """'reversed': the target itself with its head's rows in reverse order (a full-size map, so
    every draft is accepted only if the map is applied); 'even': the target's first layer with a
    head over the even ids only."""
    root = tmp_path_factory.mktemp("sub-drafts")
    target = tiny_checkpoints["llama"]
    return {
        "reversed": build_sub_vocab_draft(target, root / "reversed", range(VOCAB_SIZE - 1, -1, -1)),
        "even": build_sub_vocab_draft(target, root / "even", EVEN_IDS, num_layers=1),
    }


@pytest.fixture(params=["kernels", "no-kernels"])
def kernels(request, monkeypatch):
    """Every product and the draft's steps in ragspeed's CPU kernels, or none of them."""
    if request.param == "no-kernels":
        monkeypatch.setenv("RAGSPEED_CPU_KERNELS", "0")
    environment.configure()
    load_library.cache_clear()
    yield request.param
    monkeypatch.delenv("RAGSPEED_CPU_KERNELS", raising=False)
    environment.configure()
    load_library.cache_clear()


def _generate(engine, prompts, params=GREEDY) -> list[list[int]]:
    out = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return [out[f"r{i}"]["token_ids"] for i in range(len(prompts))]


@pytest.mark.parametrize("draft", ["reversed", "even"])
def test_greedy_with_a_sub_vocabulary_draft_is_identical_to_plain_decoding(
    tiny_checkpoints, sub_drafts, kernels, draft
):
    path = tiny_checkpoints["llama"]
    plain = _generate(make_engine(path), PROMPTS)
    engine = make_engine(
        path, speculative="draft", draft_model=str(sub_drafts[draft]), draft_quantization="none"
    )
    engine.speculator.controller.adaptive = False  # speculate in every step
    proposer = engine.speculator.proposer
    assert (proposer.fused_steps and proposer.model._fused_decoder() is not None) == (kernels == "kernels")
    assert proposer.model.lm_head.out_features == {"reversed": VOCAB_SIZE, "even": 192}[draft]
    assert _generate(engine, PROMPTS) == plain
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0
    if draft == "reversed":  # the target's own head, rows reordered: the map undoes the order
        assert stats["spec_acceptance_rate"] == 1.0
    else:  # odd ids are never drafted: a target choosing one rejects the draft
        assert 0.0 < stats["spec_acceptance_rate"] < 1.0
    assert_all_blocks_free(engine)
    assert proposer.manager.num_free_blocks == proposer.manager.num_blocks


@pytest.mark.parametrize("min_confidence", [0.0, 0.5])
def test_fused_sub_vocabulary_steps_propose_target_ids_as_the_loop_does(sub_drafts, min_confidence):
    """The kernels' greedy steps map the argmax row through d2t, like the torch loop."""
    loaded = load_model(sub_drafts["even"], max_model_len=256)
    assert loaded.model.d2t.tolist() == list(EVEN_IDS)
    proposers = [
        DraftProposer(loaded, num_blocks=64, block_size=8, device="cpu", min_confidence=min_confidence)
        for _ in range(2)
    ]
    proposers[1].fused_steps = False
    requests = [SimpleNamespace(request_id=f"r{i}", all_token_ids=list(p)) for i, p in enumerate(PROMPTS[:4])]
    proposed_ids = set()
    for round_ in range(3):
        first, second = (p.propose_batch(requests, [4, 2, 5, 1]) for p in proposers)
        assert first == second
        proposed_ids.update(t for d in first for t in d)
        for request, proposed in zip(requests, first):
            request.all_token_ids += proposed[:2] + [7 + round_]  # an odd id: never a draft
    assert proposed_ids <= set(EVEN_IDS) and len(proposed_ids) > 3
    assert loaded.model._fused_decoder().greedy


def test_rejection_sampling_keeps_the_target_distribution_with_a_sub_vocabulary_draft(
    tiny_checkpoints, tmp_path
):
    """The target's two most likely tokens lie outside the draft's vocabulary, so the draft
    never proposes them (its proposal gives them zero probability): rejection sampling must
    still emit them at the target's rates. Drafts are greedy, a point-mass proposal (the only
    kind the engine's sampler takes, engine.native.core.spec_decode.rejection)."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["llama"]
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state = SamplingState.create(
        SamplingParams(max_tokens=8, temperature=1.5, top_k=8), eos_token_ids=(), device="cpu"
    )
    prompt = list(PROMPTS[3][:12])

    def probs_after(drafts: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + drafts])).logits[0, len(prompt) - 1 :]
        return target_probs(logits.float(), state), logits.float()  # [1 + k, vocab]

    p0 = probs_after([])[0][0]
    top_two = p0.argsort(descending=True)[:2].tolist()
    sub_vocab = [t for t in range(VOCAB_SIZE) if t not in top_two]
    draft = build_sub_vocab_draft(path, tmp_path / "draft", sub_vocab)
    proposer = DraftProposer(load_model(draft, max_model_len=256), num_blocks=16, block_size=8, device="cpu")
    drafts = proposer.propose_batch([SimpleNamespace(request_id="r", all_token_ids=prompt)], [2])[0]
    assert len(drafts) == 2 and not set(drafts) & set(top_two)
    probs, logits = probs_after(drafts)
    assert round(float(probs[0, top_two].sum()), 3) == 0.443  # the mass the draft never proposes
    generator = torch.Generator().manual_seed(0)
    num_samples = 8000
    first = torch.zeros(VOCAB_SIZE)
    second = torch.zeros(VOCAB_SIZE)
    for _ in range(num_samples):
        out = verify_sampled(logits, drafts, state, generator)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    # The first token ~ p0 over its 8 tokens (top-k 8): chi-square with 7 degrees of freedom,
    # below 24.32 (p = 0.001).
    support = probs[0] > 0
    assert int(support.sum()) == 8 and first[~support].sum() == 0
    statistic, _ = chisquare(first[support].numpy(), (probs[0][support] * num_samples).numpy())
    assert statistic < 24.32
    assert first[top_two].sum() / num_samples == pytest.approx(float(probs[0, top_two].sum()), abs=0.02)
    # The second, given the first draft was accepted: ~ p1.
    support1 = probs[1] > 0
    n1 = second.sum()
    statistic, _ = chisquare(second[support1].numpy(), (probs[1][support1] * n1).numpy())
    assert statistic < 24.32 and second[~support1].sum() == 0
    # The same test fails a sampler that keeps the draft whenever it is proposed.
    wrong = first.clone()
    wrong[drafts[0]] += wrong[top_two].sum()
    wrong[top_two] = 0
    statistic, _ = chisquare(wrong[support].numpy(), (probs[0][support] * num_samples).numpy())
    assert statistic > 24.32


def test_rejection_sampling_with_a_sampled_proposal_zero_outside_the_sub_vocabulary():
    """A general proposal q (drafts drawn from a sub-vocabulary head's softmax, zero elsewhere):
    accept with min(1, p/q), else draw from max(0, p - q); the output is ~p, including the
    tokens q never proposes."""
    from scipy.stats import chisquare

    vocab = 8
    state = SamplingState.create(
        SamplingParams(max_tokens=2, temperature=1.0), eos_token_ids=(), device="cpu"
    )
    p_logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 1.2]] * 2)  # [1 + k, vocab], k = 1
    p = target_probs(p_logits, state)[0]
    sub_vocab = torch.tensor([0, 2, 3, 5])  # 1, 4, 6, 7 are never drafted
    q = torch.zeros(vocab)
    q[sub_vocab] = torch.tensor([0.1, 0.5, 0.3, 0.1])  # far from p on purpose
    generator = torch.Generator().manual_seed(0)
    num_samples = 20000
    counts = torch.zeros(vocab)
    for _ in range(num_samples):
        x = int(torch.multinomial(q, 1, generator=generator))
        counts[verify_sampled_q(p_logits, [x], q[None], state, generator)[0]] += 1
    # 7 degrees of freedom: below 24.32 (p = 0.001)
    statistic, _ = chisquare(counts.numpy(), (p * num_samples).numpy())
    assert statistic < 24.32
    assert counts[[1, 4, 6, 7]].sum() / num_samples == pytest.approx(float(p[[1, 4, 6, 7]].sum()), abs=0.01)
    # q's own distribution (every draft accepted) fails the same test
    statistic, _ = chisquare((q * num_samples).numpy() + 1e-9, (p * num_samples).numpy())
    assert statistic > 24.32


# ---------------------------------------------------------------- bad input


def _rewrite(draft, *, d2t=None, config_changes=None):
    weights = load_file(str(draft / "model.safetensors"))
    if d2t is not None:
        weights["d2t"] = d2t
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    if config_changes:
        config = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps({**config, **config_changes}))


@pytest.mark.parametrize(
    "case, message",
    [
        ("id out of range", r"'d2t' holds ids 0 \.\. 384, outside the vocabulary of 384 tokens"),
        (
            "wrong length",
            r"'d2t' must be 192 integer token ids \(draft_vocab_size\), got a torch.int64 tensor",
        ),
        ("repeated id", "'d2t' maps two head rows to the same token id"),
        ("float map", r"'d2t' must be 192 integer token ids \(draft_vocab_size\), got a torch.float32"),
        ("no map", "checkpoint lacks the 'd2t' map of its draft_vocab_size=192 head"),
        ("smaller vocabulary", "its embedding has 256 rows, the target's vocabulary 384 tokens"),
    ],
)
def test_a_map_that_does_not_fit_the_target_fails_at_start_up_naming_both(
    tiny_checkpoints, tmp_path, case, message
):
    path = tiny_checkpoints["llama"]
    draft = build_sub_vocab_draft(path, tmp_path / "draft", EVEN_IDS)
    even = torch.tensor(EVEN_IDS)
    if case == "id out of range":
        _rewrite(draft, d2t=torch.cat([even[:-1], torch.tensor([VOCAB_SIZE])]))
    elif case == "wrong length":
        _rewrite(draft, d2t=even[:100])
    elif case == "repeated id":
        _rewrite(draft, d2t=torch.cat([even[:-1], even[:1]]))
    elif case == "float map":
        _rewrite(draft, d2t=even.float())
    elif case == "no map":
        weights = load_file(str(draft / "model.safetensors"))
        del weights["d2t"]
        save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    else:  # a draft whose embedding stops at id 255: the target's ids above would index past it
        weights = load_file(str(draft / "model.safetensors"))
        weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:256].clone()
        weights["d2t"] = even[:128]
        weights["lm_head.weight"] = weights["lm_head.weight"][:128].clone()
        save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
        _rewrite(draft, config_changes={"vocab_size": 256, "draft_vocab_size": 128})
    with pytest.raises(EngineError, match=message) as err:
        make_engine(path, speculative="draft", draft_model=str(draft))
    assert err.value.param == "draft_model"
    assert str(draft) in str(err.value) and str(path) in str(err.value)


def test_a_map_beyond_the_targets_vocabulary_and_a_draft_served_as_a_target_fail(tiny_checkpoints, tmp_path):
    # A target with 256 embedding rows, a draft (of the 384-token tiny llama) proposing id 300.
    small = build_tiny_checkpoint("llama", tmp_path / "small", seed=1, vocab_size=256)
    draft = build_sub_vocab_draft(tiny_checkpoints["llama"], tmp_path / "draft", EVEN_IDS)
    with pytest.raises(
        EngineError, match="holds id 382, outside the target's vocabulary of 256 tokens"
    ) as err:
        make_engine(small, speculative="draft", draft_model=str(draft))
    assert str(draft) in str(err.value) and str(small) in str(err.value)
    with pytest.raises(
        ValueError, match="is a draft with a 192-token sub-vocabulary head, not a model to serve"
    ):
        make_engine(draft)
