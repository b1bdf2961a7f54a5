"""Carrying out a reshard plan with `torch.distributed` collectives.

Three steps at most, all rank-to-rank (no process sees more than its own share):

1. `gather_metadata`: an all-gather of (sample id, token length) pairs, a few bytes per
   sample, so that every rank can run the pure planner on identical inputs; a later
   reshard of the same rows skips it (`GlobalView`: the earlier plan says who holds what);
2. a size exchange (`all_to_all_single` of three int64 per peer): how many bytes each
   rank sends each other rank, and where (shared memory or the wire);
3. the payload exchange: one uint8 buffer per peer, through shared memory to peers on
   the same host and point-to-point (`isend`/`irecv`, all in flight at once) to the
   others (see "transports" below).

A peer's buffer is a small JSON header (field names, dtypes, shapes, and the non-tensor
fields such as ground-truth strings, which are JSON, never pickled) followed by the raw
bytes of each tensor field. Tensors of any dtype and width travel in one message; the
receiver copies every piece straight to its final row (`_Assembler`), re-padding ragged
widths as `Batch.concat` does. When the plan has no moves
(same layout: the local cache) step 2 and 3 are skipped on every rank alike, since all
ranks computed the same plan: zero bytes move.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import glob
import itertools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from distflow.coordinator.host_buffers import BUFFERS, aligned, carve, carved_bytes
from distflow.coordinator.layout import Layout
from distflow.coordinator.planner import ReshardPlan, SampleTable, gc_paused, plan_samples
from distflow.data.batch import LEFT_PADDED, Batch

_HEADER_LEN_BYTES = 8
_ALIGN = 8  # every tensor field starts at a multiple of the widest element size


@dataclass
class TransferStats:
    """Bytes this rank sent and received, split into payload and metadata."""

    payload_sent: int = 0
    payload_received: int = 0
    meta_sent: int = 0
    meta_received: int = 0
    shm_sent: int = 0  # the part of payload_sent that went through shared memory

    def as_metrics(self, prefix: str = "coordinator/") -> dict[str, int]:
        return {f"{prefix}{k}_bytes": v for k, v in vars(self).items()}


@dataclass
class GlobalView:
    """Which samples every rank holds and every sample's length, as all ranks know them
    after a reshard (every rank computed, or received, the same plan). Passed to the
    next reshard of the same rows it stands in for that reshard's metadata all-gather:
    a reshard with an empty view gathers and fills it; each later one checks this rank's
    own ids and lengths against it and updates it with its plan. The caller passes one
    only where every rank knows the rows are unchanged since (the scheduler: no filter
    ran in between)."""

    samples: SampleTable | None = None
    labels: np.ndarray | None = None  # the rows' balancing labels (see `reshard`), where a reshard gathered them

    def known(self, rank: int, sample_ids: Sequence[int], lengths: Sequence[int]) -> bool:
        """True when filled; raises when this rank's rows are not the ones it records."""
        if self.samples is None:
            return False
        rows = self.samples.held_by(rank)
        ids = np.asarray(sample_ids, dtype=np.int64)
        if not (np.array_equal(self.samples.ids[rows], ids) and
                np.array_equal(self.samples.lens[rows], np.asarray(lengths, dtype=np.int64))):
            raise ValueError(f"rank {rank}: the rows passed to reshard are not those its GlobalView records "
                             f"({len(ids)} samples against {len(rows)}); pass a new GlobalView after the rows "
                             "change")
        return True

    def update(self, plan: ReshardPlan) -> None:
        self.samples = plan.after


class PhaseTimes(dict):
    """Seconds per phase of the reshards it is passed to (summed over calls): `metadata`
    (the all-gather of ids and lengths), `plan`, `pack` (rows into send buffers and
    slots), `sizes` (the size exchange, which also waits for the slowest peer), `keep`
    (kept rows into place), `receive` (arrivals into place, waits on the wire included).
    `cpu` holds the calling thread's CPU seconds per phase (waits excluded, and the
    collective backend's own threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self[phase] = self.get(phase, 0.0) + time.perf_counter() - start
            self.cpu[phase] = self.cpu.get(phase, 0.0) + time.thread_time() - start_cpu


def _untimed(phase: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def gather_metadata(sample_ids: Sequence[int], lengths: Sequence[int], group=None,
                    stats: TransferStats | None = None) -> SampleTable:
    """All ranks' (sample id, length) lists, as the planner reads them."""
    return _gathered(sample_ids, lengths, None, group, stats)[0]


def _gathered(sample_ids: Sequence[int], lengths: Sequence[int], labels: Sequence[int] | None, group,
              stats: TransferStats | None) -> tuple[SampleTable, np.ndarray | None]:
    """`gather_metadata`, and with `labels` every sample's label, by the table's rows."""
    columns = [sample_ids, lengths] if labels is None else [sample_ids, lengths, labels]
    local = _int64([int(v) for row in zip(*columns) for v in row]).reshape(-1, len(columns))
    rows = [r.numpy() for r in all_gather_rows(local, group, stats)]
    table = SampleTable.gathered([r[:, :2] for r in rows])
    if labels is None:
        return table, None
    every = np.concatenate(rows)
    by_row = np.empty(len(table.ids), dtype=np.int64)
    by_row[np.searchsorted(table.ids, every[:, 0])] = every[:, 2]
    return table, by_row


def all_gather_rows(local: torch.Tensor, group=None, stats: TransferStats | None = None) -> list[torch.Tensor]:
    """Every rank's int64 rows (`local`: n x c, n may differ per rank), indexed by rank.

    One `all_to_all_single` (a single hop; gloo's all_gather passes through N-1 ranks in
    turn, 4 ms against 2.5 ms for 4 ranks here) of messages padded to a row capacity
    remembered per group, each starting with its row count. When some rank has more
    rows than that, every rank sees it in the counts and all repeat at the new size.
    `stats` counts the counts and rows the messages carry (not the padding)."""
    rank, world = _world(group)
    columns = local.shape[1]
    capacities = _group_state(group, world).row_capacity
    capacity = capacities.get(columns, 0)
    while True:
        width = 1 + capacity * columns
        message = torch.zeros(width, dtype=torch.int64)
        message[0] = local.shape[0]
        if local.shape[0] <= capacity:
            message[1: 1 + local.numel()] = local.flatten()
        received = torch.empty(world * width, dtype=torch.int64)
        dist.all_to_all_single(received, message.repeat(world), group=group)
        received = received.view(world, width)
        counts = received[:, 0].tolist()
        if max(counts) <= capacity:
            if stats is not None:  # what the messages carry, not the padding or a resized round, which
                # depend on earlier calls: a resumed run counts the same bytes as an uninterrupted one
                stats.meta_sent += 8 * (1 + local.numel()) * (world - 1)
                stats.meta_received += 8 * sum(1 + n * columns for r, n in enumerate(counts) if r != rank)
            if 4 * max(counts) < capacity:  # far too wide now: every rank narrows alike
                capacities[columns] = max(counts) + max(counts) // 4
            return [received[r, 1: 1 + counts[r] * columns].view(-1, columns) for r in range(world)]
        capacity = capacities[columns] = max(counts) + max(counts) // 4


class Packing:
    """How the rows of `batch` lie in one uint8 buffer: header length, JSON header, then
    each tensor field's rows at 8-byte-aligned offsets (so that the receiver can view
    them in place). Its size is known before any byte is copied, so that the receiver
    can be told first and the copy can overlap an earlier peer's transfer."""

    def __init__(self, batch: Batch, rows: Sequence[int], sample_ids: Sequence[int]):
        self.index = torch.as_tensor(list(rows), dtype=torch.long)
        self.sources = list(batch.tensors.values())
        self.shapes = [(v.dtype, (len(rows), *v.shape[1:])) for v in self.sources]
        header = {"ids": [int(s) for s in sample_ids],
                  "tensors": [[k, str(dtype).removeprefix("torch."), list(shape)]
                              for k, (dtype, shape) in zip(batch.tensors, self.shapes)],
                  "meta": {k: [m[i] for i in self.index.tolist()] for k, m in batch.meta.items()}}
        try:
            self.head = json.dumps(header).encode()
        except (TypeError, ValueError) as e:
            bad = [k for k, values in header["meta"].items() if not _is_json(values)]
            raise TypeError(f"meta field(s) {', '.join(bad)} of the rows to send hold a value JSON cannot ("
                            f"{e}); meta travels between workers as JSON") from None
        self.start = aligned(_HEADER_LEN_BYTES + len(self.head), _ALIGN)
        self.nbytes = self.start + carved_bytes(self.shapes, _ALIGN)

    def fill(self, buffer: torch.Tensor) -> torch.Tensor:
        """Gather the rows straight into `buffer` (`nbytes` long): one copy."""
        buffer[:_HEADER_LEN_BYTES] = torch.tensor([len(self.head)], dtype=torch.int64).view(torch.uint8)
        buffer[_HEADER_LEN_BYTES: _HEADER_LEN_BYTES + len(self.head)] = torch.frombuffer(
            bytearray(self.head), dtype=torch.uint8)
        for v, out in zip(self.sources, carve(buffer[self.start:], self.shapes, _ALIGN)):
            torch.index_select(v, 0, self.index, out=out)
        return buffer


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def pack(batch: Batch, rows: Sequence[int], sample_ids: Sequence[int]) -> torch.Tensor:
    """Rows of `batch` as one new uint8 buffer (see `Packing`)."""
    packing = Packing(batch, rows, sample_ids)
    return packing.fill(torch.empty(packing.nbytes, dtype=torch.uint8))


def _header_len(buffer: torch.Tensor) -> int:
    # bytes, not a view: a chunk of the receive buffer may start at any byte offset
    return int.from_bytes(bytes(buffer[:_HEADER_LEN_BYTES].tolist()), "little")


def unpack(buffer: torch.Tensor) -> tuple[Batch, list[int], int]:
    """Inverse of `pack`; returns (batch, sample ids, header bytes). Tensor fields are
    views into `buffer` (copied once first if it does not start 8-byte aligned)."""
    if buffer.storage_offset() % _ALIGN:
        buffer = buffer.clone()
    head_len = _header_len(buffer)
    header = json.loads(bytes(buffer[_HEADER_LEN_BYTES: _HEADER_LEN_BYTES + head_len].tolist()))
    start = aligned(_HEADER_LEN_BYTES + head_len, _ALIGN)
    shapes = [(getattr(torch, dtype), tuple(shape)) for _, dtype, shape in header["tensors"]]
    tensors = dict(zip((name for name, _, _ in header["tensors"]), carve(buffer[start:], shapes, _ALIGN)))
    return Batch(tensors, header["meta"]), header["ids"], start


def execute(plan: ReshardPlan, batch: Batch, sample_ids: Sequence[int], group=None,
            stats: TransferStats | None = None, transport: str = "auto",
            times: PhaseTimes | None = None) -> tuple[Batch, list[int]]:
    """Apply `plan` to this rank's `batch` (rows labelled by `sample_ids`). Returns the
    rank's new batch and its sample ids, sorted by id (the same order on every replica).
    Every row is copied once into the new batch (kept rows twice where both they and
    their new positions are scattered), into memory reused from earlier batches
    (`host_buffers`); a rank that receives nothing and keeps one block of its rows in
    order gets views of them back, uncopied (they keep the whole of `batch`'s memory alive)."""
    with gc_paused():
        return _execute(plan, batch, sample_ids, group, stats if stats is not None else TransferStats(), transport,
                        times if times is not None else _untimed)


def _execute(plan: ReshardPlan, batch: Batch, sample_ids: Sequence[int], group, stats: TransferStats,
             transport: str, timed) -> tuple[Batch, list[int]]:
    rank, world = _world(group)
    mine = plan.samples_for(rank)
    if not plan.num_moves and mine == list(sample_ids):  # the local cache: nothing to do, not even a copy
        return batch, list(sample_ids)
    row_of = {int(s): i for i, s in enumerate(sample_ids)}
    kept = [s for s in mine if s in row_of]
    kept_rows = [row_of[s] for s in kept]
    if len(kept) == len(mine):  # nothing comes in: views of the kept rows where they are one block, else a copy
        if plan.num_moves:
            _exchange(plan, batch, row_of, rank, world, group, stats, transport, timed, None)
        if _contiguous(kept_rows):
            return _block(batch, kept_rows), kept
        assembler = _Assembler(kept)
        assembler.add(batch, kept, kept_rows)
        return assembler.result(rank), kept
    assembler = _Assembler(mine)
    # the kept rows are copied into place while the wire carries the rest
    _exchange(plan, batch, row_of, rank, world, group, stats, transport, timed, assembler,
              lambda: assembler.add(batch, kept, kept_rows) if kept else None)
    return assembler.result(rank), mine


def _contiguous(rows: Sequence[int]) -> bool:
    return bool(rows) and list(rows) == list(range(rows[0], rows[0] + len(rows)))


def _block(batch: Batch, rows: Sequence[int]) -> Batch:
    """Views of `batch`'s `rows`, one increasing block (`_contiguous`)."""
    lo, hi = rows[0], rows[-1] + 1
    return Batch({k: v[lo:hi] for k, v in batch.tensors.items()}, {k: v[lo:hi] for k, v in batch.meta.items()})


class _Assembler:
    """The new batch in `ids` order, built piece by piece as pieces arrive (each holds a
    disjoint subset of `ids`): every piece's rows are copied once, straight to their final
    positions, into memory reused from earlier batches (`host_buffers`). Fields of
    different widths (dimension 1) are padded with 0 to the widest, on the left
    for LEFT_PADDED fields, and of different dtypes promoted (as `Batch.concat` does); a
    piece wider than the ones before it, or of a wider dtype, widens that field (one more
    copy of it)."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.position = {s: i for i, s in enumerate(ids)}
        self.placed: set[int] = set()  # positions filled so far
        self.tensors: dict[str, torch.Tensor] = {}
        self.meta: dict[str, list] = {}
        self.fields: tuple[list[str], list[str]] | None = None  # every piece's tensor and meta field names

    def add(self, piece: Batch, piece_ids: list[int], rows: list[int] | None = None) -> None:
        """Place `piece`'s rows (`rows` of it, default all), labelled `piece_ids`. Every
        piece has the fields of the first (as `Batch.concat` requires): a field missing
        from one would leave its rows with the bytes of an earlier batch."""
        fields = (sorted(piece.tensors), sorted(piece.meta))
        if self.fields is None:
            self.fields = fields
        elif fields != self.fields:
            raise ValueError(f"the pieces of one batch differ in their fields: {fields} against {self.fields} "
                             "(tensors, meta)")
        spots = [self.position[s] for s in piece_ids]
        index = None if _contiguous(spots) else torch.tensor(spots, dtype=torch.long)
        if rows is not None and _contiguous(rows):  # one block: views, copied once below
            piece, rows = _block(piece, rows), None
        taken = None if rows is None else torch.tensor(rows, dtype=torch.long)
        n = len(self.ids)
        if not self.tensors:  # the first piece's fields, in one reusable block of memory
            shapes = [(part.dtype, (n, *part.shape[1:])) for part in piece.tensors.values()]
            self.tensors = dict(zip(piece.tensors, carve(BUFFERS.take(carved_bytes(shapes)), shapes)))
        for name, part in piece.tensors.items():
            out = self.tensors[name]
            if part.dtype != out.dtype:  # promoted, as torch.cat does (0/1 rewards as int64 on one rank)
                dtype = torch.promote_types(out.dtype, part.dtype)
                if dtype != out.dtype:
                    out = self.tensors[name] = out.to(dtype)
                part = part.to(dtype)
            if part.dim() >= 2 and part.shape[1] > out.shape[1]:
                wider = torch.zeros((n, *part.shape[1:]), dtype=out.dtype)
                self._columns(wider, out.shape[1], name).copy_(out)
                out = self.tensors[name] = wider
            target = out
            if part.dim() >= 2 and part.shape[1] < out.shape[1]:
                if index is None:
                    out[spots[0]: spots[0] + len(spots)].zero_()
                else:
                    out.index_fill_(0, index, 0)
                target = self._columns(out, part.shape[1], name)
            if index is None:
                block = target[spots[0]: spots[0] + len(spots)]
                if taken is None:
                    block.copy_(part)
                elif block.is_contiguous():  # the rows gathered straight into place
                    torch.index_select(part, 0, taken, out=block)
                else:
                    block.copy_(part.index_select(0, taken))
            else:
                target.index_copy_(0, index, part if taken is None else part.index_select(0, taken))
        for name, values in piece.meta.items():
            column = self.meta.setdefault(name, [None] * n)
            for i, v in zip(spots, values if rows is None else (values[r] for r in rows)):
                column[i] = v
        self.placed.update(spots)

    @staticmethod
    def _columns(out: torch.Tensor, width: int, name: str) -> torch.Tensor:
        return out[:, out.shape[1] - width:] if name in LEFT_PADDED else out[:, :width]

    def result(self, rank: int) -> Batch:
        assert len(self.placed) == len(self.ids), \
            f"rank {rank} assembled {len(self.placed)} of the {len(self.ids)} samples the plan gives it"
        return Batch(self.tensors, self.meta)


# ---------------------------------------------------------------------------- transports
#
# Peers on the same host exchange payloads through shared memory (/dev/shm), never
# through a socket; only cross-host payloads go through gloo/NCCL. "Same host" is
# DISTFLOW_HOST_ID when set, else hostname + boot id + network namespace (the emulated
# cluster's hosts share one filesystem and /dev/shm, but their traffic must cross their
# links).
#
# The shared buffers are reused, because touching fresh tmpfs pages costs more than the
# copy itself (writing 16 MiB into a new /dev/shm file took 28 ms here, into a mapped one
# 4 ms). Each rank keeps, per same-host peer and direction, two slots that alternate
# between exchanges: the sender writes exchange r's rows into slot r % 2 before the
# size exchange; the receiver copies them out after it, before it returns from
# exchange r. The sender does not write that slot again before exchange r + 2, and it
# cannot get there before every peer has joined exchange r + 1's size exchange, i.e. has
# finished reading exchange r. A slot's file is created, with its space reserved, the
# first time or when a larger message needs a larger file (a new generation), and the
# receiver unlinks it as soon as it has mapped it: both sides keep their mappings and
# /dev/shm keeps no names. Where the space cannot be reserved (/dev/shm full), that
# message goes over the wire instead. The price: a rank holds two slots per same-host
# peer and direction, each as large as the largest message so far (plus 25%), for the
# life of the process. So only messages up to _KEEP_SLOT_BYTES use the kept slots; a
# larger one (a VLM batch's pixels) gets a file of its own, which the receiver unlinks
# on mapping and which is gone once both sides have dropped their mappings: fresh pages
# each time, but no batch-sized buffers held between steps. Measured with 1-MP images
# (`dataplane_vlm`, N=4, 64 samples): a rank's peak RSS 2.84 -> 1.87 GiB, the three
# transitions 3.4 -> 5.2 s.

_GROUPS: dict[int, "_GroupState"] = {}
_SHM_DIR = "/dev/shm"
_SLOTS = 2
_GROWTH = 1.25  # a regrown slot gets this much headroom, so that steps of varying size reuse it
_KEEP_SLOT_BYTES = 64 << 20  # a larger message gets a file of its own that neither side keeps


def _host_key() -> int:
    """Who shares this rank's /dev/shm: DISTFLOW_HOST_ID when set, else hostname, boot id,
    network namespace and the /dev/shm mount (a container with the host's network but its
    own /dev/shm is another host here)."""
    import hashlib
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    key = os.environ.get("DISTFLOW_HOST_ID")
    if key is None:
        try:  # another network namespace (a container, an emulated host) counts as another host
            netns = os.stat("/proc/self/ns/net").st_ino
        except OSError:
            netns = 0
        try:
            shm = os.stat(_SHM_DIR).st_dev
        except OSError:
            shm = 0
        key = f"{socket.gethostname()}-{boot}-{netns}-{shm}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "little")


class _GroupState:
    """Per process group: every rank's host key, the exchange counter (per group, because
    exchanges on different groups, such as a background transfer, interleave differently
    per rank), this rank's shared-memory slots and the metadata messages' row capacity."""

    def __init__(self, hosts: list[int], token: int, pids: list[int]) -> None:
        self.hosts, self.token, self.pids = hosts, token, pids
        self.rounds = itertools.count()
        self.row_capacity: dict[int, int] = {}  # all_gather_rows: columns -> rows per message
        self.generations = itertools.count(1)
        self.send: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (peer, slot) -> (generation, mapping)
        self.recv: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}

    def path(self, src: int, dst: int, slot: int, generation: int) -> str:
        """A slot's file: named by its writer's pid, so that a later run removes it where
        that process died before its reader took it (`_sweep_dead_writers`)."""
        return f"{_SHM_DIR}/distflow-{self.token}-{self.pids[src]}-{src}-{dst}-{slot}-{generation}"

    def send_slot(self, rank: int, peer: int, slot: int, size: int) -> tuple[int, torch.Tensor] | None:
        """(generation, a `size`-byte view of the slot for `peer`); None where /dev/shm
        has no room for it."""
        keep = size <= _KEEP_SLOT_BYTES
        generation, mapping = self.send.get((peer, slot), (0, None)) if keep else (0, None)
        if mapping is not None and len(mapping) >= size:
            return generation, mapping[:size]
        capacity = max(size, int(_GROWTH * len(mapping)) if mapping is not None else 0, 4096) if keep else size
        generation = next(self.generations)
        path = self.path(rank, peer, slot, generation)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:  # reserve the pages now: a full tmpfs then fails here, not with SIGBUS on a write
                os.posix_fallocate(fd, 0, capacity)
            finally:
                os.close(fd)
            mapping = torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            if keep:
                self.send.pop((peer, slot), None)
            return None
        if keep:
            self.send[(peer, slot)] = (generation, mapping)
        _WRITTEN.add(path)
        return generation, mapping[:size]

    def recv_slot(self, rank: int, peer: int, slot: int, generation: int, size: int) -> torch.Tensor:
        """The first `size` bytes of `peer`'s slot for this rank, mapped (no copy)."""
        have, mapping = self.recv.get((peer, slot), (0, None))
        if have != generation or mapping is None:
            path = self.path(peer, rank, slot, generation)
            mapping = torch.from_file(path, shared=True, size=os.stat(path).st_size, dtype=torch.uint8)
            os.unlink(path)  # the mappings keep the memory, until the last one is gone
            if size <= _KEEP_SLOT_BYTES:
                self.recv[(peer, slot)] = (generation, mapping)
        return mapping[:size]


def _group_state(group, world: int) -> _GroupState:
    """This group's state; one all-gather of host keys and pids (and rank 0's token naming
    the group's files) on first use, when the files of dead writers are swept too."""
    gid = id(group)
    if gid not in _GROUPS:
        _sweep_dead_writers()
        mine = torch.tensor([_host_key(), int.from_bytes(os.urandom(6), "little"), os.getpid()], dtype=torch.int64)
        every = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        _GROUPS[gid] = _GroupState([int(t[0]) for t in every], int(every[0][1]), [int(t[2]) for t in every])
    return _GROUPS[gid]


# Slot files this process wrote; a reader unlinks each once it maps it. What a reader that
# died (or failed) never took is unlinked at this process's exit, and a process killed
# outright leaves its files to the next run's sweep.
_WRITTEN: set[str] = set()


@atexit.register
def _unlink_untaken() -> None:
    for path in _WRITTEN:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _sweep_dead_writers() -> None:
    """Remove the slot files in /dev/shm whose writer (the pid in the name) has died:
    /dev/shm is memory, held until reboot otherwise."""
    for path in glob.glob(f"{_SHM_DIR}/distflow-*-*-*-*-*-*"):
        fields = os.path.basename(path).split("-")  # distflow, token, pid, src, dst, slot, generation
        if len(fields) != 7 or not all(f.isdigit() for f in fields[1:]) or not 0 < int(fields[2]) < 1 << 22:
            continue
        try:
            os.kill(int(fields[2]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except PermissionError:  # alive, another user's
            pass


def _exchange(plan: ReshardPlan, batch: Batch, row_of: dict[int, int], rank: int, world: int, group,
              stats: TransferStats, transport: str, timed, into: _Assembler | None, while_sending=None) -> None:
    """Send this rank's moves, and add what arrives to `into` (None: nothing arrives);
    `while_sending()` runs once every send is on its way, before the first arrival.
    `timed(phase)` times each phase (see `PhaseTimes`)."""
    with timed("pack"):
        wired, sizes, slot = _pack_sends(plan, batch, row_of, rank, world, group, stats, transport)
    state = _group_state(group, world)
    # The exchange orders every shared-memory write before its read, and tells every
    # receiver how many bytes to expect over the wire.
    incoming = torch.empty(world, 3, dtype=torch.int64)  # row p: what peer p sends me
    with timed("sizes"):
        dist.all_to_all_single(incoming, sizes, group=group)
    stats.meta_sent += 24 * (world - 1)
    stats.meta_received += 24 * (world - 1)
    # The wire: every receive posted at once, then each peer's buffer filled and sent as
    # soon as it is ready, rank r starting with r + 1 so that the links start together.
    # Each peer's bytes arrive on their own connection, in parallel.
    with timed("pack"):
        receives = [(p, BUFFERS.take(int(incoming[p, 0])))
                    for p in ((rank - k) % world for k in range(1, world)) if incoming[p, 0]]
        pending = [(buf, dist.irecv(buf, group_src=p, group=group)) for p, buf in receives]
        sends = []
        for peer in ((rank + k) % world for k in range(1, world)):
            if peer in wired:
                buf = wired[peer].fill(BUFFERS.take(wired[peer].nbytes))
                sends.append((buf, dist.isend(buf, group_dst=peer, group=group)))
    if while_sending is not None:
        with timed("keep"):
            while_sending()

    def take(chunk: torch.Tensor) -> None:
        part, ids, head = unpack(chunk)
        stats.payload_received += len(chunk) - head
        stats.meta_received += head
        into.add(part, ids)

    with timed("receive"):
        for p in range(world):  # shared memory first: it is there already
            if incoming[p, 1]:
                take(state.recv_slot(rank, p, slot, int(incoming[p, 2]), int(incoming[p, 1])))
        for buf, work in pending:  # then each peer's bytes, copied out while the next ones arrive
            work.wait()
            take(buf)
        for _, work in sends:
            work.wait()


def _pack_sends(plan: ReshardPlan, batch: Batch, row_of: dict[int, int], rank: int, world: int, group,
                stats: TransferStats, transport: str) -> tuple[dict[int, Packing], torch.Tensor, int]:
    """Every same-host peer's rows written into its shared-memory slot; the wire's
    packings (filled later, while earlier peers' bytes travel); the sizes to announce
    (per peer: bytes on the wire, bytes in shared memory, the slot's generation); the slot."""
    state = _group_state(group, world)
    slot = next(state.rounds) % _SLOTS
    shm_ok = transport != "gloo" and os.path.isdir(_SHM_DIR)
    # per peer: [bytes on the wire, bytes in shared memory, the slot's generation]
    sizes = torch.zeros(world, 3, dtype=torch.int64)
    wired: dict[int, Packing] = {}  # filled after the size exchange, overlapping the transfers
    for peer, samples in plan.sends_by_peer(rank).items():
        packing = Packing(batch, [row_of[s] for s in samples], samples)
        same_host = shm_ok and state.hosts[peer] == state.hosts[rank]
        got = state.send_slot(rank, peer, slot, packing.nbytes) if same_host else None
        if got is not None:
            packing.fill(got[1])
            sizes[peer, 1:] = torch.tensor([packing.nbytes, got[0]])
            stats.shm_sent += packing.nbytes - packing.start  # the payload's part, as payload_sent counts it
        else:
            wired[peer] = packing
            sizes[peer, 0] = packing.nbytes
        stats.payload_sent += packing.nbytes - packing.start
        stats.meta_sent += packing.start
    return wired, sizes, slot


def plan_collectively(sample_ids: Sequence[int], lengths: Sequence[int], src: Layout, dst: Layout, *,
                      balance: str = "kk", equal_count: bool = False, tolerance: float = 0.0, group=None,
                      stats: TransferStats | None = None, times: PhaseTimes | None = None,
                      view: GlobalView | None = None, labels: Sequence[int] | None = None) -> ReshardPlan:
    """The metadata all-gather (unless `view` already knows every rank's rows, and their
    labels where `labels` are given), then the same pure plan on every rank
    (`plan_samples`); fills or updates `view`."""
    timed = times if times is not None else _untimed
    rank, _ = _world(group)
    if view is not None and view.known(rank, sample_ids, lengths) and (labels is None or view.labels is not None):
        samples, gathered_labels = view.samples, view.labels if labels is not None else None
    else:
        with gc_paused(), timed("metadata"):
            samples, gathered_labels = _gathered(sample_ids, lengths, labels, group, stats)
    with timed("plan"):  # the same pure plan on every rank: no message
        plan = plan_samples(src, dst, samples, balance=balance, equal_count=equal_count, tolerance=tolerance,
                            labels=gathered_labels)
    if view is not None:
        view.update(plan)
        view.labels = gathered_labels  # the plan keeps the rows' order: the labels stay theirs
    return plan


def _int64(values: Sequence[int]) -> torch.Tensor:
    """A 1-D int64 tensor of Python ints (through `array`: torch.tensor of a long list is
    several times slower)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else \
        torch.empty(0, dtype=torch.int64)


def reshard(batch: Batch, sample_ids: Sequence[int], lengths: Sequence[int], src: Layout, dst: Layout,
            *, balance: str = "kk", equal_count: bool = False, tolerance: float = 0.0, group=None,
            stats: TransferStats | None = None, transport: str = "auto", times: PhaseTimes | None = None,
            view: GlobalView | None = None, labels: Sequence[int] | None = None) -> tuple[Batch, list[int], ReshardPlan]:
    """Metadata all-gather (none when `view` knows the rows: see GlobalView), the same
    plan on every rank, then the payload exchange. transport: "auto" (shared memory
    between ranks on one host, the collective backend across hosts) or "gloo" (the
    collective backend for everything). `times` collects seconds per phase. `labels`
    (an int per row): each label's rows are balanced over the replicas on their own too
    (`plan_samples`); they travel with the metadata."""
    plan = plan_collectively(sample_ids, lengths, src, dst, balance=balance, equal_count=equal_count,
                             tolerance=tolerance, group=group, stats=stats, times=times, view=view, labels=labels)
    new_batch, new_ids = execute(plan, batch, sample_ids, group, stats, transport, times)
    return new_batch, new_ids, plan
