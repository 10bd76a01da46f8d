"""The policy-gradient actor loss GRPO and PPO share (`PolicyGradient`, a mixin of their trainers): the clipped
surrogate of `algo.policy_loss` on the batch's advantages, the KL to the reference when `algo.kl_in` is the loss,
the entropy bonus, VAPO's positive-example NLL (`algo.positive_nll_coef`), and the actor metrics they log
(`megalign.algos.policy_loss_options` holds the options). With `algo.off_policy` the step's importance weights
(`megalign.algos.offpolicy`: recomputed over rollout log-probs) weigh the policy-gradient term, the tokens they drop
leave the loss and its denominator, and `offpolicy/*` is logged.
"""
from __future__ import annotations

import torch

from megalign.algos.offpolicy import off_policy_metrics, off_policy_weights
from megalign.algos.policy_loss_options import positive_nll_weights
from megalign.rollout import RolloutBatch
from megalign.rollout.mismatch import reduce_sums
from megalign.trainers.updates import RoleLoss


class PolicyGradient:
    """`policy_loss` and `policy_metrics` for an `OnlineTrainer` whose `algo` section is a `PolicyLossOptions`."""

    POLICY_STATS = ("clipped", "approx_kl", "kl", "entropy", "tokens")
    POSITIVE_NLL_STATS = ("positive_nll", "positive_tokens")

    def policy_loss(self, batch: RolloutBatch, kl_coef: float) -> RoleLoss:
        """The actor's policy-gradient loss: `algo.actor_policy_loss` (the chosen surrogate on `batch.advantages`, plus
        `kl_coef` x KL to the reference per token when `algo.kl_in` is "loss"), minus `algo.entropy_coef` x entropy
        per token, plus `algo.positive_nll_coef` x the mean NLL of the positive samples' tokens, the policy-gradient
        term weighed by `algo.off_policy` (module doc); its sums are `POLICY_STATS` (token counts and totals), and
        `POSITIVE_NLL_STATS` with the NLL term. `hidden`: the last pipeline stage's output for the rows at
        actor.pp > 1 (`accumulate`)."""
        algo, temperature = self.cfg.algo, self.cfg.rollout.temperature
        beta = kl_coef if algo.kl_where == "loss" else 0.0  # in the reward, the KL is only measured here
        off = (off_policy_weights(batch.old_logp, batch.rollout_logp, batch.response_mask, algo.off_policy)
               if algo.off_policy.active else None)
        self.off_policy_sums = None if off is None else off.sums
        loss_mask = batch.response_mask if off is None else off.mask
        nll_weight = (positive_nll_weights(batch.rewards, loss_mask, algo.positive_reward, algo.positive_nll_coef,
                                           self.layout.dp_group) if algo.positive_nll_coef else None)

        def fn(rows, hidden=None):
            with self.moe.actor_forwards(batch, rows) as routing:  # MoE: replay, agreement, aux statistics
                logp, entropy = self.actor.logprobs_with_grad(*self.logprob_inputs(batch, rows), temperature,
                                                              hidden=hidden)
            mask = loss_mask[rows]
            self.mismatch.observe(logp, batch.rollout_logp[rows], batch.response_mask[rows])  # `old_logprobs: rollout`
            loss, stats = algo.actor_policy_loss(logp, batch.old_logp[rows], batch.advantages[rows], mask, beta,
                                                 None if batch.ref_logp is None else batch.ref_logp[rows],
                                                 None if off is None else off.weight[rows])
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * entropy * mask
            loss = self.moe.with_aux(loss, mask, routing)  # + coef x the load-balancing loss (`online_moe`)
            count = stats.count
            sums = {"clipped": stats.clip_frac * count, "approx_kl": stats.approx_kl * count,
                    "kl": stats.kl_mean * count, "entropy": (entropy.detach() * mask).sum(), "tokens": count}
            if nll_weight is not None:
                weight = nll_weight[rows]
                loss = loss - weight * logp
                positive = (weight > 0).to(logp.dtype)
                sums.update(positive_nll=-(logp.detach() * positive).sum(), positive_tokens=positive.sum())
            return loss, sums
        stats = self.POLICY_STATS + (self.POSITIVE_NLL_STATS if nll_weight is not None else ())
        return RoleLoss(fn, stats, units=None if off is None else off.mask)

    def policy_metrics(self, total: dict[str, float], norms: list[torch.Tensor], lr: float) -> dict[str, float]:
        """The actor's metrics of `policy_loss` (means over the trained tokens; with a reference `actor/kl`, the mean
        k3 (or the loss's estimator) KL of the policy being trained to the reference)."""
        tokens = max(total["actor/tokens"], 1.0)
        metrics = {
            "actor/loss": total["actor/loss"] / self.cfg.algo.updates, "actor/clip_frac": total["actor/clipped"] / tokens,
            "actor/approx_kl": total["actor/approx_kl"] / tokens, "actor/entropy": total["actor/entropy"] / tokens,
            "actor/grad_norm": torch.stack(norms).mean(), "actor/lr": lr,
        }
        if self.reference is not None:
            metrics["actor/kl"] = total["actor/kl"] / tokens
        if self.cfg.algo.positive_nll_coef:  # the NLL term's mean over the positive tokens, and their share
            metrics["actor/positive_nll"] = total["actor/positive_nll"] / max(total["actor/positive_tokens"], 1.0)
            metrics["actor/positive_token_frac"] = total["actor/positive_tokens"] / tokens
        if getattr(self, "off_policy_sums", None) is not None:  # this step's correction, over dp
            metrics.update(off_policy_metrics(reduce_sums(self.off_policy_sums, self.layout.dp_group)))
        return metrics
