"""The launcher itself: a failure on one rank fails the test even while the other rank waits in a collective."""
import pytest
import torch.distributed as dist

from .dist_utils import RankFailure, run_distributed


def _rank1_fails():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the launcher stopping it


def test_failure_on_one_rank_reaches_pytest():
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_distributed(_rank1_fails, timeout_s=20)
