"""Streaming between the two sides of a disaggregated run (runtime/roles.py): finished
trajectories from each rollout rank straight to the train ranks, and new weights from
train rank 0 to every rollout rank. Rank to rank over the given gloo groups; nothing
passes through the launcher.

Trajectories. The rollout ranks split a step's samples into one part per train rank, as
one partition of all their prompt groups (`assign_groups`: whole groups, balanced by
tokens, Karmarkar-Karp on the groups' token counts, which they all-gather), and each
sends its share of every part as a packed buffer (executor.pack) with a small JSON note
(the step, the rollout side's timings and counters). Every train rank receives its part
from every rollout rank, in rank order, on a thread of its own, so the next step's
samples arrive while the current step trains.

Weights. Train rank 0 broadcasts the full state dict (in the rollout engines' dtype) as
one flat buffer per dtype with a JSON index, tagged with its version (the number of
training steps behind it, each of however many optimizer steps its mini-batches make);
each rollout rank receives on a thread and keeps only the newest version until its
generation loop swaps it in between batches. Version -1 ends the stream.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distflow.coordinator.executor import pack, unpack
from distflow.coordinator.partition import karmarkar_karp
from distflow.data.batch import Batch, sequence_lengths

_TAG = 0
END = -1


def group_tokens(batch: Batch) -> dict[int, int]:
    """Each prompt group's token total in `batch` (a rollout rank's share of a step)."""
    tokens: dict[int, int] = {}
    for g, n in zip(batch["group"].tolist(), sequence_lengths(batch)) if len(batch) else ():
        tokens[g] = tokens.get(g, 0) + n
    return tokens


def assign_groups(tokens_by_sender: list[dict[int, int]], parts: int) -> dict[int, int]:
    """Every sender's groups (`group_tokens` of each rollout rank) over `parts` receivers,
    as one partition: each group whole, the receivers' token totals near-equal. Each
    sender splitting its own share put every sender's heaviest part on the first
    receivers and, with fewer groups than receivers per sender, left some receivers none.
    The same on every sender (the groups are taken in id order)."""
    tokens = {g: n for share in tokens_by_sender for g, n in share.items()}
    keys = sorted(tokens)
    owner = {}
    for part, members in enumerate(karmarkar_karp([tokens[k] for k in keys], parts)):
        owner.update({keys[i]: part for i in members})
    return owner


def _send_message(pg: dist.ProcessGroup, dst: int, step: int, note: dict, payload: torch.Tensor) -> list:
    body = json.dumps(note).encode()
    message = torch.cat([torch.frombuffer(bytearray(body), dtype=torch.uint8), payload])
    header = torch.tensor([step, len(body), payload.numel()], dtype=torch.int64)
    return [pg.send([header], dst, _TAG), pg.send([message], dst, _TAG)]


def _recv_message(pg: dist.ProcessGroup, src: int) -> tuple[int, dict, torch.Tensor]:
    header = torch.empty(3, dtype=torch.int64)
    pg.recv([header], src, _TAG).wait()
    step, note_len, size = header.tolist()
    message = torch.empty(note_len + size, dtype=torch.uint8)
    if len(message):
        pg.recv([message], src, _TAG).wait()
    return step, json.loads(bytes(message[:note_len].tolist()) or b"{}"), message[note_len:]


class _Thread:
    """A daemon thread running `target`; its error, if any, is re-raised by `check`."""

    def __init__(self, name: str, target):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self.thread.start()

    def _run(self, target) -> None:
        try:
            target()
        except BaseException as e:  # re-raised on the main thread
            self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"{self.thread.name} failed: {type(self.error).__name__}: {self.error}") \
                from self.error


class TrajectorySender(_Thread):
    """On a rollout rank: `send(step, batch, note, owner)` returns at once; a thread sends."""

    def __init__(self, pg: dist.ProcessGroup, train_ranks: range):
        self.pg, self.train_ranks = pg, train_ranks
        self.outbox: queue.Queue = queue.Queue()
        super().__init__("trajectory sender", self._loop)

    def send(self, step: int, batch: Batch, note: dict, owner: dict[int, int]) -> dict[str, float]:
        """Queue this step's samples for the train ranks, each prompt group to the one
        `owner` names (`assign_groups`: by index among them); returns the bytes queued per
        train rank."""
        self.check()
        parts: list[list[int]] = [[] for _ in self.train_ranks]
        for row, g in enumerate(batch["group"].tolist() if len(batch) else []):
            parts[owner[g]].append(row)
        ids = batch["sample_id"] if len(batch) else []
        buffers = [pack(batch, rows, [ids[r] for r in rows]) for rows in parts]
        self.outbox.put((step, note, buffers))
        return {f"to_rank_{t}": float(b.numel()) for t, b in zip(self.train_ranks, buffers)}

    def _loop(self) -> None:
        while (item := self.outbox.get()) is not None:
            step, note, buffers = item
            works = []
            for i, (dst, buffer) in enumerate(zip(self.train_ranks, buffers)):
                works += _send_message(self.pg, dst, step, note if i == 0 else {}, buffer)
            for w in works:
                w.wait()

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        self.outbox.put(None)
        self.thread.join()
        self.check()


class TrajectoryReceiver(_Thread):
    """On a train rank: receives steps `first..last` from every rollout rank, in order,
    ahead of the trainer; `take(step)` waits for that step's samples."""

    def __init__(self, pg: dist.ProcessGroup, rollout_ranks: range, first: int, last: int, timeout_s: float):
        self.pg, self.rollout_ranks, self.first, self.last = pg, rollout_ranks, first, last
        self.timeout_s = timeout_s
        self.inbox: queue.Queue = queue.Queue()
        super().__init__("trajectory receiver", self._loop)

    def _loop(self) -> None:
        for step in range(self.first, self.last + 1):
            parts, notes = [], []
            for src in self.rollout_ranks:
                sent_step, note, payload = _recv_message(self.pg, src)
                if sent_step != step:
                    raise RuntimeError(f"rollout rank {src} sent step {sent_step} where step {step} was due")
                batch, _, _ = unpack(payload)
                parts.append(batch)
                notes.append(note)
            self.inbox.put((step, Batch.concat(parts), notes))

    def take(self, step: int) -> tuple[Batch, list[dict]]:
        """This step's samples from all rollout ranks and each rank's note."""
        waited = 0.0
        while True:
            self.check()
            try:
                got, batch, notes = self.inbox.get(timeout=1.0)
                break
            except queue.Empty:
                waited += 1.0
                if waited >= self.timeout_s:
                    raise TimeoutError(f"no samples for step {step} from the rollout workers within "
                                       f"{self.timeout_s:.0f} s") from None
        assert got == step, f"received step {got} where step {step} was due"
        return batch, notes


def _flatten(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
             keep_in_fp32: Sequence[str] = ()) -> tuple[dict, list[torch.Tensor]]:
    """One flat buffer per dtype and the index to cut it back: {name: [dtype, offset, shape]};
    with `dtype`, the floating-point tensors cast to it, but those whose name holds one of
    `keep_in_fp32` (the model's `_keep_in_fp32_modules`, which HF keeps in fp32 in any dtype)."""
    index, pieces, ends = {}, {}, {}
    for name, tensor in weights:
        cast = dtype is not None and tensor.is_floating_point() and not any(m in name for m in keep_in_fp32)
        t = tensor.detach().to("cpu", dtype=dtype if cast else None).contiguous()
        key = str(t.dtype).removeprefix("torch.")
        index[name] = [key, ends.get(key, 0), list(t.shape)]
        ends[key] = ends.get(key, 0) + t.numel()
        pieces.setdefault(key, []).append(t.view(-1))
    order = sorted(pieces)
    return {"order": order, "tensors": index}, [torch.cat(pieces[k]) for k in order]


def _broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` from member 0 of the weights group to every member (in place)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()
    return tensor


class WeightPublisher:
    """On train rank 0 (member 0 of the weights group): one broadcast per version."""

    def __init__(self, pg: dist.ProcessGroup):
        self.pg = pg

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int,
                dtype: torch.dtype | None = None, keep_in_fp32: Sequence[str] = ()) -> int:
        """Send `weights` as `version`, the floating-point ones in `dtype` where given (the
        rollout engines' own: bf16 engines are sent half the bytes of fp32 master
        weights, rounded as they would round them), but those of `keep_in_fp32` (see
        `_flatten`); returns the bytes sent."""
        index, flats = _flatten(weights, dtype, keep_in_fp32)
        body = json.dumps(index).encode()
        _broadcast(self.pg, torch.tensor([version, len(body)], dtype=torch.int64))
        _broadcast(self.pg, torch.frombuffer(bytearray(body), dtype=torch.uint8))
        for flat in flats:
            _broadcast(self.pg, flat)
        return sum(f.numel() * f.element_size() for f in flats)

    def close(self) -> None:
        _broadcast(self.pg, torch.tensor([END, 0], dtype=torch.int64))


class WeightSubscriber(_Thread):
    """On a rollout rank: receives every version on a thread and keeps those not yet
    handed to the generation loop (`take_newer`, `take_agreed`)."""

    def __init__(self, pg: dist.ProcessGroup, version: int):
        self.pg = pg
        self.version = version  # the newest received (or the starting weights')
        self.pending: dict[int, list[tuple[str, torch.Tensor]]] = {}  # version -> weights, not yet taken
        self.cond = threading.Condition()
        super().__init__("weight subscriber", self._loop)

    def _loop(self) -> None:
        while True:
            version, body_len = _broadcast(self.pg, torch.empty(2, dtype=torch.int64)).tolist()
            if version == END:
                with self.cond:
                    self.version = END
                    self.cond.notify_all()
                return
            index = json.loads(bytes(_broadcast(self.pg, torch.empty(body_len, dtype=torch.uint8)).tolist()))
            sizes: dict[str, int] = {}
            for dtype, offset, shape in index["tensors"].values():
                sizes[dtype] = max(sizes.get(dtype, 0), offset + torch.Size(shape).numel())
            flats = {k: _broadcast(self.pg, torch.empty(sizes[k], dtype=getattr(torch, k))) for k in index["order"]}
            weights = [(name, flats[dtype][offset: offset + torch.Size(shape).numel()].view(shape))
                       for name, (dtype, offset, shape) in index["tensors"].items()]
            with self.cond:
                self.pending[version], self.version = weights, version
                if len(self.pending) > 2:  # each a full copy of the weights: the two newest are enough (a replica
                    del self.pending[min(self.pending)]  # agrees on its newest; a newer needs samples not yet made)
                self.cond.notify_all()

    def wait_for(self, version: int, timeout_s: float) -> float:
        """Block until weights of `version` or newer have arrived (or the stream has
        ended); returns the seconds waited."""
        start = time.perf_counter()
        with self.cond:
            while self.version != END and self.version < version:
                self.check()
                if time.perf_counter() - start > timeout_s:
                    raise TimeoutError(f"no weights of version {version} within {timeout_s:.0f} s")
                self.cond.wait(timeout=1.0)
        self.check()
        return time.perf_counter() - start

    def take_newer(self) -> tuple[int, list[tuple[str, Any]]] | None:
        """The newest weights received and not yet taken (older ones are dropped), or None."""
        with self.cond:
            if not self.pending:
                return None
            return self._take(max(self.pending))

    def take_agreed(self, group: dist.ProcessGroup, current: int,
                    timeout_s: float) -> tuple[int, list[tuple[str, Any]]] | None:
        """Collective over `group`, the ranks of a tensor-parallel engine (each holds a
        slice of one set of weights, so all must load the same version): the newest
        version any of them has received, on every one (a rank without it yet waits for
        it), or None where none has a version newer than `current`. Newer versions that
        arrive meanwhile stay for the next call, unless two of them push the agreed one
        out of a rank's two kept: then they agree again, on the newest."""
        while True:
            with self.cond:
                mine = max(self.pending, default=current)
            agreed = torch.tensor([mine], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            version = int(agreed)
            if version <= current:
                return None
            self.wait_for(version, timeout_s)
            with self.cond:
                taken = self._take(version) if version in self.pending else None
            held = torch.tensor([taken is not None], dtype=torch.int64)
            dist.all_reduce(held, op=dist.ReduceOp.MIN, group=group)
            if int(held):
                return taken

    def _take(self, version: int) -> tuple[int, list[tuple[str, Any]]]:
        """`version`'s weights; those of it and older versions are dropped (under `cond`)."""
        weights = self.pending[version]
        self.pending = {v: w for v, w in self.pending.items() if v > version}
        return version, weights

    def join(self, timeout_s: float) -> None:
        """Wait for the end of the stream (the trainers' last update)."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"the weight stream did not end within {timeout_s:.0f} s")
        self.check()
