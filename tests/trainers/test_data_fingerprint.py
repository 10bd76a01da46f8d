"""A data file changed under the same path since the checkpoint (issue 32 item 4): the resume is refused naming the file,
or, with resume_changes=allow, continues on the new rows and recomputes what the run derived from the old ones.

Before, a DPO run resumed silently and, with reference.mode=cache, kept the old rows' reference log-probs. The
data file here is a file of pairs whose chosen and rejected replies have the same length, so swapping them keeps
the file's size: only its content tells the change. Swapping the replies of a pair swaps the reference's two summed
log-probs of it (chosen, rejected), which is what the rebuilt cache must hold.
"""
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import assert_rows_close, capture_warnings, metric_rows
from trainers.test_dpo import dpo_config

from megalign.checkpoint import CheckpointManager
from megalign.config import ConfigError
from megalign.trainers.preference import train_dpo
from megalign.trainers.run_dir import stale_state

PAIRS = [(f"{a}+{b}=", str(a + b), str((a + b + 1) % 10)) for a in range(1, 5) for b in range(1, 5)]
"""16 arithmetic pairs (prompt, right answer, wrong answer): one-digit replies, so a swap keeps every length."""


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _write_pairs(path, swapped=False):
    with open(path, "w") as f:
        for prompt, right, wrong in PAIRS:
            chosen, rejected = (wrong, right) if swapped else (right, wrong)
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")


def _train(policy, root, *overrides):
    return train_dpo(dpo_config(policy, f"{root}/run", f"data.path={root}/pairs.jsonl", "data.shuffle=false",
                                *overrides))


def _cached_reference(root, step):
    """The `reference_cache` scores [pairs, 2] (chosen, rejected summed log-probs) in checkpoint `step`."""
    reader = dcp.FileSystemReader(CheckpointManager(f"{root}/run").path(step))
    meta = reader.read_metadata().state_dict_metadata["reference_cache.scores"]
    state = {"reference_cache.scores": torch.empty(meta.size, dtype=meta.properties.dtype)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state["reference_cache.scores"]


def _resume_after_the_data_changed(policy, root):
    _train(policy, root, "steps=2")
    size = os.path.getsize(f"{root}/pairs.jsonl")
    _write_pairs(f"{root}/pairs.jsonl", swapped=True)
    assert os.path.getsize(f"{root}/pairs.jsonl") == size
    with pytest.raises(ConfigError, match=rf"data file '{root}/pairs.jsonl' \(data\.path\) changed since .*content "
                                          rf"differs.*resume_changes=allow"):
        _train(policy, root, "steps=4")


def test_a_dpo_run_resumed_after_its_data_file_changed_is_refused_naming_the_file(policy, tmp_path):
    _write_pairs(tmp_path / "pairs.jsonl")
    run_distributed(_resume_after_the_data_changed, policy, str(tmp_path), world_size=1)
    assert CheckpointManager(tmp_path / "run").steps() == [1, 2]  # the refused resume wrote nothing
    assert [row["step"] for row in metric_rows(tmp_path / "run")] == [1, 2]


def _resume_allowed(policy, root):
    _train(policy, root, "steps=2")
    _write_pairs(f"{root}/pairs.jsonl", swapped=True)
    warnings = capture_warnings("megalign")
    result = _train(policy, root, "steps=3", "resume_changes=allow")
    assert [row["step"] for row in result.metrics] == [3]
    assert any(f"'{root}/pairs.jsonl' (data.path)" in w for w in warnings), warnings
    assert any("not loading reference_cache" in w for w in warnings), warnings


def test_an_allowed_resume_after_the_data_changed_rebuilds_the_reference_cache(policy, tmp_path):
    _write_pairs(tmp_path / "pairs.jsonl")
    run_distributed(_resume_allowed, policy, str(tmp_path), world_size=2)
    before, after = _cached_reference(tmp_path, 2), _cached_reference(tmp_path, 3)
    assert before.shape == after.shape == (len(PAIRS), 2)
    assert not torch.allclose(before[:, 0], before[:, 1])  # the swap is visible in the scores
    torch.testing.assert_close(after, before.flip(1), rtol=1e-5, atol=1e-5)


def _online_then_cached(policy, root):
    _train(policy, root, "steps=2", "reference.mode=online")
    warnings = capture_warnings("megalign")
    _train(policy, root, "steps=3", "reference.mode=cache")  # a free key: the same numbers, another cost
    assert any("not loading reference_cache" in w and "the checkpoint holds none" in w for w in warnings), warnings
    _train(policy, f"{root}/straight", "steps=3", "reference.mode=online")


def test_a_run_switched_to_a_cached_reference_on_resume_computes_the_cache(policy, tmp_path):
    _write_pairs(tmp_path / "pairs.jsonl")
    (tmp_path / "straight").mkdir()
    _write_pairs(tmp_path / "straight" / "pairs.jsonl")
    run_distributed(_online_then_cached, policy, str(tmp_path), world_size=1)
    resumed, straight = metric_rows(tmp_path / "run"), metric_rows(tmp_path / "straight" / "run")
    assert len(resumed) == len(straight) == 3
    for a, b in zip(resumed, straight):  # cached scores equal on-the-fly ones (test_dpo)
        assert_rows_close(a, b)


def test_derived_state_is_left_out_when_a_key_it_is_computed_from_changed_or_the_checkpoint_lacks_it():
    derived, saved = {"reference_cache": ("data", "reference", "model.path")}, {"model", "reference_cache"}
    assert stale_state(derived, [], saved) == {}
    assert stale_state(derived, ["optim.lr", "model.pathology"], saved) == {}  # not under a source key
    assert stale_state(derived, ["optim.lr", "data.path"], saved) == {
        "reference_cache": "it is computed from data, reference, model.path, and the resume changed data.path"}
    assert stale_state(derived, [], {"model"}) == {"reference_cache": "the checkpoint holds none"}
