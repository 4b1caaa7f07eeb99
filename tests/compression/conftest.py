"""Shared fixtures: the distilled static model (built once into the disk cache, about 50 s the
first time on 2 cores, then loaded in well under a second) and a whitespace tokenizer."""

import pytest


class WhitespaceTokenizer:
    """A target tokenizer with literal counts: one token per white-space separated word."""

    def encode(self, text):
        return list(range(len(text.split())))


@pytest.fixture(scope="session")
def ws_tokenizer():
    return WhitespaceTokenizer()


@pytest.fixture(scope="session")
def static_encoder():
    from ragspeed.compression.scoring.static_encoder import StaticEncoder

    return StaticEncoder()


@pytest.fixture(scope="session")
def minilm_tokenizer():
    from transformers import AutoTokenizer

    from ragspeed.compression.scoring.static_encoder import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path())
