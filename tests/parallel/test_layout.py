"""ParallelLayout: pure rank arithmetic against Megatron's own group construction, and the mesh on 2 ranks."""
import pytest
import torch
import torch.distributed as dist

from megalign.parallel.layout import (ParallelLayout, check_sizes, coords_rank, embedding_group_ranks, group_ranks,
                                      rank_coords)

from .dist_utils import run_distributed


def megatron_groups(tp, pp, dp):
    """Groups as Megatron-LM's `initialize_model_parallel` builds them (the reference order)."""
    world = tp * pp * dp
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    num_pp_groups = world // pp
    pp_groups = [list(range(i, world, num_pp_groups)) for i in range(num_pp_groups)]
    dp_groups = []
    for i in range(pp):
        start, end = i * num_pp_groups, (i + 1) * num_pp_groups
        dp_groups += [list(range(start + j, end, tp)) for j in range(tp)]
    embedding_groups = [[ranks[0], ranks[-1]] if len(ranks) > 1 else ranks for ranks in pp_groups]
    return {"tp": tp_groups, "pp": pp_groups, "dp": dp_groups, "embedding": embedding_groups}


def factorisations(world):
    return [(tp, pp, world // (tp * pp)) for tp in range(1, world + 1) for pp in range(1, world + 1)
            if world % (tp * pp) == 0]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16, 30])
def test_groups_and_coords_follow_megatron_order(world):
    for tp, pp, dp in factorisations(world):
        expected = megatron_groups(tp, pp, dp)
        for dim in ("tp", "pp", "dp"):
            got = group_ranks(dim, tp=tp, pp=pp, dp=dp)
            assert sorted(got) == sorted(expected[dim]), (tp, pp, dp, dim)
        assert sorted(embedding_group_ranks(tp=tp, pp=pp, dp=dp)) == sorted(expected["embedding"]), (tp, pp, dp)
        for rank in range(world):
            c = rank_coords(rank, tp=tp, pp=pp, dp=dp)
            # a rank's coordinate along a dim is its position in its group of that dim
            for dim in ("tp", "pp", "dp"):
                group = next(g for g in expected[dim] if rank in g)
                assert c[dim] == group.index(rank), (tp, pp, dp, rank, dim)
            assert coords_rank(pp_rank=c["pp"], dp_rank=c["dp"], tp_rank=c["tp"], tp=tp, dp=dp) == rank


def test_layout_plan_neighbours_and_stages():
    # tp=2, dp=2, pp=3 on 12 ranks; rank 7 = (pp 1, dp 1, tp 1)
    layout = ParallelLayout(tp=2, pp=3, dp=2, world_size=12, rank=7)
    assert (layout.pp_rank, layout.dp_rank, layout.tp_rank) == (1, 1, 1)
    assert layout.group_ranks("tp") == [6, 7]
    assert layout.group_ranks("dp") == [5, 7]
    assert layout.group_ranks("pp") == [3, 7, 11]
    assert (layout.prev_stage_rank, layout.next_stage_rank) == (3, 11)
    assert not layout.is_first_stage and not layout.is_last_stage
    assert layout.device == torch.device("cpu")
    first = ParallelLayout(tp=2, pp=3, dp=2, world_size=12, rank=2)
    last = ParallelLayout(tp=2, pp=3, dp=2, world_size=12, rank=9)
    assert first.is_first_stage and first.prev_stage_rank is None and first.next_stage_rank == 6
    assert last.is_last_stage and last.next_stage_rank is None and last.prev_stage_rank == 5
    assert [first.stage_rank(s) for s in range(3)] == [2, 6, 10]
    with pytest.raises(ValueError, match=r"stage=3 is outside \[0, pp=3\)"):
        first.stage_rank(3)


def test_size_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"tp=2 \* pp=3 \* dp=1 = 6 != world_size=8"):
        ParallelLayout(tp=2, pp=3, dp=1, world_size=8)
    with pytest.raises(ValueError, match=r"dp must be a positive int, got 0"):
        check_sizes(tp=1, pp=1, dp=0, world_size=0)
    with pytest.raises(ValueError, match=r"tp must be a positive int, got 1.5"):
        check_sizes(tp=1.5, pp=1, dp=1, world_size=1)
    with pytest.raises(ValueError, match=r"rank=4 is outside \[0, world_size=4\)"):
        ParallelLayout(tp=2, pp=1, dp=2, world_size=4, rank=4)
    with pytest.raises(ValueError, match="dim must be one of"):
        group_ranks("ep", tp=1, pp=1, dp=1)
    with pytest.raises(RuntimeError, match="has no DeviceMesh"):
        ParallelLayout(tp=1, pp=1, dp=1, world_size=1).tp_group


def _layouts_on_two_ranks():
    rank = dist.get_rank()
    for tp, pp in ((2, 1), (1, 1), (1, 2)):
        layout = ParallelLayout.build(tp=tp, pp=pp, device_type="cpu")
        assert (layout.tp, layout.pp, layout.dp, layout.world_size, layout.rank) == (tp, pp, 2 // (tp * pp), 2, rank)
        for dim in ("tp", "dp", "pp"):
            group = layout.group(dim)
            ranks = dist.get_process_group_ranks(group)
            assert ranks == layout.group_ranks(dim), (tp, pp, dim, ranks)
            assert dist.get_rank(group) == layout.coords()[dim]
            # the group really connects its members: the sum of their global ranks
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)
            assert total.item() == sum(ranks)
        assert layout.tp_group is layout.group("tp") and layout.dp_group is layout.group("dp")
        assert layout.pp_group is layout.group("pp")
        embedding = layout.embedding_group  # both ranks at pp=2; at pp=1 this rank alone (the pp group)
        assert dist.get_process_group_ranks(embedding) == ([0, 1] if pp == 2 else layout.group_ranks("pp"))
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=embedding)
        assert total.item() == (1.0 if pp == 2 else rank)
        if pp == 2:
            assert layout.is_first_stage == (rank == 0) and layout.is_last_stage == (rank == 1)
            assert (layout.prev_stage_rank, layout.next_stage_rank) == ((None, 1) if rank == 0 else (0, None))
    try:
        ParallelLayout.build(tp=3)
    except ValueError as e:
        assert "world_size=2 is not divisible by tp=3 * pp=1" in str(e)
    else:
        raise AssertionError("tp=3 on 2 ranks was accepted")


def test_layout_on_two_ranks():
    run_distributed(_layouts_on_two_ranks)
