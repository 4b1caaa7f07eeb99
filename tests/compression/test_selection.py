import numpy as np

from ragspeed.compression.selection import edges_order, original_order, select_units


def test_greedy_skips_what_does_not_fit_and_fills_the_rest():
    scores = np.array([0.9, 0.8, 0.7, 0.1])
    num_tokens = np.array([5, 8, 3, 2])
    assert select_units(scores, num_tokens, budget_tokens=10) == [0, 2, 3]
    assert select_units(scores, num_tokens, budget_tokens=0) == []
    assert select_units(scores, num_tokens, budget_tokens=100) == [0, 1, 2, 3]


def test_ties_keep_the_earlier_unit():
    assert select_units(np.array([1.0, 1.0, 1.0]), np.array([1, 1, 1]), budget_tokens=2) == [0, 1]


def test_orders():
    relevance = {0: 0.1, 3: 0.9, 5: 0.5, 7: 0.7, 9: 0.3}
    assert original_order([5, 0, 9, 3, 7], relevance) == [0, 3, 5, 7, 9]
    # best first, second best last, third second, ...
    assert edges_order([0, 3, 5, 7, 9], relevance) == [3, 5, 0, 9, 7]
