"""The disaggregated streams on real gloo groups: trajectories rollout rank -> train ranks
(whole groups, balanced by tokens) and versioned weights train rank 0 -> rollout ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distflow.coordinator.stream import (TrajectoryReceiver, TrajectorySender, WeightPublisher, WeightSubscriber,
                                         assign_groups, group_tokens)
from distflow.data.batch import Batch
from helpers import run_gloo


def _batch(groups: list[int], response_lengths: list[int], width: int = 8) -> Batch:
    n = len(groups)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, length in enumerate(response_lengths):
        mask[i, :length] = 1
    return Batch({"group": torch.tensor(groups), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
                  "prompts": torch.arange(2 * n).view(n, 2), "response_mask": mask,
                  "responses": torch.arange(n * width).view(n, width)},
                 {"sample_id": list(range(100, 100 + n))})


def test_one_partition_of_every_sender_s_groups_keeps_them_whole_and_balances_tokens():
    # groups 0..3 with 2 rows each; token totals per group: 2+2+2+2=8, 2*(2+6)=16, 2*(2+1)=6, 2*(2+5)=14
    batch = _batch([0, 0, 1, 1, 2, 2, 3, 3], [2, 2, 6, 6, 1, 1, 5, 5])
    assert group_tokens(batch) == {0: 8, 1: 16, 2: 6, 3: 14}
    assert group_tokens(batch.select([])) == {}
    # two senders holding two groups each, over two receivers: {8, 14} and {16, 6}, the best split
    owner = assign_groups([{0: 8, 1: 16}, {2: 6, 3: 14}], 2)
    assert owner[0] == owner[3] != owner[1] == owner[2]
    # two senders of two equal groups each, over four receivers: one group each. Each sender splitting its own
    # share (and rotating by its rank) gave the receivers 1, 2, 1 and 0 groups
    owner = assign_groups([{0: 10, 1: 10}, {2: 10, 3: 10}], 4)
    assert sorted(owner.values()) == [0, 1, 2, 3]


def _step_batch(rank: int, step: int) -> Batch:
    offset = 10 * rank + step
    batch = _batch([offset, offset, offset + 5, offset + 5], [1, 3, 7, 2])
    batch.meta["sample_id"] = [1000 * rank + 10 * step + i for i in range(4)]
    return batch


def _trajectories(rank: int, world: int) -> list:
    """Ranks 0-1 train, ranks 2-3 generate; each rollout rank sends two steps."""
    pg = dist.new_group(backend="gloo")  # a group of its own, as the roles get
    if rank >= 2:
        sender = TrajectorySender(pg, range(2))
        for step in (1, 2):  # the rollout ranks' group sizes, as they all-gather them
            owner = assign_groups([group_tokens(_step_batch(r, step)) for r in (2, 3)], 2)
            sender.send(step, _step_batch(rank, step), {"from": rank, "step": step}, owner)
        sender.close()
        return []
    receiver = TrajectoryReceiver(pg, range(2, 4), 1, 2, timeout_s=60)
    out = []
    for step in (1, 2):
        batch, notes = receiver.take(step)
        out.append((step, sorted(batch["sample_id"]), batch["group"].tolist(), notes,
                    int(batch["prompt_mask"].sum() + batch["response_mask"].sum())))
    return out


def test_trajectories_reach_the_train_ranks_whole_and_once():
    results = run_gloo(_trajectories, 4)
    for step_index, step in enumerate((1, 2)):
        got = [results[r][step_index] for r in (0, 1)]
        ids = sorted(got[0][1] + got[1][1])
        assert ids == sorted(1000 * r + 10 * step + i for r in (2, 3) for i in range(4))  # every sample once
        for _, _, groups, _, tokens in got:  # two whole groups of 2 each: a heavy one (13 tokens), a light one (8)
            assert len(groups) == 4 and {groups.count(g) for g in groups} == {2} and tokens == 21
        # the note travels with the first train rank's part only
        assert got[0][3] == [{"from": 2, "step": step}, {"from": 3, "step": step}]
        assert got[1][3] == [{}, {}]


def _weights(rank: int, world: int) -> list:
    pg = dist.new_group(backend="gloo")  # a group of its own, as the roles get
    if rank == 0:
        dist.barrier()  # the subscribers have timed out waiting
        publisher = WeightPublisher(pg)
        sent = []
        for version in (1, 2):  # version 2 in the rollout engines' bfloat16: its floating-point tensors cast
            sent.append(publisher.publish([("w", torch.full((2, 3), float(version))),
                                           ("ids", torch.arange(4) * version),
                                           ("b", torch.full((3,), -float(version)))], version,
                                          dtype=torch.bfloat16 if version == 2 else None, keep_in_fp32=("b",)))
            dist.barrier()  # the subscribers look between versions
        publisher.close()
        return sent
    subscriber = WeightSubscriber(pg, version=0)
    with pytest.raises(TimeoutError, match="no weights of version 1 within 0 s"):  # nothing sent yet
        subscriber.wait_for(1, timeout_s=0.2)
    dist.barrier()
    seen = []
    for version in (1, 2):
        subscriber.wait_for(version, timeout_s=60)
        v, weights = subscriber.take_newer()
        seen.append((v, {name: t.tolist() for name, t in weights}, {name: str(t.dtype) for name, t in weights}))
        assert subscriber.take_newer() is None  # handed over once
        dist.barrier()
    subscriber.join(timeout_s=60)
    return seen


def test_weights_arrive_versioned_with_names_shapes_and_dtypes_or_a_wait_times_out():
    results = run_gloo(_weights, 3)
    # float32 2x3 + int64 4 + float32 3, in bytes; then with the floats in bfloat16, but b, kept in fp32 as HF does
    assert results[0] == [6 * 4 + 4 * 8 + 3 * 4, 6 * 2 + 4 * 8 + 3 * 4]
    for rank in (1, 2):
        (v1, w1, d1), (v2, w2, d2) = results[rank]
        assert (v1, v2) == (1, 2)
        assert w1 == {"w": [[1.0] * 3] * 2, "ids": [0, 1, 2, 3], "b": [-1.0] * 3}
        assert w2 == {"w": [[2.0] * 3] * 2, "ids": [0, 2, 4, 6], "b": [-2.0] * 3}
        assert d1 == {"w": "torch.float32", "ids": "torch.int64", "b": "torch.float32"}
        assert d2 == {"w": "torch.bfloat16", "ids": "torch.int64", "b": "torch.float32"}


def _weights_after_a_long_step(rank: int, world: int) -> list:
    """Rank 0 trains for longer than the role groups' collective timeout before its first
    publish, as a first step with its evaluation does; the rollout rank waits meanwhile."""
    import time

    from distflow.runtime.roles import split_roles

    roles = split_roles(1, 1, timeout_s=1, stream_timeout_s=60)
    if roles.role == "train":
        time.sleep(3)
        publisher = WeightPublisher(roles.weights)
        publisher.publish([("w", torch.ones(2))], 1)
        publisher.close()
        roles.close()
        return []
    subscriber = WeightSubscriber(roles.weights, version=0)
    subscriber.wait_for(1, timeout_s=60)
    version, weights = subscriber.take_newer()
    subscriber.join(timeout_s=60)
    roles.close()
    return [version, weights[0][1].tolist()]


def test_the_streams_wait_a_whole_step_of_the_other_side_not_the_collective_timeout():
    assert run_gloo(_weights_after_a_long_step, 2)[1] == [1, [1.0, 1.0]]


def _one_version_per_replica(rank: int, world: int) -> list:
    """Rank 0 publishes versions 1 and 2; ranks 1-2 are one tensor-parallel replica. Rank 2
    agrees as soon as it holds version 1, rank 1 once it holds version 2: both load 2."""
    pg = dist.new_group(backend="gloo")
    replica = dist.new_group([1, 2], backend="gloo")
    if rank == 0:
        publisher = WeightPublisher(pg)
        publisher.publish([("w", torch.full((2,), 1.0))], 1)
        dist.barrier()
        publisher.publish([("w", torch.full((2,), 2.0))], 2)
        dist.barrier()
        for version in (3, 4, 5):
            publisher.publish([("w", torch.full((2,), float(version)))], version)
        publisher.close()
        return []
    subscriber = WeightSubscriber(pg, version=0)
    subscriber.wait_for(1, timeout_s=60)
    dist.barrier()
    if rank == 1:
        subscriber.wait_for(2, timeout_s=60)
    version, weights = subscriber.take_agreed(replica, current=0, timeout_s=60)
    again = subscriber.take_agreed(replica, current=version, timeout_s=60)  # nothing newer: no swap
    dist.barrier()
    subscriber.wait_for(5, timeout_s=60)  # versions 3-5 arrive untaken: only the two newest are kept
    kept = sorted(subscriber.pending)
    subscriber.join(timeout_s=60)
    return [version, weights[0][1].tolist(), again, kept]


def test_the_ranks_of_a_tensor_parallel_engine_take_one_version():
    results = run_gloo(_one_version_per_replica, 3)
    assert results[1] == results[2] == [2, [2.0, 2.0], None, [4, 5]]


class _SlowToTake(WeightSubscriber):
    """Rank 2's window between agreeing on version 1 and taking it, widened: the publisher
    sends versions 2 and 3 in it, so rank 2 keeps only those two."""

    def __init__(self, pg, version: int, late: dist.ProcessGroup):
        super().__init__(pg, version)
        self.late, self.widened = late, False

    def wait_for(self, version: int, timeout_s: float) -> float:
        waited = super().wait_for(version, timeout_s)
        if version == 1 and not self.widened:
            self.widened = True
            dist.barrier(group=self.late)  # the publisher may go on
            super().wait_for(3, timeout_s)
        return waited


def _a_version_dropped_while_agreeing(rank: int, world: int) -> list:
    pg = dist.new_group(backend="gloo")
    replica, late = dist.new_group([1, 2], backend="gloo"), dist.new_group([0, 2], backend="gloo")
    if rank == 0:
        publisher = WeightPublisher(pg)
        publisher.publish([("w", torch.full((2,), 1.0))], 1)
        dist.barrier(group=late)
        for version in (2, 3):
            publisher.publish([("w", torch.full((2,), float(version)))], version)
        publisher.close()
        return []
    subscriber = _SlowToTake(pg, 0, late) if rank == 2 else WeightSubscriber(pg, version=0)
    if rank == 1:
        subscriber.wait_for(1, timeout_s=60)  # it holds version 1: the replica agrees on 1
    version, weights = subscriber.take_agreed(replica, current=0, timeout_s=60)
    subscriber.join(timeout_s=60)
    return [version, weights[0][1].tolist()]


def test_a_replica_agrees_again_when_the_version_it_agreed_on_gave_way_on_one_rank():
    """Both ranks agree on version 1; before rank 2 takes it, versions 2 and 3 arrive and
    its copy of 1 is dropped (two are kept). It raised a KeyError there; the ranks now
    agree again, on 3, and load the same weights."""
    results = run_gloo(_a_version_dropped_while_agreeing, 3)
    assert results[1] == results[2] == [3, [3.0, 3.0]]
