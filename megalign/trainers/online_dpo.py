"""Online DPO (Guo et al. 2024, arXiv 2402.04792; TRL's `OnlineDPOTrainer`) on the online step template:
`train_online_dpo(cfg)`.

    collect     G samples a prompt (default 2, the paper's), scored by the reward role [- algo.missing_eos_penalty
                for responses without EOS]
    score       one pair a prompt (`preference_pairs`: the best against the worst, or the pairwise judge's pick; a
                prompt whose rewards all tie gives none, counted as `pairs/tied`) and, for a loss against the reference, the reference's summed
                log-probs of both
    update      `ppo_epochs` x `mini_batches` updates of the offline trainer's pairwise loss (`algo` is its
                `PreferenceAlgoConfig`: any `PAIR_LOSSES` entry), one unit a pair (the mean over the global pairs)
    metrics     TRL's names: rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
                logps/rejected, objective/scores_margin, val/contain_eos_token

Design choices:

- Log-probs are the offline trainer's (`megalign.roles.sequence_logps`: the fused head on the response tokens,
  EOS included) at temperature 1, as TRL computes them: DPO's implicit reward is about the policy itself and the
  loss has no ratio to the sampler, so `rollout.temperature` shapes only the sampling (and `old_logprobs` is
  unused).
- Ties are dropped where TRL makes the first sample the chosen one. At actor.pp > 1 a 1F1B micro-batch holds
  whole pairs (chosen and rejected rows interleaved) of one fixed shape, so every prompt keeps its pair, a tied
  one with weight 0 (no loss, no gradient, not in the metrics).
- A pairwise judge (`judge:`, TRL's `OnlineDPOTrainer(judge=...)` in place of its reward model) ranks each prompt's
  two samples instead of the reward: a judge role (`megalign.roles.judge`, its own tokenizer, tp, dtype and offload
  switch, placed in its own "judge" phase) reads p(A better than B) from its template ({prompt}, {response_a},
  {response_b}), asked in both orders and averaged, p = (p_AB + 1 - p_BA) / 2, so a judge that favours the first
  (or second) position cancels out and a pair of identical responses scores exactly 1/2; the cache makes a repeated
  pair cost nothing, and logprob mode makes each verdict one forward. The first sample is chosen when p > 1/2, the
  second when p < 1/2; |p - 1/2| <= `judge.tie_tolerance` is a tie (no pair, `pairs/tied`). The reward role still
  scores every sample (reward/mean, the terms); `reward/<judge name>/mean` is the mean p(first sample), with its
  verdict, unparsable-verdict and cache-hit counts, and with verifier terms `reward/<name>/agreement` is the
  fraction of the pairs the verifier total orders (and the judge does not tie) on which the judge picks the same
  sample. `objective/scores_margin` is then the judge's |2p - 1|.
- Differences from TRL 1.16: its "ipo" takes the margin on summed log-probs, megalign's on token averages (as
  TRL's offline DPOTrainer and IPO's eq. 17); its temperature default is 0.9, the online family's 1.0.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import torch

from megalign.algos.preference import PairLogps, PreferenceAlgoConfig, pair_losses
from megalign.algos.registry import algorithm_option
from megalign.algos.reward_shaping import missing_eos_penalty
from megalign.config import option, set_defaults
from megalign.data import IGNORE_INDEX
from megalign.models.lora import adapters_disabled
from megalign.parallel import Pipeline
from megalign.parallel.collectives import all_reduce, all_reduce_count
from megalign.rewards.judge import JudgeTemplate, PairwiseJudge, TemplateOnly
from megalign.roles.judge import JudgeConfig, load_judge
from megalign.rollout import RolloutBatch
from megalign.trainers.base import MetricSums, TrainResult
from megalign.trainers.online import OnlineTrainer
from megalign.trainers.updates import RoleLoss
from megalign.trainers.online_config import (MissingEOSPenalty, OnlineConfig, RolloutConfig, UpdateSchedule,
                                             check_pipeline_batch)
from megalign.trainers.preference import check_reference_used
from megalign.roles.sequence_logps import PairBatch, hidden_sequence_logps, interleaved_pairs, sequence_logps


@dataclasses.dataclass
class OnlineDPOAlgoConfig(PreferenceAlgoConfig, MissingEOSPenalty, UpdateSchedule):
    """The pairwise loss on fresh pairs (the offline trainer's losses and defaults, as TRL's OnlineDPOConfig) and the
    update schedule over the pairs."""

    micro_batch_size: int = option(32, doc="pairs per forward on each rank (gradient accumulation)")

    def __post_init__(self):
        UpdateSchedule.__post_init__(self)
        PreferenceAlgoConfig.__post_init__(self)
        if self.loss_agg != "token-mean":
            raise ValueError(f"loss_agg={self.loss_agg!r}: online DPO has one loss per pair and takes their mean "
                             f"(token-mean over one unit a pair); leave loss_agg at token-mean")
        self.check_missing_eos_penalty()
        if self.use_weighting:
            raise ValueError("use_weighting: online DPO does not compute WPO's weights (the offline DPO trainer does); "
                             "leave it false")


@dataclasses.dataclass
class PairJudgeConfig:
    """A pairwise judge that ranks each prompt's two samples in place of the reward (TRL's `OnlineDPOTrainer(judge=)`)."""

    judge: JudgeConfig = option(doc="the judge model; its template names {prompt}, {response_a}, {response_b} "
                                    "[{criterion} / {principle}]; its verdict is p(A) in [0, 1]: logprob mode with "
                                    "answers [A, B] (A first), or generate mode with a pattern whose number is 1 for A, "
                                    "0 for B (unparsed_score 0.5 then makes an unreadable verdict a tie)")
    name: str = option("pair_judge", doc="its role name and metrics reward/<name>/...")
    criterion: Optional[str] = option(None, doc="the {criterion} / {principle} the pair is judged on; null: none")
    both_orders: bool = option(True, doc="ask (A, B) and (B, A) and average p(A) = (p_AB + 1 - p_BA) / 2 against the "
                                         "judge's position bias; false: (A, B) only")
    tie_tolerance: float = option(1e-6, doc="a pair with |p(A) - 1/2| <= this is a tie: no pair, counted (pairs/tied)")

    def __post_init__(self):
        if not self.name or "/" in self.name or ":" in self.name or self.name in ("actor", "reference", "reward"):
            raise ValueError(f"judge.name {self.name!r} must be non-empty without '/' or ':' and not a role's name")
        if not (math.isfinite(self.tie_tolerance) and 0 <= self.tie_tolerance < 0.5):
            raise ValueError(f"judge.tie_tolerance must be in [0, 1/2), got {self.tie_tolerance}")
        # the template against the fields a pair supplies, before any model loads
        PairwiseJudge(self.name, TemplateOnly(JudgeTemplate(self.judge.template, "judge.judge.template")), self.criterion)


@dataclasses.dataclass
@set_defaults(run_dir="runs/online_dpo_arith", steps=200, save_every=50)
class OnlineDPOConfig(OnlineConfig):
    """One online DPO run (`launch/train_online_dpo.py --config ... key.sub=value`)."""

    algorithm: Literal["online_dpo"] = algorithm_option("online_dpo")
    rollout: RolloutConfig = option(RolloutConfig(group_size=2), doc="sampling (G = 2 samples per prompt: one pair)")
    algo: OnlineDPOAlgoConfig = option(OnlineDPOAlgoConfig(), doc="objective")
    judge: Optional[PairJudgeConfig] = option(
        None, doc="a pairwise judge that picks chosen / rejected in place of the reward (the reward is still computed, "
                  "logged and, with verifier terms, the judge's agreement is measured against it); null: the reward ranks")

    def __post_init__(self):
        super().__post_init__()
        check_reference_used(self.reference, self.algo)
        if self.judge is not None:
            if self.rollout.group_size != 2:
                raise ValueError(f"judge: a pairwise judge ranks two samples a prompt; rollout.group_size must be 2, got "
                                 f"{self.rollout.group_size}")
            if self.judge.name in [m.name for _, m in self.reward.reward_models()] + [j.name for j in self.reward.judges]:
                raise ValueError(f"judge.name {self.judge.name!r} is also a reward model's or judge's name; rename one")


def preference_pairs(rewards: torch.Tensor, group_size: int,
                     keep_tied: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen rows [K], rejected rows [K], tied [U] bool) of N = U x G rewards in groups of G adjacent rows.

    The chosen row of a group is its highest reward, the rejected row its lowest (the first among
    equals); a group whose highest and lowest rewards are equal is tied and gives no pair, so K = U -
    tied.sum(), unless `keep_tied` (K = U; a tied group's pair is its first row twice). Rows index the
    batch (0..N-1).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size or group_size < 2:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size} >= 2, "
                         f"got {tuple(rewards.shape)}")
    groups = rewards.view(-1, group_size)
    base = torch.arange(groups.shape[0], device=rewards.device) * group_size
    tied = groups.amax(-1) == groups.amin(-1)
    keep = torch.ones_like(tied) if keep_tied else ~tied
    return (base + groups.argmax(-1))[keep], (base + groups.argmin(-1))[keep], tied


def pair_batch(batch: RolloutBatch, chosen: torch.Tensor, rejected: torch.Tensor, response_len: int) -> PairBatch:
    """The pairs (`chosen`, `rejected` rows [b] of `batch`) as the offline trainer's `PairBatch` [2b, P + R - 1].

    Rows 0..b-1 chosen, b..2b-1 rejected; inputs are the rollout rows without their last column and
    targets the next token where it is a response token (`batch.response_mask`), else IGNORE_INDEX,
    as `collate_preferences` lays them out, so `sequence_logps` sums each response's log-probs.
    """
    rows = torch.cat([chosen, rejected])
    sequences, attention = batch.sequences[rows], batch.attention_mask[rows]
    response = batch.response_mask[rows] != 0
    targets = torch.full_like(sequences[:, 1:], IGNORE_INDEX)
    targets[:, -response_len:] = torch.where(response, sequences[:, -response_len:], IGNORE_INDEX)
    return PairBatch(input_ids=sequences[:, :-1], attention_mask=attention[:, :-1], targets=targets,
                     response_lengths=response.sum(-1), margin=torch.zeros(chosen.numel(), device=sequences.device))


class OnlineDPOTrainer(OnlineTrainer):
    """Online DPO on the online trainer (module doc)."""

    name = "Online DPO"

    def needs_reference(self) -> bool:
        return self.cfg.algo.uses_reference

    def __init__(self, cfg: OnlineDPOConfig):
        super().__init__(cfg)
        check_pipeline_batch(self.cfg, self.layout.dp, "actor", self.layout, trained=True, per_prompt=1, unit="pairs")
        self.ranker: Optional[PairwiseJudge] = None
        if cfg.judge is not None:
            role = load_judge(cfg.judge.name, cfg.judge.judge, self.role_layout("judge.judge", cfg.judge.judge),
                              "judge.judge")
            self.roles.append(role)
            self.ranker = PairwiseJudge(cfg.judge.name, role, cfg.judge.criterion)

    def free_keys(self) -> tuple[str, ...]:
        return super().free_keys() + (("judge.judge.offload_weights",) if self.cfg.judge is not None else ())

    def check_role_folders(self) -> None:
        super().check_role_folders()
        if self.cfg.judge is not None:
            self.check_judge_folder("judge.judge", self.cfg.judge.judge.path)

    # ----- the pairwise judge (module doc)

    def row_texts(self, batch: RolloutBatch) -> tuple[list[str], list[str]]:
        """(prompt, response) texts of the batch's N rows, decoded as the reward role read them (`rollout`)."""
        tok, width = self.tokenizer, self.prompt_width
        ids, mask = batch.sequences.cpu(), batch.attention_mask.cpu().bool()
        prompts = [tok.decode(row[keep].tolist()) for row, keep in zip(ids[:, :width], mask[:, :width])]
        responses = [tok.decode(row[:n].tolist()) for row, n in zip(ids[:, width:], batch.lengths.long().tolist())]
        return prompts, responses

    def judge_preferences(self, prompts: list[str], responses_a: list[str], responses_b: list[str]) -> torch.Tensor:
        """[K] fp64 p(A better than B) of K pairs: with `judge.both_orders` the mean of the judge's p(A) on (A, B) and
        1 - its p(A) on (B, A) (one batch of 2K verdicts), so a judge that favours a position cancels out and a pair
        of identical responses is exactly 1/2; a p within `judge.tie_tolerance` of 1/2 is set to 1/2 (a tie)."""
        judge, k = self.cfg.judge, len(prompts)
        if judge.both_orders:
            s = self.ranker.rank(prompts * 2, responses_a + responses_b, responses_b + responses_a)
            p = torch.tensor([(s[i] + 1.0 - s[k + i]) / 2 for i in range(k)], dtype=torch.float64)
        else:
            p = torch.tensor(self.ranker.rank(prompts, responses_a, responses_b), dtype=torch.float64)
        return torch.where((p - 0.5).abs() <= judge.tie_tolerance, torch.full_like(p, 0.5), p)

    def pair_scores(self, batch: RolloutBatch) -> torch.Tensor:
        """[N] what ranks each prompt's samples: the rewards, or with a judge p(A) and 1 - p(A) of its two samples
        (A the first; a tie gives 1/2 to both), the judge placed for its phase."""
        if self.ranker is None:
            return batch.rewards
        with self.phase("judge", **{self.cfg.judge.name: ("weights",)}):
            prompts, responses = self.row_texts(batch)
            self.judged = self.judge_preferences(prompts[0::2], responses[0::2], responses[1::2])
        return torch.stack([self.judged, 1.0 - self.judged], 1).view(-1).to(batch.rewards.device)

    def judge_sums(self, batch: RolloutBatch, sums: MetricSums) -> None:
        """The judge's sums over this rank's prompts: p(A), and with verifier terms (`reward.terms`) the pairs their
        weighted sum orders and the judge does not tie, and those of them on which the judge picks the same sample."""
        p = self.judged.to(self.layout.device)
        sums.add("judge/p", p.sum())
        sums.add("judge/prompts", p.numel())
        if self.reward.functions is not None:
            verifier = sum(w * batch.terms[name].double() for name, _, w in self.reward.functions.terms).view(-1, 2)
            decided = (verifier[:, 0] != verifier[:, 1]) & (p != 0.5)
            sums.add("judge/decided", decided.sum())
            sums.add("judge/agree", (decided & ((p > 0.5) == (verifier[:, 0] > verifier[:, 1]))).sum())

    def judge_metrics(self, total: dict[str, float]) -> dict[str, float]:
        """reward/<name>/mean (p(A), the first sample's), agreement with the verifier, and the verdicts, unparsable
        verdicts and cache hits so far summed over dp."""
        name = self.cfg.judge.name
        out = {f"reward/{name}/mean": total["judge/p"] / max(total["judge/prompts"], 1.0)}
        if "judge/decided" in total:
            out[f"reward/{name}/agreement"] = total["judge/agree"] / max(total["judge/decided"], 1.0)
        counts = {k: v for k, v in self.ranker.metrics().items() if k.rsplit("/", 1)[1] in ("verdicts", "unparsed",
                                                                                               "cache_hits")}
        reduced = all_reduce(torch.tensor(list(counts.values()), dtype=torch.float64, device=self.layout.device),
                             self.layout.dp_group).cpu()
        return {**out, **dict(zip(counts, reduced.tolist()))}

    def shape_rewards(self, batch: RolloutBatch) -> None:
        if self.cfg.algo.missing_eos_penalty is not None:
            batch.rewards = missing_eos_penalty(batch.rewards, batch.finished, self.cfg.algo.missing_eos_penalty)

    def pair_logps(self, role, batch: RolloutBatch, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """[b, 2] summed (chosen, rejected) log-probs of the pairs under `role` (actor or reference), as `sequence_logps`;
        at `role.layout.pp > 1` by the forward-only schedule (no gradient), micro-batches of `algo.micro_batch_size`
        pairs, the result on every rank of its pp group."""
        pairs = pair_batch(batch, chosen, rejected, self.cfg.rollout.max_response_length)
        with role.precision.autocast(self.layout.device):
            if role.layout.pp == 1:
                return sequence_logps(role.model, pairs, role.layout).view(2, -1).t()
            order = interleaved_pairs(chosen.numel(), pairs.input_ids.device)
            micro = max(role.layout.pp, -(-chosen.numel() // self.cfg.algo.micro_batch_size))
            logps = Pipeline(role.model.model, role.layout, micro).score_broadcast(
                pairs.input_ids[order], lambda hidden, rows: hidden_sequence_logps(role.model, hidden, rows["targets"],
                                                                                   role.layout),
                attention_mask=pairs.attention_mask[order], batch={"targets": pairs.targets[order]})
        return logps.view(-1, 2)

    def reference_pair_logps(self, batch: RolloutBatch, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """`pair_logps` of the reference, replaying the rollout's experts with `reference.routing_replay`."""
        with self.moe.reference_forwards(batch, torch.cat([chosen, rejected]), slice(None, -1)):
            return self.pair_logps(self.reference, batch, chosen, rejected)

    def pipeline_pairs(self, batch: RolloutBatch, chosen: torch.Tensor, rejected: torch.Tensor):
        """`train_role`'s `unit_inputs` at actor.pp > 1: the (input ids, attention mask) [2b, P + R - 1] of pairs
        [b], chosen and rejected rows interleaved (module doc)."""
        def inputs(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rows = pair_batch(batch, chosen[pairs], rejected[pairs], self.cfg.rollout.max_response_length)
            order = interleaved_pairs(pairs.numel(), pairs.device)
            return rows.input_ids[order], rows.attention_mask[order]
        return inputs

    TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected")
    STATS = tuple(name.replace("/", "_") for name in TRL_NAMES) + ("pairs",)
    """The sums `train_role` keeps: each TRL metric's total over the pairs, and the pair count."""

    def score(self, batch: RolloutBatch) -> None:
        """The step's pairs and, for a loss against the reference, the reference's summed log-probs [K, 2] of each
        (`self.pairs`); the old log-probs are not read (the loss has no importance ratio)."""
        algo, pipelined = self.cfg.algo, self.layout.pp > 1
        self.scores = self.pair_scores(batch)
        chosen, rejected, tied = preference_pairs(self.scores, batch.group_size, keep_tied=pipelined)
        weights = (~tied).float() if pipelined else torch.ones(chosen.numel(), device=self.layout.device)
        ref = None
        if self.reference is not None:
            # adapters_disabled: with actor.lora the reference is the actor's model with its adapters off; else nothing
            with self.phase("reference", reference=("weights",)), torch.no_grad(), adapters_disabled(self.reference.model):
                mb = algo.micro_batch_size if self.reference.layout.pp == 1 else max(chosen.numel(), 1)
                ref = torch.cat([self.reference_pair_logps(batch, chosen[s:s + mb], rejected[s:s + mb])
                                 for s in range(0, chosen.numel(), mb)] or [torch.zeros(0, 2, device=self.layout.device)])
        self.pairs = (chosen, rejected, tied, weights, ref)

    def advantages(self, batch: RolloutBatch) -> None:
        """Nothing: the DPO loss compares the pairs' log-ratios directly."""

    def actor_loss(self, batch: RolloutBatch) -> RoleLoss:
        """The loss `train_role` runs over pair indices: per-pair DPO losses [b, 1] and the sums of `STATS` over the
        pairs of weight 1 (0 for the tied pairs kept at actor.pp > 1). At pp > 1 it gets the last stage's hidden
        states [2b, P + R - 1, H] of the interleaved pairs (`pipeline_pairs`)."""
        algo, layout = self.cfg.algo, self.actor.layout
        chosen, rejected, _, weights, ref = self.pairs

        def fn(pairs, hidden=None):
            routing = None
            if hidden is None:  # MoE: replay / agreement / aux statistics over the pair rows (`online_moe`)
                rows = torch.cat([chosen[pairs], rejected[pairs]])
                with self.moe.actor_forwards(batch, rows, slice(None, -1)) as routing:
                    logps = self.pair_logps(self.actor, batch, chosen[pairs], rejected[pairs])
            else:
                rows = pair_batch(batch, chosen[pairs], rejected[pairs], self.cfg.rollout.max_response_length)
                targets = rows.targets[interleaved_pairs(pairs.numel(), pairs.device)]
                logps = hidden_sequence_logps(self.actor.model, hidden, targets, layout).view(-1, 2)
            losses, stats = pair_losses(algo, PairLogps(logps[:, 0], logps[:, 1], batch.lengths[chosen[pairs]],
                                                        batch.lengths[rejected[pairs]],
                                                        *(ref[pairs].unbind(1) if ref is not None else ())))
            values = stats.metrics(weights[pairs] > 0)
            loss = self.moe.with_aux(losses[:, None], weights[pairs][:, None], routing)  # + coef x aux (`online_moe`)
            return loss, {**{stat: values[name].total for name, stat in zip(self.TRL_NAMES, self.STATS)},
                          "pairs": values["rewards/chosen"].count}
        return RoleLoss(fn, self.STATS, units=weights[:, None],
                        unit_inputs=self.pipeline_pairs(batch, chosen, rejected) if layout.pp > 1 else None)

    def update(self, batch: RolloutBatch, sums: MetricSums, counts: dict[str, float]) -> dict[str, list[torch.Tensor]]:
        chosen, rejected, tied, _, _ = self.pairs
        sums.add("tied", tied.sum())
        sums.add("score_margin", (self.scores[chosen] - self.scores[rejected]).double().sum())
        if self.ranker is not None:
            self.judge_sums(batch, sums)
        empty = all_reduce_count(int((~tied).sum()), self.layout.dp_group, self.layout.device) == 0
        return {"actor": self.update_actor(batch, sums, self.actor_loss(batch),
                                           "every prompt's responses have equal rewards on every rank: no pair"
                                           if empty else None)}

    def metrics(self, total: dict[str, float], norms: dict[str, list[torch.Tensor]],
                counts: dict[str, float]) -> dict[str, float]:
        algo = self.cfg.algo
        pairs = max(total["actor/pairs"], 1.0)  # over every update's pass
        trained = total["actor/pairs"] / algo.ppo_epochs
        return {
            "val/contain_eos_token": 1.0 - total["unfinished"] / max(total["responses"], 1.0),
            "pairs/trained": trained, "pairs/tied": total["tied"],
            "objective/scores_margin": total["score_margin"] / max(trained, 1.0),
            "actor/loss": total["actor/loss"] / algo.updates,
            **{name: total[f"actor/{stat}"] / pairs for name, stat in zip(self.TRL_NAMES, self.STATS)},
            "actor/grad_norm": torch.stack(norms["actor"]).mean(), "actor/lr": self.lr(), "beta": algo.beta_value,
            **(self.judge_metrics(total) if self.ranker is not None else {}),
        }


def train_online_dpo(cfg: OnlineDPOConfig) -> TrainResult:
    """Run online DPO as configured; every rank calls it after `init_distributed`."""
    return OnlineDPOTrainer(cfg).train()
