"""Llama 2's gated reward (all three branches and the threshold's edge), its sequence-level whitening (dp=2
equals dp=1), where steps end in response ids, the PRM's inputs, and the combined token rewards, by hand."""
import math

import pytest
import torch
from parallel.dist_utils import run_distributed

from megalign.algos.ppo import token_rewards
from megalign.algos.reward_shaping import (
    ensemble_reward,
    gated_reward,
    place_step_scores,
    prm_inputs,
    step_ends,
    whiten_scores,
)

# raw linear scores (logits) of the two reward models; logit(0.15) = -1.7346
SAFETY = torch.tensor([2.0, -2.0, 1.0, -3.0, -1.7])
HELPFUL = torch.tensor([0.5, 1.5, -1.0, 4.0, 0.25])
IS_SAFETY = torch.tensor([True, False, False, False, False])
# row 0: a safety prompt -> R_s; row 1: sigmoid(-2) = 0.119 < 0.15 -> R_s; row 2: sigmoid(1) = 0.731 -> R_h;
# row 3: sigmoid(-3) = 0.047 -> R_s; row 4: sigmoid(-1.7) = 0.1545 >= 0.15 -> R_h
GATED = [2.0, -2.0, -1.0, -3.0, 0.25]
# WHITEN by hand: mean -0.75, deviations (2.75, -1.25, -0.25, -2.25, 1.0), squares sum 15.25, unbiased var 15.25 / 4
WHITENED = [d / math.sqrt(15.25 / 4 + 1e-8) for d in (2.75, -1.25, -0.25, -2.25, 1.0)]


def test_gated_reward_takes_each_branch():
    gated, branch = gated_reward(SAFETY, HELPFUL, IS_SAFETY, 0.15)
    assert gated.tolist() == GATED
    assert branch.tolist() == [True, True, False, True, False]
    # the gate is on the sigmoid of the score (a probability): at threshold 0.16, sigmoid(-1.7) = 0.1545 is below it
    assert gated_reward(SAFETY, HELPFUL, IS_SAFETY, 0.16)[0].tolist() == pytest.approx([2.0, -2.0, -1.0, -3.0, -1.7])
    with pytest.raises(ValueError, match="threshold must be in"):
        gated_reward(SAFETY, HELPFUL, IS_SAFETY, 1.5)


def test_ensemble_reward_by_hand():
    # model 0 (mean 1, std 2): 3, -1, 1 -> 1, -1, 0; model 1 (mean 0, std 0.5): 0.25, 0.5, -1 -> 0.5, 1, -2;
    # model 2 (mean -1, std 1): -1, 0, 2 -> 0, 1, 3
    scores = torch.tensor([[3.0, -1.0, 1.0], [0.25, 0.5, -1.0], [-1.0, 0.0, 2.0]])
    means, stds = (1.0, 0.0, -1.0), (2.0, 0.5, 1.0)
    low, spread = ensemble_reward(scores, means, stds, "min")
    assert low.tolist() == [0.0, -1.0, -2.0]
    z = [[1.0, 0.5, 0.0], [-1.0, 1.0, 1.0], [0.0, -2.0, 3.0]]  # per response, the three members
    assert spread.tolist() == pytest.approx([math.sqrt(sum((v - sum(r) / 3) ** 2 for v in r) / 3) for r in z])
    mean, _ = ensemble_reward(scores, means, stds, "mean")
    assert mean.tolist() == pytest.approx([0.5, 1 / 3, 1 / 3])
    with pytest.raises(ValueError, match="reduce must be one of"):
        ensemble_reward(scores, means, stds, "max")
    with pytest.raises(ValueError, match="K >= 2"):
        ensemble_reward(scores[:1], means[:1], stds[:1])
    with pytest.raises(ValueError, match="std must be > 0, got 0.0"):
        ensemble_reward(scores, means, (2.0, 0.0, 1.0))


def test_whiten_scores_by_hand():
    torch.testing.assert_close(whiten_scores(torch.tensor(GATED)), torch.tensor(WHITENED), rtol=1e-6, atol=1e-6)


def _whiten_split(out):
    import torch.distributed as dist
    rank = dist.get_rank()
    part = torch.tensor(GATED[:3] if rank == 0 else GATED[3:])
    torch.save(whiten_scores(part, dist.group.WORLD), f"{out}/rank{rank}.pt")


def test_whiten_scores_is_global_over_dp(tmp_path):
    run_distributed(_whiten_split, str(tmp_path))
    both = torch.cat([torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")])
    torch.testing.assert_close(both, torch.tensor(WHITENED), rtol=1e-6, atol=1e-6)


EOS, SEP = 2, 9


def test_step_ends_one_token_separator():
    ids = torch.tensor([[5, SEP, 6, 7, SEP, 8, EOS, 0],    # three steps, the last closed by EOS
                        [SEP, SEP, 5, SEP, EOS, 0, 0, 0],  # empty steps are not steps; EOS right after a separator
                        [5, 6, SEP, 7, 7, 7, 7, 7],        # truncated: the unfinished last step is not scored
                        [0, 0, 0, 0, 0, 0, 0, 0]])         # no response token
    mask = torch.tensor([[1] * 7 + [0], [1] * 5 + [0] * 3, [1] * 8, [0] * 8])
    ends, eos_step = step_ends(ids, mask, [SEP], EOS)
    assert [torch.nonzero(row)[:, 0].tolist() for row in ends] == [[1, 4, 6], [3], [2], []]
    assert eos_step.tolist() == [True, False, False, False]


def test_step_ends_and_prm_inputs_with_a_two_token_separator():
    response = torch.tensor([[5, SEP, SEP, SEP, 6, EOS]])
    mask = torch.ones_like(response)
    ends, eos_step = step_ends(response, mask, [SEP, SEP], EOS)
    # "5" ends at the second 9; the next step "9 6" ends at the EOS
    assert torch.nonzero(ends[0])[:, 0].tolist() == [2, 5] and eos_step.tolist() == [True]
    sequences = torch.cat([torch.tensor([[0, 1]]), response], 1)  # a left-padded prompt of width 2
    attention = torch.cat([torch.tensor([[0, 1]]), mask], 1)
    ids, att, where = prm_inputs(sequences, attention, 6, ends, eos_step, [SEP, SEP])
    # the EOS is replaced by the separator, which runs one column past the response
    assert ids.tolist() == [[0, 1, 5, SEP, SEP, SEP, 6, SEP, SEP]]
    assert att.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 1]]
    assert torch.nonzero(where[0])[:, 0].tolist() == [4, 8]


def test_place_step_scores():
    ends = torch.tensor([[False, True, False, True], [True, False, False, False]])
    probs = torch.tensor([0.9, 0.2, 0.6])
    torch.testing.assert_close(place_step_scores(probs, ends), torch.tensor([[0, 0.9, 0, 0.2], [0.6, 0, 0, 0]]))
    torch.testing.assert_close(place_step_scores(probs, ends, "centered"),
                               torch.tensor([[0, 0.4, 0, -0.3], [0.1, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"probs must be \[3\]"):
        place_step_scores(probs[:2], ends)


def test_token_rewards_add_step_rewards_to_the_outcome_and_kl():
    scores = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    steps = torch.tensor([[0.3, 0.0, 0.8, 0.9], [0.0, 0.6, 0.0, 0.0]])  # 0.9 sits on a masked token: dropped
    logp = torch.tensor([[0.1, -0.2, 0.3, 5.0], [0.0, 0.4, 9.0, 9.0]])
    ref = torch.zeros(2, 4)
    rewards, kl = token_rewards(scores, mask, logp, ref, 0.5, "k1", step_rewards=steps)
    # row 0: 0.3 - 0.5 * 0.1; 0 + 0.5 * 0.2; 0.8 + 1.0 (outcome at the last token) - 0.5 * 0.3; masked
    # row 1: 0 - 0; 0.6 - 0.5 (outcome) - 0.5 * 0.4
    torch.testing.assert_close(rewards, torch.tensor([[0.25, 0.1, 1.65, 0.0], [0.0, -0.1, 0.0, 0.0]]))
    torch.testing.assert_close(kl, logp * mask)
    # no step rewards: the existing signature gives the outcome and the KL alone
    plain, _ = token_rewards(scores, mask, logp, ref, 0.5, "k1")
    torch.testing.assert_close(rewards - plain, steps * mask)
