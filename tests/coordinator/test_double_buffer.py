"""Overlap shown from recorded events: the transfer of micro-batch i+1 (a real reshard
over gloo, on the background group) finishes before the compute of micro-batch i ends."""

import time

import torch

from distflow.coordinator.double_buffer import DoubleBuffer, EventLog, background_group
from distflow.coordinator.executor import reshard
from distflow.coordinator.layout import Layout
from distflow.data.batch import Batch
from helpers import run_gloo

CHUNKS = 4


def _compute(seconds: float) -> None:
    end, x = time.perf_counter() + seconds, torch.randn(64, 64)
    while time.perf_counter() < end:
        x = torch.tanh(x @ x)


def _transfer_while_computing(rank, world):
    group = background_group()
    log = EventLog()

    def fetch(i: int):
        ids = [i * 100 + rank * 10 + j for j in range(4)]
        batch = Batch({"x": torch.full((4, 8), float(i * 100 + rank))})
        out, out_ids, plan = reshard(batch, ids, [8] * 4, Layout.data_parallel(world), Layout(world, tp_size=2),
                                     balance="none", group=group)
        return out, out_ids, len(plan.moves)

    received = []
    for i, (out, ids, moves) in DoubleBuffer(fetch, CHUNKS, log):
        with log.span("compute", i):
            _compute(0.4)
        received.append((sorted(ids), moves))
    return [log.overlapped(i) for i in range(CHUNKS - 1)], received


def test_next_transfer_completes_during_current_compute():
    for overlaps, received in run_gloo(_transfer_while_computing, 2):
        assert overlaps == [True] * (CHUNKS - 1)
        for i, (ids, moves) in enumerate(received):  # both ranks got both halves of chunk i
            assert ids == sorted(i * 100 + r * 10 + j for r in range(2) for j in range(4)) and moves == 8


def test_without_prefetch_there_is_no_overlap():
    log = EventLog()
    for i in range(3):  # the same work done one after the other
        with log.span("produce", i):
            time.sleep(0.01)
        with log.span("compute", i):
            time.sleep(0.01)
    assert not log.overlapped(0) and not log.overlapped(1)


def test_items_come_in_order_and_producer_errors_surface():
    assert [item for _, item in DoubleBuffer(lambda i: i * i, 5)] == [0, 1, 4, 9, 16]

    def boom(i):
        if i == 2:
            raise RuntimeError("chunk 2 failed")
        return i

    got = []
    try:
        for _, item in DoubleBuffer(boom, 4):
            got.append(item)
    except RuntimeError as e:
        assert "chunk 2 failed" in str(e)
    assert got == [0, 1]
