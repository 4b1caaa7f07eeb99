"""Segments and the prompt layout (docs/architecture.md, contract 1), on the demo tokenizer's chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ragspeed.document import Document
from ragspeed.gateway.prepare import StaticPrefixes
from ragspeed.gateway.prompt import (
    assemble_prompt,
    extract_documents,
    split_segments,
    static_prefix_token_ids,
)
from ragspeed.gateway.protocol import ChatMessage, DocumentIn


def messages(*pairs):
    return [ChatMessage(role=r, content=c) for r, c in pairs]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_extract_documents_between_markers():
    rest, docs = extract_documents("a <d>one</d> b <d> two </d>c <d>open", "<d>", "</d>")
    assert rest == "a  b c"
    assert [d.text for d in docs] == ["one", "two", "open"]


def test_split_segments_orders_static_documents_history_question():
    segments = split_segments(
        messages(
            ("system", "You are helpful."),
            ("user", "Earlier question"),
            ("assistant", "Earlier answer"),
            ("user", "Now: <document>Doc in message.</document> What year?"),
        ),
        ["Doc A", DocumentIn(title="B", text="Doc B"), "Doc A"],
        start_marker="<document>",
        end_marker="</document>",
    )
    assert segments.static_system_prompt == "You are helpful."
    assert [d.text for d in segments.documents] == ["Doc A", "Doc B", "Doc in message."]  # duplicate dropped
    assert [(t.role, t.content) for t in segments.history] == [
        ("user", "Earlier question"),
        ("assistant", "Earlier answer"),
    ]
    assert segments.question == "Now:  What year?"


def test_wire_documents_become_documents_with_their_metadata():
    wire = DocumentIn.model_validate(
        {"id": "kb-7", "title": " Cat ", "text": " Cats purr. ", "metadata": {"url": "a.html", "n": [1]}}
    )
    segments = split_segments(
        messages(("user", "Why?")), [wire, "Plain text."], start_marker="<d>", end_marker="</d>"
    )
    first, plain = segments.documents
    assert first == Document("kb-7", "Cats purr.", "Cat", {"url": "a.html", "n": [1]})
    assert plain.metadata == {} and plain.title == "" and len(plain.id) == 16


def test_static_prefix_is_shared_across_requests(tokenizer):
    static = "You are a careful assistant. " * 20
    prompts = []
    for question, doc in (("Who?", "Alpha beta."), ("When did it happen?", "Gamma delta epsilon.")):
        segments = split_segments(
            messages(("system", static), ("user", question)),
            [doc],
            start_marker="<document>",
            end_marker="</document>",
        )
        prompts.append(assemble_prompt(tokenizer, segments, segments.documents))
    a, b = prompts
    assert a.num_static_tokens == b.num_static_tokens > 100
    assert a.token_ids[: a.num_static_tokens] == b.token_ids[: b.num_static_tokens]
    # Layout: static system prompt, then documents, then the question.
    assert a.text.index(static.strip()) < a.text.index("Alpha beta.") < a.text.index("Who?")


def test_compressed_documents_replace_the_originals(tokenizer):
    segments = split_segments(
        messages(("user", "Q?")), ["long original text"], start_marker="<document>", end_marker="</document>"
    )
    prompt = assemble_prompt(tokenizer, segments, (Document(id="x", text="short"),))
    assert "short" in prompt.text and "long original text" not in prompt.text


class _CountingTokenizer:
    """Renders a system turn as its text; counts the renders."""

    def __init__(self, chat_template: str):
        self.chat_template = chat_template
        self.num_renders = 0

    def apply_chat_template(self, turns, tokenize: bool, add_generation_prompt: bool) -> str:
        self.num_renders += 1
        return turns[0]["content"]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [ord(c) for c in text]


def test_the_gateway_keeps_a_static_prefix_unless_its_template_reads_the_clock(tokenizer):
    preparer = StaticPrefixes()
    static = "You are a careful assistant."
    kept = preparer.static_token_ids(tokenizer, static)
    assert kept == static_prefix_token_ids(tokenizer, static)
    assert preparer.static_token_ids(tokenizer, static) is kept
    plain, dated = _CountingTokenizer("{{ messages }}"), _CountingTokenizer("{{ strftime_now('%d') }}")
    for fake in (plain, dated, plain, dated):
        assert preparer.static_token_ids(fake, "ab") == (97, 98)
    assert (plain.num_renders, dated.num_renders) == (1, 2)
