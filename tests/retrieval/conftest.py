import pytest


@pytest.fixture(scope="session")
def embedder():
    from ragspeed.retrieval.embedders import SentenceTransformerEmbedder

    return SentenceTransformerEmbedder(progress_min_texts=10**9)


@pytest.fixture(scope="session")
def tokenizer(embedder):
    return embedder.tokenizer


class WhitespaceTokenizer:
    """A tokenizer without offsets: words are tokens (exercises the encode/decode path)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(self.words[i] for i in token_ids)


@pytest.fixture
def whitespace_tokenizer():
    return WhitespaceTokenizer()
