"""The DPO trainer with each of TRL's DPO variants (`algo.loss`: apo_zero, apo_down, nca_pair, sppo_hard, exo_pair,
bco_pair) and with WPO's weighting (`algo.use_weighting`) on the embedded arithmetic pairs, on a tiny policy.

At the first step the policy is its own reference, so every log-ratio is 0 and the loss of every pair is a
hand-worked constant of beta (0.1, the default) and EXO's eps; the second step runs after one update. WPO's
weighted loss of the objective equals TRL's formula on transformers' full logits of the same checkpoint (loss
and head gradient, float64), and a tp = 2 run equals the tp = 1 one.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import assert_rows_close, metric_rows

from megalign.config import ConfigError, load_config
from megalign.data import IGNORE_INDEX, ArithTaskConfig, CharTokenizer, collate_preferences, make_splits
from megalign.data.arith import preference_rows
from megalign.data.preference import PreferenceExample
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.roles.sequence_logps import PairBatch
from megalign.trainers.online_dpo import OnlineDPOConfig
from megalign.trainers.preference import DPOConfig, PairwiseObjective, train_dpo

EPS = 1e-3  # EXO's default eps
FIRST_STEP_LOSS = {
    "apo_zero": 0.5 + 0.5,  # sigma(0) + sigma(0)
    "apo_down": 0.5 + 0.5,
    "nca_pair": -math.log(0.5) - 0.5 * (2 * math.log(0.5)),
    "sppo_hard": (0 - 0.5 / 0.1) ** 2 + (0 + 0.5 / 0.1) ** 2,
    "exo_pair": 0.5 * (math.log(0.5) - math.log(1 - EPS)) + 0.5 * (math.log(0.5) - math.log(EPS)),
    "bco_pair": 2 * math.log(2),  # delta = 0
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _train(policy, run_dir, *overrides):
    train_dpo(load_config(DPOConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=2", "batch_size=8", "data.arith.max_operand=4",
        "data.max_length=40", "optim.lr=1e-3", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=0", *overrides]))


@pytest.mark.parametrize("loss", sorted(FIRST_STEP_LOSS))
def test_one_step_with_each_variant(policy, tmp_path, loss):
    run_distributed(_train, policy, str(tmp_path), f"algo.loss={loss}", world_size=1)
    first, second = metric_rows(str(tmp_path))
    assert first["loss"] == pytest.approx(FIRST_STEP_LOSS[loss], rel=1e-6)
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-6) and first["pairs"] == 8
    assert math.isfinite(second["loss"]) and second["loss"] != pytest.approx(first["loss"], rel=1e-6)
    assert second["rewards/margins"] != 0  # the update moved the policy away from its reference


def trl_weighted_sigmoid(logits, targets, ref, beta, n):
    """TRL's DPOTrainer with use_weighting: concatenated_forward's policy_weights on the full logits [2n, T, V]
    (rows: n chosen, then n rejected; targets IGNORE_INDEX off the responses), times the sigmoid loss, per pair."""
    loss_mask = targets != IGNORE_INDEX
    labels = targets.clamp(min=0)
    per_token_logps = logits.log_softmax(-1).gather(2, labels[..., None]).squeeze(2) * loss_mask
    all_logps = per_token_logps.sum(-1)
    with torch.no_grad():
        logprobs = F.log_softmax(logits, dim=-1)
        weights_adjustment_factor = torch.logsumexp(2 * logprobs, dim=-1)
        per_token_logps_adjusted = per_token_logps - weights_adjustment_factor
        all_weights = (per_token_logps_adjusted * loss_mask).sum(-1) / loss_mask.sum(-1)
        policy_weights = torch.clamp(torch.exp(all_weights[:n] + all_weights[n:]), max=1)
    logits_margin = (all_logps[:n] - all_logps[n:]) - (ref[:, 0] - ref[:, 1])
    return -F.logsigmoid(beta * logits_margin) * policy_weights, policy_weights


def test_wpo_weighted_loss_equals_trls_on_full_logits(tmp_path):
    from transformers import LlamaForCausalLM

    path = tiny_policy(tmp_path / "hf")
    tok = CharTokenizer()
    train, _ = make_splits(ArithTaskConfig(max_operand=9))
    examples = [PreferenceExample(tok.encode(r["prompt"], add_bos=True), tok.encode(r["chosen"]) + [tok.eos_id],
                                  tok.encode(r["rejected"]) + [tok.eos_id], r["margin"])
                for r in preference_rows(train[:5])]
    batch = PairBatch(**collate_preferences(examples, tok.pad_id))
    batch.ref_scores = torch.tensor([[-30.0, -31.0], [-25.0, -20.0], [-40.0, -45.0], [-33.0, -33.5], [-28.0, -26.0]],
                                    dtype=torch.float64)
    cfg = load_config(DPOConfig, None, ["algo.use_weighting=true", "algo.beta=0.5"])
    model = from_pretrained(path, vocab_pad_multiple=64, dtype=torch.float64)
    layout = ParallelLayout(tp=1, pp=1, dp=1, world_size=1)
    objective = PairwiseObjective(cfg, tok)
    input_ids, attention_mask, rows = objective.inputs(batch)
    loss, metrics = objective.loss(model, model.model(input_ids, attention_mask), rows, layout)
    loss.backward()

    hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
    logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected, weights = trl_weighted_sigmoid(logits, batch.targets, batch.ref_scores, 0.5, 5)
    expected.sum().backward()
    assert (weights < 1).all() and (weights > 0).all()  # the weights are in play
    torch.testing.assert_close(loss, expected.sum(), rtol=1e-10, atol=1e-12)
    vocab = model.config.vocab_size
    torch.testing.assert_close(model.lm_head.proj.weight.grad[:vocab], hf.lm_head.weight.grad, rtol=1e-9, atol=1e-12)


def test_wpo_tp2_equals_tp1(policy, tmp_path):
    run_distributed(_train, policy, f"{tmp_path}/tp1", "algo.use_weighting=true", "steps=1", world_size=1)
    run_distributed(_train, policy, f"{tmp_path}/tp2", "algo.use_weighting=true", "steps=1", "model.tp=2",
                    "reference.tp=2", world_size=2)
    tp1, tp2 = metric_rows(f"{tmp_path}/tp1")[0], metric_rows(f"{tmp_path}/tp2")[0]
    assert_rows_close(tp1, tp2)
    assert 0 < tp1["loss"] < math.log(2)  # ln 2 per pair at the first step, times weights in (0, 1]


def test_online_dpo_refuses_wpo():
    with pytest.raises(ConfigError, match="use_weighting: online DPO does not compute WPO's weights"):
        load_config(OnlineDPOConfig, None, ["algo.use_weighting=true"])
