"""Reshard planning: which samples go to which rank when a stage's layout changes.

A reshard runs in three steps. Workers first exchange only per-sample token lengths
(metadata, a few bytes per sample, decoded once into a ``SampleTable``); then every
worker runs ``plan_samples`` on the same table and so reaches the same plan without
further talk (the planner is pure and deterministic); then an executor moves the
payloads with collectives. When nothing needs to move, ``_stay_put`` finds that plan in
one pass, without balancing. Each plan carries the table it leaves (``after``), which
the next reshard of the same rows plans from instead of gathering the metadata again.
``plan_reshard`` and ``stay_put_plan`` take the same inputs as dicts (holdings by rank,
lengths by id).

Balancing
    ``karmarkar_karp`` and ``greedy_lpt`` (``partition.py``) split the samples into one
    bin per destination DP replica with even token totals.

Partition, then match (``plan_reshard``)
    With ``balance="kk"`` or ``"lpt"`` the planner first partitions the samples into
    ``dst.dp_size`` bins by tokens alone, then decides which destination DP group
    gets which bin. Every destination group has the same shape and needs a full copy
    of its bin on each member, so *any* one-to-one assignment of bins to groups gives
    the same per-replica token totals: the second step cannot spoil the balance. It
    is therefore free to pick the assignment that maximises the tokens each group's
    members already hold, which minimises bytes moved (exactly, by a DP over subsets
    of groups, for up to 8 groups; greedily beyond). What this does *not* do is pick,
    among equally balanced partitions, the one with the most locality; so the planner
    first builds the "stay put" partition (``balance="none"``) and keeps it when its
    largest bin is within the tolerance of the bound no partition can beat and no bin
    is empty (a training rank needs a sample), so an already balanced placement moves
    nothing; failing that it repairs it, moving single
    samples from the heaviest bin to the lightest until it is (``_repaired``: a few
    samples move instead of most); only where that cannot get there does the balancer
    partition afresh. In the stay-put partition a sample that several groups hold
    equally (a TP group's rows, split among its members for a DP stage) is cut in id
    order, one run per group, where that is within the tolerance too: each member then
    keeps one block of its rows, which the executor passes on as views, uncopied.

Sources
    A destination rank that lacks a sample of its bin fetches it from one of the
    sample's holders: the holder that has sent the fewest tokens so far (ties: lowest
    rank), visiting the largest samples first so senders' loads even out like LPT.
"""

from __future__ import annotations

import bisect
import functools
import gc
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from distflow.coordinator.layout import Layout
from distflow.coordinator.partition import CountCap, greedy_lpt, karmarkar_karp

BALANCE_MODES = ("kk", "lpt", "none")
# Exact bin-to-group matching walks all 2**k subsets of groups; 8 keeps it instant.
_EXACT_MATCH_MAX = 8


# ---------------------------------------------------------------------------------
# Reshard plan


class Move(NamedTuple):
    """Send one sample's payload from rank ``src`` to rank ``dst``."""

    sample: int
    src: int
    dst: int


@dataclass(eq=False)
class ReshardPlan:
    """What every rank holds, sends and receives in one reshard.

    ``assignment[d]`` is the sorted sample ids of destination DP replica ``d``; every
    member of that replica's TP group ends up holding exactly them. The moves are only
    real transfers (a rank already holding a sample it keeps gets no move), one row
    (sample, src, dst) each of ``move_table``, sorted by (src, dst, sample): arrays, not
    an object per move, since every rank builds the plan for every sample. ``after`` is
    every rank's rows once the plan is carried out, as the planner reads them: the next
    reshard's input, and what `samples_for` and `holdings` read.
    """

    assignment: list[list[int]]
    move_table: np.ndarray  # (moves, 3) int64: sample, src, dst
    after: SampleTable

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReshardPlan) and self.assignment == other.assignment and \
            np.array_equal(self.move_table, other.move_table) and \
            all(np.array_equal(a, b) for a, b in zip(self.after, other.after))

    @property
    def num_moves(self) -> int:
        return len(self.move_table)

    @property
    def moves(self) -> list[Move]:
        return list(map(Move, *self.move_table.T.tolist())) if self.num_moves else []

    def sends(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.src == rank]

    def receives(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.dst == rank]

    def sends_by_peer(self, rank: int) -> dict[int, list[int]]:
        """The samples ``rank`` sends, by destination, each in id order."""
        sent = self.move_table[self.move_table[:, 1] == rank]
        peers, starts = np.unique(sent[:, 2], return_index=True)
        return {peer: part.tolist() for peer, part in zip(peers.tolist(), np.split(sent[:, 0], starts[1:]))}

    def samples_for(self, rank: int) -> list[int]:
        """Sorted sample ids ``rank`` holds after the reshard; [] off the layout."""
        ids, _, holder_row, holder_rank = self.after
        return ids[holder_row[holder_rank == rank]].tolist()

    def holdings(self, world: int) -> dict[int, list[int]]:
        """`samples_for` of every rank in 0..world-1, in one pass over ``after``."""
        ids, _, holder_row, holder_rank = self.after
        by_rank = np.argsort(holder_rank, kind="stable")  # rows, and so ids, stay ascending within a rank
        held = ids[holder_row[by_rank]]
        bounds = np.searchsorted(holder_rank[by_rank], np.arange(world + 1)).tolist()
        return {r: held[bounds[r]:bounds[r + 1]].tolist() for r in range(world)}

    def moved_tokens(self, lengths: Mapping[int, int]) -> int:
        return sum(lengths[s] for s in self.move_table[:, 0].tolist())


_NO_MOVES = np.empty((0, 3), dtype=np.int64)
_NO_MOVES.flags.writeable = False


def plan_reshard(src: Layout, dst: Layout, holdings: Mapping[int, Sequence[int]],
                 lengths: Mapping[int, int], *, balance: str = "kk",
                 equal_count: bool = False, tolerance: float = 0.0,
                 labels: Mapping[int, int] | None = None) -> ReshardPlan:
    """Plan moving samples from layout ``src`` to layout ``dst``.

    ``holdings[rank]`` are the sample ids ``rank`` holds now (a sample may be held by
    several ranks, e.g. a whole TP group); ``lengths[sample]`` its token count.
    ``balance``: "kk" (Karmarkar-Karp), "lpt" (greedy), or "none" (keep samples with
    a destination group that already holds them; zero moves when the layouts are
    equal). ``equal_count`` also keeps the replicas' sample counts within 1.
    ``tolerance``: keep the stay-put placement unless the balancer's largest bin is
    smaller by more than this fraction (e.g. 0.02: a 2% straggler is cheaper than
    moving most of the batch to remove it). ``labels[sample]``: see `plan_samples`.
    Raises ``ValueError`` on inconsistent inputs, before anything moves.
    """
    with gc_paused():
        samples = _validate(src, dst, holdings, lengths, balance)
        by_row = None if labels is None else np.array([labels[int(i)] for i in samples.ids], dtype=np.int64)
        return _plan(src, dst, samples, balance, equal_count, tolerance, _several(by_row, balance, equal_count))


def plan_samples(src: Layout, dst: Layout, samples: SampleTable, *, balance: str = "kk",
                 equal_count: bool = False, tolerance: float = 0.0,
                 labels: np.ndarray | None = None) -> ReshardPlan:
    """`plan_reshard` of the rows ``samples`` records (every rank's, as arrays: from the
    metadata all-gather, `SampleTable.gathered`, or an earlier plan's ``after``), as
    every rank runs it before a reshard: the stay-put plan where it applies (`_stay_put`,
    O(samples)), else the planner's. ``labels`` (one int per row of ``samples``): the
    samples of each label are balanced over the replicas on their own, as well as the
    whole (the trainer's PPO mini-batches, each an update every rank waits for)."""
    with gc_paused():
        _check(src, dst, samples, balance)
        labels = _several(labels, balance, equal_count)
        plan = _stay_put(dst, samples, balance, equal_count, tolerance, labels)
        return plan if plan is not None else _plan(src, dst, samples, balance, equal_count, tolerance, labels)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Planning (and decoding a plan, and assembling a batch) allocates thousands of
    small objects and no reference cycles; in a worker process each of the garbage
    collector's passes that this would trigger walks the process's live objects, which
    doubled the planning time here. Pause it meanwhile."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def stay_put_plan(src: Layout, dst: Layout, holdings: Mapping[int, Sequence[int]],
                  lengths: Mapping[int, int], *, balance: str = "kk", equal_count: bool = False,
                  tolerance: float = 0.0) -> ReshardPlan | None:
    """The plan `plan_reshard` returns when it is "nothing moves", found without
    balancing (`_stay_put`); None where that does not hold. Raises what `plan_reshard`
    raises."""
    with gc_paused():
        return _stay_put(dst, _validate(src, dst, holdings, lengths, balance), balance, equal_count, tolerance)


def _stay_put(dst: Layout, samples: SampleTable, balance: str, equal_count: bool,
              tolerance: float, labels: np.ndarray | None = None) -> ReshardPlan | None:
    """The plan when nothing moves, in O(samples): each sample is held by every member
    of one destination group and by no other rank, and (unless ``balance="none"``) that
    placement is within the tolerance of the balancer's bound, each label's too. None
    where that does not hold (plan it in full)."""
    if equal_count:
        return None
    group = _group_index(dst)[samples.holder_rank]
    if (group < 0).any() or not np.array_equal(np.bincount(samples.holder_row, minlength=len(samples.ids)),
                                               np.full(len(samples.ids), dst.tp_size)):
        return None  # a rank off the layout holds a sample, or a sample lacks a member or has an extra one
    group_of = group[np.searchsorted(samples.holder_row, np.arange(len(samples.ids)))]
    if not np.array_equal(group, group_of[samples.holder_row]):
        return None  # a sample held in two groups
    if balance != "none" and (_largest_bin(group_of, samples.lens, dst.dp_size) >
                              _bound(dst, samples.lens) * (1.0 + tolerance) or not _fills(group_of, dst.dp_size)):
        return None
    for rows in _label_rows(labels):
        if _largest_bin(group_of[rows], samples.lens[rows], dst.dp_size) > \
                _bound(dst, samples.lens[rows]) * (1.0 + tolerance):
            return None
    bins = [samples.ids[rows].tolist() for rows in _rows_by_label(group_of, dst.dp_size)]
    return ReshardPlan(bins, _NO_MOVES, samples)


def _fills(bin_of: np.ndarray, k: int) -> bool:
    """Every one of the k bins gets a sample (a training rank with none has no row to run
    its lockstep passes on). Staying put, or a repair, within the token bound can leave
    one empty where a sample is longer than a bin's share."""
    return bool(np.bincount(bin_of, minlength=k).min() > 0)


def _bound(dst: Layout, lens: np.ndarray) -> int:
    """No partition's largest bin is below this: when staying put is within the
    tolerance of it, the balancer cannot win and need not run."""
    return max(int(lens.max()), -(-int(lens.sum()) // dst.dp_size))


class SampleTable(NamedTuple):
    """Every rank's rows as the planner reads them: one row per sample in ascending id
    order (so a tie broken by row is broken by sample id), and who holds what as
    (row, rank) pairs sorted by row, then rank: a sample has one holder or a TP group's
    few, so pairs keep memory and time at O(samples) where a [sample, rank] matrix grew
    with both."""

    ids: np.ndarray
    lens: np.ndarray
    holder_row: np.ndarray
    holder_rank: np.ndarray

    @classmethod
    def gathered(cls, rows_by_rank: Sequence[np.ndarray]) -> SampleTable:
        """From every rank's (sample id, length) rows (n x 2), indexed by rank; a sample
        a TP group holds is on each member's list. Raises where two holders of one
        sample give it different lengths."""
        world = len(rows_by_rank)
        rows = np.concatenate([np.asarray(r, dtype=np.int64).reshape(-1, 2) for r in rows_by_rank])
        ranks = np.repeat(np.arange(world), [len(r) for r in rows_by_rank])
        ids, first, inverse = _distinct(rows[:, 0])
        lens = rows[first, 1]
        differ = np.flatnonzero(rows[:, 1] != lens[inverse])
        if len(differ):
            i = differ[0]
            raise ValueError(f"sample {ids[inverse[i]]} has length {lens[inverse[i]]} on rank "
                             f"{ranks[first[inverse[i]]]} and {rows[i, 1]} on rank {ranks[i]}; "
                             "every holder must give a sample the same length")
        holder_row, holder_rank = np.divmod(_distinct(inverse * world + ranks)[0], world)
        return cls(ids, lens, holder_row, holder_rank)

    def held_by(self, rank: int) -> np.ndarray:
        """The rows ``rank`` holds, ascending."""
        return self.holder_row[self.holder_rank == rank]

    def subset(self, rows: np.ndarray) -> SampleTable:
        """The table of the samples at ``rows`` (ascending), with their holders."""
        new_row = np.full(len(self.ids), -1, dtype=np.int64)
        new_row[rows] = np.arange(len(rows))
        kept = new_row[self.holder_row] >= 0
        return SampleTable(self.ids[rows], self.lens[rows], new_row[self.holder_row[kept]], self.holder_rank[kept])


class _Votes(NamedTuple):
    """[sample, group] counts of the destination group's members holding the sample,
    as its nonzero entries sorted by (row, group); `groups` is the number of groups."""

    row: np.ndarray
    group: np.ndarray
    count: np.ndarray
    groups: int


def _plan(src: Layout, dst: Layout, samples: SampleTable, balance: str, equal_count: bool,
          tolerance: float, labels: np.ndarray | None = None) -> ReshardPlan:
    if labels is not None:  # each label's samples placed on their own, the whole still within the tolerance
        group_of = np.empty(len(samples.ids), dtype=np.int64)
        for rows in _label_rows(labels):
            group_of[rows] = _groups(dst, samples.subset(rows), balance, equal_count, tolerance, fill=False)
        if _fills(group_of, dst.dp_size) and \
                _largest_bin(group_of, samples.lens, dst.dp_size) <= _bound(dst, samples.lens) * (1.0 + tolerance):
            return _route(group_of, dst, samples)  # the whole is even too, and most stays in place
        # else the placement whose updates and whole-step pass wait least for their slowest replica
        candidates = [p for p in (group_of, _stacked_lightest_first(group_of, samples.lens, labels, dst.dp_size),
                                  _groups(dst, samples, balance, equal_count, tolerance)) if _fills(p, dst.dp_size)]
        costs = [_waits(p, samples.lens, labels, dst.dp_size) for p in candidates]
        best = next(p for p, cost in zip(candidates, costs) if cost <= min(costs) * (1.0 + tolerance))
        return _route(best, dst, samples)
    return _route(_groups(dst, samples, balance, equal_count, tolerance), dst, samples)


def _waits(group_of: np.ndarray, lens: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Tokens of the slowest replica in each label's pass (an update) and in one pass over
    the whole (a scoring forward), added up: what a step spends waiting on stragglers."""
    return float(sum(_largest_bin(group_of[rows], lens[rows], k) for rows in _label_rows(labels))
                 + _largest_bin(group_of, lens, k))


def _stacked_lightest_first(group_of: np.ndarray, lens: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Each label's bins (as `group_of` places them) given to the groups again, so that
    the whole stays even: the heaviest label first, each bin of it, heaviest first, to
    the group with the fewest tokens so far."""
    out, totals = np.empty_like(group_of), np.zeros(k)
    for rows in sorted(_label_rows(labels), key=lambda r: -int(lens[r].sum())):
        weights = np.bincount(group_of[rows], weights=lens[rows], minlength=k)
        to = np.empty(k, dtype=np.int64)
        to[np.argsort(-weights, kind="stable")] = np.argsort(totals, kind="stable")
        out[rows] = to[group_of[rows]]
        totals += np.bincount(out[rows], weights=lens[rows], minlength=k)
    return out


def _groups(dst: Layout, samples: SampleTable, balance: str, equal_count: bool, tolerance: float,
            fill: bool = True) -> np.ndarray:
    """Each sample's destination group: staying put, repaired or balanced afresh (see the
    module's docstring), bins matched to the groups that hold most of them. `fill`: no
    bin may be empty (a training rank needs a sample); not asked of one label's samples."""
    votes = _votes(samples, dst)
    lens = samples.lens.tolist()
    bound = _bound(dst, samples.lens)
    stay = _locality_bins(votes, samples.lens, equal_count, limit=bound * (1.0 + tolerance))
    group_of, stay_largest = stay, _largest_bin(stay, samples.lens, dst.dp_size)
    filled = not fill or _fills(stay, dst.dp_size)
    if balance != "none" and (stay_largest > bound * (1.0 + tolerance) or not filled):
        repaired = None if equal_count else _repaired(stay, lens, dst.dp_size, bound * (1.0 + tolerance))
        if repaired is not None and (not fill or _fills(repaired, dst.dp_size)):  # a few samples moved, the rest stays
            return _match_bins(repaired, votes, samples.lens)
        split = karmarkar_karp if balance == "kk" else greedy_lpt
        balanced = np.empty(len(lens), dtype=np.int64)
        for b, rows in enumerate(split(lens, dst.dp_size, equal_count)):
            balanced[rows] = b
        # Staying put costs no bytes, so the balancer must be strictly better to win (or fill a bin).
        if not filled or _largest_bin(balanced, samples.lens, dst.dp_size) * (1.0 + tolerance) < stay_largest:
            group_of = balanced
    return _match_bins(group_of, votes, samples.lens)


def _several(labels: np.ndarray | None, balance: str, equal_count: bool) -> np.ndarray | None:
    """The labels where they change a balanced plan: two or more of them (not with
    `equal_count`, whose count cap holds for the whole, not per label)."""
    return labels if (labels is not None and balance != "none" and not equal_count
                      and len(np.unique(labels)) > 1) else None


def _label_rows(labels: np.ndarray | None) -> list[np.ndarray]:
    """The rows of each label, ascending; none without labels."""
    if labels is None:
        return []
    order = np.argsort(labels, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(labels[order])) + 1)


def _repaired(bin_of: np.ndarray, lens: list[int], k: int, target: float) -> np.ndarray | None:
    """`bin_of` (each sample's bin) with single samples moved from the heaviest bin to
    the lightest until none holds more than `target` tokens, or None where moves of
    single samples do not get there (then the balancer partitions afresh). Each move
    takes the longest sample that keeps the lightest bin within the target (else the
    longest that still narrows the gap), so few samples move; ties by sample id, so
    every rank repairs alike."""
    n = len(lens)
    lengths = np.asarray(lens, dtype=np.int64)
    keys = lengths * n + np.arange(n)  # (length, row) as one int, ascending in that order
    order = [np.sort(keys[rows]).tolist() for rows in _rows_by_label(bin_of, k)]  # per bin, its keys ascending
    totals = np.bincount(bin_of, weights=lengths, minlength=k).astype(np.int64)
    moved = bin_of.copy()
    for _ in range(n + 1):
        heavy = int(np.argmax(totals))  # ties: the first bin
        if totals[heavy] <= target:
            return moved
        light = int(np.argmin(totals))
        gap, items = int(totals[heavy] - totals[light]), order[heavy]
        # the last item no longer than a length: the last key below (length + 1) * n
        fits = bisect.bisect_left(items, (math.floor(min(gap - 1, target - int(totals[light]))) + 1) * n) - 1
        narrows = bisect.bisect_left(items, gap * n) - 1
        pick = fits if fits >= 0 and items[fits] >= n else narrows
        if pick < 0 or items[pick] < n:  # none, or a sample of no tokens
            return None
        key = items.pop(pick)
        bisect.insort(order[light], key)
        length, row = divmod(key, n)
        moved[row] = light
        totals[heavy] -= length
        totals[light] += length
    return None


def _validate(src: Layout, dst: Layout, holdings: Mapping[int, Sequence[int]],
              lengths: Mapping[int, int], balance: str) -> SampleTable:
    """Check the inputs (`_check` last); return them as a SampleTable."""
    ids = np.fromiter(lengths.keys(), dtype=np.int64, count=len(lengths))
    by_id = np.argsort(ids, kind="stable")
    ids, lens = ids[by_id], np.fromiter(lengths.values(), dtype=np.int64, count=len(lengths))[by_id]
    members = set(src.members)
    pairs = [np.empty(0, dtype=np.int64)]  # row * world + rank of every holding
    for rank, samples in holdings.items():
        if not len(samples):
            continue
        if rank not in members:
            _outside(rank, samples[0], src)
        wanted = np.asarray(samples, dtype=np.int64)
        rows = np.searchsorted(ids, wanted).clip(max=max(len(ids) - 1, 0))
        found = ids[rows] == wanted if len(ids) else np.zeros(len(wanted), dtype=bool)
        if not found.all():
            raise ValueError(f"rank {rank} holds sample {int(wanted[np.argmin(found)])}, which has no entry "
                             "in lengths")
        pairs.append(rows * src.world_size + rank)
    holder_row, holder_rank = np.divmod(_distinct(np.concatenate(pairs))[0], src.world_size)
    unheld = ids[np.bincount(holder_row, minlength=len(ids)) == 0]
    if len(unheld):
        raise ValueError(f"sample {int(unheld[0])} has no holder ({len(unheld)} unheld in all); "
                         f"every sample in lengths must be held by a source rank")
    samples = SampleTable(ids, lens, holder_row, holder_rank)
    _check(src, dst, samples, balance)
    return samples


def _check(src: Layout, dst: Layout, samples: SampleTable, balance: str) -> None:
    """Raise where the samples cannot be planned from ``src`` to ``dst``."""
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance={balance!r} is not one of {', '.join(map(repr, BALANCE_MODES))}")
    if src.world_size != dst.world_size:
        raise ValueError(f"src world_size={src.world_size} differs from dst world_size="
                         f"{dst.world_size}; a reshard moves data within one set of workers")
    ids, lens, holder_row, holder_rank = samples
    if len(lens) and lens.min() < 0:
        i = int(np.argmax(lens < 0))
        raise ValueError(f"sample {ids[i]} has negative length {lens[i]}; lengths must be >= 0")
    if len(ids) < dst.dp_size:
        raise ValueError(f"{len(ids)} samples cannot fill the {dst.dp_size} destination "
                         f"DP ranks; each DP rank needs at least one sample")
    outside = ~np.isin(holder_rank, src.members)
    if outside.any():
        i = int(np.argmax(outside))
        _outside(int(holder_rank[i]), int(ids[holder_row[i]]), src)


def _outside(rank: int, sample: int, src: Layout) -> None:
    raise ValueError(f"rank {rank} holds sample {sample} but is not in the source "
                     f"layout's ranks {src.members}")


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`np.unique(values, return_index=True, return_inverse=True)` of a 1-D int array
    (each value's first index), through one stable argsort: numpy 2.4's unique took
    174 ms for 262,144 values on its hashing path and 42 ms with the indices."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    new = np.ones(len(values), dtype=bool)  # where a run of equal values starts
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    inverse = np.empty(len(values), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ordered[starts], order[starts], inverse


def _rows_by_label(labels: np.ndarray, k: int) -> list[np.ndarray]:
    """For each label 0..k-1, the rows that carry it, ascending (one stable argsort)."""
    return np.split(np.argsort(labels, kind="stable"), np.cumsum(np.bincount(labels, minlength=k))[:-1])


def _group_index(dst: Layout) -> np.ndarray:
    """Each rank's destination DP group; -1 off the layout."""
    group = np.full(dst.world_size, -1, dtype=np.int64)
    for g, ranks in enumerate(dst.dp_groups()):
        group[list(ranks)] = g
    return group


def _votes(samples: SampleTable, dst: Layout) -> _Votes:
    """How many of each destination group's members hold each sample: the holdings'
    (row, group) pairs counted."""
    group = _group_index(dst)[samples.holder_rank]
    on = group >= 0
    keys, _, inverse = _distinct(samples.holder_row[on] * dst.dp_size + group[on])
    count = np.bincount(inverse, minlength=len(keys))
    row, group = np.divmod(keys, dst.dp_size)
    return _Votes(row, group, count, dst.dp_size)


def _largest_bin(bin_of: np.ndarray, lens: np.ndarray, k: int) -> int:
    return int(np.bincount(bin_of, weights=lens, minlength=k).max())  # float64 sums: exact below 2**53 tokens


def _locality_bins(votes: _Votes, lens: np.ndarray, equal_count: bool, limit: float) -> np.ndarray:
    """Each sample's destination group: the one with the most members holding it.

    Samples held by no destination member, or by several groups equally, have a choice.
    Without `equal_count` they are first cut in id order into one run per group
    (`_runs_in_id_order`): a TP group's rows split among its members that way leave each
    member one block of the rows it holds, which the executor hands on as views,
    uncopied. Where that puts a group over `limit` tokens, the samples of every group
    linked to it (through choices that share a group) are placed again, largest first,
    each on the lightest group of its choice (`_lightest_first`); the groups not linked
    keep their runs, so one uneven TP group does not cost every other member its block.
    With `equal_count` every sample is placed that way, within the count cap, its choice
    widened to groups with fewer holding members where the cap leaves no room.
    """
    n, k = len(lens), votes.groups
    patterns, pattern_of = _distinct_rows(votes, n)
    # per distinct row of votes, its groups cut into tiers of equal votes, most votes
    # first; without a count cap a sample always finds room in its first tier
    tiers_of = [_vote_tiers(row) for row in patterns]
    if equal_count:
        return _capped_lightest_first(tiers_of, pattern_of, lens, k)
    firsts = [tiers[0] for tiers in tiers_of]
    if all(len(groups) == 1 for groups in firsts):  # no sample has a choice
        return np.array([groups[0] for groups in firsts], dtype=np.int64)[pattern_of]
    group_of = _runs_in_id_order(firsts, pattern_of, lens, k)
    over = np.flatnonzero(np.bincount(group_of, weights=lens, minlength=k) > limit).tolist()
    if over:
        linked = _linked_groups(firsts, over)  # a choice's groups are all linked or none is
        again = np.array([groups[0] in linked for groups in firsts])[pattern_of]
        _lightest_first(group_of, np.flatnonzero(again), firsts, pattern_of, lens, k)
    return group_of


def _linked_groups(choices: list[list[int]], seeds: list[int]) -> set[int]:
    """`seeds` and every group linked to them by choices of several groups (a choice
    links its groups)."""
    sharing: dict[int, list[list[int]]] = {}
    for groups in choices:
        if len(groups) > 1:
            for g in groups:
                sharing.setdefault(g, []).append(groups)
    linked, todo = set(seeds), list(seeds)
    while todo:
        for groups in sharing.get(todo.pop(), ()):
            for g in groups:
                if g not in linked:
                    linked.add(g)
                    todo.append(g)
    return linked


def _lightest_first(group_of: np.ndarray, rows: np.ndarray, choices: list[list[int]], pattern_of: np.ndarray,
                    lens: np.ndarray, k: int) -> None:
    """Place `rows` again, in `group_of`: largest first (ties by sample id), each on the
    lightest group of `choices[pattern_of[row]]` (ties: the first), counting every
    other sample where `group_of` has it. Where `rows` are all the samples of their
    groups, each group's placement is what placing every sample so would give it."""
    stays = np.ones(len(group_of), dtype=bool)
    stays[rows] = False
    totals = np.bincount(group_of[stays], weights=lens[stays], minlength=k).astype(np.int64).tolist()
    rows = rows[np.argsort(-lens[rows], kind="stable")]
    placed = []
    for pattern, length in zip(pattern_of[rows].tolist(), lens[rows].tolist()):
        g = min(choices[pattern], key=totals.__getitem__)
        placed.append(g)
        totals[g] += length
    group_of[rows] = placed


def _capped_lightest_first(tiers_of: list[list[list[int]]], pattern_of: np.ndarray, lens: np.ndarray,
                           k: int) -> np.ndarray:
    """Every sample, largest first (ties by sample id), on the lightest group with room
    under the count cap in the first tier of its choices that has one (ties: the first)."""
    n = len(lens)
    cap = CountCap(n, k)
    sizes, totals = [0] * k, [0] * k
    group_of = [0] * n
    pattern_of = pattern_of.tolist()
    order, lens = np.argsort(-lens, kind="stable").tolist(), lens.tolist()
    for row in order:
        for tier in tiers_of[pattern_of[row]]:
            open_groups = [g for g in tier if cap.has_room(sizes[g])]
            if open_groups:
                g = min(open_groups, key=totals.__getitem__)
                break
        group_of[row] = g
        sizes[g] += 1
        totals[g] += lens[row]
        cap.took(sizes[g])
    return np.array(group_of, dtype=np.int64)


def _runs_in_id_order(choices: list[list[int]], pattern_of: np.ndarray, lens: np.ndarray, k: int) -> np.ndarray:
    """Each sample's group: the only one where `choices[pattern_of[sample]]` names one;
    the samples sharing a choice of several groups (one pattern at a time, in order),
    in id order, cut into one consecutive run per group (in group order), each group's
    run sized to even out the groups' totals so far (water-filling); a sample goes to
    the run its middle token falls in, so each cut is within half a sample of its
    target."""
    group_of = np.array([groups[0] if len(groups) == 1 else -1 for groups in choices], dtype=np.int64)[pattern_of]
    fixed = group_of >= 0
    totals = np.bincount(group_of[fixed], weights=lens[fixed], minlength=k).astype(np.float64)
    for groups, rows in zip(choices, _rows_by_label(pattern_of, len(choices))):  # never empty: a pattern is a row's
        if len(groups) == 1:
            continue
        ends = np.cumsum(lens[rows])
        have = totals[groups]
        quota = np.maximum(0.0, _level(have, float(ends[-1])) - have)
        cuts = np.cumsum(quota)[:-1]
        middles = ends - lens[rows] / 2.0
        run = np.searchsorted(cuts, middles, side="right")
        group_of[rows] = np.asarray(groups, dtype=np.int64)[run]
        totals[groups] += np.bincount(run, weights=lens[rows], minlength=len(groups))
    return group_of


def _level(have: np.ndarray, total: float) -> float:
    """The level L at which sum(max(0, L - have)) == total: filling the groups that hold
    least first, up to a common level."""
    low = np.sort(have)
    for i in range(1, len(low)):  # fill the i lowest, if the next is not below their level
        level = (total + low[:i].sum()) / i
        if level <= low[i]:
            return float(level)
    return float((total + low.sum()) / len(low))


@functools.cache
def _key_weights(columns: int) -> np.ndarray:
    """Fixed random int64 weights, the same in every process."""
    return np.random.default_rng(0x5EED).integers(1, 2 ** 62, size=columns, dtype=np.int64)


def _distinct_rows(votes: _Votes, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of the [sample, group] votes (`n` samples), one row of k counts
    each, ordered as numbers whose most significant digit is the last group, and each
    sample's index among them. Rows are told apart by one int64 key each (a fixed
    random projection of their nonzero entries, O(entries)); every entry is then
    checked against its row's pattern, and only a collision falls back to grouping
    exact tuples."""
    k = votes.groups
    keys = np.zeros(n, dtype=np.int64)
    starts = np.flatnonzero(np.diff(votes.row, prepend=-1))
    if len(starts):  # each row's entries are consecutive: one sum per row (wrapping mod 2**64)
        keys[votes.row[starts]] = np.add.reduceat(_key_weights(k)[votes.group] * votes.count, starts)
    _, first, inverse = _distinct(keys)
    rows = np.zeros((len(first), k), dtype=np.int64)
    pattern = inverse[votes.row]
    representative = np.zeros(n, dtype=bool)
    representative[first] = True
    representative = representative[votes.row]
    rows[pattern[representative], votes.group[representative]] = votes.count[representative]
    entries = np.bincount(pattern[representative], minlength=len(first))
    if not (np.array_equal(rows[pattern, votes.group], votes.count)
            and np.array_equal(np.bincount(votes.row, minlength=n), entries[inverse])):
        # two distinct rows with one key: group the exact (group, count) tuples instead
        exact = [()] * n
        for r, g, c in zip(votes.row.tolist(), votes.group.tolist(), votes.count.tolist()):
            exact[r] += ((g, c),)
        index: dict[tuple, int] = {}
        inverse = np.array([index.setdefault(t, len(index)) for t in exact], dtype=np.int64)
        rows = np.zeros((len(index), k), dtype=np.int64)
        for t, i in index.items():
            for g, c in t:
                rows[i, g] = c
    order = np.lexsort(rows.T)  # the last group is the primary key
    index_of = np.empty(len(order), dtype=np.int64)
    index_of[order] = np.arange(len(order))
    return rows[order], index_of[inverse]


def _vote_tiers(votes: np.ndarray) -> list[list[int]]:
    """The destination groups cut into tiers of equal votes (members holding the
    sample), most votes first; each tier in group order."""
    return [np.flatnonzero(votes == tier).tolist() for tier in np.unique(votes)[::-1].tolist()]


def _match_bins(bin_of: np.ndarray, votes: _Votes, lens: np.ndarray) -> np.ndarray:
    """Give each destination group one bin, maximising the tokens it already holds;
    returns each sample's group."""
    k = votes.groups
    # score[b][g]: tokens of bin b that group g's members already hold (one count per
    # member, since each member needs its own copy); float64 sums of integers, exact
    # below 2**53.
    score = np.bincount(bin_of[votes.row] * k + votes.group, weights=votes.count * lens[votes.row], minlength=k * k)
    score = score.astype(np.int64).reshape(k, k)
    match = _exact_matching(score.tolist()) if k <= _EXACT_MATCH_MAX else _greedy_matching(score)
    return np.asarray(match, dtype=np.int64)[bin_of]


def _exact_matching(score: list[list[int]]) -> tuple[int, ...]:
    """Max-score bin->group bijection by DP over the set of groups used so far.

    Ties go to the lexicographically smallest group tuple, so the result is canonical.
    """
    k = len(score)
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for b in range(k):
        step: dict[int, tuple[int, tuple[int, ...]]] = {}
        for used, (total, groups) in best.items():
            for g in range(k):
                if used >> g & 1:
                    continue
                cand = (total + score[b][g], groups + (g,))
                cur = step.get(used | 1 << g)
                if cur is None or (-cand[0], cand[1]) < (-cur[0], cur[1]):
                    step[used | 1 << g] = cand
        best = step
    return best[(1 << k) - 1][1]


def _greedy_matching(score: np.ndarray) -> tuple[int, ...]:
    """Best remaining (bin, group) pair first; ties by bin, then group. Scores are never
    negative, so once the positive pairs are spent the free bins take the free groups
    in order (which is what the zero-score pairs in (bin, group) order give)."""
    k = len(score)
    b_pos, g_pos = np.nonzero(score > 0)
    order = np.lexsort((g_pos, b_pos, -score[b_pos, g_pos]))
    of_bin: dict[int, int] = {}
    taken: set[int] = set()
    for b, g in zip(b_pos[order].tolist(), g_pos[order].tolist()):
        if b not in of_bin and g not in taken:
            of_bin[b] = g
            taken.add(g)
    free = iter(g for g in range(k) if g not in taken)
    return tuple(of_bin[b] if b in of_bin else next(free) for b in range(k))


def _route(group_of: np.ndarray, dst: Layout, samples: SampleTable) -> ReshardPlan:
    """Keep what is already in place; fetch the rest from the least-loaded holder."""
    ids, lens, holder_row, holder_rank = samples
    assignment = [ids[rows].tolist() for rows in _rows_by_label(group_of, dst.dp_size)]
    members = np.asarray(dst.dp_groups(), dtype=np.int64).reshape(dst.dp_size, dst.tp_size)
    # the holdings that stay: their holder is a member of the sample's destination group
    stays = _group_index(dst)[holder_rank] == group_of[holder_row]
    kept_row, kept_rank = holder_row[stays], holder_rank[stays]
    # every (row, member of its group) pair not kept is needed: slot row * tp + the member's place
    place = np.zeros(dst.world_size, dtype=np.int64)
    place[members.ravel()] = np.tile(np.arange(dst.tp_size), dst.dp_size)  # members in DP-then-TP order
    have = np.zeros(len(ids) * dst.tp_size, dtype=bool)
    have[kept_row * dst.tp_size + place[kept_rank]] = True
    need = np.flatnonzero(~have)
    rows = need // dst.tp_size
    to = members[group_of[rows], need % dst.tp_size]
    first = np.searchsorted(holder_row, rows)  # each row's holders: consecutive pairs, ascending rank
    count = np.searchsorted(holder_row, rows, side="right") - first
    source = holder_rank[first]  # the only holder, where there is one
    if (count > 1).any():  # the holder that has sent the fewest tokens so far (ties: lowest rank)
        order = np.lexsort((to, rows, -lens[rows]))  # largest first; ties by sample, then rank
        rows, to, first, count, source = rows[order], to[order], first[order], count[order], source[order]
        sent = [0] * dst.world_size
        for i, (row, src, lo, n) in enumerate(zip(rows.tolist(), source.tolist(), first.tolist(), count.tolist())):
            if n > 1:
                src = min(holder_rank[lo:lo + n].tolist(), key=lambda h: (sent[h], h))
                source[i] = src
            sent[src] += int(lens[row])
    order = np.lexsort((ids[rows], to, source))
    # afterwards each sample is held by every member of its group, and only there
    holders = np.sort(np.repeat(np.arange(len(ids)) * dst.world_size, dst.tp_size) + members[group_of].ravel())
    after = SampleTable(ids, lens, *np.divmod(holders, dst.world_size))
    return ReshardPlan(assignment, np.stack([ids[rows[order]], source[order], to[order]], axis=1), after)
