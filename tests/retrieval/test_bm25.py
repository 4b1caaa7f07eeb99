from ragspeed.retrieval.bm25 import BM25Index, tokenize


def test_tokenize_lowercases_stems_and_drops_stop_words():
    assert tokenize(["The Prizes are awarded in Physics"]) == [["prize", "award", "physic"]]


def test_search_ranks_matching_documents_and_skips_non_matching():
    index = BM25Index()
    index.add(
        [5, 6, 7], ["the nobel prize in physics", "cats and dogs", "a physics prize, a chemistry prize"]
    )
    scores, labels = index.search("physics prizes", 10)
    assert labels.tolist() == [7, 5]
    assert scores[0] > scores[1] > 0
    assert index.search("zebra", 10)[1].tolist() == []
    assert index.search("the of and", 10)[1].tolist() == []  # stop words only


def test_remove_and_empty_index():
    index = BM25Index()
    assert index.search("anything", 3)[1].tolist() == []
    index.add([1, 2], ["red apple", "green apple"])
    index.remove([1])
    assert index.search("apple", 3)[1].tolist() == [2]
    assert index.num_documents == 1
