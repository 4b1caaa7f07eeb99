"""The copy curriculum's rows, whole-passage quotes, the copying figures, and the demo's stages."""

import random
import re
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ragspeed.engine.training.copying import frequent_tokens, pattern_piece, repeat_piece, text_pattern_piece
from ragspeed.engine.training.demo import check_stage, copied_share
from ragspeed.engine.training.examples import make_passage_example
from ragspeed.engine.training.trainer import Piece, target_accuracy

PASSAGES = (
    "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen. "
    "John Bardeen is the only laureate to win the prize twice.",
    "Deadpool 2 is scheduled to be released in the United States on May 18, 2018. "
    "A sequel, Deadpool 3, is in development.",
    "The Amazon River in South America is the largest river by discharge volume of water in the world.",
)


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from ragspeed.engine.training.demo import DEMO_MODEL_DIR

    return PreTrainedTokenizerFast.from_pretrained(str(DEMO_MODEL_DIR))


def test_frequent_tokens_skips_special_ids_and_orders_by_count():
    documents = [[1, 9, 9, 9, 8, 8, 2], [1, 7, 9, 8, 2, 0, 0]]
    assert frequent_tokens(documents, 2, first_ordinary=7) == [9, 8]
    assert frequent_tokens(documents, 10, first_ordinary=7) == [9, 8, 7]


def test_repeat_piece_is_the_text_twice_cut_to_fit():
    piece = repeat_piece([10, 11, 12, 13, 14], 9, bos_id=1, eos_id=2)
    assert piece.token_ids == (1, 10, 11, 12, 2, 10, 11, 12) and all(piece.loss_mask)
    assert repeat_piece([10, 11], 9, bos_id=1, eos_id=2).token_ids == (1, 10, 11, 2, 10, 11)
    with_gap = repeat_piece([10, 11, 12, 13], 12, bos_id=1, eos_id=2, gap=[7] * 20)
    assert with_gap.token_ids == (1, 10, 11, 2, 7, 7, 7, 7, 7, 7, 10, 11)  # the text keeps a quarter of the row


def test_pattern_piece_repeats_a_pattern_and_targets_only_the_repeats():
    rng = random.Random(3)
    lengths = []
    for _ in range(200):
        piece = pattern_piece(list(range(10, 60)), 100, bos_id=1, rng=rng, min_len=4, max_len=12)
        ids, mask = piece.token_ids, piece.loss_mask
        first = mask.index(1)
        length = first - 1
        assert 4 <= length <= 12 and len(ids) == 100 and ids[0] == 1
        lengths.append(length)
        assert all(ids[i] == ids[i - length] for i in range(first, 100))
        assert all(mask[first:]) and not any(mask[:first])
    assert 0.35 < sum(length < 7 for length in lengths) / len(lengths) < 0.65  # log-uniform: half below sqrt(4 * 12)


def test_text_pattern_piece_repeats_a_span_of_the_document():
    document = list(range(100, 150))
    rng = random.Random(0)
    for _ in range(20):
        piece = text_pattern_piece(document, 64, bos_id=1, rng=rng, min_len=4, max_len=16)
        ids, first = piece.token_ids, piece.loss_mask.index(1)
        span = list(ids[1:first])
        assert 4 <= len(span) <= 16 and span == document[span[0] - 100 : span[0] - 100 + len(span)]
        assert all(ids[i] == ids[i - len(span)] for i in range(first, 64))
    assert text_pattern_piece([7, 8], 6, bos_id=1, rng=rng).token_ids == (1, 7, 8, 7, 8, 7)  # shorter than min_len


def test_passage_example_quotes_the_one_passage_holding_its_key():
    rng = random.Random(0)
    examples = [make_passage_example(PASSAGES, rng, max_passages=3) for _ in range(30)]
    examples = [e for e in examples if e is not None]
    assert len(examples) >= 20
    for example in examples:
        user = example.messages[-1]["content"]
        assert example.answer in user  # as shown: the label, then the passage
        label, passage = next((example.answer[: -len(p)], p) for p in PASSAGES if example.answer.endswith(p))
        assert label in ("[1] ", "[2] ", "[3] ", "Document 1: ", "Document 2: ", "Document 3: ") or label.startswith("### Document ")
        instruction = user.rsplit("\n\n", 1)[-1]
        others = [p for p in PASSAGES if p != passage and p in user]
        words = [w for w in re.findall(r"[\w'-]+", instruction) if len(w) > 2]
        assert any(w in passage and all(w not in p for p in others) for w in words), instruction


def test_target_accuracy_counts_only_targets():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    ids = [1]
    for position in range(9):  # the model's own greedy token at odd positions, another at even
        predicted = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(predicted if position % 2 == 0 else (predicted + 1) % 32)
    ids = tuple(ids)
    right, wrong = [1, 3, 5, 7, 9], [2, 4, 6, 8]
    only_right = Piece(ids, tuple(int(i in right) for i in range(10)))
    only_wrong = Piece(ids, tuple(int(i in wrong) for i in range(10)))
    assert target_accuracy(model, [only_right], 16, pad_id=0) == 1.0
    assert target_accuracy(model, [only_wrong], 16, pad_id=0) == 0.0
    both = target_accuracy(model, [only_right, only_wrong], 16, pad_id=0)
    assert both == pytest.approx(5 / 9)


def test_mix_phase_groups_pieces_of_each_kind(shared_data, demo_tokenizer):
    from dataclasses import replace

    from ragspeed.engine.training.corpus import load_corpus
    from ragspeed.engine.training.demo import FINETUNE_RECIPE, build_mix_phase

    recipe = replace(FINETUNE_RECIPE, groups_per_epoch=3)
    phase = build_mix_phase(recipe, load_corpus(shared_data, seed=0), demo_tokenizer)
    pieces = phase.make_pieces(random.Random(0))
    kinds = (recipe.patterns, recipe.text_patterns, recipe.repeats, recipe.chat, recipe.lm)
    assert len(pieces) == 3 * sum(kinds) and (phase.seq_len, phase.batch_size) == (768, 10)
    assert all(len(piece.token_ids) <= 768 for piece in pieces)
    patterns, text_patterns, repeats, chat, lm = (pieces[sum(kinds[:i]) : sum(kinds[: i + 1])] for i in range(5))
    bos, eos = demo_tokenizer.bos_token_id, demo_tokenizer.eos_token_id
    assert all(len(p.token_ids) == 768 and p.loss_mask[0] == 0 and p.loss_mask[-1] == 1 for p in patterns + text_patterns)
    for piece in repeats:
        ids = piece.token_ids
        text = ids[1 : ids.index(eos)]
        assert ids[0] == bos and ids[-len(text) :] == text and all(piece.loss_mask)
        assert len(ids) - 2 * len(text) - 2 <= recipe.max_gap  # the other text between
    assert all(p.loss_mask[0] == 0 and p.loss_mask[-1] == 1 and p.token_ids[-1] == eos for p in chat)
    assert all(all(p.loss_mask) for p in lm)


class _Replies:
    """Stands in for a model's generate(): appends fixed replies, in turn."""

    def __init__(self, *replies):
        self.replies = list(replies)

    def generate(self, prompt, **_):
        return torch.cat([prompt, torch.tensor([self.replies.pop(0)])], dim=1)


def test_copied_share_counts_pairs_found_in_the_prompt(demo_tokenizer):
    example = make_passage_example(PASSAGES[:1], random.Random(0), max_passages=1)
    prompt = demo_tokenizer.apply_chat_template(list(example.messages), add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    span = prompt[-40:-28]  # a stretch of the prompt (of the passage shown)
    loop = [span[0]] * 12  # a one-token loop: its pairs are not in the prompt
    assert (span[0], span[0]) not in set(zip(prompt, prompt[1:]))
    assert copied_share(_Replies(span), demo_tokenizer, [example]) == 1.0
    assert copied_share(_Replies(loop), demo_tokenizer, [example]) == 0.0
    assert copied_share(_Replies(span[:7], loop[:7]), demo_tokenizer, [example, example]) == 0.5


def test_check_stage(tmp_path):
    check_stage("base", None)
    (tmp_path / "config.json").write_text("{}")
    check_stage("copy", tmp_path)
    with pytest.raises(ValueError, match="^stage: must be one of base, copy, finetune, anneal, got 'warm'"):
        check_stage("warm", None)
    with pytest.raises(ValueError, match="^init: the base stage trains from scratch"):
        check_stage("base", tmp_path)
    with pytest.raises(ValueError, match="^init: the finetune stage goes on training a saved model"):
        check_stage("finetune", None)
    with pytest.raises(ValueError, match="^init: no saved model in"):
        check_stage("copy", tmp_path / "missing")


@pytest.mark.parametrize("args, message", [
    (["--stage", "copy"], "the copy stage goes on training a saved model"),
    (["--stage", "late"], "must be one of base, copy, finetune, anneal"),
])
def test_train_demo_cli_rejects_bad_stages_before_training(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "ragspeed", "train-demo", "--out", str(tmp_path / "m"), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in " ".join(result.stderr.replace("│", " ").split())  # typer boxes the message
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_copy_finetune_anneal_stages_end_to_end(tmp_path, shared_data):
    from ragspeed.engine.model_zoo import resolve_model
    from ragspeed.engine.training.demo import train_demo

    copy = train_demo(tmp_path / "copy", data_dir=shared_data, minutes=1, max_steps=1, num_eval_examples=1,
                      stage="copy", init=resolve_model("ragspeed-demo"), log=lambda _: None)
    assert copy["steps"] == 1 and 0.0 <= copy["pattern_token_accuracy"] <= 1.0
    tuned = train_demo(tmp_path / "tuned", data_dir=shared_data, minutes=1, max_steps=1, num_eval_examples=1,
                       stage="finetune", init=tmp_path / "copy", log=lambda _: None)
    assert tuned["steps"] == 1 and tuned["init"] == str(tmp_path / "copy")
    card = (tmp_path / "tuned" / "README.md").read_text()
    assert "--stage finetune --init" in card and "### How it was made (stage copy" in card
    assert "#### How it was made\n" in card  # the base stage's card, two levels down
    train_demo(tmp_path / "annealed", data_dir=shared_data, minutes=1, max_steps=1, num_eval_examples=1,
               stage="anneal", init=tmp_path / "tuned", log=lambda _: None)
    card = (tmp_path / "annealed" / "README.md").read_text()
    assert "--stage anneal --init" in card and "lr 0.0015 to 1e-05, cosine" in card and "5 x chat examples" in card
