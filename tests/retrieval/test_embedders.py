import pytest
import sentence_transformers

from ragspeed.retrieval.embedders import SentenceTransformerEmbedder
from ragspeed.retrieval.errors import RetrievalError


class _NoDimensionModel:
    """A model that, like some sentence-transformers pipelines, declares no vector size."""

    max_seq_length = None

    def __init__(self, path, device=None):
        pass

    def get_embedding_dimension(self):
        return None


def test_model_without_a_vector_size_is_a_retrieval_error(monkeypatch):
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", _NoDimensionModel)
    with pytest.raises(RetrievalError, match="does not declare its vector size") as info:
        SentenceTransformerEmbedder("some/model")
    assert info.value.param == "model"
