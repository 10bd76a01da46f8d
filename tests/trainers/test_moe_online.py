"""MoE actors in the online trainers (`megalign.trainers.online_moe`, `megalign.rollout.routing`) on tiny random
Qwen3-MoE checkpoints written by transformers.

References that can fail: the engine's per-sample record (continuous batching, chunked prefill, left-padded prompts)
equals the experts a full padded forward over the finished sequences picks, at every position but padding and each
response's last token; with the router moved between rollout and recomputation (top-1 routing, so a replayed token's
output does not depend on the router), replay makes the recomputed log-probs the rollout's (GRPO padded and packed,
PPO) and online DPO's pair log-probs the rollout's sums, while without replay they differ and `moe/router_agreement`
equals a count by hand of the shared (token, layer, expert) slots; `actor/moe_aux_loss` equals transformers'
`load_balancing_loss_func` on its own router logits and the actor loss grows by exactly coef x it; bad settings are
refused naming the key.
"""
import json
import os
import shutil

import pytest
import torch
from parallel.dist_utils import run_distributed
from torch.testing import assert_close
from trainers.grpo_helpers import tiny_config, tiny_policy
from trainers.test_online_dpo import _config as dpo_config
from trainers.test_ppo_trainer import tiny_ppo_config
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megalign.data import CharTokenizer
from megalign.models import from_pretrained, moe_routing
from megalign.parallel.collectives import all_reduce
from megalign.rollout import EngineConfig, SamplingParams, rollout
from megalign.rollout.routing import RoutingRecorder
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.online_dpo import OnlineDPOTrainer
from megalign.trainers.ppo import PPOTrainer

EXPERTS = 4


def tiny_moe(path, k: int, seed: int = 0, **extra) -> str:
    """A random 2-layer Qwen3-MoE (both layers MoE, E = 4, top-k renormalised) over the character vocabulary, saved
    by transformers; routers drawn wider than the rest so top-k margins are wide."""
    tok = CharTokenizer()
    cfg = Qwen3MoeConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         num_experts=EXPERTS, num_experts_per_tok=k, moe_intermediate_size=16, norm_topk_prob=True,
                         rms_norm_eps=1e-5, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                         router_aux_loss_coef=0.02, **extra)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.1)
    model.eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def top1(tmp_path_factory):
    return tiny_moe(tmp_path_factory.mktemp("moe") / "k1", k=1)


@pytest.fixture(scope="module")
def top2(tmp_path_factory):
    return tiny_moe(tmp_path_factory.mktemp("moe") / "k2", k=2)


def _routers(model):
    return [layer.mlp.router for layer in model.model.layers if hasattr(layer.mlp, "router")]


def _chosen(model, sequences, attention_mask) -> torch.Tensor:
    """[B, T, L, k] the experts a full padded forward picks (the reference the records are held to)."""
    with torch.no_grad(), moe_routing(model, record=True) as routing:
        model(sequences, attention_mask=attention_mask)
    b, t = sequences.shape
    return torch.stack([routing.chosen[layer] for layer in sorted(routing.chosen)], 1).view(b, t, -1,
                                                                                            routing.chosen[0].shape[1])


def test_engine_records_each_sample_as_a_full_forward_routes_it(top2):
    model = from_pretrained(top2).eval()
    tok = CharTokenizer()
    ids = torch.randint(4, tok.vocab_size, (3, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for row, pad in ((1, 3), (2, 1)):  # left padding of different widths
        ids[row, :pad], mask[row, :pad] = tok.pad_id, 0
    stop = int(ids[0, -1])  # a common token ends some samples early: responses of different lengths
    params = SamplingParams(max_new_tokens=7, temperature=1.5, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                            stop_token_ids=[stop])
    recorder = RoutingRecorder()
    out, _ = rollout(model, ids, mask, 3, params, seed=1,
                     config=EngineConfig(max_batch=4, sync_every=2, prefill_batch=2), routing=recorder)
    record = recorder.sequences
    b, t = out.sequences.shape
    assert record.shape == (9, t, 2, 2) and record.dtype == torch.int16
    lengths = out.attention_mask[:, 6:].sum(1)
    assert len(set(lengths.tolist())) > 1  # the continuous batching refilled slots
    real = out.attention_mask.bool()
    last = torch.zeros_like(real)
    last[torch.arange(b), 6 + lengths - 1] = True  # each response's last token is never fed
    recorded = (record >= 0).all(-1).all(-1)
    assert torch.equal(recorded, real & ~last) and bool((record[~recorded] == -1).all())
    full = _chosen(model, out.sequences, out.attention_mask)
    assert torch.equal(record[recorded].long().sort(-1).values, full[recorded].sort(-1).values)


def _hand_counts(model, batch) -> tuple[int, int]:
    """(shared, recorded) (token, layer, expert) slots of the rollout's record and a padded forward's choice, counted
    in Python."""
    now = _chosen(model, batch.sequences, batch.attention_mask).tolist()
    shared = total = 0
    for row, rec_row in enumerate(batch.routing.tolist()):
        for pos, layers in enumerate(rec_row):
            for layer, experts in enumerate(layers):
                if experts[0] >= 0:
                    shared += len(set(experts) & set(now[row][pos][layer]))
                    total += len(experts)
    return shared, total


def _expected_agreement(trainer, seen) -> float:
    """The hand counts of every dp rank pooled."""
    counts = all_reduce(torch.tensor(seen["counts"], dtype=torch.float64), trainer.layout.dp_group)
    return float(counts[0] / counts[1])


def _move_routers_before_scoring(trainer, seen):
    """Redraw the actor's (and the reference's) routers after the rollout, before the old log-probs (the router a
    training update would have moved); keep the batch and the agreement counted by hand right after the move."""
    score = trainer.score

    def moved(batch):
        gen = torch.Generator().manual_seed(5)
        models = [trainer.actor.model] + ([trainer.reference.model] if trainer.reference is not None else [])
        with torch.no_grad():
            for router in [r for model in models for r in _routers(model)]:
                router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.5)
        seen["batch"], seen["counts"] = batch, _hand_counts(trainer.actor.model, batch)
        seen["agreement"] = seen["counts"][0] / seen["counts"][1]
        score(batch)
    trainer.score = moved


COMMON = ("steps=1", "rollout.old_logprobs=recompute", "algo.mini_batches=1")


def _grpo_replay(top1, tmp_path, pack, *layout):
    diffs = {}
    for replay in (True, False):
        seen = {}
        trainer = GRPOTrainer(tiny_config(top1, tmp_path / f"{replay}", *COMMON, pack, "rollout.pack_tokens=16",
                                          f"actor.routing_replay={str(replay).lower()}", *layout))
        _move_routers_before_scoring(trainer, seen)
        metrics = trainer.train_step()
        batch = seen["batch"]
        on = batch.response_mask.bool()
        assert batch.routing is not None and batch.routing.shape[:2] == batch.sequences.shape
        diffs[replay] = (batch.old_logp - batch.rollout_logp)[on].abs().max().item()
        assert seen["agreement"] < 0.9  # the move flipped many tokens' experts
        if replay:
            assert_close(batch.old_logp[on], batch.rollout_logp[on], atol=2e-5, rtol=2e-5)
            assert "moe/router_agreement" not in metrics
        else:
            assert float(metrics["moe/router_agreement"]) == pytest.approx(_expected_agreement(trainer, seen), abs=1e-9)
    assert diffs[False] > 100 * max(diffs[True], 1e-6)


PADDED, PACKED = "rollout.pack=false", "rollout.pack_max_fill=1.0"


@pytest.mark.parametrize("pack, world, layout", [(PADDED, 1, ()), (PACKED, 1, ()), (PADDED, 2, ()),
                                                 (PACKED, 2, ("actor.tp=2",))],
                         ids=["padded", "packed", "padded-dp2", "packed-tp2"])
def test_grpo_replay_recomputes_the_rollout_logprobs_after_the_router_moves(top1, tmp_path, pack, world, layout):
    """Top-1 routing renormalised: a token's output depends on which expert, not on the router's probabilities, so
    with the rollout's experts the recomputation must give the rollout's log-probs, whatever the router became;
    padded rows, and packs of one or two rows (several forwards a micro-batch); dp = 2 (the agreement pooled over
    ranks) and tp = 2 (every tp rank records and replays the same experts)."""
    run_distributed(_grpo_replay, top1, tmp_path, pack, *layout, world_size=world, timeout_s=120)


def _agreement(top2, tmp_path, old_logprobs):
    seen = {}
    trainer = GRPOTrainer(tiny_config(top2, tmp_path / "run", "steps=1", "algo.mini_batches=1", PACKED,
                                      f"rollout.old_logprobs={old_logprobs}"))
    _move_routers_before_scoring(trainer, seen)
    metrics = trainer.train_step()
    assert 0.0 < seen["agreement"] < 0.9
    assert float(metrics["moe/router_agreement"]) == pytest.approx(seen["agreement"], abs=1e-9)


@pytest.mark.parametrize("old_logprobs", ["recompute", "rollout"])
def test_router_agreement_counts_shared_slots_of_two_experts(top2, tmp_path, old_logprobs):
    """k = 2: a token keeping one of its two experts counts 1/2 (the sets, not the order, are compared); measured on
    the recomputation, or without one on the training forwards before the first update (one mini-batch: all rows)."""
    run_distributed(_agreement, top2, tmp_path, old_logprobs, world_size=1, timeout_s=120)


def _reference(top1, tmp_path):
    seen = {}
    trainer = GRPOTrainer(tiny_config(top1, tmp_path / "run", *COMMON, "algo.kl_coef=0.1", "actor.routing_replay=true",
                                      "reference.routing_replay=true", "rollout.pack_max_fill=1.0"))
    assert trainer.reference.model is not trainer.actor.model
    _move_routers_before_scoring(trainer, seen)
    trainer.train_step()
    batch, on = seen["batch"], seen["batch"].response_mask.bool()
    assert_close(batch.ref_logp[on], batch.rollout_logp[on], atol=2e-5, rtol=2e-5)


def test_reference_replay_scores_with_the_rollout_experts(top1, tmp_path):
    """The reference (the actor's checkpoint, its own copy) with moved routers replays the actor's rollout experts: at
    the first step its log-probs are the rollout's."""
    run_distributed(_reference, top1, tmp_path, world_size=1, timeout_s=120)


def _hf_aux(path, batch) -> float:
    """transformers' load-balancing loss (`load_balancing_loss_func` over its routers' logits, padding masked) of the
    batch under the checkpoint, positions counted over real tokens as megalign's are."""
    hf = Qwen3MoeForCausalLM.from_pretrained(path).eval()
    mask = batch.attention_mask
    with torch.no_grad():
        out = hf(batch.sequences, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                 output_router_logits=True)
    return float(out.aux_loss)


def _aux(top2, tmp_path):
    runs = {}
    for coef in (0.0, 0.5):
        seen = {}
        trainer = GRPOTrainer(tiny_config(top2, tmp_path / f"{coef}", "steps=1", "algo.mini_batches=1",
                                          "algo.micro_batch_size=16", "actor.routing_replay=true",
                                          f"actor.moe_aux_loss_coef={coef}"))
        score = trainer.score
        trainer.score = lambda batch, score=score: (seen.setdefault("batch", batch), score(batch))[1]
        runs[coef] = (trainer.train_step(), seen["batch"])
    metrics, batch = runs[0.5]
    assert "actor/moe_aux_loss" not in runs[0.0][0]
    hf = _hf_aux(top2, batch)
    assert float(metrics["actor/moe_aux_loss"]) == pytest.approx(hf, rel=1e-5)
    assert torch.equal(batch.sequences, runs[0.0][1].sequences)  # the same rollout: only the aux term differs
    assert float(metrics["actor/loss"]) - float(runs[0.0][0]["actor/loss"]) == pytest.approx(0.5 * hf, rel=1e-4)


def test_aux_loss_is_transformers_and_adds_coef_times_it_to_the_actor_loss(top2, tmp_path):
    run_distributed(_aux, top2, tmp_path, world_size=1, timeout_s=120)


def _aux_default(top2, tmp_path):
    assert GRPOTrainer(tiny_config(top2, tmp_path / "off", "steps=1")).moe.coef == 0.0
    on = tmp_path / "on"
    shutil.copytree(top2, on)
    with open(os.path.join(on, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(on, "config.json"), "w") as f:
        json.dump({**hf, "output_router_logits": True}, f)
    assert GRPOTrainer(tiny_config(str(on), tmp_path / "run", "steps=1")).moe.coef == 0.02


def test_aux_loss_default_follows_output_router_logits(top2, tmp_path):
    run_distributed(_aux_default, top2, tmp_path, world_size=1)


def _ppo(top1, tmp_path):
    seen = {}
    trainer = PPOTrainer(tiny_ppo_config(top1, tmp_path / "run", *COMMON, "actor.routing_replay=true",
                                         f"critic.path={tiny_policy(tmp_path / 'critic')}"))
    _move_routers_before_scoring(trainer, seen)
    metrics = trainer.train_step()
    batch, on = seen["batch"], seen["batch"].response_mask.bool()
    assert seen["agreement"] < 0.9
    assert_close(batch.old_logp[on], batch.rollout_logp[on], atol=2e-5, rtol=2e-5)
    assert all(torch.isfinite(torch.as_tensor(metrics[k])) for k in ("actor/loss", "critic/loss"))


def test_ppo_replay_recomputes_the_rollout_logprobs(top1, tmp_path):
    run_distributed(_ppo, top1, tmp_path, world_size=1, timeout_s=120)


def _dpo(top1, tmp_path):
    seen = {}
    trainer = OnlineDPOTrainer(dpo_config(top1, tmp_path / "run", "steps=1", "actor.routing_replay=true",
                                          "rollout.prompts_per_step=8"))
    _move_routers_before_scoring(trainer, seen)
    metrics = trainer.train_step()
    batch = seen["batch"]
    chosen, rejected, tied, _, _ = trainer.pairs
    assert seen["agreement"] < 0.9 and chosen.numel() > 0
    rollout_sums = (batch.rollout_logp * batch.response_mask).sum(1)
    assert float(metrics["logps/chosen"]) == pytest.approx(float(rollout_sums[chosen].mean()), abs=1e-4)
    assert float(metrics["logps/rejected"]) == pytest.approx(float(rollout_sums[rejected].mean()), abs=1e-4)


def test_online_dpo_replay_scores_pairs_with_the_rollout_experts(top1, tmp_path):
    """Online DPO's pair log-probs (temperature 1, the rollout's too) with the rollout's experts: the summed rollout
    log-probs of each chosen response, although the routers moved before scoring."""
    run_distributed(_dpo, top1, tmp_path, world_size=1, timeout_s=120)


def _refusals(top2, tmp_path):
    dense = tiny_policy(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"actor.routing_replay=true: the actor .* is a dense model"):
        GRPOTrainer(tiny_config(dense, tmp_path / "a", "actor.routing_replay=true"))
    with pytest.raises(ValueError, match=r"actor.moe_aux_loss_coef=0.1: the actor .* is a dense model"):
        GRPOTrainer(tiny_config(dense, tmp_path / "b", "actor.moe_aux_loss_coef=0.1"))
    with pytest.raises(ValueError, match=r"actor.routing_replay=true needs actor.pp=1"):
        GRPOTrainer(tiny_config(top2, tmp_path / "c", "actor.routing_replay=true", "actor.pp=2"))
    with pytest.raises(ValueError, match=r"reference.routing_replay=true: this run has no reference"):
        GRPOTrainer(tiny_config(top2, tmp_path / "d", "reference.routing_replay=true", "algo.kl_coef=0"))
    with pytest.raises(ValueError, match=r"actor.moe_aux_loss_coef must be >= 0"):
        tiny_config(top2, tmp_path / "e", "actor.moe_aux_loss_coef=-1")


def test_settings_are_refused_naming_the_key(top2, tmp_path):
    run_distributed(_refusals, top2, tmp_path, world_size=1)
