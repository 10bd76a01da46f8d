"""The run directory is checked at start-up, before any model is built: that its checkpoints folder takes a file and
has room for one checkpoint (before, an unwritable folder failed at the first save and a full disk with
`unexpected pos 704 vs 598`)."""
import os

import pytest
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_config, tiny_policy

from megalign.config import ConfigError
from megalign.models import ModelConfig
from megalign.plan.model import total_params
from megalign.trainers import run_dir
from megalign.trainers.grpo import GRPOTrainer


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _refused(cfg, match, free=None):
    built = []
    GRPOTrainer.build_tokenizer = lambda self, *a: built.append("tokenizer")  # nothing past the base start-up
    if free is not None:
        run_dir.shutil.disk_usage = lambda path: type("Usage", (), {"free": free})()
    with pytest.raises(ConfigError, match=match):
        GRPOTrainer(cfg)
    assert not built


def test_a_run_dir_that_takes_no_checkpoint_file_fails_at_start_up(policy, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("a file where the folder goes")  # root ignores permissions; this it cannot
    run_distributed(_refused, tiny_config(policy, str(run_dir)),
                    rf"run_dir='{run_dir}': cannot write checkpoints in {run_dir}/checkpoints: File exists \(EEXIST",
                    world_size=1)


def test_a_disk_without_room_for_one_checkpoint_fails_at_start_up(policy, tmp_path):
    params = total_params(ModelConfig.from_hf(policy))
    need = params * run_dir.CHECKPOINT_BYTES_PER_PARAM / 2**20
    run_distributed(_refused, tiny_config(policy, str(tmp_path / "run")),
                    rf"has 0.00 MiB free, but one checkpoint of this run takes about {need:.2f} MiB \(12 bytes per "
                    rf"trained parameter\)", 1000, world_size=1)
    assert os.path.isdir(tmp_path / "run" / "checkpoints")
