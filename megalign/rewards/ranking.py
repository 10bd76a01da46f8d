"""How well a scorer ranks right samples above wrong ones: the ranking AUC (Mann-Whitney U over the (right, wrong)
pairs), over all samples or within each prompt's group.

Used where a learned scorer is checked against a verifier on samples it never trained on: best-of-n's AUC of a
PRM / ORM on fresh samples (`megalign.tools.best_of_n`), and the online trainers' `reward/<model>/pairwise_acc`,
a reward model's accuracy on the pairs of the *current policy's* samples that the verifier separates (the RM's
held-out accuracy as PPO moves the policy away from the samples it was trained on; Gao et al. 2022's
overoptimisation shows there first). Within a group the pairwise accuracy and the AUC are one number: the
fraction of same-prompt (right, wrong) pairs the scorer orders right, ties counting half.
"""
from __future__ import annotations

from typing import Optional, Sequence


def ranking_pairs(scores: Sequence[float], right: Sequence[bool], group: Optional[int] = None) -> tuple[float, int]:
    """(U, pairs): U counts the (right, wrong) pairs whose right sample scores higher, ties half; pairs counts them
    all. With `group` = n only the pairs of one prompt count (consecutive runs of n samples). Sums of several
    batches (or ranks) add; U / pairs is the AUC."""
    if len(scores) != len(right):
        raise ValueError(f"ranking_pairs: {len(scores)} scores for {len(right)} right/wrong labels")
    if group is not None and (group < 1 or len(scores) % group):
        raise ValueError(f"ranking_pairs: group={group} does not divide the {len(scores)} samples into whole groups")
    spans = [(0, len(scores))] if group is None else [(k, k + group) for k in range(0, len(scores), group)]
    u, pairs = 0.0, 0
    for start, end in spans:
        part_u, positives, negatives = _mann_whitney(scores[start:end], right[start:end])
        u, pairs = u + part_u, pairs + positives * negatives
    return u, pairs


def ranking_auc(scores: Sequence[float], right: Sequence[bool], group: Optional[int] = None) -> Optional[float]:
    """ROC AUC of `scores` at telling the `right` samples from the wrong ones: the probability that a right sample
    outscores a wrong one, ties counting half (Mann-Whitney U / (n_right * n_wrong), from average ranks). 0.5 is
    chance, 1 a perfect ranking; None when no (right, wrong) pair exists. Invalid solutions (score -inf) rank
    lowest. With `group` = n the pairs are only those of the same prompt (consecutive runs of n samples), which is
    the ranking best-of-n uses: a verifier can rank all samples well by telling easy prompts from hard ones and
    still not pick the right sample among one prompt's."""
    u, pairs = ranking_pairs(scores, right, group)
    return u / pairs if pairs else None


def _mann_whitney(scores: Sequence[float], right: Sequence[bool]) -> tuple[float, int, int]:
    """(U, right count, wrong count): U counts the (right, wrong) pairs where the right one scores higher, ties half."""
    positives = sum(bool(y) for y in right)
    order = sorted(range(len(scores)), key=lambda k: scores[k])
    rank_sum, start = 0.0, 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and scores[order[end + 1]] == scores[order[start]]:
            end += 1
        average_rank = (start + end) / 2 + 1  # 1-based ranks start + 1 ... end + 1 share their mean
        rank_sum += average_rank * sum(bool(right[k]) for k in order[start:end + 1])
        start = end + 1
    return rank_sum - positives * (positives + 1) / 2, positives, len(right) - positives
