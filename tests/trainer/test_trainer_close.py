"""Closing a worker's trainer: every part closes, even where one before it fails."""

from types import SimpleNamespace

import pytest

from distflow.trainer import loop


def test_every_part_closes_even_where_one_before_it_fails(monkeypatch):
    closed = []

    def part(name, fails=False):
        def close():
            closed.append(name)
            if fails:
                raise RuntimeError(f"{name} failed to close")
        return SimpleNamespace(close=close)

    monkeypatch.setattr(loop, "close_reward_runners", lambda *runners: closed.append("reward runners"))
    trainer = SimpleNamespace(scheduler=part("scheduler"), rollout=part("rollout", fails=True),
                              trackers=part("trackers"),
                              ctx=SimpleNamespace(episodes=part("episodes"), reward_fn=None, accuracy_fn=None))
    with pytest.raises(RuntimeError, match="rollout failed to close"):
        loop.Trainer.close(trainer)
    assert closed == ["scheduler", "episodes", "rollout", "trackers", "reward runners"]
