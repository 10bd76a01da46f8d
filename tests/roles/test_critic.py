"""The PPO critic: initialised from a policy (head fresh) or a reward model (head read), values per response
token against transformers, its HF `*ForTokenClassification` export, tensor parallelism and a training step."""
import os

import pytest
import torch
import transformers
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import policy_and_rm

from megalign.checkpoint import export_hf
from megalign.models import from_pretrained, scalar_head_from_pretrained
from megalign.parallel import MixedPrecision, ParallelLayout
from megalign.roles import TOKEN_CLASSIFICATION, Critic
from megalign.trainers.optim import OptimConfig, build_optimizer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(policy folder, reward-model folder): a tiny Llama, and the same trunk with a trained-looking score head."""
    return policy_and_rm(tmp_path_factory.mktemp("critic"))


def _inputs(vocab, prompt=5, response=4, batch=3):
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (batch, prompt + response))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    mask[1, -1] = 0  # a response one token short (right padding)
    return ids, mask


def _critic(path, layout, seed=0, lr=1e-2):
    model, fresh = scalar_head_from_pretrained(path, "value", layout, seed)
    optimizer = build_optimizer(model, OptimConfig(lr=lr), layout)
    return Critic(model, layout, MixedPrecision(None), False, False, optimizer, 1.0), fresh


def _single_rank_checks(policy, rm, out):
    layout = ParallelLayout.build(tp=1, device_type="cpu")
    critic, fresh = _critic(policy, layout)
    assert fresh
    # the trunk is the policy's, the head small and drawn from the seed (the same on every rank)
    causal = from_pretrained(policy)
    for name, p in causal.model.named_parameters():
        torch.testing.assert_close(dict(critic.model.model.named_parameters())[name], p, rtol=0, atol=0)
    weight = critic.model.head.score.weight
    assert weight.abs().max() < 5.0 / (critic.model.config.hidden_size + 1)
    assert torch.equal(weight, _critic(policy, layout)[0].model.head.score.weight)
    critic_rm, fresh = _critic(rm, layout)
    assert not fresh
    torch.testing.assert_close(critic_rm.model.head.score.weight[0], torch.linspace(-1, 1, weight.shape[1]))
    with pytest.raises(TypeError, match="per-token ValueModel"):
        Critic(from_pretrained(rm, kind="reward"), layout, MixedPrecision(None), False, False, None, None)

    # values of the states before each response token against transformers' token classifier
    export_hf(critic_rm.model, out, layout, architecture=TOKEN_CLASSIFICATION["llama"])
    hf = transformers.AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForTokenClassification" and hf.score.bias is None
    ids, mask = _inputs(critic.model.config.vocab_size)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # megalign counts real tokens, as HF generate does
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits[..., 0]  # [B, T, 1] -> [B, T]
    values = critic_rm.values(ids, mask, 4)
    assert values.shape == (3, 4) and values.dtype == torch.float32
    torch.testing.assert_close(values[mask[:, 5:] == 1], expected[:, 4:8][mask[:, 5:] == 1], rtol=1e-5, atol=1e-5)
    assert not values.requires_grad
    # the export reloads as a critic with the same values (verl and megalign read the same file)
    reloaded, fresh = scalar_head_from_pretrained(out, "value", layout, seed=0)
    assert not fresh
    torch.testing.assert_close(Critic(reloaded, layout, MixedPrecision(None), False, False, None, None)
                               .values(ids, mask, 4), values, rtol=1e-6, atol=1e-6)

    # one value-regression step lowers the squared error
    target = torch.full((3, 4), 2.0)
    before = ((critic.values(ids, mask, 4) - target) ** 2).mean()
    for _ in range(3):
        loss = ((critic.values_with_grad(ids, mask, 4) - target) ** 2).mean()
        loss.backward()
        stepped, norm = critic.optimizer_step(loss)
        assert stepped and torch.isfinite(norm)
    assert ((critic.values(ids, mask, 4) - target) ** 2).mean() < before


def test_critic_init_values_and_export(checkpoints, tmp_path):
    run_distributed(_single_rank_checks, *checkpoints, str(tmp_path / "critic_hf"), world_size=1)
    assert os.path.isfile(tmp_path / "critic_hf" / "model.safetensors")


def _tp_matches_single(rm):
    tp2 = _critic(rm, ParallelLayout.build(tp=2, device_type="cpu"))[0]
    ids, mask = _inputs(tp2.model.config.vocab_size)
    reference = from_pretrained(rm, kind="value")
    with torch.no_grad():
        expected = reference(ids, mask)[:, 4:8]
    real = mask[:, 5:] == 1  # values at padding are filler (0), which callers mask out
    torch.testing.assert_close(tp2.values(ids, mask, 4)[real], expected[real], rtol=1e-5, atol=1e-5)


def test_tensor_parallel_critic_matches_single_device(checkpoints):
    run_distributed(_tp_matches_single, checkpoints[1])
