"""The recipe nodes' own math, on one process with hand-computed values."""

from __future__ import annotations

import pytest
import torch

from distflow.algos import core
from distflow.config import load_config
from distflow.data.batch import Batch
from distflow.trainer import nodes


class Ctx:
    def __init__(self, params, *overrides):
        self.cfg, self.params = load_config(None, list(overrides)), params


MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 1, 1])


def test_grpo_advantage_node_uses_the_registered_estimator():
    out = nodes.advantage(Ctx({"estimator": "grpo", "reward_field": "scores"}),
                          Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS}))
    # group 0: rewards (1, 0): mean 0.5, std 0.7071 -> +-0.7071; group 1: equal rewards -> 0
    expected = torch.tensor([0.7071, -0.7071, 0.0, 0.0]).unsqueeze(-1) * MASK
    assert torch.allclose(out["advantages"], expected, atol=1e-4)


def test_reinforce_plus_plus_whitens_like_the_single_batch_formula():
    out = nodes.advantage(Ctx({"estimator": "reinforce_plus_plus", "reward_field": "scores"}),
                          Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS}))
    reference, _ = core.compute_reinforce_plus_plus_advantage(core.token_level_rewards(REWARDS, MASK), MASK)
    assert torch.allclose(out["advantages"], reference, atol=1e-5)
    # by hand: returns-to-go are 1,1 | 0,0,0 | 1 | 1,1,1 over 9 valid tokens: mean 6/9
    valid = out["advantages"][MASK.bool()]
    assert float(valid.sum()) == pytest.approx(0.0, abs=1e-5) and float(valid.std()) == pytest.approx(1.0, abs=1e-4)


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens():
    out = nodes.advantage(Ctx({"estimator": "reinforce_plus_plus_baseline", "reward_field": "scores"}),
                          Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS}))
    reference, _ = core.compute_reinforce_plus_plus_baseline_advantage(REWARDS, MASK, GROUPS)
    assert torch.allclose(out["advantages"], reference, atol=1e-5)


def test_gae_node_returns_whitened_advantages_and_returns():
    values = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.1, 0.0], [0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = nodes.advantage(Ctx({"estimator": "gae", "reward_field": "scores"}, "algorithm.gamma=1.0", "algorithm.lam=1.0"),
                          Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS, "values": values}))
    # gamma = lam = 1: the return of every valid token is the sequence's reward
    assert torch.equal(out["returns"], REWARDS.unsqueeze(-1) * MASK)
    reference, _ = core.compute_gae_advantage(core.token_level_rewards(REWARDS, MASK), values, MASK)
    assert torch.allclose(out["advantages"], reference, atol=1e-5)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    out = nodes.dynamic_sampling(Ctx({"reward_field": "scores"}),
                                 Batch({"scores": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]),
                                        "group": torch.tensor([0, 0, 1, 1, 2, 2])}))
    assert out["kept"].tolist() == [True, True, False, False, False, False]


def test_overlong_penalty_ramps_over_the_buffer():
    ctx = Ctx({}, "algorithm.overlong_buffer_len=4", "rollout.max_new_tokens=8")
    mask = torch.tensor([[1] * 4 + [0] * 4, [1] * 6 + [0] * 2, [1] * 8])
    out = nodes.overlong_penalty(ctx, Batch({"scores": torch.ones(3), "response_mask": mask}))
    assert out["shaped_scores"].tolist() == [1.0, 0.5, 0.0]  # penalties 0, -0.5, -1
