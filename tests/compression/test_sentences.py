from ragspeed.compression.sentences import MAX_UNIT_CHARS, split_sentences


def test_splits_on_terminators_not_abbreviations_or_initials():
    text = "Dr. Smith moved to the U.S. in 1990. He met J. K. Rowling! Was it fun? Yes.\nA new line"
    assert split_sentences(text) == [
        "Dr. Smith moved to the U.S. in 1990.",
        "He met J. K. Rowling!",
        "Was it fun?",
        "Yes.",
        "A new line",
    ]


def test_cjk_terminators_without_spaces():
    assert split_sentences("这是第一句。这是第二句！第三句") == ["这是第一句。", "这是第二句！", "第三句"]


def test_empty_and_blank():
    assert split_sentences("") == []
    assert split_sentences("  \n\n ") == []


def test_one_huge_sentence_is_split_at_clauses_then_words_never_inside_a_word():
    text = ", ".join(f"item{i} and more words" for i in range(200))  # about 4,600 characters
    units = split_sentences(text)
    assert len(units) > 1
    assert all(len(u) <= MAX_UNIT_CHARS for u in units)
    assert " ".join(units) == text  # nothing lost, every cut at a space
    words = set(text.replace(",", "").split())
    assert all(w in words for u in units for w in u.replace(",", "").split())


def test_unbreakable_word_stays_whole():
    word = "x" * (MAX_UNIT_CHARS + 50)
    assert split_sentences(word) == [word]
