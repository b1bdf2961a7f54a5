"""Two user nodes added to GRPO without touching DistFlow (see graph.yaml).

A node is `fn(ctx, batch) -> Batch`: `batch` has the declared inputs of the samples on
this worker, the result has the declared outputs. `ctx` gives the worker's tokenizer,
config (`ctx.cfg`), step and the node's `params` from the YAML.
"""

import torch

from distflow.data.batch import Batch


def format_bonus(ctx, batch):
    """A second reward: a bonus for answering in the `#### N` format, whatever the answer."""
    texts = ctx.tokenizer.batch_decode(batch["responses"] * batch["response_mask"], skip_special_tokens=True)
    bonus = torch.tensor([ctx.params.get("bonus", 0.1) if "####" in t else 0.0 for t in texts])
    return Batch({"total_scores": batch["scores"] + bonus})


def drop_truncated_groups(ctx, batch):
    """A filter: drop prompts whose every response ran out of tokens (no end-of-sequence)."""
    limit = ctx.cfg.rollout.max_new_tokens
    truncated = batch["response_mask"].sum(-1) >= limit
    keep = torch.ones(len(truncated), dtype=torch.bool)
    for g in batch["group"].unique():
        rows = batch["group"] == g
        keep[rows] = not bool(truncated[rows].all())
    return Batch({"not_truncated": keep})
