"""KL estimators (straight-through variants included), KL as a reward penalty and
its controllers, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from distflow.algos import core
from distflow.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_penalized_rewards,
    kl_penalty,
    make_kl_controller,
    sequence_mean_kl,
)

F64 = torch.float64


@pytest.mark.parametrize("kind, base", [("k1+", "k1"), ("k3+", "k3"), ("low_var_kl+", "k3")])
def test_straight_through_has_the_value_of_one_and_the_gradient_of_k2(kind, base):
    logp = torch.tensor([[-0.5, -2.0, -4.5]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    value = kl_penalty(logp, ref, kind)
    torch.testing.assert_close(value.detach(), kl_penalty(logp.detach(), ref, base))
    value.sum().backward()
    # d/dlogp of 0.5 (logp - ref)^2 is logp - ref: 0.5, 0, -4
    assert logp.grad.tolist() == [[0.5, 0.0, -4.0]]


def test_plain_k3_gradient_differs_from_k2():
    logp = torch.tensor([[-0.5]], dtype=F64, requires_grad=True)
    kl_penalty(logp, torch.tensor([[-1.0]], dtype=F64), "k3").sum().backward()
    # d/dlogp (e^(ref-logp) - (ref-logp) - 1) = 1 - e^(ref-logp) = 1 - e^-0.5
    assert float(logp.grad) == pytest.approx(1 - 0.6065306597126334)


def test_unknown_kind_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4\+'; registered: k1, k2, abs, k3, low_var_kl "
                                         r"\(each also as name\+"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4+")


def test_kl_penalized_rewards_hand_values():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    scores = core.token_level_rewards(torch.tensor([1.0, 45.0], dtype=F64), mask)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -2.0, -0.25], [-0.6, -0.2, 0.0]], dtype=F64)
    rewards, kl = kl_penalized_rewards(scores, logp, ref, mask, beta=0.1, kind="k1")
    # k1 = logp - ref: (0.5, 0, -0.25) and (0.5, 0, masked)
    torch.testing.assert_close(kl, torch.tensor([[0.5, 0.0, -0.25], [0.5, 0.0, 0.0]], dtype=F64))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.025], [-0.05, 45.0, 0.0]], dtype=F64))
    torch.testing.assert_close(sequence_mean_kl(kl, mask), torch.tensor([0.25 / 3, 0.25], dtype=F64))
    # what lies under the mask never enters, an infinite log-prob of padding neither (inf * 0 was NaN)
    logp[1, 2], ref[1, 2] = -math.inf, math.inf
    again, kl_again = kl_penalized_rewards(scores, logp, ref, mask, beta=0.1, kind="k1")
    assert torch.equal(again, rewards) and torch.equal(kl_again, kl)


def test_fixed_controller_keeps_beta():
    ctrl = make_kl_controller("fixed", 0.001, 0.1, 10)
    ctrl.update(45.0, 4500)
    assert isinstance(ctrl, FixedKLController) and ctrl.value == 0.001


def test_adaptive_controller_hand_values():
    ctrl = make_kl_controller("adaptive", 0.1, target=0.05, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(0.055, n_steps=10)  # error 0.1: beta *= 1 + 0.1 * 10 / 100
    assert ctrl.value == pytest.approx(0.101)
    ctrl.update(4.5, n_steps=10)  # error clipped to +0.2: beta *= 1.02
    assert ctrl.value == pytest.approx(0.101 * 1.02)
    ctrl.update(0.0, n_steps=50)  # error clipped to -0.2: beta *= 0.9
    assert ctrl.value == pytest.approx(0.101 * 1.02 * 0.9)
    with pytest.raises(ValueError, match="target > 0"):
        make_kl_controller("adaptive", 0.1, target=0.0, horizon=100)
