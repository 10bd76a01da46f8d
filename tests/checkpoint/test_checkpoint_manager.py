"""CheckpointManager: atomic saves, resume selection, exact round trips (1 process and 2 gloo ranks), NaN refusal."""
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from parallel.dist_utils import run_distributed

from megalign.checkpoint import (CheckpointManager, Counters, ModelState, OptimizerState, RNGState, checkpoint_step,
                                 nonfinite_keys)
from megalign.checkpoint import manager as manager_mod
from megalign.data import CharTokenizer, PromptSampler
from megalign.models import CausalLM, ModelConfig
from megalign.parallel import ParallelLayout, allreduce_gradients
from megalign.trainers.optim import OptimConfig, build_optimizer
from megalign.trainers.supervised import PolicyModelConfig, scratch_model


def tiny_model(seed=0) -> CausalLM:
    torch.manual_seed(seed)
    config = ModelConfig(model_type="llama", vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return CausalLM(config)


def train_step(model, optimizer, seed):
    ids = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(seed))
    model(ids).float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def draws():
    """One draw from each global generator (what a restored RNG state must reproduce)."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_round_trip_model_optimizer_rng_sampler_single_process(tmp_path):
    assert not dist.is_initialized()  # DCP's no-process-group path
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = PromptSampler(10, seed=3)
    train_step(model, optimizer, seed=1)
    sampler.next_indices(4)
    manager = CheckpointManager(tmp_path)
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer), "rng": RNGState(),
             "sampler": sampler, "progress": {"step": 1}}
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = manager.save(1, state)
    assert path == os.path.join(tmp_path, "checkpoints", "step_00000001") and manager.latest_step() == 1
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optim = {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}
    expected_draws, expected_indices = draws(), sampler.next_indices(4)

    # diverge everywhere, then restore into a fresh model and optimizer
    sampler.next_indices(4)
    draws()
    fresh = tiny_model(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sampler = PromptSampler(10, seed=3)
    progress = {"step": 0}
    manager.load(1, {"model": ModelState(fresh), "optim": OptimizerState(fresh, fresh_optimizer), "rng": RNGState(),
                     "sampler": fresh_sampler, "progress": progress})
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, saved_params[name], rtol=0, atol=0)
    restored = fresh_optimizer.state_dict()["state"]
    assert restored.keys() == saved_optim.keys()
    for i, s in saved_optim.items():
        for k, v in s.items():
            torch.testing.assert_close(restored[i][k], v, rtol=0, atol=0)
    assert progress == {"step": 1}
    assert draws() == expected_draws
    assert fresh_sampler.next_indices(4) == expected_indices
    # and the restored optimizer continues exactly like the original
    train_step(model, optimizer, seed=2)
    train_step(fresh, fresh_optimizer, seed=2)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_crash_mid_save_leaves_only_tmp_which_is_ignored(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep_last=5)
    state = {"progress": {"step": 1}, "w": {"x": torch.ones(3)}}
    manager.save(1, state)

    def crash(state_dict, checkpoint_id, storage_writer=None):
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(manager_mod.dcp, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, state)
    monkeypatch.undo()
    assert sorted(os.listdir(manager.dir)) == ["step_00000001", "step_00000002.tmp"]
    assert manager.latest_step() == 1
    assert manager.resolve_resume("auto") == manager.path(1)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.load(os.path.join(manager.dir, "step_00000002.tmp"), state)
    # the next attempt at step 2 replaces the leftover and completes
    manager.save(2, {"progress": {"step": 2}, "w": {"x": torch.full((3,), 2.0)}})
    assert sorted(os.listdir(manager.dir)) == ["step_00000001", "step_00000002"]
    target = {"progress": {"step": 0}, "w": {"x": torch.zeros(3)}}
    manager.load(manager.resolve_resume("auto"), target)
    assert target["progress"] == {"step": 2} and target["w"]["x"].tolist() == [2.0, 2.0, 2.0]


def test_resume_selection_and_pruning(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.resolve_resume("auto") is None and manager.latest_step() is None
    for step in (3, 10, 7):
        manager.save(step, {"progress": {"step": step}})
    assert manager.steps() == [7, 10]  # the oldest by step number went
    assert manager.resolve_resume("auto") == manager.path(10)
    assert manager.resolve_resume("none") is None
    assert manager.resolve_resume("7") == manager.path(7) and manager.resolve_resume(7) == manager.path(7)
    assert manager.resolve_resume(manager.path(10)) == manager.path(10)
    assert checkpoint_step(manager.path(10)) == 10
    with pytest.raises(FileNotFoundError, match=r"completed steps in .*\[7, 10\]"):
        manager.resolve_resume("3")
    with pytest.raises(FileNotFoundError):
        manager.resolve_resume(str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("harm", ["truncate", "remove", "metadata"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, harm):
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        manager.save(step, {"progress": {"step": step}, "w": torch.arange(1000.0) * step})
    folder = manager.path(2)
    data = next(name for name in os.listdir(folder) if name.endswith(".distcp"))
    if harm == "truncate":  # a copy cut short: the file exists, its last bytes do not
        with open(os.path.join(folder, data), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(folder, data)) - 10)
        reason = f"{data} has"
    elif harm == "remove":
        os.remove(os.path.join(folder, data))
        reason = f"{data} missing"
    else:  # a .metadata cut in half
        with open(os.path.join(folder, ".metadata"), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(folder, ".metadata")) // 2)
        reason = ".metadata unreadable"
    assert manager_mod.damage(folder).startswith(reason) and manager_mod.damage(manager.path(1)) is None
    assert manager.steps() == [1] and manager.latest_step() == 1 and list(manager.damaged()) == [2]
    with caplog.at_level("WARNING", logger="megalign.checkpoint.manager"):
        assert manager.resolve_resume("auto") == manager.path(1)
    assert f"{folder} is damaged ({reason}" in caplog.text and "resuming from" in caplog.text
    assert manager.not_continued(manager.path(1)) == []  # the run's own damaged step does not block its resume
    with pytest.raises(FileNotFoundError, match=f"resume=2: .* is not a complete checkpoint \\({reason}"):
        manager.resolve_resume(2)
    state = {"progress": {"step": 0}, "w": torch.zeros(1000)}
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.load(folder, state)
    manager.load(manager.resolve_resume("auto"), state)
    assert state["progress"]["step"] == 1 and torch.equal(state["w"], torch.arange(1000.0))
    manager.save(3, {"progress": {"step": 3}, "w": torch.zeros(1000)})  # the next save removes the damaged one
    assert not os.path.exists(folder) and manager.steps() == [1, 3]


def test_refuses_to_save_nonfinite_state(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match=r"non-finite tensors \['model.tp0_pp0.model.layers.0.mlp.up_proj.weight'\]"):
        manager.save(1, {"model": ModelState(model)})
    assert manager.steps() == [] and not os.path.exists(manager.path(1) + ".tmp")


def test_nonfinite_keys():
    assert nonfinite_keys({"a": {"b": torch.tensor([float("nan")]), "c": torch.ones(1)}, "d": 3}) == ["a.b"]


def _two_rank_round_trip(run_dir: str, tp: int) -> None:
    layout = ParallelLayout.build(tp=tp)
    torch.manual_seed(100 + layout.rank)  # per-rank RNG streams must come back per rank
    tokenizer = CharTokenizer()
    model = scratch_model(PolicyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                          num_kv_heads=2), tokenizer, layout, seed=0)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1), layout)

    def step(seed):
        ids = torch.randint(0, tokenizer.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed + layout.dp_rank))
        model(ids).float().logsumexp(-1).mean().backward()
        allreduce_gradients(list(model.parameters()), layout.dp_group)
        optimizer.step()
        optimizer.zero_grad()

    step(1)
    manager = CheckpointManager(run_dir)
    state = {"model": ModelState(model, layout), "optim": OptimizerState(model, optimizer, layout), "rng": RNGState()}
    manager.save(1, state)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    local = optimizer.optim.state_dict()["state"]  # this dp rank's ZeRO-1 shard
    saved_optim = {i: {k: v.clone() for k, v in s.items()} for i, s in local.items()}
    expected_rand = torch.rand(4)
    step(2)
    torch.rand(4)
    manager.load(1, state)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
    restored = optimizer.optim.state_dict()["state"]
    assert restored.keys() == saved_optim.keys() and saved_optim
    for i, s in saved_optim.items():
        for k, v in s.items():
            torch.testing.assert_close(restored[i][k], v, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(4), expected_rand, rtol=0, atol=0)
    if layout.rank == 0:  # every shard is in the checkpoint under its own key
        keys = dcp.FileSystemReader(manager.path(1)).read_metadata().state_dict_metadata.keys()
        prefixes = {k.split(".")[1] for k in keys if k.startswith(("model.", "optim.", "rng."))}
        assert prefixes == {f"tp{t}_pp0" for t in range(tp)} | {"rank0", "rank1"}, prefixes  # no dp in any key
        # the ZeRO-1 shards of the dp ranks together hold the state of every parameter of the tp shard
        saved_params = {k.split(".state.")[1].rsplit(".", 1)[0] for k in keys if k.startswith("optim.tp0_pp0.state.")}
        assert saved_params == {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_two_rank_round_trip(tmp_path, tp):
    run_distributed(_two_rank_round_trip, str(tmp_path), tp)


def _weights_after(tmp_path, save_before_first_step: bool, resume: bool):
    """The weights after two real AdamW steps of `tiny_model`, with or without a checkpoint written (and, `resume`,
    loaded into a fresh model and optimizer) before the first one."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if save_before_first_step:
        manager = CheckpointManager(tmp_path)
        manager.save(0, {"model": ModelState(model), "optim": OptimizerState(model, optimizer)})
        if resume:
            model = tiny_model(seed=1)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            manager.load(0, {"model": ModelState(model), "optim": OptimizerState(model, optimizer)})
    for seed in (1, 2):
        train_step(model, optimizer, seed)
    return model.state_dict()


@pytest.mark.parametrize("resume", [False, True])
def test_saving_before_the_first_step_changes_nothing(tmp_path, resume):
    # issue 32 item 8: DCP builds a never-stepped optimizer's state by a zero-lr step, which counted as AdamW's
    # step 1, so the first real update was bias-corrected as step 2 (about 26% smaller at beta2 = 0.999)
    expected = _weights_after(tmp_path / "unsaved", save_before_first_step=False, resume=False)
    got = _weights_after(tmp_path / "saved", save_before_first_step=True, resume=resume)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_counters_load_from_a_checkpoint_written_before_some_existed(tmp_path, caplog):
    CheckpointManager(tmp_path).save(3, {"progress": {"step": 3, "nan_skips": 1}})
    progress = {"step": 0, "nan_skips": 0, "updates": 0}
    CheckpointManager(tmp_path).load(3, {"progress": Counters(progress)})
    assert progress == {"step": 3, "nan_skips": 1, "updates": 0}
    assert "predates the counters updates" in caplog.text
