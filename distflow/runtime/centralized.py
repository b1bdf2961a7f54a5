"""`runtime.mode=centralized`: the single-controller baseline's data path.

The workers run the same graph with the same engines, micro-batching and seeds, but every
stage's data goes through the driver (the launcher process), as in verl's
single-controller design:

- at the start of a step, each worker's prompts go to the driver, which keeps the step's
  batch (one row per sample);
- before each node, the driver sends each worker that node's input fields for its rows
  (verl's dispatch), and after it, the node's outputs come back to the driver (collect);
- a layout change (rollout rows -> token-balanced training rows) is planned by the
  driver, with the same planner the Data Coordinator uses, and the driver sends each
  worker all the fields of its new rows.

Nothing goes from worker to worker. Transfers use Ray's object store with numpy buffers
(zero-copy serialisation, the best the single-controller design can do); only object
references travel through the control queues. The driver counts every payload byte it
receives and sends.

Graphs with filters (DAPO's dynamic sampling) and tensor-parallel rollout groups are
distributed-mode only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from distflow.coordinator.layout import Layout
from distflow.coordinator.planner import plan_reshard
from distflow.data.batch import LEFT_PADDED, Batch


def to_wire(batch: Batch) -> dict[str, Any]:
    """Numpy buffers (serialised out of band by Ray, no pickling of the data) and lists."""
    return {"tensors": {k: v.numpy() for k, v in batch.tensors.items()}, "meta": batch.meta}


def from_wire(wire: dict[str, Any]) -> Batch:
    # the object store's buffers are read-only: the worker takes its own copy
    return Batch({k: torch.from_numpy(np.array(v)) for k, v in wire["tensors"].items()}, dict(wire["meta"]))


def wire_bytes(wire: dict[str, Any]) -> int:
    return sum(v.nbytes for v in wire["tensors"].values())


@dataclass
class Message:
    rank: int
    seq: int
    kind: str  # sources | outputs | inputs | move
    ids: list[int]
    payload: list[Any]  # [object ref] for sources/outputs (a list, so Ray does not resolve it)
    fields: tuple[str, ...] = ()
    move: tuple[Layout, Layout, str, float, dict[int, int]] | None = None  # src, dst, balance, tolerance, lengths


class WorkerRelay:
    """A worker's end: sends to the driver's queue, waits on its own."""

    def __init__(self, up: Any, down: Any, rank: int, timeout_s: float):
        self.up, self.down, self.rank, self.timeout_s = up, down, rank, timeout_s
        self.seq = 0

    def _send(self, kind: str, ids: list[int], batch: Batch | None = None, **extra) -> None:
        import ray

        payload = [ray.put(to_wire(batch))] if batch is not None else []
        self.up.put(Message(self.rank, self.seq, kind, ids, payload, **extra), timeout=self.timeout_s)
        self.seq += 1

    def _receive(self) -> Batch:
        import ray

        ref = self.down.get(timeout=self.timeout_s)[0]
        return from_wire(ray.get(ref, timeout=self.timeout_s))

    def sources(self, batch: Batch) -> None:
        self._send("sources", list(batch["sample_id"]), batch)

    def outputs(self, store, fields: list[str]) -> None:
        batch = store.all()
        self._send("outputs", list(batch["sample_id"]), store.get(*fields))

    def inputs(self, store, fields: list[str]) -> None:
        """The driver's copy of `fields` for this worker's rows replaces the store's. The
        driver pads 2-D fields to the widest over all workers; the extra columns are
        padding for these rows, so they are cut back to the worker's own width."""
        self._send("inputs", list(store.all()["sample_id"]), fields=tuple(fields))
        received, local = self._receive(), store.all()
        for name, value in received.tensors.items():
            width = local.tensors[name].shape[1] if value.dim() == 2 and name in local.tensors else None
            if width is not None and value.shape[1] > width:
                received.tensors[name] = value[:, -width:] if name in LEFT_PADDED else value[:, :width]
        local.update(received)

    def move(self, store, src: Layout, dst: Layout, lengths: list[int], balance: str, tolerance: float) -> None:
        ids = list(store.all()["sample_id"])
        self._send("move", ids, move=(src, dst, balance, tolerance, dict(zip(ids, lengths))))
        store.replace(self._receive())


class DriverRelay:
    """The driver's end: holds the step's batch and serves the workers' requests, one
    exchange at a time (all workers' messages of exchange k before any of k+1)."""

    def __init__(self, num_workers: int, timeout_s: float):
        from ray.util.queue import Queue

        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.up = Queue(actor_options={"num_cpus": 0})
        self.down = [Queue(actor_options={"num_cpus": 0}) for _ in range(num_workers)]
        self.waiting: dict[int, dict[int, Message]] = {}
        self.next_seq = 0
        self.batch: Batch | None = None
        self.row: dict[int, int] = {}
        self.bytes_in = self.bytes_out = 0
        self.seconds = 0.0

    def endpoint(self, rank: int) -> WorkerRelay:
        return WorkerRelay(self.up, self.down[rank], rank, self.timeout_s)

    def serve(self, wait_s: float) -> None:
        """Handle what arrives within `wait_s`."""
        from ray.util.queue import Empty

        try:
            message = self.up.get(timeout=wait_s)
        except Empty:
            return
        while True:
            self.waiting.setdefault(message.seq, {})[message.rank] = message
            while len(self.waiting.get(self.next_seq, {})) == self.num_workers:
                start = time.perf_counter()
                self._handle(self.waiting.pop(self.next_seq))
                self.seconds += time.perf_counter() - start
                self.next_seq += 1
            try:
                message = self.up.get_nowait()
            except Empty:
                return

    def _get(self, message: Message) -> Batch:
        import ray

        wire = ray.get(message.payload[0], timeout=self.timeout_s)
        self.bytes_in += wire_bytes(wire)
        return from_wire(wire)

    def _reply(self, rank: int, batch: Batch) -> None:
        import ray

        wire = to_wire(batch)
        self.bytes_out += wire_bytes(wire)
        self.down[rank].put([ray.put(wire)], timeout=self.timeout_s)

    def _rows(self, ids: list[int]) -> list[int]:
        return [self.row[i] for i in ids]

    def _handle(self, messages: dict[int, Message]) -> None:
        ranks = sorted(messages)
        kind = messages[ranks[0]].kind
        if kind == "sources":  # a new step: its batch, in rank order
            parts = [self._get(messages[r]) for r in ranks]
            self.batch = Batch.concat(parts)
            self.row = {int(s): i for i, s in enumerate(self.batch["sample_id"])}
        elif kind == "outputs":
            parts = [self._get(messages[r]) for r in ranks]
            ids = [i for r in ranks for i in messages[r].ids]
            merged = Batch.concat(parts)
            order = sorted(range(len(ids)), key=lambda k: self.row[ids[k]])
            self.batch.update(merged.select(order))
        elif kind == "inputs":
            for r in ranks:
                fields = messages[r].fields  # only these are copied for the worker's rows
                wanted = Batch({f: self.batch.tensors[f] for f in fields if f in self.batch.tensors},
                               {f: self.batch.meta[f] for f in fields if f in self.batch.meta})
                self._reply(r, wanted.select(self._rows(messages[r].ids)))
        elif kind == "move":
            src, dst, balance, tolerance, _ = messages[ranks[0]].move
            lengths = {s: n for r in ranks for s, n in messages[r].move[4].items()}
            plan = plan_reshard(src, dst, {r: messages[r].ids for r in ranks}, lengths, balance=balance,
                                tolerance=tolerance)
            for r in ranks:
                self._reply(r, self.batch.select(self._rows(plan.samples_for(r))))
        else:
            raise ValueError(f"unknown relay message {kind!r}")

    def stats(self) -> dict[str, float]:
        return {"driver_payload_bytes_received": self.bytes_in, "driver_payload_bytes_sent": self.bytes_out,
                "driver_relay_seconds": self.seconds}
