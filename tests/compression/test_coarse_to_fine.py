"""The default cascade with the real (int8) MiniLM on a handful of documents."""

import pytest

from ragspeed.compression import Document, build_compressor
from ragspeed.compression.budget import Budget
from ragspeed.compression.scoring.embedding_cache import EmbeddingCache
from ragspeed.compression.scoring.minilm_encoder import MiniLMEncoder

DOCS = [
    Document(
        "0",
        "The Amazon is a river in South America. It carries more water than any other river.",
        "Amazon River",
    ),
    Document(
        "1",
        "Marie Curie was a physicist and chemist. She won the Nobel Prize in Physics in 1903.",
        "Marie Curie",
    ),
    Document(
        "2",
        "The first Nobel Prize in Physics was awarded in 1901. It went to Wilhelm Röntgen.",
        "Nobel Prize in Physics",
    ),
    Document("3", "Tokyo is the capital of Japan. It is one of the largest cities in the world.", "Tokyo"),
    Document(
        "4", "Röntgen discovered X-rays in 1895. He was a German engineer and physicist.", "Wilhelm Röntgen"
    ),
]
QUESTION = "who got the first nobel prize in physics"


@pytest.fixture(scope="module")
def cascade(static_encoder):
    cache = EmbeddingCache(1000)
    fine = MiniLMEncoder(cache=cache)
    return build_compressor(
        "coarse-to-fine", static_encoder=static_encoder, minilm_encoder=fine, cache=cache
    ), fine


def test_keeps_the_answer_at_high_compression(cascade, minilm_tokenizer):
    compressor, _ = cascade
    result = compressor.compress(QUESTION, DOCS, Budget(minilm_tokenizer, target_tokens=20))
    assert "It went to Wilhelm Röntgen." in result.text
    assert result.num_compressed_tokens <= 20
    assert result.kept_document_ids[0] == "2"


def test_second_call_hits_the_embedding_cache(cascade, minilm_tokenizer):
    compressor, fine = cascade
    first = compressor.compress(QUESTION, DOCS, Budget(minilm_tokenizer, rate=0.5))
    encoded = fine.num_encoded_texts
    second = compressor.compress(QUESTION, DOCS, Budget(minilm_tokenizer, rate=0.5))
    assert fine.num_encoded_texts == encoded  # nothing reached the transformer
    assert second.kept_sentences == first.kept_sentences


def test_cache_is_bounded():
    cache = EmbeddingCache(2)
    import numpy as np

    for i in range(3):
        cache.put(bytes([i]), np.zeros(1))
    assert len(cache) == 2 and cache.get(bytes([0])) is None and cache.get(bytes([2])) is not None
