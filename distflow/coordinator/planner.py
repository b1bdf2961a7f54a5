"""Reshard planning: which samples go to which rank when a stage's layout changes.

A reshard runs in three steps. Workers first exchange only per-sample token lengths
(metadata, a few bytes per sample); then every worker runs ``plan_reshard`` on the
same metadata and so reaches the same plan without further talk (the planner is pure
and deterministic); then an executor moves the payloads with collectives. When nothing
needs to move, ``stay_put_plan`` finds that plan in one pass, without balancing.

Balancing (``karmarkar_karp``, ``greedy_lpt``)
    Samples are split into one bin per destination DP replica so that the bins'
    token totals are as even as possible: the slowest replica sets the step time.
    ``karmarkar_karp`` is the k-way largest differencing method as used by verl's
    ``seqlen_balancing.py``: every item starts as a k-tuple of partitions holding
    just that item; the two tuples with the largest spread (max minus min total)
    are repeatedly merged by pairing the heaviest partition of one with the lightest
    of the other, until one tuple is left. Merging never makes the spread larger
    than the larger of the two inputs' spreads, so the result's max and min totals
    differ by at most the longest item. Where this departs from verl:

    * ``equal_size`` does not require ``len(weights) % k == 0`` (verl asserts it).
      Items are seeded k at a time (one per partition) from the sorted order; the
      ``n % k`` smallest items form one extra, partial seed. Only that one seed has
      unequal sizes, so final sizes differ by at most 1.
    * Ties are broken by item index, never by object identity, and partitions come
      back as sorted index lists ordered by descending total (ties: more items
      first, then lowest first index; so empty partitions come last).
    * Empty partitions are allowed (verl asserts none); callers that need every
      bin filled check ``len(weights) >= k`` themselves, as ``plan_reshard`` does.
    * Merging extends the longer item list with the shorter one, so the total
      copying stays O(n log n).

    ``greedy_lpt`` (longest item to the lightest bin) is the simpler fallback and
    ``contiguous_split`` the naive baseline for benchmarks.

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
    largest bin is within the tolerance of the bound no partition can beat, so an
    already balanced placement moves nothing; failing that it repairs it, moving single
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
import gc
import heapq
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from distflow.coordinator.layout import Layout

BALANCE_MODES = ("kk", "lpt", "none")
# Exact bin-to-group matching walks all 2**k subsets of groups; 8 keeps it instant.
_EXACT_MATCH_MAX = 8


# ---------------------------------------------------------------------------------
# Partitioning


def _check_weights(weights: Sequence[int], k: int) -> None:
    if k < 1:
        raise ValueError(f"k={k} partitions requested; k must be >= 1")
    for i, w in enumerate(weights):
        if w < 0:
            raise ValueError(f"weights[{i}]={w} is negative; weights must be >= 0")


def _seeds(order: list[int], k: int, equal_size: bool) -> Iterator[list[int]]:
    """The items each starting k-tuple holds, one item per partition."""
    if not equal_size:
        yield from ([i] for i in order)
        return
    rest = len(order) % k
    if rest:
        # The only seed with unequal partition sizes: merging it with equal-size
        # tuples keeps sizes within 1 of each other, whatever the pairing.
        yield order[:rest]
    for start in range(rest, len(order), k):
        yield order[start:start + k]


def karmarkar_karp(weights: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split item indices into ``k`` partitions of near-equal total weight (LDM).

    Returns ``k`` sorted index lists ordered by descending total (ties: more items
    first, then lowest first index). The largest and smallest totals differ by at most
    ``max(weights)``. With ``equal_size`` the partition sizes differ by at most 1.
    """
    _check_weights(weights, k)
    # A partition is [-total, -size, lead, items], so a plain sort puts a tuple's parts
    # in descending order (lead: smallest item, the tie-break; empty parts sort last).
    order = sorted(range(len(weights)), key=weights.__getitem__)  # stable: ties by index
    heap: list[tuple[int, int, list[list]]] = []
    for seq, seed in enumerate(_seeds(order, k, equal_size)):
        parts = [[-weights[i], -1, i, [i]] for i in seed] + [[0, 0, sys.maxsize, []] for _ in range(k - len(seed))]
        parts.sort()
        # (min total - max total, creation order): the widest spread pops first.
        heap.append((parts[0][0] - parts[-1][0], seq, parts))
    if not heap:
        return [[] for _ in range(k)]
    heapq.heapify(heap)
    seq = len(heap)
    pop, push = heapq.heappop, heapq.heappush
    while len(heap) > 1:
        a, b = pop(heap)[2], pop(heap)[2]
        # Heaviest with lightest: the merged spread is at most max(spread a, spread b).
        for pa, pb in zip(a, reversed(b)):
            pa[0] += pb[0]
            pa[1] += pb[1]
            if pb[2] < pa[2]:
                pa[2] = pb[2]
            if len(pa[3]) < len(pb[3]):  # extend the longer list: O(n log n) copying in all
                pa[3], pb[3] = pb[3], pa[3]
            pa[3].extend(pb[3])
        a.sort()
        push(heap, (a[0][0] - a[-1][0], seq, a))
        seq += 1
    return [sorted(p[3]) for p in heap[0][2]]


class _CountCap:
    """Keeps ``n`` items in ``k`` bins at floor(n/k) or ceil(n/k) items each."""

    def __init__(self, n: int, k: int) -> None:
        self.low, self.spare = divmod(n, k)  # `spare` bins may hold low + 1
        self.full_high = 0

    def has_room(self, size: int) -> bool:
        return size < self.low or (size == self.low and self.full_high < self.spare)

    def took(self, new_size: int) -> None:
        if new_size == self.low + 1:
            self.full_high += 1


def _ordered(parts: list[list[int]], weights: Sequence[int]) -> list[list[int]]:
    """Sorted index lists, in ``karmarkar_karp``'s order."""
    def key(p: list[int]) -> tuple[int, int, int]:
        return (-sum(weights[i] for i in p), -len(p), min(p, default=sys.maxsize))
    return [sorted(p) for p in sorted(parts, key=key)]


def greedy_lpt(weights: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: heaviest item first, into the lightest bin.

    Same return shape and order as ``karmarkar_karp``. Ties go to the lower bin.
    With ``equal_size`` a bin stops taking items once it has its share of the count.
    """
    _check_weights(weights, k)
    cap = _CountCap(len(weights), k) if equal_size else None
    parts: list[list[int]] = [[] for _ in range(k)]
    totals = [0] * k
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_bins = [b for b in range(k) if cap is None or cap.has_room(len(parts[b]))]
        b = min(open_bins, key=lambda b: (totals[b], b))
        parts[b].append(i)
        totals[b] += weights[i]
        if cap is not None:
            cap.took(len(parts[b]))
    return _ordered(parts, weights)


def contiguous_split(weights: Sequence[int], k: int) -> list[list[int]]:
    """Consecutive chunks of near-equal count (the first ``n % k`` get one more).

    Ignores the weights' values: the naive baseline the balancers are measured
    against. Partitions are in index order.
    """
    _check_weights(weights, k)
    low, spare = divmod(len(weights), k)
    parts, start = [], 0
    for b in range(k):
        size = low + (1 if b < spare else 0)
        parts.append(list(range(start, start + size)))
        start += size
    return parts


def imbalance(weights: Sequence[int], parts: Sequence[Sequence[int]]) -> float:
    """Largest partition total over the mean total: 1.0 is perfect balance.

    Defined as 1.0 when every total is 0 (nothing to balance).
    """
    if not parts:
        raise ValueError("parts=[] has no partitions; imbalance needs at least one")
    totals = [sum(weights[i] for i in p) for p in parts]
    mean = sum(totals) / len(totals)
    return 1.0 if mean == 0 else max(totals) / mean


# ---------------------------------------------------------------------------------
# Reshard plan


class Move(NamedTuple):
    """Send one sample's payload from rank ``src`` to rank ``dst``."""

    sample: int
    src: int
    dst: int


@dataclass
class ReshardPlan:
    """What every rank keeps, sends and receives in one reshard.

    ``assignment[d]`` is the sorted sample ids of destination DP replica ``d``; every
    member of that replica's TP group ends up holding exactly them. ``moves`` lists
    only real transfers (a rank already holding a sample it keeps gets no move),
    sorted by (src, dst, sample). ``keep`` has one entry per destination member:
    the sorted samples it already holds and keeps.
    """

    assignment: list[list[int]]
    moves: list[Move]
    keep: dict[int, list[int]]

    def sends(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.src == rank]

    def receives(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.dst == rank]

    def samples_for(self, rank: int) -> list[int]:
        """Sorted sample ids ``rank`` holds after the reshard; [] off the layout."""
        return sorted(self.keep.get(rank, []) + [m.sample for m in self.receives(rank)])

    def moved_tokens(self, lengths: Mapping[int, int]) -> int:
        return sum(lengths[m.sample] for m in self.moves)


def plan_reshard(src: Layout, dst: Layout, holdings: Mapping[int, Sequence[int]],
                 lengths: Mapping[int, int], *, balance: str = "kk",
                 equal_count: bool = False, tolerance: float = 0.0) -> ReshardPlan:
    """Plan moving samples from layout ``src`` to layout ``dst``.

    ``holdings[rank]`` are the sample ids ``rank`` holds now (a sample may be held by
    several ranks, e.g. a whole TP group); ``lengths[sample]`` its token count.
    ``balance``: "kk" (Karmarkar-Karp), "lpt" (greedy), or "none" (keep samples with
    a destination group that already holds them; zero moves when the layouts are
    equal). ``equal_count`` also keeps the replicas' sample counts within 1.
    ``tolerance``: keep the stay-put placement unless the balancer's largest bin is
    smaller by more than this fraction (e.g. 0.02: a 2% straggler is cheaper than
    moving most of the batch to remove it).
    Raises ``ValueError`` on inconsistent inputs, before anything moves.
    """
    with gc_paused():
        return _plan(src, dst, holdings, lengths, balance, equal_count, tolerance)


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
    """The plan `plan_reshard` returns, in O(samples), when it is "nothing moves": each
    destination group's members all hold the same samples, no sample is held outside
    one group, and (unless ``balance="none"``) that placement is within the tolerance of
    the balancer's bound. None when that does not hold (plan it in full), found before
    the inputs are checked: `plan_reshard` checks them then. Where it returns a plan it
    has raised what `plan_reshard` raises."""
    with gc_paused():
        if equal_count:
            return None
        bins = []
        for ranks in dst.dp_groups():
            held = [holdings.get(r, ()) for r in ranks]
            if any(len(h) != len(held[0]) or set(h) != set(held[0]) for h in held[1:]):
                return None
            bins.append(sorted(held[0]))
        if sum(map(len, bins)) != len(lengths) or \
                sum(map(len, holdings.values())) != dst.tp_size * sum(map(len, bins)):
            return None  # a sample held by two groups, or by a rank outside the layout
        _validate(src, dst, holdings, lengths, balance)
        largest = max(sum(lengths[s] for s in b) for b in bins)
        if balance != "none" and largest > _bound(dst, lengths) * (1.0 + tolerance):
            return None
        return ReshardPlan(bins, [], {r: list(bins[g]) for g, ranks in enumerate(dst.dp_groups()) for r in ranks})


def _bound(dst: Layout, lengths: Mapping[int, int]) -> int:
    """No partition's largest bin is below this: when staying put is within the
    tolerance of it, the balancer cannot win and need not run."""
    return max(max(lengths.values()), -(-sum(lengths.values()) // dst.dp_size))


class _Samples(NamedTuple):
    """The planner's inputs as arrays, one row per sample in ascending id order (so a
    tie broken by row is broken by sample id): ``held[i, r]`` says rank ``r`` holds it."""

    ids: np.ndarray
    lens: np.ndarray
    held: np.ndarray


def _plan(src: Layout, dst: Layout, holdings: Mapping[int, Sequence[int]], lengths: Mapping[int, int],
          balance: str, equal_count: bool, tolerance: float) -> ReshardPlan:
    samples = _validate(src, dst, holdings, lengths, balance)
    votes = samples.held.astype(np.int64) @ _group_matrix(dst)  # [sample, group]: members holding it
    lens = samples.lens.tolist()
    bound = _bound(dst, lengths)
    stay = _locality_bins(votes, samples.lens, equal_count, limit=bound * (1.0 + tolerance))
    group_of, stay_largest = stay, _largest_bin(stay, samples.lens, dst.dp_size)
    if balance != "none" and stay_largest > bound * (1.0 + tolerance):
        repaired = None if equal_count else _repaired(stay, lens, dst.dp_size, bound * (1.0 + tolerance))
        if repaired is not None:  # a few samples moved, the rest stays: within the tolerance of the bound
            return _route(_match_bins(repaired, votes, samples.lens), dst, samples)
        split = karmarkar_karp if balance == "kk" else greedy_lpt
        balanced = np.empty(len(lens), dtype=np.int64)
        for b, rows in enumerate(split(lens, dst.dp_size, equal_count)):
            balanced[rows] = b
        # Staying put costs no bytes, so the balancer must be strictly better to win.
        if _largest_bin(balanced, samples.lens, dst.dp_size) * (1.0 + tolerance) < stay_largest:
            group_of = balanced
    return _route(_match_bins(group_of, votes, samples.lens), dst, samples)


def _repaired(bin_of: np.ndarray, lens: list[int], k: int, target: float) -> np.ndarray | None:
    """`bin_of` (each sample's bin) with single samples moved from the heaviest bin to
    the lightest until none holds more than `target` tokens, or None where moves of
    single samples do not get there (then the balancer partitions afresh). Each move
    takes the longest sample that keeps the lightest bin within the target (else the
    longest that still narrows the gap), so few samples move; ties by sample id, so
    every rank repairs alike."""
    by_length = np.lexsort((np.arange(len(lens)), lens))  # (length, sample) ascending
    in_order = bin_of[by_length]
    order: list[list[tuple[int, int]]] = []  # per bin, its (length, row) pairs in that order
    for b in range(k):
        rows = by_length[in_order == b].tolist()
        order.append([(lens[row], row) for row in rows])
    totals = [sum(n for n, _ in b) for b in order]
    moved = bin_of.copy()
    for _ in range(len(lens) + 1):
        heavy = max(range(k), key=lambda g: (totals[g], -g))
        if totals[heavy] <= target:
            return moved
        light = min(range(k), key=lambda g: (totals[g], g))
        gap, items = totals[heavy] - totals[light], order[heavy]
        fits = bisect.bisect_right(items, (min(gap - 1, target - totals[light]), sys.maxsize)) - 1
        narrows = bisect.bisect_right(items, (gap - 1, sys.maxsize)) - 1
        pick = fits if fits >= 0 and items[fits][0] > 0 else narrows
        if pick < 0 or items[pick][0] <= 0:
            return None
        n, row = items.pop(pick)
        bisect.insort(order[light], (n, row))
        moved[row] = light
        totals[heavy] -= n
        totals[light] += n
    return None


def _validate(src: Layout, dst: Layout, holdings: Mapping[int, Sequence[int]],
              lengths: Mapping[int, int], balance: str) -> _Samples:
    """Check the inputs; return them as arrays."""
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance={balance!r} is not one of {', '.join(map(repr, BALANCE_MODES))}")
    if src.world_size != dst.world_size:
        raise ValueError(f"src world_size={src.world_size} differs from dst world_size="
                         f"{dst.world_size}; a reshard moves data within one set of workers")
    ids = np.fromiter(lengths.keys(), dtype=np.int64, count=len(lengths))
    by_id = np.argsort(ids, kind="stable")
    ids, lens = ids[by_id], np.fromiter(lengths.values(), dtype=np.int64, count=len(lengths))[by_id]
    if len(lens) and lens.min() < 0:
        s, n = next((s, n) for s, n in lengths.items() if n < 0)
        raise ValueError(f"sample {s} has negative length {n}; lengths must be >= 0")
    if len(lengths) < dst.dp_size:
        raise ValueError(f"{len(lengths)} samples cannot fill the {dst.dp_size} destination "
                         f"DP ranks; each DP rank needs at least one sample")
    members = set(src.members)
    held = np.zeros((len(ids), src.world_size), dtype=bool)
    for rank, samples in holdings.items():
        if not len(samples):
            continue
        if rank not in members:
            raise ValueError(f"rank {rank} holds sample {samples[0]} but is not in the source "
                             f"layout's ranks {src.members}")
        wanted = np.asarray(samples, dtype=np.int64)
        rows = np.searchsorted(ids, wanted).clip(max=max(len(ids) - 1, 0))
        found = ids[rows] == wanted if len(ids) else np.zeros(len(wanted), dtype=bool)
        if not found.all():
            raise ValueError(f"rank {rank} holds sample {int(wanted[np.argmin(found)])}, which has no entry "
                             "in lengths")
        held[rows, rank] = True
    unheld = ids[~held.any(axis=1)]
    if len(unheld):
        raise ValueError(f"sample {int(unheld[0])} has no holder ({len(unheld)} unheld in all); "
                         f"every sample in lengths must be held by a source rank")
    return _Samples(ids, lens, held)


def _group_matrix(dst: Layout) -> np.ndarray:
    """[rank, group]: 1 where the rank is a member of that destination DP group."""
    member = np.zeros((dst.world_size, dst.dp_size), dtype=np.int64)
    for g, ranks in enumerate(dst.dp_groups()):
        member[list(ranks), g] = 1
    return member


def _largest_bin(bin_of: np.ndarray, lens: np.ndarray, k: int) -> int:
    totals = np.zeros(k, dtype=np.int64)
    np.add.at(totals, bin_of, lens)
    return int(totals.max())


def _locality_bins(votes: np.ndarray, lens: np.ndarray, equal_count: bool, limit: float) -> np.ndarray:
    """Each sample's destination group: the one with the most members holding it.

    Samples held by no destination member, or by several groups equally, have a choice.
    Without `equal_count` they are first cut in id order into one run per group
    (`_runs_in_id_order`), kept when no group then exceeds `limit` tokens: a TP group's
    rows split among its members that way leave each member one block of the rows it
    holds, which the executor hands on as views, uncopied. Otherwise each goes to the
    lightest such group, largest samples first, so those choices even out.
    """
    n, k = votes.shape
    patterns, pattern_of = _distinct_rows(votes)
    # per distinct row of votes, its groups cut into tiers of equal votes, most votes
    # first; without a count cap a sample always finds room in its first tier
    tiers_of = [_vote_tiers(row) for row in patterns]
    if not equal_count:
        firsts = [tiers[0] for tiers in tiers_of]
        if all(len(groups) == 1 for groups in firsts):  # no sample has a choice
            return np.array([groups[0] for groups in firsts], dtype=np.int64)[pattern_of]
        runs = _runs_in_id_order(firsts, pattern_of, lens, k)
        if _largest_bin(runs, lens, k) <= limit:
            return runs
        tiers_of = [[groups] for groups in firsts]
    cap = _CountCap(n, k) if equal_count else None
    sizes, totals = [0] * k, [0] * k
    group_of = [0] * n
    pattern_of = pattern_of.tolist()
    order, lens = np.argsort(-lens, kind="stable").tolist(), lens.tolist()
    for row in order:  # largest first, ties by sample id
        for tier in tiers_of[pattern_of[row]]:
            open_groups = tier if cap is None else [g for g in tier if cap.has_room(sizes[g])]
            if open_groups:
                g = open_groups[0]
                for other in open_groups[1:]:  # the lightest; ties: the first group
                    if totals[other] < totals[g]:
                        g = other
                break
        group_of[row] = g
        sizes[g] += 1
        totals[g] += lens[row]
        if cap is not None:
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
    for p, groups in enumerate(choices):
        if len(groups) == 1:
            continue
        rows = np.flatnonzero(pattern_of == p)  # ascending sample id; never empty (a pattern is some row's)
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


def _distinct_rows(votes: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
    """The distinct rows of a non-negative int matrix and each row's index among them
    (`np.unique(axis=0)`, through one int64 key per row where the rows fit in one)."""
    base = int(votes.max(initial=0)) + 1
    if base ** votes.shape[1] >= 2 ** 62:
        rows, inverse = np.unique(votes, axis=0, return_inverse=True)
        return rows.tolist(), inverse.reshape(-1)
    keys, inverse = np.unique(votes @ base ** np.arange(votes.shape[1], dtype=np.int64), return_inverse=True)
    rows = [[key // base ** g % base for g in range(votes.shape[1])] for key in keys.tolist()]
    return rows, inverse.reshape(-1)


def _vote_tiers(votes: list[int]) -> list[list[int]]:
    """The destination groups cut into tiers of equal votes (members holding the
    sample), most votes first; each tier in group order."""
    return [[g for g, v in enumerate(votes) if v == tier] for tier in sorted(set(votes), reverse=True)]


def _match_bins(bin_of: np.ndarray, votes: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Give each destination group one bin, maximising the tokens it already holds;
    returns each sample's group."""
    k = votes.shape[1]
    # score[b][g]: tokens of bin b that group g's members already hold (one count per
    # member, since each member needs its own copy).
    score = np.zeros((k, k), dtype=np.int64)
    np.add.at(score, bin_of, votes * lens[:, None])
    match = _exact_matching if k <= _EXACT_MATCH_MAX else _greedy_matching
    return np.asarray(match(score.tolist()), dtype=np.int64)[bin_of]


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


def _greedy_matching(score: list[list[int]]) -> tuple[int, ...]:
    """Best remaining (bin, group) pair first; ties by bin, then group."""
    k = len(score)
    pairs = sorted(((score[b][g], b, g) for b in range(k) for g in range(k)),
                   key=lambda t: (-t[0], t[1], t[2]))
    of_bin: dict[int, int] = {}
    taken: set[int] = set()
    for _, b, g in pairs:
        if b not in of_bin and g not in taken:
            of_bin[b] = g
            taken.add(g)
    return tuple(of_bin[b] for b in range(k))


def _route(group_of: np.ndarray, dst: Layout, samples: _Samples) -> ReshardPlan:
    """Keep what is already in place; fetch the rest from the least-loaded holder."""
    ids, lens, held = samples
    assignment = [ids[group_of == g].tolist() for g in range(dst.dp_size)]
    keep: dict[int, list[int]] = {r: [] for r in dst.members}
    need_rows, need_ranks = [], []
    for g, ranks in enumerate(dst.dp_groups()):
        in_group = group_of == g
        for r in ranks:
            keep[r] = ids[in_group & held[:, r]].tolist()
            rows = np.flatnonzero(in_group & ~held[:, r])
            need_rows.append(rows)
            need_ranks.append(np.full(len(rows), r, dtype=np.int64))
    rows, to = np.concatenate(need_rows), np.concatenate(need_ranks)
    order = np.lexsort((to, rows, -lens[rows]))  # largest first; ties by sample, then rank
    rows, to = rows[order], to[order]
    holders = held[rows]
    source = holders.argmax(axis=1)  # the only holder, where there is one
    choices = np.flatnonzero(holders.sum(axis=1) > 1)
    if len(choices):  # the holder that has sent the fewest tokens so far (ties: lowest rank)
        sent = [0] * held.shape[1]
        chosen = set(choices.tolist())
        for i, (row, src) in enumerate(zip(rows.tolist(), source.tolist())):
            if i in chosen:
                src = min(np.flatnonzero(held[row]).tolist(), key=lambda h: (sent[h], h))
                source[i] = src
            sent[src] += lens[row]
    order = np.lexsort((ids[rows], to, source))
    moves = list(map(Move, ids[rows[order]].tolist(), source[order].tolist(), to[order].tolist()))
    return ReshardPlan(assignment, moves, keep)
