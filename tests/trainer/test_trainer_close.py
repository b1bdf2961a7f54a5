"""Closing a worker's trainer: the trackers first (told whether the run failed), then every
part, last built first, even where one before it fails. A trainer that fails to build
closes what it built: tests/trainer/test_bad_input.py."""

import contextlib
from types import SimpleNamespace

import pytest

from distflow.trainer import loop


def test_every_part_closes_even_where_one_before_it_fails():
    closed = []

    def closer(name, fails=False):
        def close():
            closed.append(name)
            if fails:
                raise RuntimeError(f"{name} failed to close")
        return close

    parts = contextlib.ExitStack()
    for name in ("rollout", "reward runners", "episodes", "scheduler"):  # as Trainer._build adds them
        parts.callback(closer(name, fails=name == "episodes"))
    trainer = SimpleNamespace(_parts=parts, trackers=SimpleNamespace(close=lambda failed: closed.append(("trackers", failed))))
    with pytest.raises(RuntimeError, match="episodes failed to close"):
        loop.Trainer.close(trainer, failed=True)
    assert closed == [("trackers", True), "scheduler", "episodes", "reward runners", "rollout"]
