"""Partitioning samples into bins of even token totals: the balancers the reshard
planner (`planner.py`), the micro-batcher and the stream use, and the naive split
the benchmarks measure them against.

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
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterator, Sequence


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


class CountCap:
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
    cap = CountCap(len(weights), k) if equal_size else None
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
