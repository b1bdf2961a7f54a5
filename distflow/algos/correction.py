"""The rollout-training mismatch correction: an inference engine's probabilities differ
from the trainer's for the same weights (other kernels, other precision, a KV cache), so
the samples come from a slightly different policy than the one the loss assumes. The
correction re-weights the policy loss by the importance ratio between the trainer's
(old) policy and the engine's, ``rho = exp(old_log_probs - rollout_log_probs)``:

* ``token_tis``: truncated importance sampling per token, ``w_t = min(rho_t, cap)``
  (verl's rollout correction, TRL's default with vLLM);
* ``seq_tis``: one weight per sequence, ``min(prod_t rho_t, cap)`` on all its tokens;
* ``token_mask``: ``w_t = 1`` where ``1/cap <= rho_t <= cap``, else 0 (masked IS: a token
  the two policies disagree on too much is not trained on);
* ``seq_mask``: the same on the sequence ratio, so a whole sequence is kept or dropped.

The weights carry no gradient (they multiply the per-token loss). Pure functions of
tensors, tested against hand-computed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distflow.algos.core import masked_mean, masked_sum

CORRECTION_MODES = ("off", "token_tis", "seq_tis", "token_mask", "seq_mask")
_LOG_RATIO_CLAMP = 20.0  # exp() of a log-ratio stays finite


@dataclass
class CorrectionOutput:
    weights: torch.Tensor  # (B, T), detached; 0 where masked
    mismatch_kl: torch.Tensor  # masked mean of k3, an estimate of KL(rollout || old): how far apart they are
    weight_mean: torch.Tensor  # over valid tokens
    weight_max: torch.Tensor
    corrected_fraction: torch.Tensor  # valid tokens truncated (tis) or masked out (mask)


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       mode: str, cap: float) -> CorrectionOutput:
    """Per-token weights for the policy loss ``(B, T)`` and the mismatch metrics."""
    if mode not in CORRECTION_MODES or mode == "off":
        raise ValueError(f"Unknown rollout correction {mode!r}; allowed: {list(CORRECTION_MODES[1:])}")
    if cap < 1.0:
        raise ValueError(f"the rollout correction cap must be >= 1, got {cap}")
    m = mask.to(old_log_probs.dtype)
    with torch.no_grad():
        log_rho = (old_log_probs - rollout_log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP) * m  # (B, T)
        if mode.startswith("seq"):  # the sequence's log-ratio on each of its tokens
            log_rho = masked_sum(log_rho, mask, dim=-1).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
            log_rho = log_rho.unsqueeze(-1).expand_as(m)
        rho = torch.exp(log_rho)
        if mode.endswith("tis"):
            weights, corrected = rho.clamp(max=cap), rho > cap
        else:
            inside = (rho >= 1.0 / cap) & (rho <= cap)
            weights, corrected = inside.to(rho.dtype), ~inside
        weights = weights * m
        # k3 = r - 1 - log r with r = old / rollout: unbiased for KL(rollout || old) on the rollout's
        # samples (as verl), non-negative per token
        log_r = (old_log_probs - rollout_log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        k3 = torch.exp(log_r) - log_r - 1
        return CorrectionOutput(weights, masked_mean(k3, mask), masked_mean(weights, mask),
                                (weights * m).max() if m.any() else weights.new_zeros(()),
                                masked_mean(corrected.to(rho.dtype), mask))
