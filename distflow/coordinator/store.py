"""The per-worker store: where each stage's output stays on the worker that made it.

Stages read the fields they need and add the fields they produce; nothing leaves the
worker unless a later stage with another layout needs it there (the Data
Coordinator's reshard). Within one layout the store *is* the local cache: zero bytes move.
"""

from __future__ import annotations

from distflow.data.batch import Batch


class LocalStore:
    def __init__(self) -> None:
        self._batch = Batch()

    def put(self, batch: Batch) -> None:
        """Add fields for the current step's samples (same sample order)."""
        clash = set(batch.keys()) & set(self._batch.keys())
        assert not clash, f"fields produced twice in one step: {sorted(clash)}"
        self._batch.update(batch)

    def get(self, *fields: str) -> Batch:
        missing = [f for f in fields if f not in self._batch]
        assert not missing, f"fields not produced yet: {missing}"
        return Batch({f: self._batch.tensors[f] for f in fields if f in self._batch.tensors},
                     {f: self._batch.meta[f] for f in fields if f in self._batch.meta})

    def __contains__(self, field: str) -> bool:
        return field in self._batch

    def __len__(self) -> int:
        return len(self._batch)

    def all(self) -> Batch:
        return self._batch

    def replace(self, batch: Batch) -> None:
        """After a reshard: the samples this worker holds now, with all their fields."""
        self._batch = batch

    def clear(self) -> None:
        self._batch = Batch()

    def nbytes(self) -> int:
        return self._batch.nbytes()
