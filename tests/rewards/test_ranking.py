"""The ranking AUC and its pair counts (`megalign.rewards.ranking`) against hand-counted pairs."""
import pytest

from megalign.rewards.ranking import ranking_auc, ranking_pairs


def test_ranking_auc_against_hand_worked_pairs():
    # right: 0.9, 0.5, 0.3; wrong: 0.5, 0.1 -> pairs (right above wrong): 0.9 beats both (2), 0.5 ties 0.5 (0.5) and
    # beats 0.1 (1), 0.3 beats 0.1 (1): 4.5 of 6
    assert ranking_auc([0.9, 0.5, 0.5, 0.1, 0.3], [True, True, False, False, True]) == pytest.approx(4.5 / 6)
    assert ranking_auc([float("-inf"), 0.2], [False, True]) == 1.0  # an invalid solution ranks lowest
    assert ranking_auc([0.3, 0.2], [False, True]) == 0.0
    assert ranking_auc([0.3, 0.3], [False, True]) == 0.5
    assert ranking_auc([0.1, 0.2], [True, True]) is None
    # two prompts of 3 samples, in each the wrong ones outscore the right ones: 0 within a prompt; across prompts the
    # easy prompt's right answers (0.9, 0.8) outscore the hard one's wrong ones (0.2, 0.3): 4 of the 9 pairs
    scores, right = [0.9, 0.8, 0.95, 0.1, 0.2, 0.3], [True, True, False, True, False, False]
    assert ranking_auc(scores, right) == pytest.approx(4 / 9)
    assert ranking_auc(scores, right, group=3) == 0.0
    assert ranking_auc([0.5, 0.4, 0.3, 0.6], [True, False, True, True], group=2) == 1.0  # the all-right prompt adds no pair


def test_ranking_pairs_add_over_batches_and_check_their_input():
    # prompt 1 (right 0.7 / wrong 0.2, 0.9): 1 of 2 pairs; prompt 2 (right 0.4, 0.4 / wrong 0.4): two ties, 1 of 2;
    # prompt 3 all wrong: no pair
    scores = [0.7, 0.2, 0.9, 0.4, 0.4, 0.4, 0.1, 0.2, 0.3]
    right = [True, False, False, True, True, False, False, False, False]
    assert ranking_pairs(scores, right, group=3) == (2.0, 4)
    first, second = ranking_pairs(scores[:3], right[:3], group=3), ranking_pairs(scores[3:], right[3:], group=3)
    assert (first[0] + second[0], first[1] + second[1]) == (2.0, 4)
    assert ranking_pairs([0.1, 0.2], [True, True]) == (0.0, 0)
    with pytest.raises(ValueError, match="group=2"):
        ranking_pairs([0.1, 0.2, 0.3], [True, False, True], group=2)
    with pytest.raises(ValueError, match="2 scores for 3"):
        ranking_pairs([0.1, 0.2], [True, False, True])
