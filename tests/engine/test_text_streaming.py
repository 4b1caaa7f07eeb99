"""Stop strings over split deltas, and detokenisation that never splits a UTF-8 character."""

from __future__ import annotations

from transformers import AutoTokenizer

from ragspeed.engine.native.core.detokenizer import IncrementalDetokenizer, text_decoder
from ragspeed.engine.native.core.stop import StopStringMatcher
from ragspeed.engine.native.loading.model_zoo import resolve_model


def test_stop_string_split_across_deltas():
    matcher = StopStringMatcher(["\nUser:"])
    emitted = [matcher.feed(t) for t in ("Hello", " world\n", "Us", "er: more")]
    assert emitted == ["Hello", " world", "", ""]
    assert matcher.stopped and matcher.flush() == ""


def test_partial_stop_released_when_it_cannot_match():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abcST") == "abc"
    assert matcher.feed("ay") == "STay"
    assert matcher.feed("S") == ""
    assert matcher.flush() == "S" and not matcher.stopped


def test_no_stop_strings_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == "abc" and matcher.flush() == ""


def test_detokenizer_never_splits_utf8_characters():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("ragspeed-demo"))
    text = "Röntgen won 🎉 in 1901 — 東京"
    prompt_ids = tokenizer.encode("Answer:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)


def test_detokenizer_streams_a_long_text_exactly():
    """Windowed decoding (two short decodes per token) gives exactly the whole decode: spaces,
    punctuation, a special token skipped, 2,000+ tokens."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("ragspeed-demo"))
    text = "Marie Curie (1867–1934), née Skłodowska, won two Nobel prizes. " * 40
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids[len(ids) // 2 : len(ids) // 2] = [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Q:", add_special_tokens=False))
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 1000


def test_the_backend_decodes_what_the_tokenizer_decodes():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("ragspeed-demo"))
    decode = text_decoder(tokenizer)
    assert decode.func == tokenizer.backend_tokenizer.decode  # transformers' layers skipped
    ids = tokenizer.encode("Röntgen won 🎉 in 1901 — 東京", add_special_tokens=False)
    specials = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens]
    for window in (ids, specials + ids[:3], ids[2:5] + specials, ids[:1]):
        assert decode(window) == tokenizer.decode(window, skip_special_tokens=True)
    tokenizer.clean_up_tokenization_spaces = True  # transformers' decode may change the text
    assert text_decoder(tokenizer).func == tokenizer.decode
