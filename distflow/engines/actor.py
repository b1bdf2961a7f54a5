"""Training engine: the policy data-parallel over the workers, as DDP replicas or sharded
with FSDP2 (`fully_shard`) by size (`actor.strategy`), AdamW, grad clipping, micro-batch
gradient accumulation. Also the frozen reference model.

Loss normalisation across ranks: the trainer's loss function divides each micro-batch's
sum by the *global* token (or sequence) count of the mini-batch, so the sum over all
micro-batches and ranks is exactly the full-batch loss. DDP and FSDP average gradients
over the data-parallel ranks, so the engine multiplies by the DP size before backward to
turn that average back into the sum. Result: the same gradient for any number of workers.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distflow.data.batch import Batch
from distflow.data.images import IMAGE_FIELDS
from distflow.engines.common import (check_head_chunking, computing_in, enable_gradient_checkpointing, first_of_tied,
                                     forward_response)
from distflow.engines.lora import is_lora, merged_weights

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
    over `warmup_steps` steps, then the peak, constant, or decaying from it by a cosine or
    a line towards `min_ratio`, which the step after `total_steps` would reach (as HF's
    and verl's schedules: the first step after warm-up trains at the peak, the last not at
    the minimum, so not at 0 under min_ratio=0). A pure function of the step, so a resumed
    run (which restores the step) continues the schedule exactly."""
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps - 1) / max(total_steps - warmup_steps, 1)  # [0, 1)
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def _decoder_layer_classes(model) -> tuple[type, ...]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def shard_model(model, compute_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2: one unit per decoder layer (HF's `_no_split_modules`), then the root. A
    lower `compute_dtype` gathers the parameters in it for the forward and backward while
    the shards (the master weights) and the gradient reduction stay in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layer_types = _decoder_layer_classes(model)
    for module in model.modules():
        if layer_types and isinstance(module, layer_types):
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


MicroBatches = list[list[int]]  # row indices per micro-batch; [] = a lockstep-only pass


Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # (model, micro, train) -> per-token outputs


def policy_forward(model, micro: Batch, train: bool, temperature: float = 1.0, prompt_once: bool = False,
                   head_chunk_tokens: int = 0):
    """Log-probs of the responses at the sampling temperature, and their entropy when
    training. `prompt_once`: rows with the same prompt share one forward of it;
    `head_chunk_tokens`: the output head runs that many tokens at a time."""
    return forward_response(model, micro["prompts"], micro["prompt_mask"], micro["responses"],
                            micro["response_mask"], with_entropy=train, temperature=temperature,
                            observation_mask=micro.tensors.get("observation_mask"),
                            images={k: micro.tensors[k] for k in IMAGE_FIELDS if k in micro.tensors},
                            prompt_once=prompt_once, head_chunk_tokens=head_chunk_tokens)


def _micro(batch: Batch, rows: list[int]) -> Batch:
    # An empty micro-batch still runs (FSDP's and DDP's collectives need every rank), on
    # one row with its response masked out: its loss and gradient are exactly zero. A rank
    # that holds no rows at all (a scoring forward outside the training layout, after a
    # filter) runs a blank one: a one-token prompt and a masked one-token response.
    if not rows and len(batch) == 0:
        one = torch.ones(1, 1, dtype=torch.long, device=batch["prompts"].device)
        return Batch({"prompts": one * 0, "prompt_mask": one, "responses": one * 0,
                      "response_mask": batch["response_mask"].new_zeros(1, 1)})
    micro = batch.select(rows or [0])
    if not rows:
        micro.tensors["response_mask"] = torch.zeros_like(micro["response_mask"])
    return micro


def _forward_chunks(model, batch: Batch, micro_batches: MicroBatches, forward: Forward, train: bool):
    for rows in micro_batches:
        micro = _micro(batch, rows)
        out, extra = forward(model, micro, train)
        yield rows, micro, out, extra


def _gather_rows(batch: Batch, model, micro_batches: MicroBatches, forward: Forward = policy_forward) -> torch.Tensor:
    """Per-token outputs (log-probs, values) of every row of `batch`, in row order."""
    out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    for rows, _, values, _ in _forward_chunks(model, batch, micro_batches, forward, False):
        if rows:
            out[rows] = values.float().cpu()
    return out


def resolve_strategy(strategy: str, model, device: torch.device) -> str:
    """How a trainable model is spread over the data-parallel ranks: `none` (one rank),
    `ddp` (a full replica per rank, gradients all-reduced once per mini-batch) or `fsdp2`
    (parameters, gradients and optimizer state sharded per decoder layer). `auto` takes
    DDP when weights, gradients and AdamW's two moments (16 bytes a parameter in fp32) fit
    in a quarter of the smallest device's memory over the ranks (a GPU's, or a CPU worker's
    share of its host's: every rank takes the same strategy, or their collectives would not
    match), FSDP2 otherwise. A LoRA model (frozen base, a small adapter) is always DDP: its
    weight pushes, checkpoints and adapter-off reference need replicas."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return "none"
    if strategy != "auto":
        return strategy
    if is_lora(model):
        return "ddp"
    need = 16 * sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:  # this host's workers share its memory
        workers_here = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / workers_here
    smallest = torch.tensor([float(memory)], dtype=torch.float64, device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return "ddp" if need <= float(smallest) / 4 else "fsdp2"


class DataParallelTrainable:
    """A model spread over the data-parallel ranks (resolve_strategy) and its optimizer:
    the actor, or the critic. `module` is the model itself, unwrapped.

    Mixed precision: the weights and AdamW's state are fp32 (the master copy); with
    `compute_dtype=torch.bfloat16` the forwards and backwards run in bf16 (FSDP2's
    MixedPrecisionPolicy, or autocast for DDP and one worker) and the gradients are
    reduced and applied in fp32. `gradient_checkpointing`: each decoder layer's
    activations are recomputed in the backward (`enable_gradient_checkpointing`)."""

    forward: Forward = staticmethod(policy_forward)

    def __init__(self, model, optim: OptimConfig, device: torch.device, strategy: str = "auto",
                 compute_dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = False):
        self.device, self.compute_dtype = device, compute_dtype
        self.dp_size = dist.get_world_size() if dist.is_initialized() else 1
        self.module = model.to(device=device, dtype=torch.float32)
        if hasattr(self.module, "config"):
            self.module.config.use_cache = False
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.module)
        self.strategy = resolve_strategy(strategy, self.module, device)
        if self.strategy == "fsdp2":
            shard_model(self.module, compute_dtype)
        # buffers (rotary caches) are the same constants on every rank: no broadcast per forward
        self.model = (DistributedDataParallel(self.module, device_ids=[device.index] if device.type == "cuda" else None,
                                              forward_sync_buffers=False)
                      if self.strategy == "ddp" else self.module)
        self.optim = optim
        # frozen weights (a LoRA adapter's base) get no optimizer state
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=optim.lr,
                                           betas=optim.betas, weight_decay=optim.weight_decay)

    def parameter_counts(self) -> dict[str, int]:
        """Trainable and total parameters, and the bytes of AdamW's state (two fp32 moments per trainable one)."""
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        return {"trainable_parameters": trainable, "total_parameters": sum(p.numel() for p in self.module.parameters()),
                "optimizer_state_bytes": 8 * trainable}

    @property
    def holds_full_weights(self) -> bool:
        """Every rank has the whole model as plain tensors (no sharding)."""
        return self.strategy != "fsdp2"

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _autocast(self):
        """bf16 compute on the fp32 master weights, where FSDP2 does not cast them itself."""
        if self.strategy == "fsdp2":
            return contextlib.nullcontext()
        return computing_in(self.compute_dtype, self.device)

    @torch.no_grad()
    def compute(self, batch: Batch, micro_batches: MicroBatches) -> torch.Tensor:
        self.model.eval()
        with self._autocast():
            return _gather_rows(batch.to_device(self.device), self.model, micro_batches, self.forward)

    def train_mini_batch(self, batch: Batch, micro_batches: MicroBatches, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's share of a mini-batch).

        Every rank must call this with the same number of micro-batches: FSDP's and DDP's
        collectives run in lockstep."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        batch = batch.to_device(self.device)
        for i, rows in enumerate(micro_batches):
            # DDP all-reduces the gradients once, in the backward of the last micro-batch
            last = i == len(micro_batches) - 1
            with self.model.no_sync() if self.strategy == "ddp" and not last else contextlib.nullcontext():
                micro = _micro(batch, rows)
                with self._autocast():
                    out, extra = self.forward(self.model, micro, True)
                loss, metrics = loss_fn(out, extra, micro)
                (loss * self.dp_size).backward()
            for k, v in metrics.items():  # sums over micro-batches; a "*_max" metric keeps the largest
                totals[k] = max(totals.get(k, v), v) if k.endswith("_max") else totals.get(k, 0.0) + v
        # the global norm either way; 0 = no clipping (as in HF's Trainer), never a zero update
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip or math.inf)
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

    def release_gradients(self) -> None:
        """Frees the last update's gradients (a copy of the weights' size), which would
        otherwise stay until the next update, through the weight push and the rollout."""
        self.optimizer.zero_grad(set_to_none=True)


class Actor(DataParallelTrainable):
    """`prompt_once` (actor.forward_prompt_once): rows sharing a prompt share its forward,
    except under FSDP2, whose per-layer gathers would run for both forwards, and in the
    update with gradient checkpointing (`forward_response` decides). `head_chunk_tokens`
    (actor.output_head_chunk_tokens): the output head runs that many tokens at a time."""

    def __init__(self, model, optim: OptimConfig, device: torch.device, temperature: float = 1.0,
                 strategy: str = "auto", compute_dtype: torch.dtype = torch.float32, prompt_once: bool = False,
                 gradient_checkpointing: bool = False, head_chunk_tokens: int = 0):
        if head_chunk_tokens:
            check_head_chunking(model)
        super().__init__(model, optim, device, strategy, compute_dtype, gradient_checkpointing)
        self.head_chunk_tokens = head_chunk_tokens
        # the rollout's temperature, as verl
        self.forward = partial(policy_forward, temperature=temperature,
                               prompt_once=prompt_once and self.strategy != "fsdp2",
                               head_chunk_tokens=head_chunk_tokens)

    def compute_log_probs(self, batch: Batch, micro_batches: MicroBatches) -> torch.Tensor:
        return self.compute(batch, micro_batches)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on every rank (an all-gather when sharded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.holds_full_weights:
            return {k: v.detach() for k, v in self.module.state_dict().items()}
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))

    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The unsharded weights as a stream of (HF name, tensor), gathered one parameter at
        a time (a collective per sharded tensor: every rank iterates in the same order), so
        a rollout engine can take each tensor before the next is gathered. A tied weight
        comes once, under its first name."""
        from torch.distributed.tensor import DTensor

        if is_lora(self.module):  # base + adapter delta, under the HF names
            yield from merged_weights(self.module)
            return
        for name, tensor in first_of_tied(self.module):
            yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


class ReferenceModel:
    """Frozen policy copy for the KL term; replicated, since at small sizes a replica is
    cheaper than the all-gathers of a sharded forward."""

    def __init__(self, model, device: torch.device, temperature: float = 1.0, prompt_once: bool = False,
                 head_chunk_tokens: int = 0, compute_dtype: torch.dtype = torch.float32):
        if head_chunk_tokens:
            check_head_chunking(model)
        self.device, self.compute_dtype = device, compute_dtype
        self.forward = partial(policy_forward, temperature=temperature, prompt_once=prompt_once,
                               head_chunk_tokens=head_chunk_tokens)
        self.model = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, micro_batches: MicroBatches) -> torch.Tensor:
        """`compute_dtype` (bf16): the weights as they are, under autocast, as the actor computes."""
        with computing_in(self.compute_dtype, self.device):
            return _gather_rows(batch.to_device(self.device), self.model, micro_batches, self.forward)
