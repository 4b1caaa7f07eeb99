"""LLMLingua-2 backend offline, on a tiny BERT token classifier the test builds."""

import pytest

from ragspeed.compression import CompressionError, Document
from ragspeed.compression.budget import Budget
from ragspeed.compression.llmlingua2 import LLMLingua2Compressor

WORDS = (
    "the capital of france is paris . it lies on the seine river and has many museums "
    "berlin germany city people live in large old towns ? !"
).split()


class WhitespaceTokenizer:
    def encode(self, text):
        return list(range(len(text.split())))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch
    from transformers import BertConfig, BertForTokenClassification, BertTokenizer

    path = tmp_path_factory.mktemp("llmlingua2-tiny")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(WORDS)) + ["##s", "##ly"]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=2,
    )
    BertForTokenClassification(config).save_pretrained(path)
    return path


def test_compresses_offline_counting_target_tokens(tiny_model):
    compressor = LLMLingua2Compressor(tiny_model)
    docs = [
        Document("a", "the capital of france is paris . it lies on the seine river and has many museums ."),
        Document("b", "berlin is the capital of germany . many people live in large old towns ."),
    ]
    result = compressor.compress(
        "what is the capital of france ?", docs, Budget(WhitespaceTokenizer(), rate=0.5)
    )
    assert result.method == "llmlingua2"
    assert result.num_original_tokens == 18 + 15  # whitespace tokens of both texts
    assert 0 < result.num_compressed_tokens < result.num_original_tokens
    assert result.num_compressed_tokens == sum(len(d.text.split()) for d in result.documents)
    assert result.budget_tokens == 16


def test_rate_one_keeps_everything(tiny_model):
    compressor = LLMLingua2Compressor(tiny_model)
    docs = [Document("a", "paris is the capital of france .")]
    result = compressor.compress("q", docs, Budget(WhitespaceTokenizer(), rate=1.0))
    assert result.documents[0].text == "paris is the capital of france ."


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(CompressionError) as err:
        LLMLingua2Compressor(tmp_path / "absent")
    assert err.value.param == "model_path"
    assert "no LLMLingua-2 model" in str(err.value)
    with pytest.raises(CompressionError):
        LLMLingua2Compressor(None)


def test_without_llmlingua_the_error_names_the_extra(tiny_model, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llmlingua", None)  # as if not installed
    with pytest.raises(CompressionError) as error:
        LLMLingua2Compressor(tiny_model)
    assert error.value.message == "llmlingua2 needs the llmlingua package: pip install 'ragspeed[llmlingua]'"
