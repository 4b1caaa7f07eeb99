"""The compression stage's forecast, which the admission checks before compressing."""

from ragspeed.compression import Budget
from ragspeed.compression.base import count_tokens_many
from ragspeed.document import Document
from ragspeed.gateway.compress import CompressionStage
from ragspeed.gateway.prompt import Segments
from ragspeed.gateway.protocol import CompressionOptions
from ragspeed.gateway.settings import CompressionSettings

QUESTION = "Who wrote the play Hamlet?"
TEXTS = [
    "Hamlet is a tragedy written by William Shakespeare sometime between 1599 and 1601.",
    "The Globe Theatre was a theatre in London associated with William Shakespeare.",
    "Elsinore is the setting of the play, a castle on the coast of Denmark.",
    "Christopher Marlowe was an English playwright, a contemporary of Shakespeare.",
]


def test_the_forecast_is_the_budget_and_the_recent_compressions_seconds_a_token(demo_tokenizer):
    stage = CompressionStage(CompressionSettings(methods=["bm25"], min_document_tokens=0), demo_tokenizer)
    segments = Segments("You answer from the documents.", (), (), QUESTION)
    documents = tuple(Document(id=str(i), text=text) for i, text in enumerate(TEXTS))
    options = CompressionOptions(method="bm25", rate=0.5)
    num_tokens = sum(count_tokens_many(demo_tokenizer, TEXTS))
    protected = sum(count_tokens_many(demo_tokenizer, [segments.static_system_prompt, QUESTION]))
    budget = Budget(demo_tokenizer, 0.5, None, protected).document_tokens(num_tokens)

    first = stage.forecast(segments, documents, options)
    assert first.kept_tokens == min(num_tokens, budget) > 0
    assert first.seconds == 0.0  # nothing measured yet

    _, report = stage(segments, documents, options)
    assert report is not None and report.original_tokens == num_tokens
    after = stage.forecast(segments, documents, options)
    assert after.kept_tokens == first.kept_tokens
    assert 0.0 < after.seconds < 10.0
    # Twice the documents, twice the expected time.
    assert stage.forecast(segments, documents * 2, options).seconds == 2 * after.seconds
    # A target below the protected tokens, which the compression refuses with a 400: no bound.
    below = CompressionOptions(method="bm25", target_tokens=protected - 1)
    assert stage.forecast(segments, documents, below).kept_tokens == 0
