"""Advantage estimators behind one signature and one registry.

Every estimator is ``fn(inputs: AdvantageInputs) -> (advantages (B, T), returns (B, T))``
and is selected by name (``algorithm.estimator``). The inputs are the same for all:
token-level rewards (the task reward on each sequence's last valid token, plus any
per-token terms such as a KL penalty), the response mask, the prompt-group ids, and the
optional inputs an estimator declares it needs (the critic's ``values``, ReMax's greedy
``baseline``). Whitening over the batch goes through the injected ``whiten``: in a
distributed run the caller passes one whose statistics are all-reduced over every
worker, so this module stays free of collectives and 1 and N workers compute the same
advantages.

Adding an estimator is one function here (or in your own module) and one recipe entry:

    @register_adv_est("grpo_pass_at_k", needs=())
    def grpo_pass_at_k(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
        ...

``needs`` tells the graph builder which extra nodes the estimator implies (a critic for
``values``, a greedy rollout for ``baseline``); ``batch_whitened`` that it calls
``whiten`` (a collective in a distributed run, so its node runs in lockstep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from distflow.algos import core
from distflow.algos.core import Whiten, lookup, register

OPTIONAL_INPUTS = ("values", "baseline")


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    token_rewards: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T)
    group_ids: torch.Tensor  # (B,): the n samples of one prompt share an id
    values: torch.Tensor | None = None  # (B, T): the critic's estimates (needs "values")
    baseline: torch.Tensor | None = None  # (B,): the reward of the prompt's greedy response (needs "baseline")
    gamma: float = 1.0
    lam: float = 1.0
    whiten: Whiten = core.batch_whiten  # batch-wide; all-reduced when the batch spans workers

    def outcome(self) -> torch.Tensor:
        """Each sequence's total reward ``(B,)``: the outcome estimators' input (as verl's
        ``token_level_rewards.sum(-1)``, so a KL-in-reward penalty counts too)."""
        return core.masked_sum(self.token_rewards, self.mask, dim=-1)


Estimator = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EstimatorInfo:
    needs: tuple[str, ...]  # optional inputs read: "values", "baseline"
    batch_whitened: bool  # calls inputs.whiten
    min_group_size: int = 1  # fewer responses per prompt give every advantage 0


ADV_ESTIMATORS: dict[str, Estimator] = {}
ESTIMATOR_INFO: dict[str, EstimatorInfo] = {}


def register_adv_est(name: str, *, needs: tuple[str, ...] = (), batch_whitened: bool = False,
                     min_group_size: int = 1):
    """Decorator registering an estimator under ``name`` with what it needs
    (``min_group_size``: the responses per prompt below which it gives no signal)."""
    unknown = set(needs) - set(OPTIONAL_INPUTS)
    if unknown:
        raise ValueError(f"estimator {name!r}: unknown needs {sorted(unknown)}; allowed: {list(OPTIONAL_INPUTS)}")

    def decorator(fn: Estimator) -> Estimator:
        register(ADV_ESTIMATORS, "advantage estimator", name)(fn)
        ESTIMATOR_INFO[name] = EstimatorInfo(tuple(needs), batch_whitened, min_group_size)
        return fn

    return decorator


def get_adv_estimator(name: str) -> Estimator:
    """The estimator registered as ``name`` (ValueError listing the allowed names if none)."""
    return lookup(ADV_ESTIMATORS, "advantage estimator", name)


def estimator_info(name: str) -> EstimatorInfo:
    get_adv_estimator(name)
    return ESTIMATOR_INFO[name]


# ---------------------------------------------------------------------------- the built-in ones


@register_adv_est("grpo")
def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward standardised within its prompt group (``core.compute_grpo_advantage``)."""
    return core.compute_grpo_advantage(inputs.outcome(), inputs.mask, inputs.group_ids)


@register_adv_est("dr_grpo")
def dr_grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO without the std normalisation."""
    return core.compute_dr_grpo_advantage(inputs.outcome(), inputs.mask, inputs.group_ids)


@register_adv_est("rloo", min_group_size=2)
def rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward minus the mean of the group's other samples. A group of one gets 0, where
    verl's RLOO gives the raw reward: with no other sample there is no baseline, and a
    raw reward would push the update in one direction for every such prompt; so a run of
    one response per prompt is refused (``min_group_size=2``)."""
    return core.compute_rloo_advantage(inputs.outcome(), inputs.mask, inputs.group_ids)


@register_adv_est("reinforce_plus_plus", batch_whitened=True)
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted return-to-go, whitened over the whole step's batch."""
    return core.compute_reinforce_plus_plus_advantage(inputs.token_rewards, inputs.mask, inputs.gamma,
                                                      whiten=inputs.whiten)


@register_adv_est("reinforce_plus_plus_baseline", batch_whitened=True)
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-mean baseline, then whitened over the whole step's batch."""
    return core.compute_reinforce_plus_plus_baseline_advantage(inputs.outcome(), inputs.mask, inputs.group_ids,
                                                               whiten=inputs.whiten)


@register_adv_est("gae", needs=("values",), batch_whitened=True)
def gae(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the critic's values; ``returns`` (the value target) un-whitened, the
    advantages whitened over the whole step's batch."""
    return core.compute_gae_advantage(inputs.token_rewards, inputs.values, inputs.mask, inputs.gamma, inputs.lam,
                                      whiten=inputs.whiten)


@register_adv_est("remax", needs=("baseline",))
def remax(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Return-to-go minus the reward of the prompt's greedy response."""
    return core.compute_remax_advantage(inputs.token_rewards, inputs.baseline, inputs.mask)
