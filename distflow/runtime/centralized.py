"""`runtime.mode=centralized`: the single-controller baseline.

The driver (the launcher process) runs the step's task graph, as verl's trainer does, and
every stage's data goes through it; the workers keep the same engines, micro-batching
and seeds and carry out what the driver tells them:

- at the start of a step, each worker's prompts go to the driver, which keeps the step's
  batch (one row per sample);
- for each node of the graph, in the graph's order, the driver sends every worker a
  command to run it, with that node's input fields for the worker's rows (verl's
  dispatch), and collects the node's outputs from every worker (collect);
- at a layout change (rollout rows -> token-balanced training rows) the driver plans the
  new placement, with the same planner the Data Coordinator uses, and sends each worker
  all the fields of its new rows;
- when the graph is done, the driver tells every worker that the step has ended.

Nothing goes from worker to worker. Transfers use Ray's object store; only object
references travel through the control queues. What a batch travels as is the wire
(runtime.centralized_wire): numpy buffers (`NumpyWire`: zero-copy serialisation, the best
the single-controller design can do), or verl's own `DataProto` (`VerlWire`), serialised
by verl's code with torch.save (its default) or numpy arrays. The driver counts every
payload byte it receives and sends.

Graphs with filters (DAPO's dynamic sampling) and tensor-parallel rollout groups are
distributed-mode only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distflow.coordinator.layout import LAYOUT_ORDER
from distflow.coordinator.placement import Placement
from distflow.coordinator.planner import plan_reshard
from distflow.coordinator.store import LocalStore
from distflow.dag.scheduler import Scheduler, Span
from distflow.data.batch import LEFT_PADDED, Batch, sequence_lengths


_VERL_METHOD = "VERL_DATAPROTO_SERIALIZATION_METHOD"  # read by DataProto.__getstate__/__setstate__
VERL_INSTALL = ("python -m venv --system-site-packages .venv-verl && .venv-verl/bin/pip install verl==0.9.1 "
                "torch==2.13.0, then run with .venv-verl/bin/python")


class NumpyWire:
    """Numpy buffers (serialised out of band by Ray, no pickling of the data) and lists."""

    def encode(self, batch: Batch) -> dict[str, Any]:
        return {"tensors": {k: v.numpy() for k, v in batch.tensors.items()}, "meta": batch.meta}

    def decode(self, wire: dict[str, Any]) -> Batch:
        # the object store's buffers are read-only: the worker takes its own copy
        return Batch({k: torch.from_numpy(np.array(v)) for k, v in wire["tensors"].items()}, dict(wire["meta"]))

    def nbytes(self, wire: dict[str, Any]) -> int:
        return sum(v.nbytes for v in wire["tensors"].values())


class VerlWire:
    """verl's `DataProto` (the tensors in its TensorDict, the other fields as numpy object
    arrays, as verl keeps them), serialised by verl's own `__getstate__`: torch.save, or
    numpy arrays where VERL_DATAPROTO_SERIALIZATION_METHOD=numpy (`wire_env`)."""

    def encode(self, batch: Batch) -> Any:
        from verl import DataProto

        def column(values: list) -> np.ndarray:  # one object per row, even where rows are lists
            out = np.empty(len(values), dtype=object)
            for i, v in enumerate(values):
                out[i] = v
            return out

        return DataProto.from_dict(tensors=dict(batch.tensors), non_tensors={k: column(v) for k, v in batch.meta.items()})

    def decode(self, data: Any) -> Batch:
        tensors = {} if data.batch is None else dict(data.batch.items())
        return Batch(tensors, {k: list(v) for k, v in data.non_tensor_batch.items()})

    def nbytes(self, data: Any) -> int:
        return 0 if data.batch is None else sum(v.numel() * v.element_size() for v in data.batch.values())


def make_wire(name: str) -> NumpyWire | VerlWire:
    """The wire `name` (runtime.centralized_wire); a one-line error where a verl wire has no verl."""
    if name == "numpy":
        return NumpyWire()
    if name not in ("verl", "verl-numpy"):
        raise ValueError(f"runtime.centralized_wire={name!r} is not one of numpy, verl, verl-numpy")
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        raise ValueError(f"runtime.centralized_wire={name} needs verl in this Python: {VERL_INSTALL}")
    return VerlWire()


def wire_env(name: str) -> dict[str, str]:
    """The environment every process of the run needs for the wire `name`."""
    return {_VERL_METHOD: "numpy"} if name == "verl-numpy" else {}


@dataclass
class Message:
    """Worker -> driver: a step's sources or a node's outputs, for the rows `ids`."""

    rank: int
    kind: str  # sources | outputs
    ids: list[int]
    payload: list[Any]  # [object ref] (a list, so Ray does not resolve it)


@dataclass
class Command:
    """Driver -> worker: run `node` on these inputs, take these rows (a layout change), or
    the step has ended."""

    kind: str  # run | move | end
    node: str = ""  # run: the node; move: the target layout
    payload: list[Any] = field(default_factory=list)  # [object ref]


@dataclass
class NodeSpec:
    """What the driver needs of a graph node."""

    name: str
    layout: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class WorkerRelay:
    """A worker's end: sends to the driver's queue, takes commands from its own."""

    def __init__(self, up: Any, down: Any, rank: int, timeout_s: float, wire: NumpyWire | VerlWire):
        self.up, self.down, self.rank, self.timeout_s, self.wire = up, down, rank, timeout_s, wire

    def _send(self, kind: str, ids: list[int], batch: Batch) -> None:
        import ray

        self.up.put(Message(self.rank, kind, ids, [ray.put(self.wire.encode(batch))]), timeout=self.timeout_s)

    def sources(self, batch: Batch) -> None:
        self._send("sources", list(batch["sample_id"]), batch)

    def outputs(self, store, fields: list[str]) -> None:
        self._send("outputs", list(store.all()["sample_id"]), store.get(*fields))

    def command(self) -> Command:
        return self.down.get(timeout=self.timeout_s)

    def received(self, command: Command) -> Batch:
        import ray

        return self.wire.decode(ray.get(command.payload[0], timeout=self.timeout_s))

    def inputs(self, store, command: Command) -> None:
        """The driver's copy of a node's input fields for this worker's rows replaces the
        store's. The driver pads fields to the widest (dimension 1) over all workers; the extra
        columns are padding for these rows, so they are cut back to the worker's own width."""
        received, local = self.received(command), store.all()
        for name, value in received.tensors.items():
            width = local.tensors[name].shape[1] if value.dim() >= 2 and name in local.tensors else None
            if width is not None and value.shape[1] > width:
                received.tensors[name] = value[:, -width:] if name in LEFT_PADDED else value[:, :width]
        local.update(received)


def run_commanded_step(scheduler: Scheduler, ctx: Any, store: LocalStore, step: int,
                       relay: WorkerRelay) -> list[Span]:
    """A worker's step in centralized mode: send the driver the step's sources, then
    carry out its commands (run a node on the inputs it sent, take the rows it sent, or
    end the step) with the scheduler's single-node primitives; returns the step's spans."""
    scheduler.begin(step)
    scheduler.timed("relay_sources", lambda: relay.sources(store.all()))
    while True:
        command = relay.command()
        if command.kind == "end":
            return scheduler.spans
        if command.kind == "move":
            scheduler.timed(f"reshard_{command.node}", lambda: store.replace(relay.received(command)))
            continue
        node = scheduler.graph.by_name[command.node]
        scheduler.timed(f"relay_in_{node.name}", lambda: relay.inputs(store, command))
        if node.stream:  # its chunks, one after another (no pool: no consumers run behind it)
            scheduler.run_stream(ctx, store, node, [], {})
        else:
            scheduler.run_node(ctx, store, node)
        if node.outputs:
            scheduler.timed(f"relay_out_{node.name}", lambda: relay.outputs(store, node.outputs))


class DriverRelay:
    """The driver's end: runs the graph of every step (`_control`, on a thread of the
    launcher) and holds the step's batch."""

    def __init__(self, num_workers: int, timeout_s: float, nodes: list[NodeSpec], placement: Placement,
                 wire: NumpyWire | VerlWire):
        from ray.util.queue import Queue

        self.num_workers, self.timeout_s, self.wire = num_workers, timeout_s, wire
        self.nodes, self.placement = nodes, placement
        self.up = Queue(actor_options={"num_cpus": 0})
        self.down = [Queue(actor_options={"num_cpus": 0}) for _ in range(num_workers)]
        self.batch: Batch | None = None
        self.row: dict[int, int] = {}  # sample id -> row of the step's batch
        self.rows_of: dict[int, list[int]] = {}  # rank -> the sample ids it holds
        self.bytes_in = self.bytes_out = 0
        self.seconds = 0.0  # handling data (not waiting for the workers)
        self.steps = self.node_calls = 0
        self.error: BaseException | None = None

    def endpoint(self, rank: int) -> WorkerRelay:
        return WorkerRelay(self.up, self.down[rank], rank, self.timeout_s, self.wire)

    def start(self) -> threading.Thread:
        self._stop = threading.Event()
        thread = threading.Thread(target=self._control, name="distflow-driver", daemon=True)
        thread.start()
        return thread

    def stop(self, thread: threading.Thread) -> None:
        self._stop.set()
        thread.join(timeout=10)

    def _control(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # the launcher's loop raises it
            self.error = e

    def _step(self) -> bool:
        """One step of the graph; False once the launcher stops the driver."""
        sources = self._collect("sources")
        if sources is None:
            return False
        start = time.perf_counter()
        self.batch = Batch.concat([self._get(sources[r]) for r in range(self.num_workers)])
        self.row = {int(s): i for i, s in enumerate(self.batch["sample_id"])}
        self.rows_of = {r: sources[r].ids for r in range(self.num_workers)}
        self.seconds += time.perf_counter() - start
        state = "local"
        for node in self.nodes:
            if LAYOUT_ORDER[node.layout] > LAYOUT_ORDER[state]:
                if self.placement.moves(state, node.layout):
                    self._move(state, node.layout)
                state = node.layout
            start = time.perf_counter()
            wanted = self._fields(node.inputs)
            for r in range(self.num_workers):  # only the node's inputs are copied for the worker's rows
                self._send(r, "run", wanted.select(self._rows(self.rows_of[r])), node.name)
                self.node_calls += 1
            self.seconds += time.perf_counter() - start
            if node.outputs:
                outputs = self._collect("outputs")
                if outputs is None:
                    return False
                start = time.perf_counter()
                ids = [i for r in range(self.num_workers) for i in outputs[r].ids]
                merged = Batch.concat([self._get(outputs[r]) for r in range(self.num_workers)])
                self.batch.update(merged.select(sorted(range(len(ids)), key=lambda k: self.row[ids[k]])))
                self.seconds += time.perf_counter() - start
        for r in range(self.num_workers):
            self.down[r].put(Command("end"), timeout=self.timeout_s)
        self.steps += 1
        return True

    def _move(self, state: str, layout: str) -> None:
        """A layout change, planned here: each worker gets all the fields of its new rows."""
        start = time.perf_counter()
        src, dst, balance = self.placement.layouts(state, layout)
        length_of_row = sequence_lengths(self.batch)
        lengths = {i: length_of_row[self.row[i]] for r in range(self.num_workers) for i in self.rows_of[r]}
        within = self.placement.balance_within
        labels = None if within is None or within not in self.batch else \
            {i: int(self.batch[within][self.row[i]]) for r in range(self.num_workers) for i in self.rows_of[r]}
        plan = plan_reshard(src, dst, self.rows_of, lengths, balance=balance, tolerance=self.placement.tolerance,
                            labels=labels)
        self.rows_of = plan.holdings(self.num_workers)
        for r in range(self.num_workers):
            self._send(r, "move", self.batch.select(self._rows(self.rows_of[r])), layout)
        self.seconds += time.perf_counter() - start

    def _collect(self, kind: str) -> dict[int, Message] | None:
        """One message of `kind` from every worker; None once the launcher stops the driver
        (it watches the workers: a dead one stops the run)."""
        from ray.util.queue import Empty

        got: dict[int, Message] = {}
        while len(got) < self.num_workers:
            if self._stop.is_set():
                return None
            try:
                message = self.up.get(timeout=0.2)
            except Empty:
                continue
            if message.kind != kind or message.rank in got:
                raise RuntimeError(f"driver: expected {kind} from every worker, got {message.kind} "
                                   f"from worker {message.rank}")
            got[message.rank] = message
        return got

    def _fields(self, names: tuple[str, ...]) -> Batch:
        return Batch({f: self.batch.tensors[f] for f in names if f in self.batch.tensors},
                     {f: self.batch.meta[f] for f in names if f in self.batch.meta})

    def _get(self, message: Message) -> Batch:
        import ray

        wire = ray.get(message.payload[0], timeout=self.timeout_s)
        self.bytes_in += self.wire.nbytes(wire)
        return self.wire.decode(wire)

    def _send(self, rank: int, kind: str, batch: Batch, node: str = "") -> None:
        import ray

        wire = self.wire.encode(batch)
        self.bytes_out += self.wire.nbytes(wire)
        self.down[rank].put(Command(kind, node, [ray.put(wire)]), timeout=self.timeout_s)

    def _rows(self, ids: list[int]) -> list[int]:
        return [self.row[i] for i in ids]

    def stats(self) -> dict[str, float]:
        return {"driver_payload_bytes_received": self.bytes_in, "driver_payload_bytes_sent": self.bytes_out,
                "driver_relay_seconds": self.seconds, "driver_steps": self.steps,
                "driver_node_calls": self.node_calls}
