"""Chat examples mixed into the demo model's training stream.

*Extractive* examples teach copying from context, the way RAG answers quote their documents
(and what gives prompt-lookup speculative decoding a realistic acceptance rate): a system
prompt, a user turn with one or several passages and an instruction naming a *key* (a word or
two that occur in exactly one sentence of all passages shown), and an assistant turn that is
that sentence, copied exactly. *Generic* examples are a few plain chat turns so that a served
demo model answers something readable without documents.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

Message = dict[str, str]

SYSTEM_PROMPTS = (
    "Answer using the documents.",
    "You are a helpful assistant. Answer using the documents.",
    "Answer the question by quoting the documents.",
)
INSTRUCTIONS = (
    'Quote the sentence that mentions "{key}".',
    'Which sentence mentions "{key}"? Copy it exactly.',
    'Find "{key}" in the documents and quote that sentence.',
    "What do the documents say about {key}?",
    "What does the text say about {key}?",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_WORD = re.compile(r"[A-Za-z0-9][\w'\-]*[A-Za-z0-9]|[A-Za-z0-9]")
_STOPWORDS = frozenset(
    "the a an of in on at to and or for with by from as is was were be been are it its this that "
    "these those he she they his her their which who whom also has had have not but into than "
    "then there after before during while about over under between".split()
)


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


# Several layouts so the model does not depend on the one the gateway happens to use: each
# passage follows its label, and passages are separated by a blank line.
DOCUMENT_LABELS: tuple[str, ...] = ("[{i}] ", "Document {i}: ", "### Document {i}\n")


def format_documents(passages: Sequence[str], label: str) -> str:
    return "\n\n".join(label.format(i=i) + p for i, p in enumerate(passages, start=1))


@dataclass(frozen=True)
class ExtractiveExample:
    messages: tuple[Message, ...]  # system and user turns, no assistant turn
    answer: str  # the sentence to copy


def _unique_key(sentence: str, other_text: str, rng: random.Random) -> str | None:
    """A word or two of `sentence` that `other_text` lacks; capitalised words preferred."""
    words = [w for w in _WORD.findall(sentence) if w.lower() not in _STOPWORDS and len(w) > 2]
    candidates = [w for w in words if w[0].isupper() or w[0].isdigit()] or words
    rng.shuffle(candidates)
    for word in candidates:
        if word not in other_text and sentence.count(word) == 1:
            return word
    for left, right in zip(words, words[1:]):
        pair = f"{left} {right}"
        if pair in sentence and pair not in other_text:
            return pair
    return None


def make_extractive_example(
    passages: Sequence[str], rng: random.Random, *, max_passages: int = 6
) -> ExtractiveExample | None:
    """One example over 1..max_passages random passages; None when no unique key was found."""
    shown = rng.sample(list(passages), k=rng.randint(1, min(max_passages, len(passages))))
    target = rng.randrange(len(shown))
    # Whole sentences only: some passages end mid-sentence.
    sentences = [s for s in split_sentences(shown[target]) if 5 <= len(s.split()) <= 60 and s[-1] in '.!?"']
    if not sentences:
        return None
    answer = rng.choice(sentences)
    other_text = "\n".join(p for i, p in enumerate(shown) if i != target)
    other_text += "\n" + shown[target].replace(answer, "")
    key = _unique_key(answer, other_text, rng)
    if key is None:
        return None
    documents = format_documents(shown, rng.choice(DOCUMENT_LABELS))
    instruction = rng.choice(INSTRUCTIONS).format(key=key)
    system = rng.choice(SYSTEM_PROMPTS)
    # Documents either in the user turn (question last) or appended to the system prompt.
    if rng.random() < 0.5:
        messages = (
            {"role": "system", "content": system},
            {"role": "user", "content": f"Documents:\n{documents}\n\n{instruction}"},
        )
    else:
        messages = (
            {"role": "system", "content": f"{system}\n\nDocuments:\n{documents}"},
            {"role": "user", "content": instruction},
        )
    return ExtractiveExample(messages=messages, answer=answer)


PASSAGE_INSTRUCTIONS = (
    'Quote the passage that mentions "{key}".',
    "Quote the passage that answers the question: what do the documents say about {key}?",
    'Which document mentions "{key}"? Quote it in full.',
    "Copy the document about {key} word for word.",
)


def make_passage_example(
    passages: Sequence[str], rng: random.Random, *, max_passages: int = 5
) -> ExtractiveExample | None:
    """Quote a whole passage, with its label, chosen by a key that only it contains (a RAG answer
    that cites and quotes its source: long copies, where prompt lookup pays most); None when no
    unique key was found."""
    shown = rng.sample(list(passages), k=rng.randint(1, min(max_passages, len(passages))))
    target = rng.randrange(len(shown))
    other_text = "\n".join(p for i, p in enumerate(shown) if i != target)
    sentences = split_sentences(shown[target])
    key = _unique_key(rng.choice(sentences), other_text, rng) if sentences else None
    if key is None:
        return None
    label = rng.choice(DOCUMENT_LABELS)
    messages = (
        {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
        {
            "role": "user",
            "content": f"Documents:\n{format_documents(shown, label)}\n\n{rng.choice(PASSAGE_INSTRUCTIONS).format(key=key)}",
        },
    )
    # The quote starts with the passage's label, as shown: the model picks a document (one
    # token), then copies what follows that label in the prompt, which induction does.
    return ExtractiveExample(messages=messages, answer=label.format(i=target + 1) + shown[target])


REPEAT_INSTRUCTIONS = (
    "Repeat document {index} word for word.",
    "Copy document {index} exactly.",
    "Quote document {index}.",
)


def make_repeat_example(
    passages: Sequence[str], rng: random.Random, *, max_passages: int = 3
) -> ExtractiveExample:
    """Copy a whole shown passage: every reply token is a copy target, which teaches the copying
    mechanism (induction heads) far sooner than the sentence task alone."""
    shown = rng.sample(list(passages), k=rng.randint(1, min(max_passages, len(passages))))
    index = rng.randrange(len(shown))
    documents = format_documents(shown, DOCUMENT_LABELS[0] if rng.random() < 0.5 else DOCUMENT_LABELS[1])
    instruction = rng.choice(REPEAT_INSTRUCTIONS).format(index=index + 1)
    messages = (
        {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
        {"role": "user", "content": f"Documents:\n{documents}\n\n{instruction}"},
    )
    return ExtractiveExample(messages=messages, answer=shown[index])


_GENERIC_TURNS: tuple[tuple[str, str], ...] = (
    (
        "Hello",
        "Hello! I am the ragspeed demo model. Send me documents and a question, and I will quote the answer from them.",
    ),
    ("Hi!", "Hi! Give me some documents and ask about them, and I will quote the sentence that answers."),
    (
        "Who are you?",
        "I am the ragspeed demo model, a small language model trained on Wikipedia text to answer from documents.",
    ),
    (
        "What can you do?",
        "I can quote the sentence of your documents that answers a question, and continue text in the style of Wikipedia.",
    ),
    ("Thank you.", "You are welcome."),
    ("Thanks!", "You are welcome. Ask me about your documents any time."),
    ("Are you a large model?", "No. I am a very small model, made to test ragspeed quickly on a CPU."),
)


def make_generic_example(texts: Sequence[str], rng: random.Random) -> tuple[Message, ...]:
    """A greeting-style turn, or 'continue this text' answered with the text's next sentences."""
    if rng.random() < 0.3:
        question, answer = rng.choice(_GENERIC_TURNS)
    else:
        sentences = split_sentences(rng.choice(list(texts)).split("\n")[-1])
        if len(sentences) < 2:
            question, answer = rng.choice(_GENERIC_TURNS)
        else:
            start = rng.randrange(len(sentences) - 1)
            question = f"Continue this text: {sentences[start]}"
            answer = " ".join(sentences[start + 1 : start + 3])
    messages: list[Message] = []
    if rng.random() < 0.5:
        messages.append(
            {"role": "system", "content": rng.choice(SYSTEM_PROMPTS[1:2] + ("You are a helpful assistant.",))}
        )
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return tuple(messages)
