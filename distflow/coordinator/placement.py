"""Where a step's rows live at each stage, and the reshards between those layouts.

`local` (rows as the rollout made them: unique per worker), `groups` (whole prompt
groups on each worker: the rows of a rollout replica) and `train` (data-parallel over
all workers, balanced by tokens). The scheduler asks `moves` before a node whose layout
is later than the store's and calls `move` when rows must change worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distflow.coordinator.executor import GlobalView, TransferStats, reshard
from distflow.coordinator.layout import Layout
from distflow.coordinator.store import LocalStore
from distflow.data.batch import sequence_lengths


@dataclass
class Placement:
    """The rollout replicas' layout and the training layout; moves between them are reshards."""

    rollout: Layout
    train: Layout
    stats: TransferStats = field(default_factory=TransferStats)
    balance: str = "kk"
    tolerance: float = 0.02
    view: GlobalView = field(default_factory=GlobalView)  # who holds which rows since the last move
    # a field of int labels whose rows are balanced on their own too (the trainer's PPO mini-batches:
    # each is an update every rank waits for); it travels with the metadata of every move
    balance_within: str | None = None

    def moves(self, src: str, dst: str) -> bool:
        if src == dst:
            return False
        if dst == "groups":
            return self.rollout.tp_size > 1  # with one rank per replica every worker already holds whole groups
        return self.train.world_size > 1

    def layouts(self, src: str, dst: str) -> tuple[Layout, Layout, str]:
        """(source layout, target layout, balance) of a move."""
        if dst == "groups":  # gather the replica's shares on every member of its group
            return self.train, self.rollout, "none"
        return self.rollout if src == "groups" else self.train, self.train, self.balance

    def move(self, store: LocalStore, src: str, dst: str, same_rows: bool = False) -> None:
        """`same_rows`: every rank's rows are those the previous move left (the caller
        knows it on every rank alike), so its plan replaces the metadata all-gather."""
        batch = store.all()
        source, target, balance = self.layouts(src, dst)
        if not same_rows:
            self.view = GlobalView()
        within = self.balance_within is not None and self.balance_within in batch
        labels = batch[self.balance_within].tolist() if within else None
        new, _, _ = reshard(batch, batch["sample_id"], sequence_lengths(batch), source, target,
                            balance=balance, tolerance=self.tolerance, stats=self.stats, view=self.view,
                            labels=labels)
        store.replace(new)
