"""Which prompts each worker takes at each step.

The global stream is a seeded permutation of the dataset per epoch; step s takes the
next `batch_size` positions. Position i of a step's batch belongs to rank i % world
(interleaved), so that every contiguous slice of the global batch (a PPO mini-batch) is
spread evenly over the ranks, and any number of workers trains on the same mini-batches.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass


@dataclass
class ShardedSampler:
    num_rows: int
    batch_size: int  # global prompts per step
    rank: int
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        assert self.batch_size % self.world_size == 0, "batch must split evenly over ranks"
        self._perm_cache: dict[int, array] = {}

    def _perm(self, epoch: int) -> array:
        if epoch not in self._perm_cache:
            order = list(range(self.num_rows))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self._perm_cache = {epoch: array("q", order)}  # only the current epoch; 8 bytes a row, not a list's 36
        return self._perm_cache[epoch]

    def global_indices(self, step: int) -> list[int]:
        """Dataset rows of the whole step's batch (step counts from 1)."""
        start = (step - 1) * self.batch_size
        out = []
        for pos in range(start, start + self.batch_size):
            epoch, offset = divmod(pos, self.num_rows)
            out.append(self._perm(epoch)[offset])
        return out

    def epoch_of(self, step: int, pos: int) -> int:
        """The epoch position `pos` of step `step`'s batch falls in (a step may straddle two)."""
        return ((step - 1) * self.batch_size + pos) // self.num_rows

    def local_indices(self, step: int) -> list[int]:
        return [index for _, index in self.local_positions(step)]

    def local_positions(self, step: int) -> list[tuple[int, int]]:
        """(position in the step's global batch, dataset row) of this rank's prompts."""
        return list(enumerate(self.global_indices(step)))[self.rank::self.world_size]

    def position(self, step: int) -> dict[str, int]:
        """(epoch, offset) of the next unread position after `step`: the resumable state."""
        epoch, offset = divmod(step * self.batch_size, self.num_rows)
        return {"epoch": epoch, "offset": offset}

    def state_dict(self, step: int) -> dict[str, int]:
        return self.position(step) | {"seed": self.seed, "batch_size": self.batch_size, "num_rows": self.num_rows}

    def next_step(self, state: dict[str, int]) -> int:
        """The step to run next after restoring `state` (saved by `state_dict`)."""
        for key, setting in (("seed", "trainer.seed"), ("batch_size", "data.train_batch_size"),
                             ("num_rows", "the rows of data.train_files")):
            if state[key] != getattr(self, key):
                raise ValueError(f"its run had {setting}={state[key]}, this one {getattr(self, key)}; the data "
                                 "order goes on only with the same data, batch size and seed (trainer.resume=off, "
                                 "or another trainer.output_dir, starts a new run)")
        consumed = state["epoch"] * self.num_rows + state["offset"]
        assert consumed % self.batch_size == 0, "positions are saved at step boundaries"
        return consumed // self.batch_size + 1
