"""The rollout-training mismatch correction against hand-computed values and a naive loop."""

from __future__ import annotations

import math

import pytest
import torch

from distflow.algos.core import policy_loss_vanilla
from distflow.algos.correction import rollout_correction

F64 = torch.float64
# log-ratios old - rollout: row 0 (ln 4, ln 0.5, masked), row 1 (ln 1.5, ln 0.25, ln 1)
OLD = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
ROLLOUT = -torch.log(torch.tensor([[4.0, 0.5, 450.0], [1.5, 0.25, 1.0]], dtype=F64))
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)


def test_token_tis_truncates_each_token_at_the_cap():
    out = rollout_correction(OLD, ROLLOUT, MASK, "token_tis", cap=2.0)
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 0.5, 0.0], [1.5, 0.25, 1.0]], dtype=F64))
    assert float(out.weight_mean) == pytest.approx((2.0 + 0.5 + 1.5 + 0.25 + 1.0) / 5)
    assert float(out.weight_max) == 2.0 and float(out.corrected_fraction) == pytest.approx(1 / 5)


def test_seq_tis_weights_every_token_by_the_sequence_ratio():
    out = rollout_correction(OLD, ROLLOUT, MASK, "seq_tis", cap=2.0)
    # row 0: 4 * 0.5 = 2 (at the cap, not over it); row 1: 1.5 * 0.25 * 1 = 0.375
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 2.0, 0.0], [0.375, 0.375, 0.375]], dtype=F64))
    assert float(out.corrected_fraction) == 0.0


def test_token_mask_drops_tokens_outside_the_band():
    out = rollout_correction(OLD, ROLLOUT, MASK, "token_mask", cap=2.0)
    # band [0.5, 2]: 4 out, 0.5 in, 1.5 in, 0.25 out, 1 in
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]], dtype=F64))
    assert float(out.corrected_fraction) == pytest.approx(2 / 5)


def test_seq_mask_keeps_or_drops_whole_sequences():
    out = rollout_correction(OLD, ROLLOUT, MASK, "seq_mask", cap=2.0)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64))


def test_mismatch_kl_is_k3_of_the_two_policies():
    """k3 = r - 1 - log r with r = old / rollout, the unbiased estimate of KL(rollout || old)
    on tokens the rollout sampled (verl's), not the reverse ratio."""
    out = rollout_correction(OLD, ROLLOUT, MASK, "token_tis", cap=2.0)
    log_r = [math.log(4), math.log(1 / 2), math.log(1.5), math.log(1 / 4), 0.0]  # old - rollout
    assert float(out.mismatch_kl) == pytest.approx(sum(math.exp(d) - d - 1 for d in log_r) / 5)


def test_token_tis_matches_a_naive_loop_and_carries_no_gradient():
    gen = torch.Generator().manual_seed(3)
    old = (torch.randn(5, 7, generator=gen, dtype=F64) * 0.5).requires_grad_()
    rollout = torch.randn(5, 7, generator=gen, dtype=F64) * 0.5
    mask = (torch.rand(5, 7, generator=gen) < 0.7).to(F64)
    out = rollout_correction(old, rollout, mask, "token_tis", cap=1.5)
    assert not out.weights.requires_grad
    for i in range(5):
        for t in range(7):
            expected = min(math.exp(float(old[i, t].detach() - rollout[i, t])), 1.5) if mask[i, t] else 0.0
            assert float(out.weights[i, t]) == pytest.approx(expected)


def test_bad_mode_or_cap():
    with pytest.raises(ValueError, match=r"'tis'.*'token_tis'"):
        rollout_correction(OLD, ROLLOUT, MASK, "tis", cap=2.0)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        rollout_correction(OLD, ROLLOUT, MASK, "token_tis", cap=0.5)


def test_policy_loss_token_weights_multiply_each_tokens_loss():
    logp = torch.zeros(1, 2, dtype=F64)
    adv = torch.tensor([[4.5, -45.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    plain = policy_loss_vanilla(logp, logp, adv, mask)
    weighted = policy_loss_vanilla(logp, logp, adv, mask, token_weights=torch.tensor([[2.0, 0.5]], dtype=F64))
    # ratio 1: per-token losses -4.5 and 45; token-mean: (-4.5 + 45) / 2, weighted (-9 + 22.5) / 2
    assert float(plain.loss) == pytest.approx(20.25) and float(weighted.loss) == pytest.approx(6.75)
