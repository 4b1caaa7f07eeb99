"""Fidelity against full prefill on literal distributions: the top-20 KL, where a greedy run
leaves the reference, which positions need a forced step, and the figures over questions."""

from __future__ import annotations

import math

import pytest

from ragspeed.evals.fidelity import (
    Generated,
    QuestionFidelity,
    binomial_ci,
    compare,
    first_divergence,
    forced_positions,
    summarize_fidelity,
    top_k_kl,
)


def dist(*pairs):
    return tuple((token, math.log(p)) for token, p in pairs)


def test_kl_of_a_distribution_with_itself_is_zero():
    d = dist((1, 0.5), (2, 0.3))
    assert top_k_kl(d, d) == 0.0


def test_kl_over_the_top_tokens_and_the_rest_as_one_bucket():
    # 0.5 ln(0.5/0.3) + 0.3 ln(0.3/0.5) + 0.2 ln(0.2/0.2)
    assert top_k_kl(dist((1, 0.5), (2, 0.3)), dist((2, 0.5), (1, 0.3))) == pytest.approx(
        0.2 * math.log(5 / 3)
    )


def test_a_reference_token_missing_from_the_others_top_gets_its_least_probability():
    # token 2: q = 0.2 (other's last); rest: p 0.1, q 1 - 0.6 - 0.2
    kl = top_k_kl(dist((1, 0.6), (2, 0.3)), dist((1, 0.6), (3, 0.2)))
    assert kl == pytest.approx(0.3 * math.log(0.3 / 0.2) + 0.1 * math.log(0.1 / 0.2))


def test_divergence_and_forced_positions():
    assert first_divergence((5, 6, 7), (5, 9, 7)) == 1
    assert first_divergence((5, 6, 7), (5, 6, 7)) == 3
    assert first_divergence((5, 6, 7), (5,)) == 1  # stopped early: leaves at its end
    assert list(forced_positions((5, 6, 7, 8), (5, 9))) == [2, 3]
    assert list(forced_positions((5, 6, 7), (5, 6, 7))) == []


def test_compare_reads_the_greedy_run_up_to_its_divergence_and_forced_steps_after():
    reference = Generated((5, 6, 7), (dist((5, 0.9)), dist((6, 0.8)), dist((7, 0.7))), 1.0)
    greedy = Generated((5, 9, 2), (dist((5, 0.9)), dist((9, 0.6), (6, 0.3)), dist((2, 0.9))), 0.1)
    fidelity = compare(reference, greedy, {2: dist((7, 0.7))})
    assert fidelity.identical is False
    assert fidelity.top1 == (True, False, True)
    assert fidelity.kl[0] == 0.0 and fidelity.kl[2] == 0.0 and fidelity.kl[1] > 0


def test_the_wilson_interval_at_30_questions():
    assert binomial_ci(29, 30) == pytest.approx((0.8333, 0.9941), abs=1e-4)
    assert binomial_ci(1, 30) == pytest.approx((0.0059, 0.1667), abs=1e-4)
    assert binomial_ci(0, 0) == (0.0, 1.0)


def test_figures_over_questions_and_the_paired_accuracy_change():
    questions = [
        QuestionFidelity(True, (True, True), (0.0, 0.0)),
        QuestionFidelity(False, (True, False), (0.1, 0.5)),
    ]
    figures = summarize_fidelity(questions, [1.0, 0.0], [1.0, 1.0], num_resamples=200)
    assert figures["identical"] == 0.5 and figures["num_positions"] == 4
    assert figures["top1_agreement"] == 0.75 and figures["kl_mean"] == pytest.approx(0.15)
    assert figures["accuracy"] == 0.5 and figures["accuracy_minus_full"]["value"] == -0.5
