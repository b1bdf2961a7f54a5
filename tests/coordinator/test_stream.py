"""The reshard in micro-batch chunks: same samples as the one-shot reshard, chunk i+1
transferred (background group) while chunk i is consumed."""

import time

import torch

from distflow.coordinator.executor import reshard
from distflow.coordinator.layout import Layout
from distflow.coordinator.double_buffer import EventLog
from distflow.coordinator.microbatch import local_micro_batches
from distflow.coordinator.planner import plan_reshard
from distflow.coordinator.stream import chunk_plans, stream_reshard
from distflow.data.batch import Batch
from helpers import run_gloo


def test_chunk_plans_partition_each_ranks_destination():
    lengths = {s: 10 + (s * 37) % 50 for s in range(24)}
    src, dst = Layout(4, tp_size=2), Layout.data_parallel(4)
    holdings = {0: list(range(12)), 1: list(range(12)), 2: list(range(12, 24)), 3: list(range(12, 24))}
    plan = plan_reshard(src, dst, holdings, lengths, balance="kk")
    subs = chunk_plans(plan, lengths, range(4), lambda lens: local_micro_batches(lens, micro_batch_size=2))
    assert len(subs) == 3  # 6 samples per rank, 2 per micro-batch
    for r in range(4):
        got = [s for sub in subs for s in sub.samples_for(r)]
        assert sorted(got) == plan.samples_for(r) and len(got) == len(set(got))
        assert all(len(sub.samples_for(r)) <= 2 for sub in subs)
    key = lambda m: (m.src, m.dst, m.sample)  # noqa: E731
    assert sorted((m for sub in subs for m in sub.moves), key=key) == sorted(plan.moves, key=key)


def _stream(rank, world):
    ids = list(range(rank * 8, rank * 8 + 8))
    batch = Batch({"x": torch.tensor(ids, dtype=torch.float32)[:, None] * torch.ones(1, 16)},
                  {"tag": [f"s{s}" for s in ids]})
    lengths = [5 + s % 7 for s in ids]
    dp = Layout.data_parallel(world)
    src = dp
    whole, whole_ids, _ = reshard(batch, ids, lengths, src, dp, balance="kk")
    log, got_ids = EventLog(), []
    for i, (chunk, chunk_ids) in stream_reshard(batch, ids, lengths, src, dp,
                                                lambda lens: local_micro_batches(lens, micro_batch_size=3),
                                                balance="kk", log=log):
        with log.span("compute", i):
            end = time.perf_counter() + 0.3
            while time.perf_counter() < end:
                torch.randn(64, 64) @ torch.randn(64, 64)
        assert chunk["x"][:, 0].tolist() == [float(s) for s in chunk_ids]
        assert chunk["tag"] == [f"s{s}" for s in chunk_ids]
        got_ids += chunk_ids
    chunks = len([s for s in log.spans if s.kind == "compute"])
    return sorted(got_ids) == whole_ids, [log.overlapped(i) for i in range(chunks - 1)]


def test_streamed_chunks_equal_the_one_shot_reshard_and_overlap():
    for same, overlaps in run_gloo(_stream, 2):
        assert same
        assert overlaps and all(overlaps)
