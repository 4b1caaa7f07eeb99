"""Demo-model training pieces on literal inputs, a 3-step training run, and the committed model."""

import math
import random
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ragspeed import environment
from ragspeed.engine.native.loading.model_zoo import resolve_model
from ragspeed.training.cli import train_demo, train_draft
from ragspeed.training.corpus import detokenize_wikitext, load_corpus, read_wikitext_articles
from ragspeed.training.demo import ChatEncoder, chunk_documents, copied_share, encode_documents
from ragspeed.training.examples import make_extractive_example, make_passage_example, split_sentences
from ragspeed.training.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, save_tokenizer, train_tokenizer
from ragspeed.training.trainer import (
    Phase,
    Piece,
    TrainingConfig,
    masked_lm_loss,
    pack_rows,
    target_accuracy,
    train_causal_lm,
)

PASSAGES = (
    "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen. "
    "John Bardeen is the only laureate to win the prize twice.",
    "Deadpool 2 is scheduled to be released in the United States on May 18, 2018. "
    "A sequel, Deadpool 3, is in development.",
)
QUOTE_PASSAGES = (
    *PASSAGES,
    "The Amazon River in South America is the largest river by discharge volume of water in the world.",
)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("ragspeed-demo"))


@pytest.fixture(scope="module")
def demo_model():
    return AutoModelForCausalLM.from_pretrained(resolve_model("ragspeed-demo"), dtype=torch.float32)


def test_detokenize_wikitext():
    line = ' He had a guest @-@ starring role , worth 1 @,@ 000 ( about $ 2 ) in " The Bill " . '
    assert detokenize_wikitext(line) == 'He had a guest-starring role, worth 1,000 (about $2) in "The Bill".'


def test_read_wikitext_articles(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(
        " = Robert Boulter = \n \n Robert Boulter is an actor . \n = = Career = = \n He won . \n = Other = \n Text .\n"
    )
    assert read_wikitext_articles(path) == [
        "Robert Boulter\nRobert Boulter is an actor.\n\nCareer\nHe won.",
        "Other\nText.",
    ]


def test_split_sentences():
    assert split_sentences(PASSAGES[0]) == [
        "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen.",
        "John Bardeen is the only laureate to win the prize twice.",
    ]


def test_extractive_example_quotes_a_sentence_of_the_shown_passages():
    rng = random.Random(3)
    for _ in range(20):
        example = make_extractive_example(PASSAGES, rng, max_passages=2)
        if example is None:
            continue
        prompt = "\n".join(m["content"] for m in example.messages)
        assert example.answer in prompt
        assert example.answer in {s for p in PASSAGES for s in split_sentences(p)}
        assert example.messages[0]["role"] == "system" and example.messages[-1]["role"] == "user"


def test_train_tokenizer_round_trips_non_ascii(tmp_path):
    tokenizer = train_tokenizer(list(PASSAGES) * 3, vocab_size=300)
    save_tokenizer(tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.convert_ids_to_tokens(list(range(6))) == list(SPECIAL_TOKENS)
    text = "Röntgen — naïve 東京 ✓"
    ids = loaded(text).input_ids
    assert ids[0] == loaded.bos_token_id == 1
    assert loaded.decode(ids, skip_special_tokens=True) == text


def test_demo_tokenizer(demo_tokenizer):
    tok = demo_tokenizer
    assert len(tok) == 4096
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|end|>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for text in (
        "Wilhelm Conrad Röntgen won in 1901.",
        "Ünïcödé — 東京 and emoji 🙂",
        "  two  spaces\nand a newline",
    ):
        assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert tok.chat_template == CHAT_TEMPLATE


def test_chat_template_renders(demo_tokenizer):
    messages = [
        {"role": "system", "content": "Answer using the documents."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Why?"},
    ]
    rendered = demo_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|bos|><|system|>\nAnswer using the documents.<|end|>\n<|user|>\nHi<|end|>\n"
        "<|assistant|>\nHello.<|end|>\n<|user|>\nWhy?<|end|>\n<|assistant|>\n"
    )
    ids = demo_tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert ids[:3] == [1, 3, demo_tokenizer.convert_tokens_to_ids("Ċ")]  # <|bos|><|system|>\n
    with pytest.raises(Exception, match="unknown role: tool"):
        demo_tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_chat_encoder_masks_all_but_the_reply(demo_tokenizer):
    piece = ChatEncoder(demo_tokenizer).encode([{"role": "user", "content": "Quote it."}], "It is.")
    reply_ids = [t for t, m in zip(piece.token_ids, piece.loss_mask) if m]
    assert demo_tokenizer.decode(reply_ids) == "It is.<|end|>"
    assert demo_tokenizer.decode([t for t, m in zip(piece.token_ids, piece.loss_mask) if not m]) == (
        "<|bos|><|user|>\nQuote it.<|end|>\n<|assistant|>\n"
    )


def test_pack_rows_and_chunking():
    pieces = [Piece((5, 6, 7), (1, 1, 1)), Piece((8, 9), (0, 1)), Piece((1, 2, 3, 4, 5, 6), (1,) * 6)]
    ids, mask = pack_rows(pieces, seq_len=5, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9]]  # the 6-token piece is longer than a row: dropped
    assert mask.tolist() == [[1, 1, 1, 0, 1]]
    ids, mask = pack_rows(pieces[:2], seq_len=4, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0], [0, 1, 0, 0]]
    chunks = chunk_documents([[1, 10, 11, 12, 13, 2]], seq_len=4)
    assert [c.token_ids for c in chunks] == [(1, 10, 11, 12), (13, 2)]


def test_masked_lm_loss_ignores_masked_targets():
    token_ids = torch.tensor([[0, 1, 2]])
    logits = torch.full((1, 3, 4), -10.0)
    logits[0, 0, 1] = 10.0  # predicts token 1 well
    # position 1 is uniform over 4 tokens (loss ln 4) when predicting token 2; masked out, it is ignored
    assert masked_lm_loss(logits, token_ids, torch.tensor([[0, 1, 0]])).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_lm_loss(logits, token_ids, torch.tensor([[0, 1, 1]])).item() == pytest.approx(
        math.log(4) / 2
    )


def test_train_causal_lm_three_steps():
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    pieces = [Piece(tuple(range(1, 17)), (1,) * 16)] * 8
    phase = Phase(seq_len=16, batch_size=2, time_fraction=1.0, make_pieces=lambda rng: list(pieces))
    lines = []
    model, log = train_causal_lm(
        config,
        [phase],
        TrainingConfig(max_minutes=1, max_steps=3, warmup_steps=1, log_every=1, num_threads=1),
        pad_id=0,
        log=lines.append,
    )
    assert log.steps == 3 and log.tokens == 3 * 2 * 16
    assert [step for step, _ in log.losses] == [1, 2, 3]
    assert log.losses[-1][1] < log.losses[0][1]
    assert not model.training


def test_corpus_split_is_seeded(shared_data):
    corpus = load_corpus(shared_data, seed=0)
    assert (len(corpus.train_passages), len(corpus.heldout_passages)) == (1297, 68)
    assert (len(corpus.train_articles), len(corpus.heldout_articles)) == (59, 3)
    assert load_corpus(shared_data, seed=0).heldout_passages == corpus.heldout_passages
    with pytest.raises(ValueError, match="heldout_fraction"):
        load_corpus(shared_data, heldout_fraction=0.9)


def test_encode_documents_adds_bos_and_eos(demo_tokenizer):
    [ids] = encode_documents(demo_tokenizer, ["Hello world."])
    assert ids[0] == 1 and ids[-1] == 2
    assert demo_tokenizer.decode(ids[1:-1]) == "Hello world."


def test_demo_model_loads_fp32_and_generates_deterministically(demo_model, demo_tokenizer):
    assert demo_model.config.architectures == ["LlamaForCausalLM"]
    assert demo_model.config.num_hidden_layers == 8
    assert demo_model.config.max_position_embeddings == 4096
    assert all(p.dtype == torch.float32 for p in demo_model.parameters())
    messages = [
        {"role": "system", "content": "Answer using the documents."},
        {
            "role": "user",
            "content": "Documents:\n[1] " + PASSAGES[0] + '\n\nQuote the sentence that mentions "Bardeen".',
        },
    ]
    prompt = demo_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    outputs = [demo_model.generate(prompt, max_new_tokens=24, do_sample=False) for _ in range(2)]
    assert torch.equal(outputs[0], outputs[1])
    new_ids = outputs[0][0, prompt.shape[1] :].tolist()
    assert 0 < len(new_ids) <= 24
    assert demo_model.generation_config.eos_token_id == demo_tokenizer.eos_token_id == 2


@pytest.mark.slow
def test_train_demo_end_to_end(tmp_path, shared_data):
    from ragspeed.training.demo import train_demo

    figures = train_demo(
        tmp_path / "demo",
        data_dir=shared_data,
        minutes=1,
        max_steps=2,
        num_eval_examples=1,
        log=lambda _: None,
    )
    assert figures["steps"] == 2
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [
        "README.md",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "demo"), dtype=torch.float32)
    assert model.config.num_hidden_layers == 8


def test_passage_example_quotes_the_one_passage_holding_its_key():
    rng = random.Random(0)
    examples = [make_passage_example(QUOTE_PASSAGES, rng, max_passages=3) for _ in range(30)]
    examples = [e for e in examples if e is not None]
    assert len(examples) >= 20
    for example in examples:
        user = example.messages[-1]["content"]
        assert example.answer in user  # as shown: the label, then the passage
        label, passage = next(
            (example.answer[: -len(p)], p) for p in QUOTE_PASSAGES if example.answer.endswith(p)
        )
        assert label in (
            "[1] ",
            "[2] ",
            "[3] ",
            "Document 1: ",
            "Document 2: ",
            "Document 3: ",
        ) or label.startswith("### Document ")
        instruction = user.rsplit("\n\n", 1)[-1]
        others = [p for p in QUOTE_PASSAGES if p != passage and p in user]
        words = [w for w in re.findall(r"[\w'-]+", instruction) if len(w) > 2]
        assert any(w in passage and all(w not in p for p in others) for w in words), instruction


def test_target_accuracy_counts_only_targets():
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
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


class _Replies:
    """Stands in for a model's generate(): appends fixed replies, in turn."""

    def __init__(self, *replies):
        self.replies = list(replies)

    def generate(self, prompt, **_):
        return torch.cat([prompt, torch.tensor([self.replies.pop(0)])], dim=1)


def test_copied_share_counts_pairs_found_in_the_prompt(demo_tokenizer):
    example = make_passage_example(QUOTE_PASSAGES[:1], random.Random(0), max_passages=1)
    prompt = demo_tokenizer.apply_chat_template(
        list(example.messages), add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    span = prompt[-40:-28]  # a stretch of the prompt (of the passage shown)
    loop = [span[0]] * 12  # a one-token loop: its pairs are not in the prompt
    assert (span[0], span[0]) not in set(zip(prompt, prompt[1:]))
    assert copied_share(_Replies(span), demo_tokenizer, [example]) == 1.0
    assert copied_share(_Replies(loop), demo_tokenizer, [example]) == 0.0
    assert copied_share(_Replies(span[:7], loop[:7]), demo_tokenizer, [example, example]) == 0.5


def test_train_demo_needs_out_and_checks_its_data_dir(tmp_path):
    missing_out = CliRunner().invoke(train_demo, ["--data-dir", str(tmp_path)])
    assert missing_out.exit_code == 2 and "Missing option '--out'" in missing_out.output
    assert "default: (the shipped data" in " ".join(CliRunner().invoke(train_demo, ["--help"]).output.split())
    empty = CliRunner().invoke(train_demo, ["--out", str(tmp_path / "m"), "--data-dir", str(tmp_path)])
    assert empty.exit_code == 2
    assert f"{tmp_path} has no wiki_passages.txt and no wikitext2_raw_test.txt" in " ".join(
        empty.output.split()
    )
    assert not (tmp_path / "m").exists()


def test_train_draft_needs_out_and_a_target_model(tmp_path):
    (tmp_path / "wiki_passages.txt").write_text("A passage.\n")
    (tmp_path / "wikitext2_raw_test.txt").write_text(" = A =\n text\n")
    # only a zoo model with a trained draft in the zoo (the default model) has a default --out
    missing_out = CliRunner().invoke(train_draft, ["--data-dir", str(tmp_path), "--target", "ragspeed-demo"])
    assert missing_out.exit_code == 2
    assert "the zoo has no trained draft for 'ragspeed-demo' to write: pass --out DIR" in " ".join(
        missing_out.output.split()
    )
    no_model = CliRunner().invoke(
        train_draft, ["--out", str(tmp_path / "d"), "--data-dir", str(tmp_path), "--target", str(tmp_path)]
    )
    assert no_model.exit_code == 2 and "no config.json" in no_model.output
    assert not (tmp_path / "d").exists()


def test_ragspeed_train_demo_without_out_fails_before_training(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ragspeed", "train-demo", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Missing option '--out'" in result.stderr


def test_train_draft_of_the_default_model_writes_its_zoo_draft_by_default(tmp_path, monkeypatch):
    from ragspeed.engine.native.loading import model_zoo
    from ragspeed.training import cli

    (tmp_path / "wiki_passages.txt").write_text("A passage.\n")
    (tmp_path / "wikitext2_raw_test.txt").write_text(" = A =\n text\n")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path / "cache"))
    environment.configure()
    monkeypatch.setattr(model_zoo, "resolve_model", lambda name: str(target))
    calls = []
    monkeypatch.setattr(cli, "run_train_draft", lambda *args: calls.append(args) or {})
    result = CliRunner().invoke(
        train_draft, ["--data-dir", str(tmp_path), "--minutes", "55", "--threads", "2"]
    )
    assert result.exit_code == 0, result.output
    ((target_dir, out, _, minutes, _, _, threads, num_layers, command, draft_vocab),) = calls
    assert (target_dir, out) == (target, tmp_path / "cache" / "smollm2-135m-instruct-draft")
    assert (minutes, threads, num_layers, draft_vocab) == (55.0, 2, 2, 4096)
    assert command == f"ragspeed train-draft --minutes 55 --seed 0 --data-dir {tmp_path} --threads 2"
