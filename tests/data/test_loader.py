import pytest

from distflow.data.loader import ShardedSampler


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_partition_each_global_batch(world):
    samplers = [ShardedSampler(num_rows=37, batch_size=8, rank=r, world_size=world, seed=3) for r in range(world)]
    for step in range(1, 12):  # crosses several epochs of 37 rows
        glob = samplers[0].global_indices(step)
        locs = [s.local_indices(step) for s in samplers]
        assert sorted(i for loc in locs for i in loc) == sorted(glob)
        assert all(len(loc) == 8 // world for loc in locs)


def test_each_epoch_is_a_permutation_and_seeded():
    s = ShardedSampler(num_rows=16, batch_size=4, rank=0, world_size=1, seed=0)
    epoch0 = [i for step in range(1, 5) for i in s.global_indices(step)]
    epoch1 = [i for step in range(5, 9) for i in s.global_indices(step)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(16))
    assert epoch0 != epoch1
    other = ShardedSampler(num_rows=16, batch_size=4, rank=0, world_size=1, seed=1)
    assert other.global_indices(1) != s.global_indices(1)


def test_mini_batches_do_not_depend_on_world_size():
    """Rank r's k-th local slice over all ranks == the k-th contiguous global slice."""
    batch, mini = 8, 4
    one = ShardedSampler(num_rows=100, batch_size=batch, rank=0, world_size=1, seed=0)
    two = [ShardedSampler(num_rows=100, batch_size=batch, rank=r, world_size=2, seed=0) for r in range(2)]
    glob = one.global_indices(5)
    for k in range(batch // mini):
        union = [i for s in two for i in s.local_indices(5)[k * mini // 2:(k + 1) * mini // 2]]
        assert sorted(union) == sorted(glob[k * mini:(k + 1) * mini])


def test_position_is_resumable_state():
    s = ShardedSampler(num_rows=10, batch_size=4, rank=0, world_size=1, seed=0)
    assert s.position(0) == {"epoch": 0, "offset": 0}
    assert s.position(3) == {"epoch": 1, "offset": 2}


def test_state_roundtrip_resumes_the_same_stream():
    s = ShardedSampler(num_rows=10, batch_size=4, rank=1, world_size=2, seed=5)
    state = s.state_dict(7)
    fresh = ShardedSampler(num_rows=10, batch_size=4, rank=1, world_size=2, seed=5)
    nxt = fresh.next_step(state)
    assert nxt == 8 and fresh.local_positions(nxt) == s.local_positions(8)
    with pytest.raises(ValueError, match="its run had trainer.seed=5, this one 6; "):
        ShardedSampler(num_rows=10, batch_size=4, rank=1, world_size=2, seed=6).next_step(state)
