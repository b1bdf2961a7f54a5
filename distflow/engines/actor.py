"""Training engine: the policy wrapped in FSDP2 (`fully_shard`), AdamW, grad clipping,
micro-batch gradient accumulation. Also the frozen reference model.

Loss normalisation across ranks: the trainer's loss function divides each micro-batch's
sum by the *global* token (or sequence) count of the mini-batch, so the sum over all
micro-batches and ranks is exactly the full-batch loss. FSDP averages gradients over
the data-parallel ranks, so the engine multiplies by the DP size before backward to turn
that average back into the sum. Result: the same gradient for any number of workers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from distflow.data.batch import Batch
from distflow.engines.common import forward_response

# (log_probs (B,R), entropy (B,R), micro-batch) -> (loss share, metrics to sum)
LossFn = Callable[[torch.Tensor, torch.Tensor, Batch], tuple[torch.Tensor, dict[str, float]]]


@dataclass(kw_only=True)
class OptimConfig:
    lr: float
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float) -> float:
    """The learning rate of training step `step` (1-based) over the peak: a linear warm-up
    over `warmup_steps` steps, then constant, or a cosine or linear decay that reaches
    `min_ratio` at `total_steps`. A pure function of the step, so a resumed run (which
    restores the step) continues the schedule exactly."""
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)  # (0, 1]
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def _decoder_layer_classes(model) -> tuple[type, ...]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def shard_model(model) -> None:
    """FSDP2: one unit per decoder layer (HF's `_no_split_modules`), then the root."""
    from torch.distributed.fsdp import fully_shard

    layer_types = _decoder_layer_classes(model)
    for module in model.modules():
        if layer_types and isinstance(module, layer_types):
            fully_shard(module)
    fully_shard(model)


MicroBatches = list[list[int]]  # row indices per micro-batch; [] = a lockstep-only pass


Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # (model, micro, train) -> per-token outputs


def policy_forward(model, micro: Batch, train: bool, temperature: float = 1.0):
    """Log-probs of the responses at the sampling temperature, and their entropy when training."""
    return forward_response(model, micro["prompts"], micro["prompt_mask"], micro["responses"],
                            micro["response_mask"], with_entropy=train, temperature=temperature)


def _forward_chunks(model, batch: Batch, micro_batches: MicroBatches, forward: Forward, train: bool):
    for rows in micro_batches:
        # An empty micro-batch still runs (FSDP's collectives need every rank), on one
        # row with its response masked out: its loss and gradient are exactly zero.
        micro = batch.select(rows or [0])
        if not rows:
            micro.tensors["response_mask"] = torch.zeros_like(micro["response_mask"])
        out, extra = forward(model, micro, train)
        yield rows, micro, out, extra


def _gather_rows(batch: Batch, model, micro_batches: MicroBatches, forward: Forward = policy_forward) -> torch.Tensor:
    """Per-token outputs (log-probs, values) of every row of `batch`, in row order."""
    out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    for rows, _, values, _ in _forward_chunks(model, batch, micro_batches, forward, False):
        if rows:
            out[rows] = values.float().cpu()
    return out


class FSDPTrainable:
    """A model sharded with FSDP2 and its optimizer: the actor, or the critic."""

    forward: Forward = staticmethod(policy_forward)

    def __init__(self, model, optim: OptimConfig, device: torch.device):
        self.device = device
        self.dp_size = dist.get_world_size() if dist.is_initialized() else 1
        self.model = model.to(device)
        if hasattr(self.model, "config"):
            self.model.config.use_cache = False
        if dist.is_initialized():
            shard_model(self.model)
        self.optim = optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def compute(self, batch: Batch, micro_batches: MicroBatches) -> torch.Tensor:
        self.model.eval()
        return _gather_rows(batch.to_device(self.device), self.model, micro_batches, self.forward)

    def train_mini_batch(self, batch: Batch, micro_batches: MicroBatches, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's share of a mini-batch).

        Every rank must call this with the same number of micro-batches: FSDP's
        collectives run in lockstep."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for _, micro, out, extra in _forward_chunks(self.model, batch.to_device(self.device),
                                                    micro_batches, self.forward, True):
            loss, metrics = loss_fn(out, extra, micro)
            (loss * self.dp_size).backward()
            for k, v in metrics.items():  # sums over micro-batches; a "*_max" metric keeps the largest
                totals[k] = max(totals.get(k, v), v) if k.endswith("_max") else totals.get(k, 0.0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        finite = bool(torch.isfinite(torch.tensor(grad_norm)))  # the same on every rank (a global norm)
        if finite:
            self.optimizer.step()
        else:  # NaN/inf in the loss or the gradients: skip this update, keep the weights and moments
            self.optimizer.zero_grad(set_to_none=True)
        totals["grad_norm"] = grad_norm if finite else 0.0
        totals["skipped"] = 0.0 if finite else 1.0
        return totals


class FSDPActor(FSDPTrainable):
    def __init__(self, model, optim: OptimConfig, device: torch.device, temperature: float = 1.0):
        super().__init__(model, optim, device)
        self.forward = partial(policy_forward, temperature=temperature)  # the rollout's temperature, as verl

    def compute_log_probs(self, batch: Batch, micro_batches: MicroBatches) -> torch.Tensor:
        return self.compute(batch, micro_batches)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on every rank (an all-gather when sharded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not dist.is_initialized():
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))

    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The unsharded weights as a stream of (HF name, tensor), gathered one parameter at
        a time (a collective per sharded tensor: every rank iterates in the same order), so
        a rollout engine can take each tensor before the next is gathered. A tied weight
        comes once, under its first name."""
        from torch.distributed.tensor import DTensor

        seen: set[int] = set()
        for name, tensor in self.model.state_dict().items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


class ReferenceModel:
    """Frozen policy copy for the KL term; replicated, since at small sizes a replica is
    cheaper than the all-gathers of a sharded forward."""

    def __init__(self, model, device: torch.device, temperature: float = 1.0):
        self.device, self.temperature = device, temperature
        self.model = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, micro_batches: MicroBatches) -> torch.Tensor:
        return _gather_rows(batch.to_device(self.device), self.model, micro_batches,
                            partial(policy_forward, temperature=self.temperature))
