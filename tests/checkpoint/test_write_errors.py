"""A checkpoint write that fails names the file and the cause: on a full disk torch's zip writer said only
`unexpected pos 704 vs 598`. The disk is a 64 KiB tmpfs, which needs mount rights (root in a container): skipped
where there are none."""
import os
import subprocess

import pytest
import torch
from parallel.dist_utils import run_distributed

from megalign.checkpoint import CheckpointManager
from megalign.checkpoint.write_errors import CheckpointWriteError


@pytest.fixture
def full_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (no mount rights)")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _save_too_much(run_dir):
    manager = CheckpointManager(run_dir)
    manager.save(1, {"model": {"w": torch.ones(10)}})  # fits
    with pytest.raises(CheckpointWriteError) as error:
        manager.save(2, {"model": {"w": torch.ones(100_000)}})
    assert error.value.errno == 28
    message = str(error.value)
    assert message.startswith(f"[Errno 28] cannot write the checkpoint of step 2: rank 0: {run_dir}/checkpoints/"
                              f"step_00000002.tmp/"), message
    assert "ENOSPC (No space left on device)" in message and "unexpected pos" not in message, message
    assert manager.steps() == [1]  # nothing renamed into place


def test_a_full_disk_names_the_file_and_enospc(full_disk):
    run_distributed(_save_too_much, os.path.join(full_disk, "run"), world_size=1)
