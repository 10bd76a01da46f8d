"""SFT at pp = 2 (and tp = 2 x pp = 2): one trainer step equals the unpipelined step on the same global batch
(loss, gradient norm, updated weights), the HF export reloads in transformers with the same logits, a pp = 2 run
resumes exactly, and bad placements fail at start-up naming the settings and numbers."""
import os

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.helpers import compare_runs, metric_rows, whole_model

from megalign.config import load_config
from megalign.trainers.sft import SFTConfig, train_sft

LAYERS = 2
SFT_METRICS = ("loss", "grad_norm", "tokens")


def tiny(run_dir, *overrides) -> SFTConfig:
    """2 layers (one per stage at pp=2), hidden 32; batch 8 so dp=1 x 2 micro-batches and dp=2 x 2 both split."""
    return load_config(SFTConfig, None, [
        f"run_dir={run_dir}", "steps=2", "batch_size=8", "model.hidden_size=32", "model.intermediate_size=64",
        f"model.num_layers={LAYERS}", "model.num_heads=2", "model.num_kv_heads=2", "data.arith.max_operand=4",
        "optim.lr=1e-2", "optim.warmup_steps=0", "optim.weight_decay=0.01", "optim.grad_clip=0.5",
        "eval.max_samples=0", "tensorboard=false", "export_hf=false", "save_every=1", "keep_last=10", *overrides])


def _train(run_dir, *overrides):
    train_sft(tiny(run_dir, *overrides))


def hf_logits(path):
    """transformers' logits of the export at `path` on a fixed sequence of character ids."""
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([[1, 5, 9, 17, 33, 40, 2]])
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits


@pytest.mark.parametrize("tied", [True, False])
def test_pp2_step_equals_unpipelined(tmp_path, tied):
    """pp=2, dp=1 (2 processes) against tp=1 x pp=1 (1 process), tied and untied embeddings; the HF export too."""
    overrides = (f"model.tie_word_embeddings={str(tied).lower()}", "export_hf=true")
    run_distributed(_train, str(tmp_path / "ref"), *overrides, world_size=1)
    run_distributed(_train, str(tmp_path / "pp2"), "model.pp=2", *overrides, world_size=2)
    compare_runs(tmp_path / "ref", tmp_path / "pp2", 2, 1, LAYERS, SFT_METRICS)
    assert os.path.exists(tmp_path / "pp2" / "hf" / "model.safetensors.index.json")  # one shard per stage
    tokenizer_files = set(os.listdir(tmp_path / "ref" / "hf")) - {"model.safetensors"}
    assert tokenizer_files <= set(os.listdir(tmp_path / "pp2" / "hf")), tokenizer_files
    torch.testing.assert_close(hf_logits(tmp_path / "pp2" / "hf"), hf_logits(tmp_path / "ref" / "hf"),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tp2_pp2_step_equals_unpipelined(tmp_path):
    """4 processes on 2 cores (~1 min): tp=2 x pp=2, dp=1, untied; and pp=2 x dp=2."""
    overrides = ("model.tie_word_embeddings=false", "export_hf=true")
    run_distributed(_train, str(tmp_path / "ref"), *overrides, world_size=1)
    run_distributed(_train, str(tmp_path / "tp2pp2"), "model.tp=2", "model.pp=2", *overrides, world_size=4)
    compare_runs(tmp_path / "ref", tmp_path / "tp2pp2", 2, 2, LAYERS, SFT_METRICS)
    torch.testing.assert_close(hf_logits(tmp_path / "tp2pp2" / "hf"), hf_logits(tmp_path / "ref" / "hf"),
                               rtol=1e-5, atol=1e-5)
    run_distributed(_train, str(tmp_path / "pp2dp2"), "model.pp=2", *overrides, world_size=4)
    compare_runs(tmp_path / "ref", tmp_path / "pp2dp2", 2, 1, LAYERS, SFT_METRICS)


def _resume(tmp):
    straight, split = os.path.join(tmp, "straight"), os.path.join(tmp, "split")
    constant = ("model.pp=2", "optim.schedule=constant")  # the lr then does not depend on `steps`
    train_sft(tiny(straight, *constant, "steps=3"))
    train_sft(tiny(split, *constant, "steps=2"))
    resumed = train_sft(tiny(split, *constant, "steps=3"))
    assert [row["step"] for row in resumed.metrics] == [3]


def test_pp2_resumes_exactly(tmp_path):
    run_distributed(_resume, str(tmp_path), world_size=2)
    straight, split = whole_model(tmp_path / "straight", 3, 2, 1, LAYERS), whole_model(tmp_path / "split", 3, 2, 1, LAYERS)
    assert sorted(straight) == sorted(split)
    for name in straight:
        torch.testing.assert_close(split[name][0], straight[name][0], rtol=0, atol=0, msg=name)
    assert metric_rows(tmp_path / "straight")[2] == metric_rows(tmp_path / "split")[2]


def _start_up_error(tmp, *overrides):
    with pytest.raises(ValueError) as e:
        train_sft(tiny(tmp, *overrides))
    return str(e.value)


def _layers_error(tmp):
    message = _start_up_error(tmp, "model.pp=2", "model.num_layers=3")
    assert "model.pp=2 does not divide the 3 decoder layers of model.num_layers" in message, message


def test_start_up_errors_name_the_settings(tmp_path):
    run_distributed(_world_error, str(tmp_path / "world"), world_size=1)
    run_distributed(_layers_error, str(tmp_path / "layers"), world_size=2)
    run_distributed(_micro_error, str(tmp_path / "micro"), world_size=2)


def _world_error(tmp):
    message = _start_up_error(tmp, "model.pp=2")
    assert "model.tp=1 x model.pp=2 = 2 does not divide the world size 1" in message, message


def _micro_error(tmp):
    message = _start_up_error(tmp, "model.pp=2", "model.microbatches=3")
    assert "8 examples per rank do not split into model.microbatches=3" in message, message
