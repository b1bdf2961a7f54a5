"""Overlap shown from recorded events: producing item i+1 (the trainer's prefetch of
the next step's prompts) finishes before the compute of item i ends."""

import threading
import time

import pytest
import torch

from distflow.coordinator.double_buffer import DoubleBuffer, EventLog

CHUNKS = 4


def _compute(seconds: float) -> None:
    end, x = time.perf_counter() + seconds, torch.randn(64, 64)
    while time.perf_counter() < end:
        x = torch.tanh(x @ x)


def test_next_item_is_produced_during_current_compute():
    log, produced = EventLog(), []

    def produce(i: int) -> int:
        time.sleep(0.05)  # reading and tokenising: waits on I/O, not the CPU
        produced.append(i)
        return i * 45

    got = []
    for i, item in DoubleBuffer(produce, CHUNKS, log):
        with log.span("compute", i):
            _compute(0.3)
        got.append(item)
    assert got == [0, 45, 90, 135] and produced == [0, 1, 2, 3]
    assert [log.overlapped(i) for i in range(CHUNKS - 1)] == [True] * (CHUNKS - 1)


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
    with pytest.raises(RuntimeError, match="chunk 2 failed"):
        for _, item in DoubleBuffer(boom, 4):
            got.append(item)
    assert got == [0, 1]


def test_a_failing_step_reaches_its_caller_without_waiting_for_the_next_item():
    """In a disaggregated run the next item is the next step's trajectories, which never
    come once the trainer's step has failed: the failure must not wait for them."""
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def produce(i: int) -> int:
        if i == 1:
            started.set()
            release.wait(30)  # stands for trajectories that never come
            finished.set()
        return i

    try:
        with pytest.raises(RuntimeError, match="step 0 failed"):
            for _, item in DoubleBuffer(produce, 3):
                assert started.wait(30)
                raise RuntimeError("step 0 failed")
        assert not finished.is_set()  # the caller got its error while item 1 was still being produced
    finally:
        release.set()
