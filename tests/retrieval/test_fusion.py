import pytest

from ragspeed.retrieval.fusion import reciprocal_rank_fusion


def test_rrf_scores_are_sums_of_reciprocal_ranks():
    fused = reciprocal_rank_fusion([[1, 2, 3], [3, 1]], k=60)
    assert [label for label, _ in fused] == [1, 3, 2]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 62)
    assert fused[1][1] == pytest.approx(1 / 63 + 1 / 61)
    assert fused[2][1] == pytest.approx(1 / 62)


def test_rrf_weights_and_ties():
    assert reciprocal_rank_fusion([[7], [8]], k=0) == [(7, 1.0), (8, 1.0)]  # tie: first seen first
    assert [x for x, _ in reciprocal_rank_fusion([[7], [8]], k=0, weights=[1.0, 2.0])] == [8, 7]
    assert reciprocal_rank_fusion([[], []]) == []
    with pytest.raises(ValueError):
        reciprocal_rank_fusion([[1]], weights=[1.0, 1.0])
