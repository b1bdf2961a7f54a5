"""PPO's critic: the policy's transformer body with a scalar value head, trained
data-parallel like the actor (verl initialises the critic from the actor's weights too).

The value of response token t is read at the position that predicts it (the last
prompt token for t = 0), the same alignment as the policy's log-probs.
"""

from __future__ import annotations

import torch

from distflow.data.batch import Batch
from distflow.engines.actor import DataParallelTrainable, MicroBatches
from distflow.engines.common import trim_padding


class ValueModel(torch.nn.Module):
    def __init__(self, causal_lm):
        super().__init__()
        self.body = causal_lm.get_decoder()
        self._no_split_modules = getattr(causal_lm, "_no_split_modules", None)
        # zero-initialised: every value starts at 0, the same on every worker and run
        self.value_head = torch.nn.Linear(causal_lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids):
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()  # (B, T)


def value_forward(model, micro: Batch, train: bool):
    """(values (B, R), None): one value per response token."""
    full_width = micro["responses"].shape[1]
    p, pm, r, rm = trim_padding(micro["prompts"], micro["prompt_mask"], micro["responses"], micro["response_mask"])
    attention = torch.cat([pm, rm], dim=1).long()
    values = model(torch.cat([p, r], dim=1), attention, (attention.cumsum(-1) - 1).clamp(min=0))
    values = values[:, p.shape[1] - 1: p.shape[1] - 1 + r.shape[1]]  # (B, R')
    return torch.nn.functional.pad(values, (0, full_width - values.shape[1])), None


class Critic(DataParallelTrainable):
    forward = staticmethod(value_forward)

    def __init__(self, causal_lm, optim, device: torch.device, strategy: str = "auto",
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__(ValueModel(causal_lm), optim, device, strategy, compute_dtype)

    def compute_values(self, batch: Batch, micro_batches: MicroBatches) -> torch.Tensor:
        return self.compute(batch, micro_batches)
