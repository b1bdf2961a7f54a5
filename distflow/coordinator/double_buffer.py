"""Asynchronous double buffering: item i+1 is produced (the next step's prompts read
and tokenised) on a background thread while the caller computes on item i.

A producer must not run collectives on the default process group: collectives on one
group are ordered per rank, so a background one could interleave with the main
thread's (FSDP's) in a different order on different ranks and deadlock.

Every produce and compute span is recorded in an `EventLog`, so overlap is shown from
events (transfer i+1 finished before compute i did), not inferred from timings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar


T = TypeVar("T")


@dataclass(frozen=True)
class Span:
    kind: str  # "produce" or "compute"
    index: int
    start: float
    end: float


@dataclass
class EventLog:
    spans: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def span(self, kind: str, index: int):
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.spans.append(Span(kind, index, start, time.perf_counter()))

    def get(self, kind: str, index: int) -> Span:
        return next(s for s in self.spans if s.kind == kind and s.index == index)

    def overlapped(self, index: int) -> bool:
        """Did producing item index+1 finish while item index was still computing?"""
        nxt, cur = self.get("produce", index + 1), self.get("compute", index)
        return nxt.start < cur.end and nxt.end <= cur.end


class DoubleBuffer(Generic[T]):
    """Iterate over `produce(0..count-1)` with the next item always in flight.

        for i, item in DoubleBuffer(fetch, n, log):
            with log.span("compute", i):
                work(item)
    """

    def __init__(self, produce: Callable[[int], T], count: int, log: EventLog | None = None):
        self.produce, self.count, self.log = produce, count, log or EventLog()

    def _run(self, index: int) -> T:
        with self.log.span("produce", index):
            return self.produce(index)

    def __iter__(self) -> Iterator[tuple[int, T]]:
        if self.count == 0:
            return
        pending = self._start(0)
        for index in range(self.count):
            item = pending.result()
            if index + 1 < self.count:  # start the next one before handing this one out
                pending = self._start(index + 1)
            yield index, item

    def _start(self, index: int) -> Future:
        """Produce item `index` on a daemon thread of its own: a caller that fails or stops
        early neither waits for it (the next step's trajectories may never come once a
        step has failed) nor keeps its process alive for it."""
        future: Future = Future()

        def produce() -> None:
            try:
                future.set_result(self._run(index))
            except BaseException as e:  # handed to the caller, raised where it takes the item
                future.set_exception(e)

        threading.Thread(target=produce, name=f"distflow-prefetch-{index}", daemon=True).start()
        return future
