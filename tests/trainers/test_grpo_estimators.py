"""The GRPO trainer with each new option (REINFORCE++ estimators, CISPO, GSPO) and PPO with CISPO / GSPO: the first
update against the estimator's and the loss's formulas written out here on transformers' models of the same
checkpoints (`LlamaForCausalLM` for the actor, `LlamaForSequenceClassification` for PPO's critic); config errors that
name the bad value."""
import math
from types import SimpleNamespace

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import policy_and_rm, record_batches, tiny_config, tiny_policy, train_replayed
from trainers.helpers import metric_rows
from trainers.test_ppo_trainer import tiny_ppo_config

from megalign.algos.registry import get as get_algorithm
from megalign.config import ConfigError
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.ppo import PPOTrainer


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _rows(run_dir):
    return [row for row in metric_rows(run_dir) if "reward/mean" in row]


# One update of the whole batch, old log-probs recomputed by the actor: every importance ratio is 1 (to rounding), so the
# update is the gradient of the surrogate at ratio 1 and the actor is still the reference (KL 0 in the reward).
ONE_UPDATE = ("steps=1", "algo.mini_batches=1", "algo.ppo_epochs=1", "rollout.old_logprobs=recompute", "export_hf=false")


def _record_and_train(trainer_cls, config, policy, run_dir, batch_file, *overrides):
    """Sample and score one global batch, save it, then train one step on it (so the test sees the batch trained on)."""
    record_batches(trainer_cls(config(policy, f"{run_dir}_record", *overrides)), 1, batch_file)
    train_replayed(trainer_cls, config(policy, run_dir, *overrides), batch_file)


def _group_normalised(rewards, group_size, eps=1e-6):
    """GRPO's (r - mean) / (std + eps) per group of `group_size`, unbiased std; [N] float64."""
    r = rewards.double().view(-1, group_size)
    d = r - r.mean(-1, keepdim=True)
    std = r.std(-1, keepdim=True)
    return torch.where(d == 0, 0.0, d / (std + eps)).view(-1)


def _reinforce_plus_plus(rewards, mask, group_size, gamma, baseline):
    """REINFORCE++ (Hu et al. 2025, eq. 3-5) with no KL (the actor is the reference): the score (minus its group's mean
    for the baseline variant) at each response's last valid token, returns G_t = r_t + gamma G_t+1 over the valid
    tokens, whitened over every valid token of the batch (unbiased variance, 1e-8 inside the root); [N, R] float64."""
    scores = rewards.double()
    if baseline:
        scores = scores - scores.view(-1, group_size).mean(-1).repeat_interleave(group_size)
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t] != 0]
        g = 0.0
        for k, t in enumerate(reversed(valid)):
            g = (scores[i].item() if k == 0 else 0.0) + gamma * g
            returns[i, t] = g
    m = mask != 0
    mean, var = returns[m].mean(), returns[m].var()
    return torch.where(m, (returns - mean) / torch.sqrt(var + 1e-8), 0.0)


def _surrogate_at_ratio_one(policy, batch, advantages, policy_loss):
    """(loss, gradient norm) of the first update by the papers' formulas on transformers' model of the same checkpoint.

    With old = logp.detach() the ratios are exactly 1, inside every clip range, so
      ppo (token-mean):            -sum_t A_t r_t / tokens
      cispo (token-mean):          -sum_t sg(min(r_t, 1 + eps_high)) A_t logp_t / tokens   (Chen et al. 2025, eq. 4-5)
      gspo (seq-mean-token-mean):  -mean_i mean_t s_i,t A_t, GSPO-token's s_i,t = sg(s_i) pi_t / sg(pi_t) with
                                   s_i = exp(mean_t (logp_t - old_t))   (Zheng et al. 2025, eq. 5-7 and 11-12)
    """
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(policy, torch_dtype=torch.float32)
    model.model.embed_tokens.padding_idx = None  # megalign trains the pad row (a random policy samples the pad id)
    ids, attention, mask = batch.sequences, batch.attention_mask, batch.response_mask
    R = mask.shape[1]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -R - 1:-1]
    logp = logits.log_softmax(-1).gather(-1, ids[:, -R:, None])[..., 0]
    adv = advantages.float()
    ratio = torch.exp(logp - logp.detach())
    if policy_loss == "ppo":
        loss = -(adv * ratio * mask).sum() / mask.sum()
    elif policy_loss == "cispo":
        loss = -(ratio.detach().clamp(max=1.28) * adv * logp * mask).sum() / mask.sum()
    else:
        seq_ratio = torch.exp(((logp - logp.detach()) * mask).sum(-1) / mask.sum(-1).clamp(min=1)).detach()
        token_ratio = seq_ratio[:, None] * torch.exp(logp - logp.detach())
        loss = -((token_ratio * adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), norm


@pytest.mark.parametrize("overrides", [
    ("algo.advantage=reinforce_plus_plus", "algo.gamma=0.9"),
    ("algo.advantage=reinforce_plus_plus_baseline",),
    ("algo.policy_loss=cispo",),
    ("algo.policy_loss=gspo", "algo.loss_agg=seq-mean-token-mean"),
], ids=["reinforce_plus_plus", "reinforce_plus_plus_baseline", "cispo", "gspo"])
def test_grpo_option_first_update_equals_the_formulas(policy, tmp_path, overrides):
    batch_file = str(tmp_path / "batch.pt")
    run_distributed(_record_and_train, GRPOTrainer, tiny_config, policy, str(tmp_path / "run"), batch_file, *ONE_UPDATE,
                    *overrides, world_size=1)
    (row,) = _rows(str(tmp_path / "run"))
    batch = torch.load(batch_file, weights_only=False)[0]
    G, mask = batch.group_size, batch.response_mask
    if "reinforce" in overrides[0]:
        gamma = 0.9 if "algo.gamma=0.9" in overrides else 1.0
        advantages = _reinforce_plus_plus(batch.rewards, mask, G, gamma, baseline="baseline" in overrides[0])
        # the reference was built for the reward's KL, and at the first update it is the actor: k3 = 0
        assert row["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    else:
        advantages = _group_normalised(batch.rewards, G)[:, None] * mask
    assert float(advantages.abs().sum()) > 0, batch.rewards  # the update has something to learn from
    policy_loss = overrides[0].split("=")[1] if overrides[0].startswith("algo.policy_loss") else "ppo"
    loss, norm = _surrogate_at_ratio_one(policy, batch, advantages, policy_loss)
    assert row["actor/loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert row["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert row["actor/clip_frac"] == 0 and row["actor/approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_reference_only_when_the_reward_kl_is_on(policy, tmp_path):
    def roles(*overrides):
        cfg = tiny_config(policy, str(tmp_path), *overrides)
        built = GRPOTrainer.needs_reference(SimpleNamespace(cfg=cfg))
        assert get_algorithm("grpo").needs_reference(cfg) == built  # the planner reads the registry
        return built
    assert roles("algo.advantage=reinforce_plus_plus")
    assert not roles("algo.advantage=reinforce_plus_plus", "algo.kl_coef=0")
    assert not roles("algo.advantage=grpo")  # the group estimators' KL is in the loss, 0 unless set
    assert roles("algo.advantage=grpo", "algo.kl_coef=0.04")


def _whitened_gae(rm, batch, gamma=1.0, lam=0.95):
    """PPO's advantages at the first update (Schulman et al. 2016, eq. 16; TRL's PPOTrainer): V(s_t) the critic's score
    of the state before each response token (an RM export's head on transformers' trunk), the sequence score at the last
    valid token (no KL: the actor is the reference), delta_t = r_t + gamma V_t+1 - V_t and A_t = delta_t +
    gamma lam A_t+1 over the valid tokens (0 past the last), whitened over them (unbiased variance, 1e-8); [N, R]."""
    from transformers import LlamaForSequenceClassification

    critic = LlamaForSequenceClassification.from_pretrained(rm, torch_dtype=torch.float32)
    ids, attention, mask = batch.sequences, batch.attention_mask, batch.response_mask
    R = mask.shape[1]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = critic.model(input_ids=ids, attention_mask=attention, position_ids=positions).last_hidden_state
        values = critic.score(hidden)[:, -R - 1:-1, 0].double()
    advantages = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        valid = [t for t in range(R) if mask[i, t] != 0]
        next_value, next_adv = 0.0, 0.0
        for k, t in enumerate(reversed(valid)):
            reward = batch.rewards[i].item() if k == 0 else 0.0
            next_adv = reward + gamma * next_value - values[i, t].item() + gamma * lam * next_adv
            next_value = values[i, t].item()
            advantages[i, t] = next_adv
    m = mask != 0
    mean, var = advantages[m].mean(), advantages[m].var()
    return torch.where(m, (advantages - mean) / torch.sqrt(var + 1e-8), 0.0)


@pytest.mark.parametrize("overrides", [("algo.policy_loss=cispo",),
                                       ("algo.policy_loss=gspo", "algo.loss_agg=seq-mean-token-mean")],
                         ids=["cispo", "gspo"])
def test_ppo_option_first_update_equals_the_formulas(tmp_path, overrides):
    """The critic starts from a reward-model export (a known head), so its values are transformers' too."""
    policy, rm = policy_and_rm(tmp_path)
    batch_file = str(tmp_path / "batch.pt")
    run_distributed(_record_and_train, PPOTrainer, tiny_ppo_config, policy, str(tmp_path / "run"), batch_file,
                    *ONE_UPDATE, f"critic.path={rm}", *overrides, world_size=1)
    (row,) = _rows(str(tmp_path / "run"))
    batch = torch.load(batch_file, weights_only=False)[0]
    advantages = _whitened_gae(rm, batch)
    loss, norm = _surrogate_at_ratio_one(policy, batch, advantages, overrides[0].split("=")[1])
    assert row["actor/loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert row["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert row["actor/clip_frac"] == 0 and row["actor/approx_kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (("algo.advantage=reinforce",), "unknown advantage estimator 'reinforce'"),
    (("algo.policy_loss=sapo",), "'sapo'"),
    (("algo.policy_loss=gspo",), "loss_agg='token-mean'"),
    (("algo.policy_loss=cispo", "algo.dual_clip=3"), "dual_clip=3.0"),
    (("algo.kl_estimator=k2",), "'k2'"),
    (("algo.cispo_eps_high=-1",), "cispo_eps_high must be >= 0, got -1"),
])
def test_config_errors_name_the_value(policy, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        tiny_config(policy, str(tmp_path), *overrides)
    if overrides[0].startswith("algo.policy_loss"):
        with pytest.raises(ConfigError, match=message):
            tiny_ppo_config(policy, str(tmp_path), *overrides)
