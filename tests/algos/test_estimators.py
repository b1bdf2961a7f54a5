"""Every advantage estimator through the one registry signature: the same numbers as
its math function, hand-computed values for ReMax, and batch-wide whitening that gives
the same advantages whether the batch is on one process or split over several."""

from __future__ import annotations

import math
import threading
from functools import partial

import pytest
import torch

from distflow.algos import core
from distflow.algos.estimators import (
    ADV_ESTIMATORS,
    ESTIMATOR_INFO,
    AdvantageInputs,
    estimator_info,
    get_adv_estimator,
    register_adv_est,
)

F64 = torch.float64
# groups 7: rows 0, 2; 3: rows 1, 3; rewards of different magnitudes show any mixing
REWARDS = torch.tensor([4.5, 45.0, 450.0, 4500.0], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=F64)
GROUPS = torch.tensor([7, 3, 7, 3])
VALUES = torch.tensor([[0.5, 5.0, 0.0], [50.0, 0.5, 5.0], [500.0, 0.0, 0.0], [0.05, 50.0, 500.0]], dtype=F64)


def inputs(**kw) -> AdvantageInputs:
    return AdvantageInputs(token_rewards=core.token_level_rewards(REWARDS, MASK), mask=MASK, group_ids=GROUPS, **kw)


def test_registry_holds_the_built_in_estimators_and_what_they_need():
    # at least these: other tests' files register their own (e.g. a graph test's sign_baseline)
    assert set(ADV_ESTIMATORS) >= {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                                   "reinforce_plus_plus_baseline", "gae", "remax"}
    assert estimator_info("gae").needs == ("values",) and estimator_info("gae").batch_whitened
    assert estimator_info("remax").needs == ("baseline",) and not estimator_info("remax").batch_whitened
    assert estimator_info("grpo").needs == () and not estimator_info("grpo").batch_whitened
    assert estimator_info("rloo").min_group_size == 2 and estimator_info("grpo").min_group_size == 1
    with pytest.raises(ValueError, match=r"'ppo_magic'.*'gae'.*'grpo'.*'rloo'"):
        get_adv_estimator("ppo_magic")


def test_register_a_new_estimator_and_reject_a_conflicting_duplicate():
    def mine(inp):
        return inp.token_rewards, inp.token_rewards

    def other(inp):
        return inp.token_rewards, inp.token_rewards

    try:
        assert register_adv_est("tmp_est", needs=("values",))(mine) is mine
        assert get_adv_estimator("tmp_est") is mine and estimator_info("tmp_est").needs == ("values",)
        with pytest.raises(ValueError, match="tmp_est"):
            register_adv_est("tmp_est")(other)
        with pytest.raises(ValueError, match=r"unknown needs \['critic'\]"):
            register_adv_est("tmp_bad", needs=("critic",))
    finally:
        ADV_ESTIMATORS.pop("tmp_est", None)
        ESTIMATOR_INFO.pop("tmp_est", None)


@pytest.mark.parametrize("name, expected", [
    ("grpo", lambda: core.compute_grpo_advantage(REWARDS, MASK, GROUPS)[0]),
    ("dr_grpo", lambda: core.compute_dr_grpo_advantage(REWARDS, MASK, GROUPS)[0]),
    ("rloo", lambda: core.compute_rloo_advantage(REWARDS, MASK, GROUPS)[0]),
    ("reinforce_plus_plus", lambda: core.compute_reinforce_plus_plus_advantage(
        core.token_level_rewards(REWARDS, MASK), MASK)[0]),
    ("reinforce_plus_plus_baseline", lambda: core.compute_reinforce_plus_plus_baseline_advantage(
        REWARDS, MASK, GROUPS)[0]),
    ("gae", lambda: core.compute_gae_advantage(core.token_level_rewards(REWARDS, MASK), VALUES, MASK)[0]),
])
def test_each_estimator_through_the_registry_equals_its_math(name, expected):
    adv, _ = get_adv_estimator(name)(inputs(values=VALUES))
    # batch-whitened ones: one-pass moments (what an all-reduce can sum) against the
    # math's two-pass variance, equal to rounding
    torch.testing.assert_close(adv, expected(), rtol=1e-9, atol=1e-7)


def test_only_batch_whitened_estimators_call_the_injected_whiten():
    for name in ADV_ESTIMATORS:
        calls = []

        def whiten(x, mask):
            calls.append(name)
            return x * 0 + 4.5 * mask

        adv, _ = get_adv_estimator(name)(inputs(values=VALUES, baseline=torch.zeros(4, dtype=F64), whiten=whiten))
        assert bool(calls) == estimator_info(name).batch_whitened, name
        if calls:
            torch.testing.assert_close(adv, 4.5 * MASK)  # the injected result is what comes back


def test_outcome_estimators_see_per_token_rewards_summed():
    """With KL in the reward, GRPO's outcome is the sum of the token rewards (verl)."""
    token = torch.tensor([[-0.5, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1]], dtype=F64)
    adv, _ = get_adv_estimator("dr_grpo")(AdvantageInputs(token_rewards=token, mask=mask, group_ids=torch.tensor([0, 0])))
    assert adv[:, 0].tolist() == [-0.75, 0.75]  # outcomes -0.5 and 1.0, mean 0.25


def test_remax_hand_values():
    token = torch.tensor([[0.0, 0.0, 4.5], [0.0, 45.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv, ret = get_adv_estimator("remax")(AdvantageInputs(token_rewards=token, mask=mask, group_ids=torch.tensor([0, 1]),
                                                          baseline=torch.tensor([0.5, 50.0], dtype=F64)))
    # return-to-go 4.5, 4.5, 4.5 | 45, 45, (masked); minus the greedy rewards 0.5 and 50
    assert adv.tolist() == [[4.0, 4.0, 4.0], [-5.0, -5.0, 0.0]]
    assert torch.equal(adv, ret)


def test_remax_matches_a_naive_loop():
    gen = torch.Generator().manual_seed(5)
    token = torch.randn(6, 8, generator=gen, dtype=F64) * 45
    mask = (torch.rand(6, 8, generator=gen) < 0.7).to(F64)
    baseline = torch.randn(6, generator=gen, dtype=F64) * 450
    adv, _ = core.compute_remax_advantage(token, baseline, mask)
    for i in range(6):
        for t in range(8):
            expected = sum(token[i, s] for s in range(t, 8) if mask[i, s]) - baseline[i] if mask[i, t] else 0.0
            assert float(adv[i, t]) == pytest.approx(float(expected), abs=1e-9)


def _all_reducing(jobs):
    """Run each `job(sum_fn)` on a thread of its own, `sum_fn` summing its numbers over
    every thread's call (as the trainer's all-reduce does over processes)."""
    barrier, given, results = threading.Barrier(len(jobs)), [None] * len(jobs), [None] * len(jobs)

    def run(i):
        def sum_fn(*values):
            given[i] = values
            barrier.wait()
            total = [sum(column) for column in zip(*given)]
            barrier.wait()  # every thread has read the sums before any gives its next values
            return total

        results[i] = jobs[i](sum_fn)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_batch_whiten_split_over_two_processes_equals_the_whole_batch():
    """What the trainer injects: statistics summed over every shard, so each shard's
    whitened values are exactly the whole batch's rows."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=gen, dtype=F64) * 450
    mask = (torch.rand(8, 5, generator=gen) < 0.6).to(F64)
    whole = core.batch_whiten(x, mask)
    shards = [(x[:3], mask[:3]), (x[3:], mask[3:])]
    parts = _all_reducing([partial(lambda a, m, sum_fn: core.batch_whiten(a, m, sum_fn=sum_fn), a, m)
                           for a, m in shards])
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-12, atol=1e-12)
    valid = whole[mask.bool()]
    assert float(valid.mean()) == pytest.approx(0.0, abs=1e-9) and float(valid.std()) == pytest.approx(1.0, abs=1e-6)
    assert torch.all(whole[~mask.bool()] == 0)


def test_batch_whiten_keeps_a_small_spread_around_a_large_mean():
    """Returns of 1000 +- 0.01 in float32 (a reward model's offset): the one-pass sum of
    squares cancelled to a std of 0.03 after whitening; two passes in float64 give 1."""
    gen = torch.Generator().manual_seed(2)
    x = (1000 + 0.01 * torch.randn(512, 512, generator=gen)).float()
    mask = torch.ones_like(x)
    whitened = core.batch_whiten(x, mask)
    assert whitened.dtype == torch.float32
    assert float(whitened.double().std()) == pytest.approx(1.0, abs=1e-2)


def test_batch_whiten_ignores_what_lies_under_the_mask_an_infinite_value_too():
    x = torch.tensor([[1.0, 2.0, math.inf], [3.0, -math.inf, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    clean = core.batch_whiten(torch.where(mask.bool(), x, 0.0), mask)
    assert torch.equal(core.batch_whiten(x, mask), clean) and torch.isfinite(clean).all()  # it was all NaN


def test_gae_on_a_shard_with_one_valid_token_leans_on_the_batch_wide_whiten():
    """A worker may hold a single valid token of the batch: the estimator must not whiten
    locally (an unbiased variance of one value is undefined), only through `whiten`."""
    token = torch.tensor([[0.0, 4.5]], dtype=F64)
    mask = torch.tensor([[0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.0, 0.5]], dtype=F64)
    adv, ret = get_adv_estimator("gae")(AdvantageInputs(token_rewards=token, mask=mask, group_ids=torch.tensor([0]),
                                                        values=values, whiten=lambda x, m: x * 10))
    assert ret.tolist() == [[0.0, 4.5]] and adv.tolist() == [[0.0, 40.0]]  # raw advantage 4.5 - 0.5, then x10
