"""Carrying out a reshard plan with `torch.distributed` collectives.

Three collectives at most, all rank-to-rank (no process sees more than its own share):

1. `gather_metadata`: an all-gather of (sample id, token length) pairs, a few bytes per
   sample, so that every rank can run the pure planner on identical inputs.
2. a size exchange (`all_to_all_single` of one int64 per peer): how many bytes each
   rank will receive from each other rank;
3. the payload exchange (`all_to_all_single` on one uint8 buffer per peer).

A peer's buffer is a small JSON header (field names, dtypes, shapes, and the non-tensor
fields such as ground-truth strings, which are JSON, never pickled) followed by the raw
bytes of each tensor field. Tensors of any dtype and width travel in one message;
ragged widths are re-padded on arrival (`Batch.concat`). When the plan has no moves
(same layout: the local cache) step 2 and 3 are skipped on every rank alike, since all
ranks computed the same plan: zero bytes move.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distflow.coordinator.layout import Layout
from distflow.coordinator.planner import ReshardPlan, plan_reshard
from distflow.data.batch import Batch

_HEADER_LEN_BYTES = 8


@dataclass
class TransferStats:
    """Bytes this rank sent and received, split into payload and metadata."""

    payload_sent: int = 0
    payload_received: int = 0
    meta_sent: int = 0
    meta_received: int = 0

    def add(self, other: "TransferStats") -> None:
        for name in ("payload_sent", "payload_received", "meta_sent", "meta_received"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

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


def pack(batch: Batch, rows: Sequence[int], sample_ids: Sequence[int]) -> torch.Tensor:
    """Rows of `batch` as one uint8 buffer: header length, JSON header, tensor bytes."""
    part = batch.select(list(rows))
    tensors = {k: v.contiguous() for k, v in part.tensors.items()}
    header = {"ids": [int(s) for s in sample_ids],
              "tensors": [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()],
              "meta": part.meta}
    head = json.dumps(header).encode()
    chunks = [torch.tensor([len(head)], dtype=torch.int64).view(torch.uint8),
              torch.frombuffer(bytearray(head), dtype=torch.uint8)]
    chunks += [v.reshape(-1).view(torch.uint8) for v in tensors.values()]
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)


def _header_len(buffer: torch.Tensor) -> int:
    # bytes, not a view: a chunk of the receive buffer may start at any byte offset
    return int.from_bytes(bytes(buffer[:_HEADER_LEN_BYTES].tolist()), "little")


def unpack(buffer: torch.Tensor) -> tuple[Batch, list[int], int]:
    """Inverse of `pack`; returns (batch, sample ids, header bytes)."""
    head_len = _header_len(buffer)
    header = json.loads(bytes(buffer[_HEADER_LEN_BYTES: _HEADER_LEN_BYTES + head_len].tolist()))
    offset, tensors = _HEADER_LEN_BYTES + head_len, {}
    for name, dtype_name, shape in header["tensors"]:
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        tensors[name] = buffer[offset: offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    return Batch(tensors, header["meta"]), header["ids"], _HEADER_LEN_BYTES + head_len


def execute(plan: ReshardPlan, batch: Batch, sample_ids: Sequence[int], group=None,
            stats: TransferStats | None = None) -> tuple[Batch, list[int]]:
    """Apply `plan` to this rank's `batch` (rows labelled by `sample_ids`). Returns the
    rank's new batch and its sample ids, sorted by id (the same order on every replica)."""
    rank, world = _world(group)
    stats = stats if stats is not None else TransferStats()
    row_of = {int(s): i for i, s in enumerate(sample_ids)}
    kept = [s for s in plan.samples_for(rank) if s in row_of]
    pieces: list[tuple[Batch, list[int]]] = [(batch.select([row_of[s] for s in kept]), kept)] if kept else []
    if plan.moves:
        pieces += _exchange(plan, batch, row_of, rank, world, group, stats)
    if not pieces:
        return batch.select([]), []
    merged, ids = Batch.concat([p for p, _ in pieces]), [s for _, i in pieces for s in i]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return merged.select(order), [ids[i] for i in order]


def _exchange(plan: ReshardPlan, batch: Batch, row_of: dict[int, int], rank: int, world: int,
              group, stats: TransferStats) -> list[tuple[Batch, list[int]]]:
    outgoing: list[torch.Tensor] = []
    for peer in range(world):
        samples = sorted(m.sample for m in plan.sends(rank) if m.dst == peer)
        outgoing.append(pack(batch, [row_of[s] for s in samples], samples) if samples
                        else torch.empty(0, dtype=torch.uint8))
    send_sizes = torch.tensor([len(b) for b in outgoing], dtype=torch.int64)
    recv_sizes = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    stats.meta_sent += 8 * (world - 1)
    stats.meta_received += 8 * (world - 1)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, torch.cat(outgoing), recv_sizes.tolist(), send_sizes.tolist(), group=group)
    pieces = []
    for peer, chunk in enumerate(recv.split(recv_sizes.tolist())):
        if peer != rank and len(chunk):
            part, ids, head = unpack(chunk)
            stats.payload_received += len(chunk) - head
            stats.meta_received += head
            pieces.append((part, ids))
    for peer, chunk in enumerate(outgoing):
        if peer != rank and len(chunk):
            head = _header_len(chunk) + _HEADER_LEN_BYTES
            stats.payload_sent += len(chunk) - head
            stats.meta_sent += head
    return pieces


def reshard(batch: Batch, sample_ids: Sequence[int], lengths: Sequence[int], src: Layout, dst: Layout,
            *, balance: str = "kk", equal_count: bool = False, tolerance: float = 0.0, group=None,
            stats: TransferStats | None = None) -> tuple[Batch, list[int], ReshardPlan]:
    """Metadata all-gather, the same plan on every rank, then the payload exchange."""
    holdings, all_lengths = gather_metadata(sample_ids, lengths, group, stats)
    plan = plan_reshard(src, dst, holdings, all_lengths, balance=balance, equal_count=equal_count,
                        tolerance=tolerance)
    new_batch, new_ids = execute(plan, batch, sample_ids, group, stats)
    return new_batch, new_ids, plan
