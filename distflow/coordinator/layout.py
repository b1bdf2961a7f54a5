"""Stage layouts: which ranks take part in a pipeline stage and how they group.

A layout lists its participating ranks (``members``) in order and cuts that list
into consecutive tensor-parallel (TP) groups of ``tp_size`` ranks. Each TP group is
one data-parallel (DP) replica: its members shard the model, so they all need the
same samples. For a member at position ``p`` in ``members``::

    dp_rank = p // tp_size      tp_rank = p % tp_size

so ``Layout(4, tp_size=2)`` has DP groups ``(0, 1)`` and ``(2, 3)``.

When two consecutive stages have different layouts, the Data Coordinator reshards
the samples between them (see ``planner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

# A step's rows are laid out per stage as `local` (as the rollout made them), `groups`
# (whole prompt groups per rollout replica) or `train` (data-parallel, token-balanced);
# they move only in this order (coordinator/placement.py).
LAYOUTS = ("local", "groups", "train")
LAYOUT_ORDER = {name: i for i, name in enumerate(LAYOUTS)}


@dataclass(frozen=True)
class Layout:
    """Participating ranks of one stage, grouped into TP groups (= DP replicas).

    ``ranks`` defaults to every worker ``0..world_size-1``; ``__post_init__`` fills
    it in, so ``Layout(4) == Layout(4, ranks=(0, 1, 2, 3))``.
    """

    world_size: int
    tp_size: int = 1
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        members = tuple(range(self.world_size)) if self.ranks is None else tuple(self.ranks)
        # Filled in (and made a tuple even if a list was passed) so that equality and
        # hashing compare what the layout means, not how it was spelled.
        object.__setattr__(self, "ranks", members)
        _check_ranks(members, self.world_size)
        _check_tp_size(self.tp_size, len(members))

    @classmethod
    def data_parallel(cls, world_size: int) -> Layout:
        """Every worker is its own DP replica (tp_size=1)."""
        return cls(world_size)

    @property
    def members(self) -> tuple[int, ...]:
        """The participating ranks, in DP-then-TP order."""
        assert self.ranks is not None  # __post_init__ always fills it in
        return self.ranks

    @property
    def dp_size(self) -> int:
        return len(self.members) // self.tp_size

    def dp_rank(self, rank: int) -> int:
        return self._position(rank) // self.tp_size

    def tp_rank(self, rank: int) -> int:
        return self._position(rank) % self.tp_size

    def dp_groups(self) -> list[tuple[int, ...]]:
        """The ranks of each TP group, indexed by DP rank."""
        m, tp = self.members, self.tp_size
        return [m[i * tp:(i + 1) * tp] for i in range(self.dp_size)]

    def group_of(self, dp_index: int) -> tuple[int, ...]:
        """The ranks of the TP group that forms DP replica ``dp_index``."""
        if not 0 <= dp_index < self.dp_size:
            raise ValueError(f"dp_index={dp_index} is outside [0, {self.dp_size}) for this layout")
        return self.dp_groups()[dp_index]

    def _position(self, rank: int) -> int:
        try:
            return self.members.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in this layout's ranks {self.members}") from None


def _check_ranks(members: tuple[int, ...], world_size: int) -> None:
    if not members:
        raise ValueError("ranks=() is empty; a layout needs at least one participating rank")
    seen: set[int] = set()
    for r in members:
        if not 0 <= r < world_size:
            raise ValueError(f"rank {r} in ranks is outside [0, {world_size}) for world_size={world_size}")
        if r in seen:
            raise ValueError(f"rank {r} appears more than once in ranks; each rank may take part once")
        seen.add(r)


def _check_tp_size(tp_size: int, n_members: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} must be >= 1")
    if tp_size > n_members:
        raise ValueError(f"tp_size={tp_size} is more than the {n_members} participating ranks")
    if n_members % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the {n_members} participating ranks")
