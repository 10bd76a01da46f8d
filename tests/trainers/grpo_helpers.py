"""Shared pieces of the GRPO tests (and the other online trainers'): a tiny random policy in HF format, test reward
functions, a config, recorded global batches replayed at any dp."""
import json
import os
import time

import torch

from megalign.config import load_config
from megalign.data import CharTokenizer
from megalign.models import CausalLM, ModelConfig, from_pretrained, save_hf_checkpoint
from megalign.trainers.grpo import GRPOConfig

HERE = os.path.dirname(os.path.abspath(__file__))


def digit_fraction(prompt, response, answer, metadata):
    """A dense reward a random policy can climb: the fraction of response characters that are digits."""
    return sum(ch.isdigit() for ch in response) / max(1, len(response))


def raise_on_odd_length(prompt, response, answer, metadata):
    """A broken user reward: raises for about half of the responses."""
    if len(response) % 2:
        raise RuntimeError("deliberately broken reward")
    return 1.0


def tiny_policy(path, seed=0, vocab_size=None, model_cls=CausalLM, std=0.1, layers=2):
    """A `layers`-layer (default 2) random Llama over the character vocabulary (or `vocab_size` rows), written as an HF checkpoint at `path`.

    `model_cls`: `CausalLM` (a policy) or `megalign.models.RewardModel` (a scalar head: a reward model); the
    matrices are drawn from N(0, std^2)."""
    tok = CharTokenizer()
    config = ModelConfig(model_type="llama", vocab_size=vocab_size or tok.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=64, pad_token_id=tok.pad_id,
                         extra_hf={"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id})
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    save_hf_checkpoint(model, path)
    return str(path)


def policy_and_rm(root):
    """(policy folder, reward-model folder) under `root`: a `tiny_policy`, and the same trunk with a trained-looking
    score head (a linear ramp), as an RM export is."""
    policy = tiny_policy(root / "policy")
    rm = from_pretrained(policy, kind="reward", new_head=True)
    with torch.no_grad():
        rm.head.score.weight.copy_(torch.linspace(-1, 1, rm.config.hidden_size)[None])
    save_hf_checkpoint(rm, root / "rm")
    return policy, str(root / "rm")


def tiny_overrides(policy, run_dir, *overrides):
    """The `key=value` overrides of `tiny_config` (also the command line of `launch/train_grpo.py` for it)."""
    return [
        f"run_dir={run_dir}", f"actor.path={policy}", "steps=2", "seed=0", "device=cpu", "tensorboard=false",
        f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}]",
        "data.arith.max_operand=4", "data.arith.ops=['+']", "rollout.group_size=4", "rollout.prompts_per_step=4",
        "rollout.max_response_length=8", "algo.mini_batches=2", "optim.lr=0.01", "optim.warmup_steps=0",
        "eval.max_samples=0", "save_every=0", *overrides]


def tiny_config(policy, run_dir, *overrides):
    """A GRPO config that runs a step in well under a second on the tiny policy, rewarding digits."""
    return load_config(GRPOConfig, None, tiny_overrides(policy, run_dir, *overrides))


def write_rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return str(path)


def constant_one(prompt, response, answer, metadata):
    """Every response scores the same: no group is informative for dynamic sampling."""
    return 1.0


def always_raises(prompt, response, answer, metadata):
    """A verifier broken for every sample (e.g. a renamed metadata field)."""
    raise KeyError("expected_answer")


def record_batches(trainer, steps, batch_file):
    """Save `steps` global batches sampled and scored by `trainer` (one rank, so each is the whole global batch)."""
    torch.save([trainer.collect()[0] for _ in range(steps)], batch_file)


def train_replayed(trainer_cls, cfg, batch_file):
    """Train a `trainer_cls` on `cfg` whose step s trains recorded global batch s (`record_batches`) in place of
    sampling: dp rank r takes rows [r N/dp, (r+1) N/dp) (whole groups). Sampled live, each dp rank would draw its
    own responses from its own generator, so only replayed batches let runs at different dp see the same ones."""

    class Replayed(trainer_cls):
        def collect(self):
            batch = torch.load(batch_file, weights_only=False)[self.progress["step"]]
            per_rank = len(batch) // self.layout.dp
            mine = batch.select(slice(self.layout.dp_rank * per_rank, (self.layout.dp_rank + 1) * per_rank))
            return mine, mine, {"rounds": 1, "dropped_groups": 0,
                                "kept_groups": per_rank // self.cfg.rollout.group_size}

    return Replayed(cfg).train()


def never_returns(prompt, response, answer, metadata):
    """A user reward that hangs (a network call with no timeout), catching the exceptions a retry loop would."""
    while True:
        try:
            time.sleep(3600)
        except Exception:
            pass


def hangs_on_rank0(prompt, response, answer, metadata):
    """Hangs on global rank 0 only (one stuck node); digit_fraction elsewhere."""
    if int(os.environ.get("RANK", "0")) == 0:
        never_returns(prompt, response, answer, metadata)
    return digit_fraction(prompt, response, answer, metadata)
