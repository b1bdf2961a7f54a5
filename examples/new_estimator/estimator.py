"""A new advantage estimator in one file: the sign of each reward against its group's
mean (+1 better than the group, -1 worse, 0 equal). It ignores the reward's scale,
so a reward of 0.9 vs 0.1 pushes as hard as 450 vs 45.

Used by recipe.yaml beside it; registering it says what it needs (nothing beyond the
rewards, mask and groups) and that it does no batch-wide whitening."""

import torch

from distflow.algos.estimators import AdvantageInputs, register_adv_est


@register_adv_est("sign_baseline")
def sign_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    outcome = inputs.outcome()  # (B,): each sequence's total reward
    _, group = torch.unique(inputs.group_ids, return_inverse=True)
    count = torch.zeros(int(group.max()) + 1, dtype=outcome.dtype).index_add(0, group, torch.ones_like(outcome))
    mean = torch.zeros_like(count).index_add(0, group, outcome) / count  # (G,)
    adv = torch.sign(outcome - mean[group]).unsqueeze(-1) * inputs.mask  # (B, T)
    return adv, adv
