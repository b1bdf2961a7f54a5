"""KL between the policy and the reference: the estimators (one signature,
``(log_probs, ref_log_probs) -> (B, T)``, selected by name), and KL as a reward
penalty with its fixed and adaptive coefficient controllers (verl's
``algorithm.use_kl_in_reward``).

KL in the loss (``use_kl_loss``) adds ``coef * agg(kl)`` to the actor's loss; KL in
the reward subtracts ``beta * kl`` from each token's reward *before* the advantage
estimator, so the penalty is credited like any other reward (verl's
``apply_kl_penalty``). Both may be on; recipes use one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from distflow.algos.core import masked_mean, register

_LOG_RATIO_CLAMP = 20.0  # as core's: exp() of a log-ratio stays finite

KL_ESTIMATORS: dict[str, Callable] = {}


def register_kl(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a KL estimator ``(log_probs, ref_log_probs) -> (B, T)``."""
    return register(KL_ESTIMATORS, "kl estimator", name)


@register_kl("k1")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``logp - ref``: unbiased for KL(policy || ref), high variance."""
    return log_probs - ref_log_probs


@register_kl("k2")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``0.5 (logp - ref)^2``: biased, but its gradient is KL's expected gradient."""
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl("abs")
def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``|logp - ref|``."""
    return (log_probs - ref_log_probs).abs()


@register_kl("k3")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman's ``exp(ref - logp) - (ref - logp) - 1``: unbiased, non-negative,
    low variance; clamped to [-10, 10] as verl does because its tail is exponential."""
    log_r = (ref_log_probs - log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1).clamp(-10.0, 10.0)


register_kl("low_var_kl")(kl_k3)  # verl's name for k3

def straight_through(estimator: Callable) -> Callable:
    """`estimator`'s value with the gradient of k2, whose expected gradient is KL's (verl's
    "+" suffix: "k1+", "k3+"; k1's and k3's own gradients are not KL's)."""
    def value_of_it_gradient_of_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
        grad = kl_k2(log_probs, ref_log_probs)
        return grad - grad.detach() + estimator(log_probs, ref_log_probs).detach()
    return value_of_it_gradient_of_k2


def get_kl(kind: str) -> Callable:
    """The registered estimator `kind`, or for `name+` its straight-through variant."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; registered: {', '.join(KL_ESTIMATORS)} (each also as "
                         "name+, straight-through)")
    return straight_through(KL_ESTIMATORS[base]) if kind.endswith("+") else KL_ESTIMATORS[base]


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str | Callable) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference ``(B, T)``, by the
    registered estimator ``kind`` (``name+``: straight-through) or an estimator function."""
    return (get_kl(kind) if isinstance(kind, str) else kind)(log_probs, ref_log_probs)


# --------------------------------------------------------------------------
# KL as a reward penalty
# --------------------------------------------------------------------------


@dataclass
class FixedKLController:
    """beta stays at its initial value."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


@dataclass
class AdaptiveKLController:
    """Ziegler et al. (2019)'s proportional controller, as verl's: after each step,
    ``beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``, so beta
    grows while the measured KL is above ``target`` and shrinks below it."""

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def make_kl_controller(kind: str, coef: float, target: float, horizon: int):
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL control needs target > 0 and horizon > 0, got {target}, {horizon}")
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"Unknown kl controller {kind!r}; allowed: ['adaptive', 'fixed']")


def kl_penalized_rewards(
    token_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kind: str | Callable = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with the KL penalty: ``scores - beta * kl`` on valid tokens.

    ``token_scores`` (B, T): the task reward on each sequence's last valid token;
    ``log_probs`` the behaviour policy's (the sampler's), ``ref_log_probs`` the
    reference's. Returns ``(token_rewards (B, T), kl (B, T))``, both 0 on masked
    positions; the caller feeds ``masked_mean(kl, mask, -1)`` averaged over the
    batch to the controller (verl's ``current_kl``).
    """
    valid = mask.bool()  # a masked position's value never enters (inf * 0 is NaN)
    kl = torch.where(valid, kl_penalty(log_probs, ref_log_probs, kind), 0.0)  # (B, T)
    return torch.where(valid, token_scores - beta * kl, 0.0), kl


def sequence_mean_kl(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean per-token KL ``(B, T) -> (B,)``; the controller sees their mean."""
    return masked_mean(kl, mask, dim=-1)
