"""SFT trainer: exact resume (dp=2 with ZeRO-1), NaN steps skipped and kept out of checkpoints, learning, HF export."""
import json
import math
import os

import torch
from parallel.dist_utils import run_distributed
from safetensors.torch import load_file
from trainers.helpers import NaNOnCalls, capture_warnings, checkpoint_params

from megalign.config import load_config
from megalign.data import CharTokenizer
from megalign.data.sft import IGNORE_INDEX, collate_sft, encode_sft
from megalign.trainers import sft as sft_mod
from megalign.trainers.sft import SFTConfig, train_sft


def tiny_config(run_dir, *overrides) -> SFTConfig:
    """A model and task small enough for a step to take milliseconds (4 operand values, 75 problems)."""
    return load_config(SFTConfig, None, [
        f"run_dir={run_dir}", "steps=4", "batch_size=8", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "data.arith.max_operand=4",
        "optim.lr=1e-2", "optim.warmup_steps=1", "optim.weight_decay=0.01", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=2", "keep_last=10", *overrides])


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_collate_masks_prompt_and_padding():
    tok = CharTokenizer()
    a, b = encode_sft("1+2=", "<answer>3</answer>", tok), encode_sft("10*10=", "<answer>100</answer>", tok)
    assert a.prompt_ids[0] == tok.bos_id and a.response_ids[-1] == tok.eos_id
    batch = collate_sft([a, b], tok.pad_id)
    seq_b = b.prompt_ids + b.response_ids
    assert batch["input_ids"].shape == (2, len(seq_b) - 1)
    # row b: targets are the response tokens (and EOS), predicted from the last prompt position on
    assert batch["targets"][1].tolist() == [IGNORE_INDEX] * (len(b.prompt_ids) - 1) + b.response_ids
    n_a = len(a.prompt_ids) + len(a.response_ids) - 1
    assert batch["attention_mask"][0].tolist() == [1] * n_a + [0] * (batch["input_ids"].shape[1] - n_a)
    assert tok.decode([t for t in batch["targets"][0].tolist() if t != IGNORE_INDEX]) == "<answer>3</answer>"


def _resume_matches_straight_run(tmp: str) -> None:
    straight, split = os.path.join(tmp, "straight"), os.path.join(tmp, "split")
    train_sft(tiny_config(straight))
    train_sft(tiny_config(split, "steps=2"))  # stops after step 2 (checkpoint at 2)
    resumed = train_sft(tiny_config(split))  # resume=auto continues at step 3
    assert [row["step"] for row in resumed.metrics] == [3, 4]
    if torch.distributed.get_rank() == 0:
        losses = {r["step"]: r["loss"] for r in read_metrics(straight)}
        resumed_losses = {r["step"]: r["loss"] for r in read_metrics(split)}
        assert losses == resumed_losses and len(losses) == 4, (losses, resumed_losses)
        a, b = checkpoint_params(straight, 4), checkpoint_params(split, 4)
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_resume_continues_exactly_dp2(tmp_path):
    run_distributed(_resume_matches_straight_run, str(tmp_path))


def _nan_step_is_skipped(tmp: str) -> None:
    warnings = capture_warnings("megalign.trainers")
    sft_mod.sft_loss = NaNOnCalls(sft_mod.sft_loss, nan_calls={2})
    train_sft(tiny_config(tmp, "save_every=1", "steps=3"))
    assert any("step 2: non-finite loss" in w and "skipping the update" in w for w in warnings), warnings
    rows = read_metrics(tmp)
    assert [r["nan_skips"] for r in rows] == [0, 1, 1] and rows[1]["loss"] is None  # NaN is written as null
    step1, step2, step3 = (checkpoint_params(tmp, s) for s in (1, 2, 3))
    for name in step1:
        assert torch.isfinite(step2[name]).all(), name
        torch.testing.assert_close(step2[name], step1[name], rtol=0, atol=0, msg=name)  # the NaN step changed nothing
    assert any(not torch.equal(step3[n], step2[n]) for n in step2)  # training went on afterwards


def test_nan_loss_skips_the_step_and_never_reaches_a_checkpoint(tmp_path):
    run_distributed(_nan_step_is_skipped, str(tmp_path), world_size=1)


def _learns_and_exports(tmp: str) -> None:
    result = train_sft(tiny_config(tmp, "steps=40", "optim.lr=3e-3", "optim.warmup_steps=5", "save_every=0",
                                   "export_hf=true", "eval.max_samples=8", "eval.max_new_tokens=12"))
    losses = [row["loss"] for row in result.metrics]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    # the per-token NLL starts near log(99) = 4.6 (uniform over the char vocabulary)
    assert abs(losses[0] - math.log(99)) < 0.5, losses[0]
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses
    assert result.accuracy is not None and 0.0 <= result.accuracy <= 1.0
    exported = load_file(os.path.join(result.hf_path, "model.safetensors"))
    ckpt = checkpoint_params(tmp, 40)
    torch.testing.assert_close(exported["model.embed_tokens.weight"], ckpt["model.tp0_pp0.model.embed.weight"],
                               rtol=0, atol=0)
    with open(os.path.join(result.hf_path, "config.json")) as f:
        hf = json.load(f)
    assert (hf["vocab_size"], hf["eos_token_id"], hf["architectures"]) == (99, 2, ["LlamaForCausalLM"])
    assert read_metrics(tmp)[-1] == {"step": 40, "eval/accuracy": result.accuracy}
    assert load_config(SFTConfig, os.path.join(tmp, "config.yaml")).steps == 40  # resolved config saved


def test_loss_decreases_and_final_model_is_exported(tmp_path):
    run_distributed(_learns_and_exports, str(tmp_path), world_size=1)
