"""Carrying out a reshard plan with `torch.distributed` collectives.

Three collectives at most, all rank-to-rank (no process sees more than its own share):

1. `gather_metadata`: an all-gather of (sample id, token length) pairs, a few bytes per
   sample, so that every rank can run the pure planner on identical inputs.
2. a size exchange (`all_to_all_single` of one int64 per peer): how many bytes each
   rank will receive from each other rank;
3. the payload exchange: one uint8 buffer per peer, through shared memory to peers on
   the same host and `all_to_all_single` to the others (see "transports" below).

A peer's buffer is a small JSON header (field names, dtypes, shapes, and the non-tensor
fields such as ground-truth strings, which are JSON, never pickled) followed by the raw
bytes of each tensor field. Tensors of any dtype and width travel in one message;
ragged widths are re-padded on arrival (`Batch.concat`). When the plan has no moves
(same layout: the local cache) step 2 and 3 are skipped on every rank alike, since all
ranks computed the same plan: zero bytes move.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distflow.coordinator.layout import Layout
from distflow.coordinator.planner import ReshardPlan, plan_reshard
from distflow.data.batch import Batch

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


def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def gather_metadata(sample_ids: Sequence[int], lengths: Sequence[int], group=None,
                    stats: TransferStats | None = None) -> tuple[dict[int, list[int]], dict[int, int]]:
    """All ranks' (sample id, length) lists: returns holdings by rank and lengths by id."""
    rank, world = _world(group)
    local = torch.tensor([[int(s), int(n)] for s, n in zip(sample_ids, lengths)] or [], dtype=torch.int64)
    local = local.reshape(-1, 2)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([local.shape[0]]), group=group)
    widest = max(int(c) for c in counts)
    padded = torch.zeros(widest, 2, dtype=torch.int64)
    padded[: local.shape[0]] = local
    gathered = [torch.empty(widest, 2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    if stats is not None:
        stats.meta_sent += 8 + padded.numel() * 8 * (world - 1)
        stats.meta_received += (8 + padded.numel() * 8) * (world - 1)
    holdings, all_lengths = {}, {}
    for r, (count, rows) in enumerate(zip(counts, gathered)):
        rows = rows[: int(count)].tolist()
        holdings[r] = [s for s, _ in rows]
        all_lengths.update({s: n for s, n in rows})
    return holdings, all_lengths


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack(batch: Batch, rows: Sequence[int], sample_ids: Sequence[int],
         alloc=lambda n: torch.empty(n, dtype=torch.uint8)) -> torch.Tensor:
    """Rows of `batch` as one uint8 buffer: header length, JSON header, then each tensor
    field's rows, gathered straight into the buffer (one copy) at 8-byte-aligned offsets
    so that the receiver can view them in place. `alloc(n)` provides the buffer (a
    shared-memory file for a peer on the same host)."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    fields = [(k, v, (len(rows), *v.shape[1:])) for k, v in batch.tensors.items()]
    header = {"ids": [int(s) for s in sample_ids],
              "tensors": [[k, str(v.dtype).removeprefix("torch."), list(shape)] for k, v, shape in fields],
              "meta": {k: [m[i] for i in index.tolist()] for k, m in batch.meta.items()}}
    head = json.dumps(header).encode()
    offset = _aligned(_HEADER_LEN_BYTES + len(head))
    sizes = [_aligned(torch.Size(shape).numel() * v.element_size()) for _, v, shape in fields]
    buffer = alloc(offset + sum(sizes))
    buffer[:_HEADER_LEN_BYTES] = torch.tensor([len(head)], dtype=torch.int64).view(torch.uint8)
    buffer[_HEADER_LEN_BYTES: _HEADER_LEN_BYTES + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    for (_, v, shape), size in zip(fields, sizes):
        nbytes = torch.Size(shape).numel() * v.element_size()
        out = buffer[offset: offset + nbytes].view(v.dtype).view(shape)
        torch.index_select(v, 0, index, out=out)
        offset += size
    return buffer


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
    offset, tensors = _aligned(_HEADER_LEN_BYTES + head_len), {}
    for name, dtype_name, shape in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        tensors[name] = buffer[offset: offset + nbytes].view(dtype).view(shape)
        offset += _aligned(nbytes)
    return Batch(tensors, header["meta"]), header["ids"], _aligned(_HEADER_LEN_BYTES + head_len)


def execute(plan: ReshardPlan, batch: Batch, sample_ids: Sequence[int], group=None,
            stats: TransferStats | None = None, transport: str = "auto") -> tuple[Batch, list[int]]:
    """Apply `plan` to this rank's `batch` (rows labelled by `sample_ids`). Returns the
    rank's new batch and its sample ids, sorted by id (the same order on every replica)."""
    rank, world = _world(group)
    stats = stats if stats is not None else TransferStats()
    mine = plan.samples_for(rank)
    if not plan.moves and mine == list(sample_ids):  # the local cache: nothing to do, not even a copy
        return batch, list(sample_ids)
    row_of = {int(s): i for i, s in enumerate(sample_ids)}
    kept = [s for s in mine if s in row_of]
    pieces: list[tuple[Batch, list[int]]] = [(batch.select([row_of[s] for s in kept]), kept)] if kept else []
    if plan.moves:
        pieces += _exchange(plan, batch, row_of, rank, world, group, stats, transport)
    if not pieces:
        return batch.select([]), []
    pieces.sort(key=lambda piece: piece[1][0])  # disjoint sorted runs usually end up in order
    merged, ids = Batch.concat([p for p, _ in pieces]), [s for _, i in pieces for s in i]
    if all(a < b for a, b in zip(ids, ids[1:])):
        return merged, ids
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return merged.select(order), [ids[i] for i in order]


# ---------------------------------------------------------------------------- transports
#
# Peers on the same host exchange payloads through shared memory (/dev/shm): the sender
# writes one file per peer, the collective size exchange that follows orders the write
# before the read, and the receiver reads and unlinks it. Only cross-host payloads go
# through gloo/NCCL. "Same host" is DISTFLOW_HOST_ID when set, else hostname + boot id +
# network namespace (the emulated cluster's hosts share one filesystem and /dev/shm, but
# their traffic must cross their links).

_GROUP_INFO: dict[int, tuple[list[int], int, itertools.count]] = {}
_SHM_DIR = "/dev/shm"


def _host_key() -> int:
    import hashlib
    import socket

    key = os.environ.get("DISTFLOW_HOST_ID")
    if key is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        try:  # another network namespace (a container, an emulated host) counts as another host
            netns = os.stat("/proc/self/ns/net").st_ino
        except OSError:
            netns = 0
        key = f"{socket.gethostname()}-{boot}-{netns}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "little")


def _group_info(group, world: int) -> tuple[list[int], int, itertools.count]:
    """(host key of every rank, a token naming this group's shm files, the group's
    exchange counter); one all-gather on first use. The counter is per group because
    exchanges on different groups (a background transfer) interleave differently per rank."""
    gid = id(group)
    if gid not in _GROUP_INFO:
        mine = torch.tensor([_host_key(), int.from_bytes(os.urandom(6), "little")], dtype=torch.int64)
        every = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        _GROUP_INFO[gid] = ([int(t[0]) for t in every], int(every[0][1]), itertools.count())  # rank 0's token
    return _GROUP_INFO[gid]


class _Shm:
    def __init__(self, group, world: int, rank: int, transport: str):
        hosts, self.token, rounds = _group_info(group, world)
        shm_ok = transport != "gloo" and os.path.isdir(_SHM_DIR)
        self.local = [shm_ok and p != rank and hosts[p] == hosts[rank] for p in range(world)]
        self.rank, self.round = rank, next(rounds)

    def path(self, src: int, dst: int) -> str:
        return f"{_SHM_DIR}/distflow-{self.token}-{self.round}-{src}-{dst}"

    def allocator(self, peer: int):
        """A send buffer that *is* the shared file: packing writes straight into it."""
        def alloc(size: int) -> torch.Tensor:
            path = self.path(self.rank, peer)
            with open(path, "wb") as f:
                f.truncate(size)
            return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return alloc

    def read(self, peer: int, size: int) -> torch.Tensor:
        """Map the peer's file (no copy); unlinking keeps the mapping valid."""
        path = self.path(peer, self.rank)
        data = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        os.unlink(path)
        return data


def _exchange(plan: ReshardPlan, batch: Batch, row_of: dict[int, int], rank: int, world: int,
              group, stats: TransferStats, transport: str = "auto") -> list[tuple[Batch, list[int]]]:
    shm, empty = _Shm(group, world, rank, transport), torch.empty(0, dtype=torch.uint8)
    outgoing: list[torch.Tensor] = []
    for peer in range(world):
        samples = sorted(m.sample for m in plan.sends(rank) if m.dst == peer)
        # a same-host peer's buffer is written into shared memory before the size
        # exchange, which orders the write before the peer's read
        alloc = {"alloc": shm.allocator(peer)} if shm.local[peer] else {}
        outgoing.append(pack(batch, [row_of[s] for s in samples], samples, **alloc) if samples else empty)
        stats.shm_sent += len(outgoing[-1]) if shm.local[peer] else 0
    wire = [empty if shm.local[p] else b for p, b in enumerate(outgoing)]
    send_sizes = torch.tensor([[len(w), len(b) if shm.local[p] else 0]
                               for p, (w, b) in enumerate(zip(wire, outgoing))], dtype=torch.int64)
    recv_sizes = torch.empty(world, 2, dtype=torch.int64)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    stats.meta_sent += 16 * (world - 1)
    stats.meta_received += 16 * (world - 1)
    wire_sizes = recv_sizes[:, 0].tolist()
    recv = torch.empty(sum(wire_sizes), dtype=torch.uint8)
    dist.all_to_all_single(recv, torch.cat(wire), wire_sizes, [len(w) for w in wire], group=group)
    chunks = [shm.read(p, int(recv_sizes[p, 1])) if recv_sizes[p, 1] else c
              for p, c in enumerate(recv.split(wire_sizes))]
    pieces = []
    for peer, chunk in enumerate(chunks):
        if peer != rank and len(chunk):
            part, ids, head = unpack(chunk)
            stats.payload_received += len(chunk) - head
            stats.meta_received += head
            pieces.append((part, ids))
    for peer, chunk in enumerate(outgoing):
        if peer != rank and len(chunk):
            head = _aligned(_header_len(chunk) + _HEADER_LEN_BYTES)
            stats.payload_sent += len(chunk) - head
            stats.meta_sent += head
    return pieces


def plan_collectively(sample_ids: Sequence[int], lengths: Sequence[int], src: Layout, dst: Layout, *,
                      balance: str = "kk", equal_count: bool = False, tolerance: float = 0.0, group=None,
                      stats: TransferStats | None = None) -> tuple[ReshardPlan, dict[int, int]]:
    """The metadata all-gather, then the same pure plan on every rank. Returns the plan
    and every sample's length."""
    holdings, all_lengths = gather_metadata(sample_ids, lengths, group, stats)
    plan = plan_reshard(src, dst, holdings, all_lengths, balance=balance, equal_count=equal_count,
                        tolerance=tolerance)
    return plan, all_lengths


def reshard(batch: Batch, sample_ids: Sequence[int], lengths: Sequence[int], src: Layout, dst: Layout,
            *, balance: str = "kk", equal_count: bool = False, tolerance: float = 0.0, group=None,
            stats: TransferStats | None = None, transport: str = "auto") -> tuple[Batch, list[int], ReshardPlan]:
    """Metadata all-gather, the same plan on every rank, then the payload exchange.
    transport: "auto" (shared memory between ranks on one host, the collective backend
    across hosts) or "gloo" (the collective backend for everything)."""
    plan, _ = plan_collectively(sample_ids, lengths, src, dst, balance=balance, equal_count=equal_count,
                                tolerance=tolerance, group=group, stats=stats)
    new_batch, new_ids = execute(plan, batch, sample_ids, group, stats, transport)
    return new_batch, new_ids, plan
