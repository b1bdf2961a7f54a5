"""Tests for distflow.algos.core.

Each function gets (a) a hand-computed case with literal expected numbers and
(b) a naive per-element Python reference compared on random inputs. Rewards in
hand cases use magnitudes (4.5 / 45 / 450 ...) that expose cross-group mixing.
"""

from __future__ import annotations

import math

import pytest
import torch

from distflow.algos import core
from distflow.algos.core import (
    batch_whiten,
    POLICY_LOSSES,
    agg_loss,
    compute_dr_grpo_advantage,
    compute_gae_advantage,
    compute_grpo_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_rloo_advantage,
    entropy_from_logits,
    get_policy_loss,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    overlong_reward_penalty,
    policy_loss_gspo,
    policy_loss_vanilla,
    register_policy_loss,
    token_level_rewards,
    value_loss_clipped,
)
from distflow.algos.kl import kl_penalty

F64 = torch.float64
SHAPES = [(2, 1), (3, 5), (6, 7), (11, 16)]
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    """assert_close with a tight rtol, so e.g. a dropped eps of 1e-6 on 450 shows."""
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-7)


# ---------------------------------------------------------------- random inputs


def rand_mask(B: int, T: int, gen: torch.Generator, p: float = 0.6) -> torch.Tensor:
    """Random (B, T) bool mask with holes and at least one valid token per row."""
    mask = torch.rand(B, T, generator=gen) < p
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=gen)] = True
    return mask


def rand_groups(B: int, gen: torch.Generator) -> torch.Tensor:
    """Unsorted, non-contiguous int64 ids; small pools so singletons and big groups both occur."""
    return torch.randint(0, max(1, B // 2), (B,), generator=gen) * 7 + 100


def make_gen(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- naive references


def naive_group_stats(r: list[float], g: list[int], i: int) -> tuple[list[float], float]:
    members = [r[j] for j in range(len(r)) if g[j] == g[i]]
    return members, sum(members) / len(members)


def naive_grpo(rewards, mask, gids, norm_by_std=True, eps=1e-6) -> torch.Tensor:
    r, g, m = rewards.tolist(), gids.tolist(), mask.float().tolist()
    out = []
    for i in range(len(r)):
        members, mean = naive_group_stats(r, g, i)
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        score = (r[i] - mean) / (std + eps) if norm_by_std else r[i] - mean
        out.append([score * mk for mk in m[i]])
    return torch.tensor(out, dtype=F64)


def naive_rloo(rewards, mask, gids) -> torch.Tensor:
    r, g, m = rewards.tolist(), gids.tolist(), mask.float().tolist()
    out = []
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if g[j] == g[i] and j != i]
        score = r[i] - sum(others) / len(others) if others else 0.0
        out.append([score * mk for mk in m[i]])
    return torch.tensor(out, dtype=F64)


def naive_whiten(x: list[list[float]], m: list[list[float]]) -> list[list[float]]:
    vals = [v for row, mrow in zip(x, m) for v, mk in zip(row, mrow) if mk]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) if mk else 0.0 for v, mk in zip(row, mrow)] for row, mrow in zip(x, m)]


def naive_returns(token_rewards, mask, gamma) -> list[list[float]]:
    out = []
    for rrow, mrow in zip(token_rewards.tolist(), mask.float().tolist()):
        running, row = 0.0, [0.0] * len(rrow)
        for t in reversed(range(len(rrow))):
            if mrow[t]:
                running = rrow[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def naive_gae(token_rewards, values, mask, gamma, lam) -> tuple[list[list[float]], list[list[float]]]:
    """GAE on the compressed sequence of valid positions only."""
    advs, rets = [], []
    for rrow, vrow, mrow in zip(token_rewards.tolist(), values.tolist(), mask.float().tolist()):
        idx = [t for t in range(len(mrow)) if mrow[t]]
        adv_row, ret_row = [0.0] * len(mrow), [0.0] * len(mrow)
        next_v, next_a = 0.0, 0.0
        for t in reversed(idx):
            delta = rrow[t] + gamma * next_v - vrow[t]
            next_a = delta + gamma * lam * next_a
            next_v = vrow[t]
            adv_row[t], ret_row[t] = next_a, next_a + vrow[t]
        advs.append(adv_row)
        rets.append(ret_row)
    return advs, rets


def naive_agg(loss, mask, mode, num_tokens=None, num_seqs=None, norm_len=None) -> float:
    L, M = loss.tolist(), mask.float().tolist()
    rows = [[lv for lv, mk in zip(lr, mr) if mk] for lr, mr in zip(L, M)]
    rows_nonempty = [r for r in rows if r]
    n_tok = num_tokens if num_tokens is not None else sum(len(r) for r in rows)
    n_seq = num_seqs if num_seqs is not None else len(rows_nonempty)
    total = sum(sum(r) for r in rows)
    if mode == "token-mean":
        return total / n_tok
    if mode == "seq-mean-token-sum":
        return total / n_seq
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows_nonempty) / n_seq
    return total / (n_seq * (norm_len or len(L[0])))


def naive_vanilla(old, new, adv, mask, low, high, c) -> tuple[list[list[float]], float, float, float]:
    per_tok, n_valid, n_clip, n_lower, kl = [], 0, 0, 0, 0.0
    for orow, nrow, arow, mrow in zip(old.tolist(), new.tolist(), adv.tolist(), mask.float().tolist()):
        row = []
        for o, n, a, mk in zip(orow, nrow, arow, mrow):
            ratio = math.exp(n - o)
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
            best = max(l1, l2)
            val = min(best, -a * c) if a < 0 else best
            row.append(val)
            if mk:
                n_valid += 1
                n_clip += l2 > l1
                n_lower += a < 0 and best > -a * c
                kl += o - n
        per_tok.append(row)
    return per_tok, n_clip / n_valid, n_lower / n_valid, kl / n_valid


# ---------------------------------------------------------------- registries


def test_policy_loss_registry_holds_the_documented_names():
    assert set(POLICY_LOSSES) == {"vanilla", "gspo"}
    assert get_policy_loss("vanilla") is policy_loss_vanilla
    assert get_policy_loss("gspo") is policy_loss_gspo
    with pytest.raises(ValueError, match=r"'cispo'.*'gspo'.*'vanilla'"):
        get_policy_loss("cispo")


def test_register_policy_loss_rejects_a_conflicting_duplicate():
    def mine(*args, **kwargs):
        return None

    def other(*args, **kwargs):
        return None

    try:
        assert register_policy_loss("tmp_loss")(mine) is mine
        register_policy_loss("tmp_loss")(mine)  # same function again is harmless
        with pytest.raises(ValueError, match="tmp_loss"):
            register_policy_loss("tmp_loss")(other)
        assert get_policy_loss("tmp_loss") is mine
    finally:
        POLICY_LOSSES.pop("tmp_loss", None)


# ---------------------------------------------------------------- masked helpers


def test_masked_helpers_hand_values_ignore_inf_padding():
    x = torch.tensor([[1.0, 2.0, math.inf], [10.0, 20.0, 30.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    close(masked_sum(x, mask), 53.0)
    close(masked_sum(x, mask, dim=-1), [3.0, 50.0])
    close(masked_mean(x, mask), 13.25)
    close(masked_mean(x, mask, dim=-1), [1.5, 25.0])
    w = batch_whiten(x, mask)
    close(w[mask.bool()], [-0.8642275496258489, -0.7936783619012898, 0.4762070171407739, 1.1816988943863649])
    assert torch.equal(w[~mask.bool()], torch.zeros(2, dtype=F64))


def test_masked_mean_of_empty_row_is_zero_and_one_token_whitens_to_zero():
    x = torch.tensor([[5.0, 7.0]])
    close(masked_mean(x, torch.tensor([[0, 0]]), dim=-1), [0.0])
    close(batch_whiten(x, torch.tensor([[0, 1]])), [[0.0, 0.0]])


@pytest.mark.parametrize("B,T", SHAPES)
def test_batch_whiten_matches_naive(B, T):
    gen = make_gen(B * 100 + T)
    x, mask = torch.randn(B, T, generator=gen, dtype=F64) * 30, rand_mask(B, T, gen)
    expected = naive_whiten(x.tolist(), mask.float().tolist())
    close(batch_whiten(x, mask), expected)
    valid = [v for row, mrow in zip(x.tolist(), mask.tolist()) for v, mk in zip(row, mrow) if mk]
    close(masked_mean(x, mask.float()), sum(valid) / len(valid))


# ---------------------------------------------------------------- GRPO / Dr.GRPO

# Groups: 7 -> rows 0,2,4 rewards (1, 2, 6); 3 -> rows 1,3 rewards (40, 50); 9 -> row 5 alone (450).
HAND_REWARDS = torch.tensor([1.0, 40.0, 2.0, 50.0, 6.0, 450.0], dtype=F64)
HAND_GIDS = torch.tensor([7, 3, 7, 3, 7, 9])
HAND_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 1], [1, 1, 0]])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.float64])
def test_grpo_hand_values(mask_dtype):
    mask = HAND_MASK.to(mask_dtype)
    adv, ret = compute_grpo_advantage(HAND_REWARDS, mask, HAND_GIDS)
    # group 7: mean 3, unbiased std sqrt(7); group 3: mean 45, std sqrt(50);
    # singleton 450: mean 0, std 1 -> 450 / (1 + 1e-6).
    scores = [-0.7559286603042766, -0.7071066811865616, -0.3779643301521383,
              0.7071066811865616, 1.133892990456415, 449.99955000045003]
    close(adv, [[s * m for m in row] for s, row in zip(scores, HAND_MASK.tolist())], atol=1e-5)
    assert torch.equal(adv, ret)


def test_dr_grpo_hand_values():
    adv, _ = compute_dr_grpo_advantage(HAND_REWARDS, HAND_MASK, HAND_GIDS)
    close(adv[:, 0], [-2.0, -5.0, -1.0, 5.0, 3.0, 450.0])
    adv2, _ = compute_grpo_advantage(rewards=HAND_REWARDS, mask=HAND_MASK, group_ids=HAND_GIDS, norm_by_std=False)
    assert torch.equal(adv, adv2)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_naive(B, T, norm_by_std):
    gen = make_gen(B * 10 + T)
    rewards = torch.randn(B, generator=gen, dtype=F64) * 50
    mask, gids = rand_mask(B, T, gen), rand_groups(B, gen)
    adv, _ = compute_grpo_advantage(rewards, mask, gids, norm_by_std=norm_by_std)
    close(adv, naive_grpo(rewards, mask, gids, norm_by_std), atol=1e-9)


@pytest.mark.parametrize("reward", [1.1, 0.7, 9.306941986083984, -3.3])
@pytest.mark.parametrize("n", [6, 16, 64])
def test_a_group_of_identical_float32_rewards_has_no_advantage(reward, n):
    # float32 group sums miss the mean by an ulp; divided by a std of an ulp that gave up to 0.9
    rewards = torch.full((n,), reward, dtype=torch.float32)
    for fn in (compute_grpo_advantage, compute_rloo_advantage):
        adv, _ = fn(rewards, torch.ones(n, 3), torch.zeros(n, dtype=torch.long))
        assert adv.dtype == torch.float32 and torch.equal(adv, torch.zeros(n, 3)), fn.__name__


def test_grpo_int_rewards_and_bad_shapes():
    adv, _ = compute_grpo_advantage(torch.tensor([1, 3]), torch.ones(2, 2), torch.tensor([5, 5]))
    assert adv.is_floating_point()
    close(adv[:, 0], [-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)])
    with pytest.raises(ValueError, match=r"\(3,\)"):
        compute_grpo_advantage(torch.zeros(2), torch.ones(2, 2), torch.tensor([1, 2, 3]))


# ---------------------------------------------------------------- RLOO


def test_rloo_hand_values():
    adv, ret = compute_rloo_advantage(HAND_REWARDS, HAND_MASK, HAND_GIDS)
    # row0: 1 - (2+6)/2; row2: 2 - (1+6)/2; row4: 6 - (1+2)/2; group 3: +-10; singleton: 0.
    close(adv[:, 0], [-3.0, -10.0, -1.5, 10.0, 4.5, 0.0])
    close(adv[4], [4.5, 0.0, 4.5])
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("B,T", SHAPES)
def test_rloo_matches_naive(B, T):
    gen = make_gen(B * 7 + T)
    rewards = torch.randn(B, generator=gen, dtype=F64) * 50
    mask, gids = rand_mask(B, T, gen), rand_groups(B, gen)
    adv, _ = compute_rloo_advantage(rewards, mask, gids)
    close(adv, naive_rloo(rewards, mask, gids), atol=1e-9)


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand_values_with_masked_hole():
    token_r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 99.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = compute_reinforce_plus_plus_advantage(token_r, mask, gamma=0.5)
    # The masked 99 is ignored and the hole costs no discount step: row2 t0 = 0.5 * 4.
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0], [2.0, 0.0, 4.0]])
    # whitened over the 7 valid returns (mean 1.5357142857, unbiased var 1.6339285714)
    close(adv, [[-1.0058377581308293, -0.8102581940498347, -0.41909906588784557],
                [-0.41909906588784557, 0.3632191904361327, 0.0],
                [0.3632191904361327, 0.0, 1.9278557030840895]])


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_naive(B, T, gamma):
    gen = make_gen(B * 3 + T)
    token_r, mask = torch.randn(B, T, generator=gen, dtype=F64), rand_mask(B, T, gen)
    adv, ret = compute_reinforce_plus_plus_advantage(token_r, mask, gamma=gamma)
    expected_ret = naive_returns(token_r, mask, gamma)
    close(ret, expected_ret, atol=1e-9)
    close(adv, naive_whiten(expected_ret, mask.float().tolist()), atol=1e-9)


def test_reinforce_pp_baseline_hand_values():
    rewards = torch.tensor([4.5, 45.0, 5.5, 55.0], dtype=F64)
    gids = torch.tensor([7, 3, 7, 3])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
    adv, ret = compute_reinforce_plus_plus_baseline_advantage(rewards, mask, gids)
    # centred: -0.5 (x3 tokens), -5, +0.5 (x2 tokens), +5; whitened over those 7 tokens.
    a, b, c, d = -0.14669093597779653, -1.68694576374466, 0.19558791463706202, 1.7358427424039253
    close(adv, [[a, a, a], [b, 0.0, 0.0], [c, c, 0.0], [d, 0.0, 0.0]])
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("B,T", SHAPES)
def test_reinforce_pp_baseline_matches_naive(B, T):
    gen = make_gen(B * 5 + T)
    rewards = torch.randn(B, generator=gen, dtype=F64) * 50
    mask, gids = rand_mask(B, T, gen), rand_groups(B, gen)
    centred = naive_grpo(rewards, mask, gids, norm_by_std=False).tolist()
    adv, _ = compute_reinforce_plus_plus_baseline_advantage(rewards, mask, gids)
    close(adv, naive_whiten(centred, mask.float().tolist()), atol=1e-9)


# ---------------------------------------------------------------- GAE


def test_gae_hand_values():
    token_r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.2, 0.4], [1.0, 3.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_gae_advantage(token_r, values, mask, gamma=0.9, lam=0.5)
    # row0 deltas (-0.32, 0.16, 0.6) -> raw adv (-0.1265, 0.43, 0.6);
    # row1: the padded value 100 is never bootstrapped from -> raw adv (1.25, -1.0).
    close(ret, [[0.3735, 0.63, 1.0], [2.25, 2.0, 0.0]])
    close(adv, [[-0.42263386885607007, 0.2358088747564802, 0.4369504136857409],
                [1.2060210037093844, -1.456146423295536, 0.0]])


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0)])
def test_gae_matches_naive(B, T, gamma, lam):
    gen = make_gen(B * 11 + T)
    token_r, values = torch.randn(B, T, generator=gen, dtype=F64), torch.randn(B, T, generator=gen, dtype=F64)
    mask = rand_mask(B, T, gen)
    adv, ret = compute_gae_advantage(token_r, values, mask, gamma=gamma, lam=lam)
    raw, expected_ret = naive_gae(token_r, values, mask, gamma, lam)
    close(ret, expected_ret, atol=1e-9)
    close(adv, naive_whiten(raw, mask.float().tolist()), atol=1e-9)


# ---------------------------------------------------------------- agg_loss

AGG_LOSS = torch.tensor([[1.0, 2.0, 1000.0, 1000.0], [10.0, 20.0, 30.0, 1000.0]], dtype=F64)
AGG_MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 12.6),             # 63 / 5 tokens
    ("seq-mean-token-sum", 31.5),     # (3 + 60) / 2
    ("seq-mean-token-mean", 10.75),   # (1.5 + 20) / 2
    ("seq-mean-token-sum-norm", 7.875),  # 63 / (2 * 4)
])
def test_agg_loss_hand_values(mode, expected):
    close(agg_loss(AGG_LOSS, AGG_MASK, mode), expected)


def test_agg_loss_norm_len_padding_rows_and_errors():
    close(agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", norm_len=10), 3.15)
    # An all-masked padding row must not count as a sequence.
    padded_loss = torch.cat([AGG_LOSS, torch.full((1, 4), 7.0, dtype=F64)])
    padded_mask = torch.cat([AGG_MASK, torch.zeros(1, 4, dtype=AGG_MASK.dtype)])
    close(agg_loss(padded_loss, padded_mask, "seq-mean-token-mean"), 10.75)
    close(agg_loss(AGG_LOSS, AGG_MASK, "token-mean", global_num_tokens=20), 3.15)
    close(agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum", global_num_seqs=6), 10.5)
    with pytest.raises(ValueError, match="'seq-sum'"):
        agg_loss(AGG_LOSS, AGG_MASK, "seq-sum")
    with pytest.raises(ValueError, match="global_num_tokens.*0"):
        agg_loss(AGG_LOSS, AGG_MASK, "token-mean", global_num_tokens=0)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_naive(B, T, mode):
    gen = make_gen(B * 13 + T)
    loss, mask = torch.randn(B, T, generator=gen, dtype=F64), rand_mask(B, T, gen)
    close(agg_loss(loss, mask.float(), mode), naive_agg(loss, mask, mode), atol=1e-9)


def shard_rows(B: int) -> list[slice]:
    cuts = [0, B // 3, (2 * B) // 3 + 1, B]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_shard_sum_equals_full_batch(mode):
    gen = make_gen(42)
    B, T = 10, 6
    loss = torch.randn(B, T, generator=gen, dtype=F64, requires_grad=True)
    mask = rand_mask(B, T, gen)
    full = agg_loss(loss, mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss)
    counts = dict(global_num_tokens=float(mask.sum()), global_num_seqs=float(B))
    parts = [agg_loss(loss[s], mask[s], mode, norm_len=T, **counts) for s in shard_rows(B)]
    assert len(parts) == 3
    total = sum(parts)
    (shard_grad,) = torch.autograd.grad(total, loss)
    close(total, full.item(), atol=1e-12)
    close(shard_grad, full_grad, atol=1e-12)
    # Without global counts each shard normalises locally, which is not the same.
    local_total = sum(agg_loss(loss[s], mask[s], mode) for s in shard_rows(B))
    assert not torch.isclose(local_total, full)


def test_policy_and_value_losses_forward_global_counts_to_agg():
    gen = make_gen(7)
    B, T = 9, 5
    old, new = torch.randn(B, T, generator=gen, dtype=F64) * 0.3, torch.randn(B, T, generator=gen, dtype=F64) * 0.3
    adv, mask = torch.randn(B, T, generator=gen, dtype=F64), rand_mask(B, T, gen)
    counts = dict(global_num_tokens=float(mask.sum()), global_num_seqs=float(B))
    for fn in (policy_loss_vanilla, policy_loss_gspo):
        for mode in ("token-mean", "seq-mean-token-mean"):
            full = fn(old, new, adv, mask, loss_agg_mode=mode).loss
            parts = sum(fn(old[s], new[s], adv[s], mask[s], loss_agg_mode=mode, **counts).loss for s in shard_rows(B))
            close(parts, full.item(), atol=1e-12)
    full_v, _ = value_loss_clipped(new, old, adv, mask, 0.1)
    parts_v = sum(value_loss_clipped(new[s], old[s], adv[s], mask[s], 0.1, **counts)[0] for s in shard_rows(B))
    close(parts_v, full_v.item(), atol=1e-12)


# ---------------------------------------------------------------- vanilla PPO


def vanilla_hand_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ratios = [1.5, 0.5, 0.5, 5.0, 1.1, 10.0]
    new = torch.tensor([[math.log(r) for r in ratios]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 6, dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -2.0, -2.0, 1.0, 1000.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    return old, new, adv, mask


def test_vanilla_hand_values_clip_fractions_and_dual_clip():
    old, new, adv, mask = vanilla_hand_inputs()
    out = policy_loss_vanilla(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0)
    # per-token: t0 clipped at 1.3 -> -1.3; t1 unclipped -0.5; t2 clipped at 0.8 -> 1.6;
    # t3 ratio 5: max(10, 2.6) = 10 capped by dual clip 3 * 2 = 6; t4 -1.1; t5 masked.
    close(out.loss, (-1.3 - 0.5 + 1.6 + 6.0 - 1.1) / 5)
    close(out.clip_frac, 0.4)        # t0, t2
    close(out.clip_frac_lower, 0.2)  # t3
    close(out.approx_kl, -0.1447837678453398)
    out.loss.backward()
    # Only unclipped tokens carry gradient -adv * ratio / 5; the dual-clipped t3 has none.
    close(new.grad, [[0.0, -0.1, 0.0, 0.0, -0.22, 0.0]])


def test_vanilla_without_dual_clip_bound_would_differ():
    old, new, adv, mask = vanilla_hand_inputs()
    low_c = policy_loss_vanilla(old, new, adv, mask, clip_ratio_high=0.3, clip_ratio_c=1.5).loss
    # t3 now capped at 1.5 * 2 = 3 and t2 (1.6) at min(1.6, 3) = 1.6.
    close(low_c, (-1.3 - 0.5 + 1.6 + 3.0 - 1.1) / 5)


def test_vanilla_validates_clip_args():
    old, new, adv, mask = vanilla_hand_inputs()
    with pytest.raises(ValueError, match="clip_ratio_c.*1.0"):
        policy_loss_vanilla(old, new, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low.*1.5"):
        policy_loss_vanilla(old, new, adv, mask, clip_ratio_low=1.5)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_vanilla_matches_naive(B, T, mode):
    gen = make_gen(B * 17 + T)
    old = torch.randn(B, T, generator=gen, dtype=F64) * 0.5
    new = old + torch.randn(B, T, generator=gen, dtype=F64) * 0.6
    adv, mask = torch.randn(B, T, generator=gen, dtype=F64) * 2, rand_mask(B, T, gen)
    out = policy_loss_vanilla(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                              clip_ratio_c=2.0, loss_agg_mode=mode)
    per_tok, frac, frac_lower, kl = naive_vanilla(old, new, adv, mask, 0.2, 0.28, 2.0)
    close(out.loss, naive_agg(torch.tensor(per_tok, dtype=F64), mask, mode), atol=1e-9)
    close(out.clip_frac, frac, atol=1e-9)
    close(out.clip_frac_lower, frac_lower, atol=1e-9)
    close(out.approx_kl, kl, atol=1e-9)


# ---------------------------------------------------------------- GSPO


def test_gspo_hand_values_and_token_gradient():
    old = torch.zeros(2, 3, dtype=F64)
    new = torch.tensor([[0.1, 0.2, 0.3], [-0.5, -0.1, 99.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = policy_loss_gspo(old, new, adv, mask)
    # seq0: s = e^0.2 = 1.2214 > 1.2 -> clipped, -1.2; seq1: s = e^-0.3 = 0.7408, -3 s.
    close(out.loss, -1.711227331022577)
    close(out.clip_frac, 0.6)  # the 3 tokens of seq0
    close(out.clip_frac_lower, 0.0)
    close(out.approx_kl, 0.0)  # valid log-ratios sum to 0; the masked 99 is excluded
    out.loss.backward()
    g = -0.5556136655112884  # (1/2 seqs) * (1/2 tokens) * (-3 * e^-0.3)
    close(new.grad, [[0.0, 0.0, 0.0], [g, g, 0.0]])


def seq_form_gspo(old, new, adv_seq, mask, low, high) -> torch.Tensor:
    """Literal GSPO objective: per-sequence ratio with full gradient, seq-mean."""
    terms = []
    for i in range(new.shape[0]):
        idx = mask[i].nonzero().flatten()
        s = torch.exp((new[i, idx] - old[i, idx]).mean())
        terms.append(torch.maximum(-adv_seq[i] * s, -adv_seq[i] * s.clamp(1 - low, 1 + high)))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("B,T", SHAPES)
def test_gspo_equals_sequence_form_in_value_and_gradient(B, T):
    gen = make_gen(B * 19 + T)
    old = torch.randn(B, T, generator=gen, dtype=F64)
    new = (old + torch.randn(B, T, generator=gen, dtype=F64) * 0.3).requires_grad_(True)
    adv_seq = torch.randn(B, generator=gen, dtype=F64)
    mask = rand_mask(B, T, gen)
    out = policy_loss_gspo(old, new, adv_seq.unsqueeze(-1).expand(B, T), mask)
    (grad,) = torch.autograd.grad(out.loss, new)
    ref = seq_form_gspo(old, new, adv_seq, mask, 0.2, 0.2)
    (ref_grad,) = torch.autograd.grad(ref, new)
    close(out.loss, ref.item(), atol=1e-12)
    close(grad, ref_grad, atol=1e-12)
    assert grad.abs().sum() > 0
    assert torch.all(grad[~mask] == 0)


@pytest.mark.parametrize("B,T", SHAPES)
def test_gspo_per_token_advantages_match_naive(B, T):
    gen = make_gen(B * 23 + T)
    old = torch.randn(B, T, generator=gen, dtype=F64)
    new = (old + torch.randn(B, T, generator=gen, dtype=F64) * 0.3).requires_grad_(True)
    adv, mask = torch.randn(B, T, generator=gen, dtype=F64), rand_mask(B, T, gen)
    out = policy_loss_gspo(old, new, adv, mask, clip_ratio_high=0.1)
    out.loss.backward()
    M = mask.float().tolist()
    n_seqs, loss, grad, n_clip = len(M), 0.0, [[0.0] * T for _ in range(B)], 0
    for i in range(B):
        idx = [t for t in range(T) if M[i][t]]
        s = math.exp(sum(new[i, t].item() - old[i, t].item() for t in idx) / len(idx))
        for t in idx:
            a = adv[i, t].item()
            l1, l2 = -a * s, -a * min(max(s, 0.8), 1.1)
            loss += max(l1, l2) / len(idx) / n_seqs
            grad[i][t] = (-a * s if l1 >= l2 else 0.0) / len(idx) / n_seqs
            n_clip += l2 > l1
    close(out.loss, loss, atol=1e-9)
    close(new.grad, grad, atol=1e-9)
    close(out.clip_frac, n_clip / sum(map(sum, M)), atol=1e-9)


# ---------------------------------------------------------------- KL penalty


def test_kl_penalty_hand_values():
    logp = torch.tensor([[0.0, -1.0]], dtype=F64)
    ref = torch.tensor([[-1.0, 0.5]], dtype=F64)
    close(kl_penalty(logp, ref, "k1"), [[1.0, -1.5]])
    close(kl_penalty(logp, ref, "k2"), [[0.5, 1.125]])
    close(kl_penalty(logp, ref, "abs"), [[1.0, 1.5]])
    k3 = [[0.36787944117144233, 1.9816890703380645]]  # e^-1 + 1 - 1, e^1.5 - 1.5 - 1
    close(kl_penalty(logp, ref, "k3"), k3)
    close(kl_penalty(logp, ref, "low_var_kl"), k3)
    # e^15 - 16 would be ~3.3e6; verl clamps to 10.
    close(kl_penalty(torch.tensor([[-15.0]]), torch.tensor([[0.0]]), "k3"), [[10.0]])


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; registered: k1, .*low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


@pytest.mark.parametrize("kind", ["k1+", "k3+", "low_var_kl+", "abs+"])
def test_a_straight_through_kl_has_its_estimator_s_value_and_k2_s_gradient(kind):
    gen = make_gen(5)
    logp = (torch.randn(3, 4, generator=gen, dtype=F64)).requires_grad_()
    ref = torch.randn(3, 4, generator=gen, dtype=F64)
    value = kl_penalty(logp, ref, kind)
    close(value.detach(), kl_penalty(logp.detach(), ref, kind[:-1]))
    value.sum().backward()
    close(logp.grad, logp.detach() - ref)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_penalty_matches_naive(kind):
    gen = make_gen(3)
    logp, ref = torch.randn(4, 9, generator=gen, dtype=F64) * 2, torch.randn(4, 9, generator=gen, dtype=F64) * 2
    naive = {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: min(10.0, math.exp(b - a) - (b - a) - 1),
        "abs": lambda a, b: abs(a - b),
    }[kind]
    expected = [[naive(a, b) for a, b in zip(ra, rb)] for ra, rb in zip(logp.tolist(), ref.tolist())]
    close(kl_penalty(logp, ref, kind), expected, atol=1e-9)


# ---------------------------------------------------------------- entropy / log-probs


def naive_log_softmax(row: list[float]) -> list[float]:
    mx = max(row)
    lse = mx + math.log(sum(math.exp(v - mx) for v in row))
    return [v - lse for v in row]


def test_entropy_hand_values():
    ln2 = math.log(2.0)
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, ln2, 0.0]],
                           [[0.0, 0.0, -math.inf], [1000.0, 0.0, 0.0]]], dtype=F64)
    close(entropy_from_logits(logits), [[1.0986122886681098, 1.0397207708399179], [ln2, 0.0]])


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 3, 5), (3, 4, 11)])
def test_entropy_matches_naive(shape):
    gen = make_gen(shape[-1])
    logits = torch.randn(*shape, generator=gen, dtype=F64) * 4
    expected = [[-sum(math.exp(lp) * lp for lp in naive_log_softmax(v)) for v in row] for row in logits.tolist()]
    close(entropy_from_logits(logits), expected, atol=1e-9)


def _autograd_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy as autograd differentiates it: the reference for the gradient."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.where(probs > 0, probs * logits, torch.zeros_like(logits)).sum(-1)


def test_entropy_gradient_is_autograds_and_keeps_only_the_logits():
    gen = make_gen(7)
    logits = (torch.randn(2, 3, 6, generator=gen, dtype=F64) * 3).requires_grad_()
    torch.autograd.gradcheck(entropy_from_logits, (logits,))
    masked = logits.detach().clone()
    masked[0, 1, :4] = -math.inf  # masked vocab: no nan, the gradient there is 0
    masked[1, 2, 1:] = -math.inf  # one token certain: entropy 0, gradient 0
    upstream = torch.randn(2, 3, generator=gen, dtype=F64)
    grads = []
    # autograd's own gradient through -inf is nan: its reference has them at -1e4 (p is 0 there too)
    for fn, x in ((entropy_from_logits, masked), (_autograd_entropy, masked.nan_to_num(neginf=-1e4))):
        x = x.clone().requires_grad_()
        (fn(x) * upstream).sum().backward()
        grads.append(x.grad)
    assert torch.isfinite(grads[0]).all() and grads[0][0, 1, :4].eq(0).all() and grads[0][1, 2].eq(0).all()
    close(grads[0].flatten(1), grads[1].flatten(1).tolist(), atol=1e-12)
    close(entropy_from_logits(masked), _autograd_entropy(masked).tolist(), atol=1e-12)
    # what each keeps for the backward: the logits only, against three more tensors of their size
    kept = {}
    for name, fn in (("ours", entropy_from_logits), ("autograd", _autograd_entropy)):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn(logits)
        kept[name] = sum(sizes)
    assert kept["ours"] == logits.numel() and kept["autograd"] >= 3 * logits.numel()


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_log_probs_from_hidden_is_the_head_then_log_probs_and_entropy_with_their_gradients(chunk):
    """The chunked output head: the same values as the whole logits followed by
    log_probs_from_logits and entropy_from_logits, and gradients that gradcheck confirms
    for the hidden states, the weight and the bias (a temperature; chunks that do not
    divide the rows; one chunk for all)."""
    gen = make_gen(11)
    hidden = torch.randn(9, 5, generator=gen, dtype=F64).requires_grad_()
    weight = torch.randn(13, 5, generator=gen, dtype=F64).requires_grad_()
    bias = torch.randn(13, generator=gen, dtype=F64).requires_grad_()
    labels = torch.randint(0, 13, (9,), generator=gen)
    log_probs, entropy = core.log_probs_from_hidden(hidden, weight, bias, labels, 0.6, chunk, True)
    logits = torch.nn.functional.linear(hidden, weight, bias) / 0.6
    close(log_probs, log_probs_from_logits(logits, labels).tolist(), atol=1e-12)
    close(entropy, entropy_from_logits(logits).tolist(), atol=1e-12)
    torch.autograd.gradcheck(lambda h, w, b: core.log_probs_from_hidden(h, w, b, labels, 0.6, chunk, True),
                             (hidden, weight, bias))
    torch.autograd.gradcheck(lambda h, w: core.log_probs_from_hidden(h, w, None, labels, 1.0, chunk, False)[0],
                             (hidden, weight))


def test_log_probs_hand_values():
    ln2 = math.log(2.0)
    logits = torch.tensor([[[0.0, ln2, 0.0], [0.0, ln2, 0.0], [1000.0, 0.0, 0.0], [1000.0, 0.0, 0.0]]], dtype=F64)
    labels = torch.tensor([[1, 0, 0, 2]])
    close(log_probs_from_logits(logits, labels), [[-ln2, -2 * ln2, 0.0, -1000.0]])


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 3, 5), (3, 4, 11)])
def test_log_probs_matches_naive(shape):
    gen = make_gen(shape[-1] + 1)
    logits = torch.randn(*shape, generator=gen, dtype=F64) * 4
    labels = torch.randint(0, shape[-1], shape[:2], generator=gen)
    expected = [[naive_log_softmax(v)[lab] for v, lab in zip(row, lrow)]
                for row, lrow in zip(logits.tolist(), labels.tolist())]
    close(log_probs_from_logits(logits, labels), expected, atol=1e-9)


def test_log_probs_bf16_is_upcast():
    gen = make_gen(5)
    logits = (torch.randn(2, 3, 2000, generator=gen) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 2000, (2, 3), generator=gen)
    got = log_probs_from_logits(logits, labels)
    assert got.dtype == torch.bfloat16
    ref = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.double(), ref, atol=0.05, rtol=0.01)


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 5.0, 2.0, 1.2]], dtype=F64)
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=F64)
    returns = torch.tensor([[3.0, 0.0, 2.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, frac = value_loss_clipped(values, old, returns, mask, 0.5)
    # per token max: 4, 25 (unclipped wins), 0.25 (clipped 1.5 vs 2 wins), masked -> 0.5 * 29.25 / 3
    close(loss, 4.875)
    close(frac, 1 / 3)
    close(value_loss_clipped(values, old, returns, mask, 0.5, loss_agg_mode="seq-mean-token-sum")[0], 14.625)


@pytest.mark.parametrize("B,T", SHAPES)
def test_value_loss_matches_naive(B, T):
    gen = make_gen(B * 29 + T)
    values, old = torch.randn(B, T, generator=gen, dtype=F64), torch.randn(B, T, generator=gen, dtype=F64)
    returns, mask = torch.randn(B, T, generator=gen, dtype=F64), rand_mask(B, T, gen)
    c = 0.3
    per_tok, n_clip = [], 0
    for vr, orow, rr, mr in zip(values.tolist(), old.tolist(), returns.tolist(), mask.tolist()):
        row = []
        for v, o, r, mk in zip(vr, orow, rr, mr):
            l1, l2 = (v - r) ** 2, (min(max(v, o - c), o + c) - r) ** 2
            row.append(0.5 * max(l1, l2))
            n_clip += mk and l2 > l1
        per_tok.append(row)
    loss, frac = value_loss_clipped(values, old, returns, mask, c)
    close(loss, naive_agg(torch.tensor(per_tok, dtype=F64), mask, "token-mean"), atol=1e-9)
    close(frac, n_clip / int(mask.sum()), atol=1e-9)


# ---------------------------------------------------------------- reward shaping


def test_overlong_penalty_hand_values():
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    out = overlong_reward_penalty(lengths, max_response_length=20, buffer_length=5, penalty_factor=2.0)
    close(out, [0.0, 0.0, -0.4, -1.2, -2.0, -2.0])
    with pytest.raises(ValueError, match="got 0"):
        overlong_reward_penalty(lengths, 20, 0)
    with pytest.raises(ValueError, match="got 30"):
        overlong_reward_penalty(lengths, 20, 30)


def test_overlong_penalty_matches_naive():
    gen = make_gen(11)
    lengths = torch.randint(0, 600, (50,), generator=gen)

    def naive(n: int) -> float:
        if n <= 400:
            return 0.0
        if n >= 512:
            return -0.7
        return -0.7 * (n - 400) / 112

    close(overlong_reward_penalty(lengths, 512, 112, 0.7), [naive(n) for n in lengths.tolist()], atol=1e-6)


def test_token_level_rewards_hand_values():
    rewards = torch.tensor([4.5, 45.0, 450.0, 4500.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    close(token_level_rewards(rewards, mask), [[0, 4.5, 0, 0], [0, 0, 0, 45.0], [0, 0, 450.0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("B,T", SHAPES)
def test_token_level_rewards_matches_naive(B, T):
    gen = make_gen(B * 31 + T)
    rewards, mask = torch.randn(B, generator=gen, dtype=F64), rand_mask(B, T, gen).float()
    expected = [[0.0] * T for _ in range(B)]
    for i, row in enumerate(mask.tolist()):
        expected[i][max(t for t in range(T) if row[t])] = rewards[i].item()
    close(token_level_rewards(rewards, mask), expected)


def test_module_has_no_other_distflow_imports():
    src = open(core.__file__).read()
    assert "import distflow" not in src and "from distflow" not in src


def test_token_sum_adds_every_valid_token_and_shards_add_up():
    loss = torch.tensor([[4.5, 2.0], [45.0, 450.0]], dtype=F64)
    mask = torch.tensor([[1, 0], [1, 1]])
    close(agg_loss(loss, mask, "token-sum"), 499.5)
    # two shards' losses add up to the whole batch's, with no normaliser to agree on
    close(agg_loss(loss[:1], mask[:1], "token-sum") + agg_loss(loss[1:], mask[1:], "token-sum"), 499.5)
