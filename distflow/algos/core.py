"""Core RL-for-LLM tensor math: advantage estimators, policy/value losses, KL.

Everything here is a pure function of tensors, so it can be unit-tested on CPU
and reused unchanged by any trainer or worker.

Shape conventions (B = batch of responses, T = response length, V = vocab):

* ``mask``: float or bool ``(B, T)``; 1 marks a real response token. Masked
  positions may hold garbage (padding, tool-observation tokens) and never
  influence a result.
* ``log_probs``, ``old_log_probs``, ``ref_log_probs``, ``advantages``,
  ``values``, ``token_rewards``: float ``(B, T)``.
* ``rewards``: one scalar per response, ``(B,)``.
* ``group_ids``: int ``(B,)``; responses sharing an id are the n samples of one
  prompt. Ids need not be sorted or contiguous.

The ``compute_*_advantage`` functions are the estimators' math, each with the
arguments it needs; ``estimators.py`` calls every one of them through one
registry signature. Policy losses share the signature of
:func:`policy_loss_vanilla` and return a :class:`PolicyLossOutput`; KL
estimators share ``(log_probs, ref_log_probs) -> (B, T)``. Both are selected
by name through registries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "POLICY_LOSSES",
    "AGG_LOSS_MODES",
    "PolicyLossOutput",
    "register_policy_loss",
    "get_policy_loss",
    "masked_sum",
    "masked_mean",
    "batch_whiten",
    "compute_grpo_advantage",
    "compute_dr_grpo_advantage",
    "compute_rloo_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_gae_advantage",
    "gae_returns",
    "compute_remax_advantage",
    "discounted_returns",
    "agg_loss",
    "policy_loss_vanilla",
    "policy_loss_gspo",
    "entropy_from_logits",
    "log_probs_from_logits",
    "log_probs_from_hidden",
    "value_loss_clipped",
    "overlong_reward_penalty",
    "token_level_rewards",
]

# Keep exp() of a log-ratio finite; same bounds as verl (GSPO has no dual clip
# to cap the loss, hence its tighter bound).
_LOG_RATIO_CLAMP = 20.0
_GSPO_LOG_RATIO_MAX = 10.0
# Variance floor in whitening, so a constant batch whitens to 0 instead of nan.
_WHITEN_EPS = 1e-8

# --------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------

POLICY_LOSSES: dict[str, Callable] = {}


def register(registry: dict[str, Callable], kind: str, name: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        existing = registry.get(name)
        # Silently replacing an entry would make a config string mean two
        # different algorithms depending on import order.
        if existing is not None and existing is not fn:
            raise ValueError(f"{kind} {name!r} is already registered to {existing.__name__}")
        registry[name] = fn
        return fn

    return decorator


def lookup(registry: dict[str, Callable], kind: str, name: str) -> Callable:
    if name not in registry:
        raise ValueError(f"Unknown {kind} {name!r}; allowed: {sorted(registry)}")
    return registry[name]


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss under ``name``."""
    return register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> Callable:
    """Return the policy loss registered as ``name`` (ValueError if none)."""
    return lookup(POLICY_LOSSES, "policy loss", name)


# --------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x * mask``; masked entries contribute 0 even if they are inf/nan."""
    m = mask.to(x.dtype)
    # where() rather than a bare product: 0 * inf = nan would leak padding in.
    prod = torch.where(mask.bool(), x * m, torch.zeros_like(x))
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is set; 0 when nothing is set."""
    count = mask.to(x.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    # A clamp (not + eps) keeps the result exact for any 0/1 mask.
    return masked_sum(x, mask, dim) / count.clamp(min=_WHITEN_EPS)


Whiten = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x (B, T), mask (B, T)) -> (B, T), 0 where masked


def local_sums(*values: float) -> list[float]:
    """The identity reduction: the statistics of this process's data alone."""
    return list(values)


def batch_whiten(
    x: torch.Tensor, mask: torch.Tensor, sum_fn: Callable[..., list[float]] = local_sums
) -> torch.Tensor:
    """Whiten ``x`` over the valid tokens of the whole batch; 0 on masked positions.

    The batch may be spread over processes: ``sum_fn`` sums numbers over all of them
    (an all-reduce in a distributed run, injected by the caller so that this module
    stays free of collectives), called twice on every process: (sum x, count), then
    the sum of squared deviations from the mean. Two passes in float64: the one-pass
    sum of squares cancels where the mean is large against the spread (a reward
    model's offset). A batch with one valid token has
    variance 0 and whitens to 0.
    """
    valid = mask.bool()
    wide = torch.where(valid, x.to(torch.float64), 0.0)  # a masked position's value never enters (inf * 0 is NaN)
    total, count = sum_fn(float(wide.sum()), float(valid.sum()))
    mean = total / max(count, 1.0)
    (squared_deviations,) = sum_fn(float(torch.where(valid, (wide - mean) ** 2, 0.0).sum()))
    var = squared_deviations / max(count - 1.0, 1.0)
    return torch.where(valid, (wide - mean) * (var + _WHITEN_EPS) ** -0.5, 0.0).to(x.dtype)


# --------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------


def _check_seq_inputs(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None) -> None:
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"expected rewards (B,) and mask (B, T), got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    if group_ids is not None and tuple(group_ids.shape) != tuple(rewards.shape):
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} does not match rewards {tuple(rewards.shape)}")


def _group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group (count, sum, mean, unbiased std), each (B,), in float64: float32
    sums of equal rewards (1.1 sixteen times) miss their mean by an ulp, and dividing that
    by a std of an ulp gave a group of identical rewards advantages up to 0.9."""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    rewards = rewards.double()
    zeros = rewards.new_zeros(n_groups)  # (G,)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))
    total = zeros.index_add(0, inverse, rewards)
    mean = total / count
    # Two-pass variance: the sum-of-squares shortcut cancels badly for large rewards.
    sq_dev = zeros.index_add(0, inverse, (rewards - mean[inverse]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    return count[inverse], total[inverse], mean[inverse], std[inverse]


def compute_grpo_advantage(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: reward standardised within its prompt group.

    Signature: ``(rewards (B,), mask (B, T), group_ids (B,), *, norm_by_std=True,
    eps=1e-6) -> (advantages (B, T), returns (B, T))``; returns == advantages.

    ``adv_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased group std, or
    ``r_i - mean_g`` when ``norm_by_std`` is False (Dr. GRPO). As in verl, a group
    of size 1 uses mean 0 and std 1, so its advantage is its raw reward.
    """
    _check_seq_inputs(rewards, mask, group_ids)
    rewards = _as_float(rewards)
    count, _, mean, std = _group_stats(rewards, group_ids)  # (B,), float64
    singleton = count < 2
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    scores = rewards.double() - mean
    if norm_by_std:
        scores = scores / (std + eps)
    scores = scores.to(rewards.dtype)
    adv = scores.unsqueeze(-1) * mask.to(scores.dtype)  # (B, T)
    return adv, adv


def compute_dr_grpo_advantage(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO advantage: GRPO without the std normalisation.

    Signature: ``(rewards (B,), mask (B, T), group_ids (B,)) ->
    (advantages (B, T), returns (B, T))``.
    """
    return compute_grpo_advantage(rewards, mask, group_ids, norm_by_std=False)


def compute_rloo_advantage(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO advantage: reward minus the mean reward of the *other* group samples.

    Signature: ``(rewards (B,), mask (B, T), group_ids (B,)) ->
    (advantages (B, T), returns (B, T))``; returns == advantages.
    A group of size 1 has no other sample to compare against, so its advantage is 0.
    """
    _check_seq_inputs(rewards, mask, group_ids)
    rewards = _as_float(rewards)
    count, total, _, _ = _group_stats(rewards, group_ids)  # (B,), float64
    baseline = (total - rewards.double()) / (count - 1).clamp(min=1)
    scores = torch.where(count > 1, rewards.double() - baseline, torch.zeros_like(baseline)).to(rewards.dtype)
    adv = scores.unsqueeze(-1) * mask.to(scores.dtype)  # (B, T)
    return adv, adv


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go over valid tokens only; masked tokens are transparent.

    A masked token (e.g. a tool observation inside a multi-turn response) adds no
    reward and costs no discount step, so the final reward still reaches earlier
    turns. The output is 0 on masked positions.
    """
    m = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)  # (B, T)
    running = token_rewards.new_zeros(token_rewards.shape[0])  # (B,)
    for t in reversed(range(token_rewards.shape[1])):
        stepped = token_rewards[:, t] + gamma * running
        running = torch.where(mask[:, t].bool(), stepped, running)
        returns[:, t] = running * m[:, t]
    return returns


def compute_reinforce_plus_plus_advantage(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, *, whiten: Whiten = batch_whiten
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage: discounted return-to-go, whitened over the batch.

    Signature: ``(token_rewards (B, T), mask (B, T), gamma=1.0) ->
    (advantages (B, T), returns (B, T))``; ``returns`` is the un-whitened
    return-to-go. Rewards on masked positions are ignored. ``whiten``: over this
    process's batch by default; the estimator passes one all-reduced over every worker.
    """
    returns = discounted_returns(_as_float(token_rewards), mask, gamma)  # (B, T)
    return whiten(returns, mask), returns


def compute_reinforce_plus_plus_baseline_advantage(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor, *, whiten: Whiten = batch_whiten
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the batch.

    Signature: ``(rewards (B,), mask (B, T), group_ids (B,)) ->
    (advantages (B, T), returns (B, T))``; returns == advantages. The
    whitening statistics are taken over all valid tokens, so long responses
    weigh more, as in verl. Singleton groups use mean 0 (as GRPO). ``whiten``: as
    in :func:`compute_reinforce_plus_plus_advantage`.
    """
    centred, _ = compute_grpo_advantage(rewards, mask, group_ids, norm_by_std=False)  # (B, T)
    adv = whiten(centred, mask)
    return adv, adv


def compute_gae_advantage(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    *,
    whiten: Whiten = batch_whiten,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over valid tokens.

    Signature: ``(token_rewards (B, T), values (B, T), mask (B, T), gamma=1.0,
    lam=1.0) -> (advantages (B, T), returns (B, T))``. ``returns`` is the
    un-whitened advantage plus ``values`` (the value-function target);
    ``advantages`` are whitened over valid tokens (``whiten``: as in
    :func:`compute_reinforce_plus_plus_advantage`). Masked tokens are skipped
    (no reward, no value, no discount step) and are 0 in both outputs. The
    value after the last valid token is taken as 0 (terminal).
    """
    raw_adv, returns = gae_returns(token_rewards, values, mask, gamma, lam)
    return whiten(raw_adv * mask.to(raw_adv.dtype), mask), returns


def gae_returns(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE before any whitening: ``(raw advantages, returns)``, both ``(B, T)``;
    ``returns`` is 0 on masked positions."""
    token_rewards, values = _as_float(token_rewards), _as_float(values)
    valid = mask.bool()
    raw_adv = torch.zeros_like(values)  # (B, T)
    next_value = values.new_zeros(values.shape[0])  # (B,)
    last_gae = values.new_zeros(values.shape[0])  # (B,)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(valid[:, t], delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        raw_adv[:, t] = last_gae
    return raw_adv, (raw_adv + values) * mask.to(values.dtype)


def compute_remax_advantage(
    token_rewards: torch.Tensor, baseline: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): return-to-go minus the reward of a greedy response.

    Signature: ``(token_rewards (B, T), baseline (B,), mask (B, T)) ->
    (advantages (B, T), returns (B, T))``; returns == advantages. ``baseline``
    is the reward the greedy decode of the sample's prompt earned, so a sample
    is credited only for beating the policy's own mode. As verl: undiscounted
    return-to-go (gamma 1), no whitening.
    """
    returns = discounted_returns(_as_float(token_rewards), mask, 1.0)  # (B, T)
    adv = (returns - _as_float(baseline).unsqueeze(-1)) * mask.to(returns.dtype)
    return adv, adv


# --------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------

AGG_LOSS_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _denominator(local: torch.Tensor, global_count: float | None, what: str) -> torch.Tensor | float:
    if global_count is None:
        # Empty shard: its sum is 0 anyway, so any positive divisor is correct.
        return local.clamp(min=1)
    if global_count <= 0:
        raise ValueError(f"{what} must be positive, got {global_count}")
    return float(global_count)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``(B, T)`` to a scalar.

    Modes:

    * ``token-mean``: ``sum(loss * mask) / num_tokens``.
    * ``token-sum``: ``sum(loss * mask)``, no normaliser: the step size grows
      with the number of tokens (verl has no such mode; pair it with a smaller lr).
    * ``seq-mean-token-sum``: ``sum_i (sum_t loss_it) / num_seqs``.
    * ``seq-mean-token-mean``: ``sum_i (mean_t loss_it) / num_seqs``.
    * ``seq-mean-token-sum-norm``: ``sum(loss * mask) / (num_seqs * norm_len)``;
      Dr. GRPO's length-independent normaliser, ``norm_len`` defaults to T.

    ``num_seqs`` counts rows with at least one valid token, so all-masked
    padding rows do not dilute the loss. Passing ``global_num_tokens`` /
    ``global_num_seqs`` (counts over the whole batch, across ranks and
    micro-batches) replaces the local count, so that summing the results of all
    shards gives exactly the full-batch loss. With sharding, pass ``norm_len``
    explicitly, since shards may be padded to different T.
    """
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / _denominator(m.sum(), global_num_tokens, "global_num_tokens")
    if mode == "token-sum":  # shards' sums add up to the full batch's sum as they are
        return masked_sum(loss_mat, mask)
    if mode not in AGG_LOSS_MODES:
        raise ValueError(f"Unknown loss_agg_mode {mode!r}; allowed: {list(AGG_LOSS_MODES)}")
    tokens_per_seq = m.sum(-1)  # (B,)
    num_seqs = _denominator((tokens_per_seq > 0).to(m.dtype).sum(), global_num_seqs, "global_num_seqs")
    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # (B,)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (seq_sums / tokens_per_seq.clamp(min=1)).sum() / num_seqs
    length = loss_mat.shape[-1] if norm_len is None else norm_len
    if length <= 0:
        raise ValueError(f"norm_len must be positive, got {length}")
    return seq_sums.sum() / (num_seqs * length)


# --------------------------------------------------------------------------
# Policy losses
# --------------------------------------------------------------------------


@dataclass
class PolicyLossOutput:
    """Policy loss plus detached diagnostics (all scalar tensors)."""

    loss: torch.Tensor
    clip_frac: torch.Tensor  # valid tokens where the clipped surrogate won
    clip_frac_lower: torch.Tensor  # valid tokens where the dual-clip bound won
    approx_kl: torch.Tensor  # masked mean of old_log_prob - log_prob


def _check_clip_args(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0 <= clip_ratio_low < 1:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio_low: float,
                       clip_ratio_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unclipped, clipped, pessimistic max of the two) per-token PPO losses."""
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return pg1, pg2, torch.maximum(pg1, pg2)


@register_policy_loss("vanilla")
def policy_loss_vanilla(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher (DAPO) and dual-clip (Ye et al. 2020).

    ``token_weights`` (B, T), optional: multiplies each token's loss (the rollout
    correction's importance weights, algos/correction.py).

    The ratio is clipped to ``[1 - clip_ratio_low, 1 + clip_ratio_high]``. For
    negative advantages the per-token loss is additionally capped at
    ``-adv * clip_ratio_c``, so a huge ratio on a bad token cannot blow up the
    update.
    """
    _check_clip_args(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip, got {clip_ratio_c}")
    log_ratio = (log_probs - old_log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    pg1, pg2, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    pg3 = -advantages * clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(clipped, pg3), clipped)  # (B, T)
    if token_weights is not None:  # the rollout correction's importance weights (no gradient)
        per_token = per_token * token_weights
    loss = agg_loss(
        per_token, mask, loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs
    )
    with torch.no_grad():
        clip_frac = masked_mean((pg2 > pg1).to(ratio.dtype), mask)
        clip_frac_lower = masked_mean(((clipped > pg3) & negative).to(ratio.dtype), mask)
        approx_kl = masked_mean(-log_ratio, mask)
    return PolicyLossOutput(loss, clip_frac, clip_frac_lower, approx_kl)


@register_policy_loss("gspo")
def policy_loss_gspo(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025), token form: sequence-level importance ratio.

    ``s_i = exp(mean_t(log_prob - old_log_prob))`` over valid tokens. Each token
    uses ``exp(logp_t - sg(logp_t) + sg(log s_i))``: its value is ``s_i`` but
    its gradient flows through that token's own log-prob, which allows
    per-token advantages. ``clip_ratio_c`` is accepted for signature
    compatibility and unused (GSPO has no dual clip); ``clip_frac_lower`` is 0.
    The token log-ratio is capped at 10 (as verl) since no dual clip bounds it.
    """
    _check_clip_args(clip_ratio_low, clip_ratio_high)
    log_ratio = log_probs - old_log_probs  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,)
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=_GSPO_LOG_RATIO_MAX))  # (B, T)
    pg1, pg2, per_token = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    if token_weights is not None:  # the rollout correction's importance weights (no gradient)
        per_token = per_token * token_weights
    loss = agg_loss(
        per_token, mask, loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs
    )
    with torch.no_grad():
        clip_frac = masked_mean((pg2 > pg1).to(ratio.dtype), mask)
        approx_kl = masked_mean(-log_ratio, mask)
    return PolicyLossOutput(loss, clip_frac, torch.zeros_like(clip_frac), approx_kl)


# --------------------------------------------------------------------------
# KL, entropy, log-probs
# --------------------------------------------------------------------------

def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` ``(B, T, V) -> (B, T)``.

    Uses ``logsumexp - sum(p * logits)``; ``-inf`` logits (masked vocab) are
    allowed and contribute 0 rather than ``0 * -inf = nan``. For the backward it keeps
    only ``logits`` (which the log-probs keep anyway), not the softmax, the product and
    the mask that autograd would keep: three more (B, T, V) tensors, as large as the
    logits, for a term that is often only a metric (``_Entropy``).
    """
    return _Entropy.apply(logits)


def _probs_and_mean(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(logits)`` and ``E_p[logits]`` (B, T, 1), masked vocab (p = 0) left out."""
    probs = torch.softmax(logits, dim=-1)
    return probs, torch.where(probs > 0, probs * logits, 0.0).sum(-1, keepdim=True)


class _Entropy(torch.autograd.Function):
    """H = logsumexp(l) - E_p[l], whose gradient ``-p * (l - E_p[l])`` is recomputed
    from the logits in the backward (a softmax more, no (B, T, V) tensor kept)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits)
        _, mean = _probs_and_mean(logits)
        return torch.logsumexp(logits, dim=-1) - mean.squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (logits,) = ctx.saved_tensors
        probs, mean = _probs_and_mean(logits)
        return torch.where(probs > 0, probs * (mean - logits), 0.0) * grad.unsqueeze(-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``: ``(B, T, V) -> (B, T)``.

    Gathers first and subtracts ``logsumexp``, so no (B, T, V) log-softmax
    tensor is materialised. Half-precision logits are upcast one row at a time
    because a bf16 logsumexp over a large vocab loses ~2 digits.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        rows = [log_probs_from_logits(row.float(), lab) for row, lab in zip(logits, labels)]
        return torch.stack(rows).to(logits.dtype)
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)


def log_probs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, temperature: float, chunk_tokens: int,
                          with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and the entropy) under ``softmax((hidden @ weight.T + bias)
    / temperature)``, ``(N, H) -> (N,)``, computed ``chunk_tokens`` rows at a time: the
    output head's (N, V) logits are never kept, only a chunk's, in the forward and again
    in the backward, which recomputes them (``_ChunkedOutputHead``). The same values and
    gradients as the head followed by :func:`log_probs_from_logits` and
    :func:`entropy_from_logits`, with (chunk, V) memory instead of (N, V); the head runs in
    autocast's dtype when autocast is on, in the weight's otherwise, as ``nn.Linear``
    would. Returns fp32 (fp64 for an fp64 head)."""
    return _ChunkedOutputHead.apply(hidden, weight, bias, labels, temperature, chunk_tokens, with_entropy)


class _ChunkedOutputHead(torch.autograd.Function):
    """Per chunk of rows, logits l = (h W^T + b) / T, then log p(y) = l_y - logsumexp(l)
    and H = logsumexp(l) - E_p[l]. Backward, per chunk: dL/dl = g_logp (onehot(y) - p) +
    g_H p (E_p[l] - l), then through the head (dh = dz W, dW += dz^T h, db += sum dz) with
    dz = dL/dl / T. Keeps h, W, b and the labels: nothing V-sized."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_tokens, with_entropy):
        dtype = _head_dtype(hidden, weight)
        head = _cast(weight, dtype), _cast(bias, dtype)  # once, not per chunk
        log_probs = torch.empty(len(hidden), dtype=_at_least_fp32(dtype), device=hidden.device)
        entropy = torch.empty_like(log_probs) if with_entropy else None
        for rows in _chunks(len(hidden), chunk_tokens):
            logits = _head_logits(hidden[rows], *head, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            log_probs[rows] = logits.gather(-1, labels[rows].long().unsqueeze(-1)).squeeze(-1) - lse
            if with_entropy:
                entropy[rows] = lse - _probs_and_mean(logits)[1].squeeze(-1)
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.dtype, ctx.temperature, ctx.chunk_tokens = dtype, temperature, chunk_tokens
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, labels = ctx.saved_tensors
        dtype, need_hidden, need_weight, need_bias = ctx.dtype, *ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        accumulate = _at_least_fp32(dtype)  # the weight's gradient is summed over the chunks in fp32 at least
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if need_bias else None
        head = _cast(weight, dtype), _cast(bias, dtype)
        for rows in _chunks(len(hidden), ctx.chunk_tokens):
            logits = _head_logits(hidden[rows], *head, ctx.temperature)
            probs, mean = _probs_and_mean(logits)
            grad_logits = torch.zeros_like(logits)
            if grad_log_probs is not None:
                grad_logits -= probs * grad_log_probs[rows].unsqueeze(-1)
                grad_logits.scatter_add_(-1, labels[rows].long().unsqueeze(-1), grad_log_probs[rows].unsqueeze(-1))
            if grad_entropy is not None:  # the entropy's gradient, as _Entropy's
                grad_logits += torch.where(probs > 0, probs * (mean - logits), 0.0) * grad_entropy[rows].unsqueeze(-1)
            grad_z = (grad_logits / ctx.temperature).to(dtype)
            if need_hidden:
                grad_hidden[rows] = (grad_z @ head[0]).to(hidden.dtype)
            if need_weight:
                grad_weight += grad_z.T @ hidden[rows].to(dtype)
            if need_bias:
                grad_bias += grad_z.sum(0)
        return (grad_hidden, grad_weight.to(weight.dtype) if need_weight else None,
                grad_bias.to(bias.dtype) if need_bias else None, None, None, None, None)


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` computes in here: autocast's, where it is on."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _head_logits(hidden, weight, bias, temperature) -> torch.Tensor:
    """fp32 (or fp64) logits / T of one chunk, the head's product taken in the (cast)
    weight's dtype."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias)
    return logits.to(_at_least_fp32(weight.dtype)) / temperature


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------
# Value loss and reward shaping
# --------------------------------------------------------------------------


def value_loss_clipped(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss ``0.5 * max((v - R)^2, (clip(v, old ± c) - R)^2)``.

    Returns ``(loss, clip_frac)``; ``clip_frac`` is the fraction of valid
    tokens where the clipped term was strictly larger.
    """
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss1 = (values - returns) ** 2  # (B, T)
    loss2 = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(loss1, loss2)
    loss = agg_loss(
        per_token, mask, loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs
    )
    with torch.no_grad():
        clip_frac = masked_mean((loss2 > loss1).to(per_token.dtype), mask)
    return loss, clip_frac


def overlong_reward_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment ``(B,) -> (B,)``.

    0 up to ``max_response_length - buffer_length``, then linear down to
    ``-penalty_factor`` at ``max_response_length``, and ``-penalty_factor``
    beyond (clamped, unlike verl which keeps extrapolating).
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(f"buffer_length must be in (0, {max_response_length}], got {buffer_length}")
    excess = _as_float(response_lengths) - (max_response_length - buffer_length)  # (B,)
    fraction = (excess / buffer_length).clamp(0.0, 1.0)
    return -penalty_factor * fraction


def token_level_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's reward on its last valid token ``(B,) -> (B, T)``.

    Rows without any valid token get no reward (an all-zero row): there is no
    token a policy gradient could credit it to.
    """
    _check_seq_inputs(rewards, mask, None)
    rewards = _as_float(rewards)
    valid = mask.bool()
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)  # (T,)
    last = (valid * positions).argmax(-1, keepdim=True)  # (B, 1)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    out.scatter_(-1, last, rewards.unsqueeze(-1))
    return out * valid.any(-1, keepdim=True).to(out.dtype)
