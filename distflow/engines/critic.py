"""PPO's critic: the policy's transformer body with a scalar value head, trained
data-parallel like the actor (verl initialises the critic from the actor's weights too).
A vision-language policy's body includes its vision tower, so the critic sees the pixels.

The value of response token t is read at the position that predicts it (the last
prompt token for t = 0), the same alignment as the policy's log-probs.
"""

from __future__ import annotations

import torch

from distflow.data.batch import Batch
from distflow.data.images import IMAGE_FIELDS, model_inputs
from distflow.engines.actor import DataParallelTrainable, MicroBatches
from distflow.engines.common import is_vision_language, trim_padding, unwrapped, vision_tower_always_runs


class ValueModel(torch.nn.Module):
    def __init__(self, causal_lm):
        super().__init__()
        # a vision-language model's whole body (vision tower and language model: it takes
        # the pixels), a text model's decoder
        vlm = is_vision_language(causal_lm.config)
        self.image_token_id = causal_lm.config.image_token_id if vlm else None
        self.body = causal_lm.model if vlm else causal_lm.get_decoder()
        self._no_split_modules = getattr(causal_lm, "_no_split_modules", None)
        # zero-initialised: every value starts at 0, the same on every worker and run
        hidden_size = causal_lm.config.get_text_config().hidden_size
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids, **vision):
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False, **vision).last_hidden_state
        # (B, T), a tensor of its own rather than a view of the head's output: FSDP2 hooks
        # its backward on the module's output and warns of views
        return self.value_head(hidden).float().sum(-1)


def value_forward(model, micro: Batch, train: bool):
    """(values (B, R), None): one value per response token. With a VLM's images the model
    places the image tokens itself (M-RoPE), as the policy's forward does."""
    full_width = micro["responses"].shape[1]
    p, pm, r, rm = trim_padding(micro["prompts"], micro["prompt_mask"], micro["responses"], micro["response_mask"])
    input_ids, attention = torch.cat([p, r], dim=1), torch.cat([pm, rm], dim=1).long()
    images = {k: micro.tensors[k] for k in IMAGE_FIELDS if k in micro.tensors}
    vision = model_inputs(images, input_ids, unwrapped(model).image_token_id) if images else {}
    with vision_tower_always_runs(unwrapped(model).body, images):
        values = model(input_ids, attention, None if vision else (attention.cumsum(-1) - 1).clamp(min=0), **vision)
    values = values[:, p.shape[1] - 1: p.shape[1] - 1 + r.shape[1]]  # (B, R')
    return torch.nn.functional.pad(values, (0, full_width - values.shape[1])), None


class Critic(DataParallelTrainable):
    forward = staticmethod(value_forward)

    def __init__(self, causal_lm, optim, device: torch.device, strategy: str = "auto",
                 compute_dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = False):
        super().__init__(ValueModel(causal_lm), optim, device, strategy, compute_dtype, gradient_checkpointing)

    def compute_values(self, batch: Batch, micro_batches: MicroBatches) -> torch.Tensor:
        return self.compute(batch, micro_batches)
