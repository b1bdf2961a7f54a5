"""Rollout with HuggingFace `generate` on a plain (unsharded) copy of the policy: the
actor's own module when every worker holds the whole model (DDP replicas, or one
worker), else a copy of its own that takes fresh weights after each update.

Generation never runs a collective per token (DESIGN.md). Sampling is
*placement-invariant*: each sequence draws its randomness from its own seed, from (run
seed, step, prompt id, sample number), inside a logits processor that draws all rows at
once: one counter-based uniform per row and token, turned into a token by inverting the
CDF of softmax(logits / T), an exact sample. So the same prompt yields the same responses
whichever worker generates it and whatever else shares its batch; this is what lets 1
and 2 workers produce the same training run. That holds where the logits themselves do
not depend on the batch (fp32 on CPU, as the tests run); in bf16 on a GPU a kernel
chosen by batch size can move a logit enough to flip a sampled token.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from distflow.data.batch import Batch
from distflow.data.images import image_fields, model_inputs, vision_token_ids
from distflow.engines.common import cache_arguments, computing_in, distinct_prompts, is_vision_language, rows_can_share


def sample_seed(*parts: int) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    greedy: bool = False


def _int64(constant: int) -> int:
    """A 64-bit constant as the signed value torch's int64 holds."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN, _MIX1, _MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical: int64's >> copies the sign bit


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def counter_uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """(B,) uniforms in (0, 1), a pure function of (row seed, step): a counter-based
    generator, so each row's draw comes from its own seed, for all rows in one vectorised
    call, whatever else is in the batch."""
    bits = _splitmix64(_splitmix64(seeds) + step)
    return (_shift_right(bits, 11).double() + 0.5) / float(1 << 53)  # 53 random bits, never 0 or 1


class PerSequenceSampler:
    """A logits processor that picks each row's next token and records its log-probability.
    With seeds, each row's token is drawn by inverting the CDF of softmax(logits / T)
    (after top-p) at one uniform from `counter_uniform(row seed, token step)`; without,
    it is the argmax. `suppress`: token ids never picked (a VLM's image placeholders).
    The scores returned make the picked token the argmax. `log_probs` gets, per step, each
    row's picked token's log-probability under the whole softmax(logits / T) (top-p and the
    suppressed tokens left in), as the trainer scores it; only that (B,) column is kept,
    never a step's (B, V) logits."""

    def __init__(self, seeds: list[int] | None, temperature: float, top_p: float, suppress: list[int] = ()):
        self.seeds = None if seeds is None else torch.tensor(seeds, dtype=torch.int64)
        self.temperature, self.top_p, self.suppress, self.step = temperature, top_p, list(suppress), 0
        self.log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.temperature  # (B, V)
        log_probs = scores.log_softmax(-1)
        if self.suppress:
            scores[:, self.suppress] = float("-inf")
        if self.seeds is None:
            choice = scores.argmax(-1, keepdim=True)
        else:
            choice = self._draw(scores)
        self.step += 1
        self.log_probs.append(log_probs.gather(-1, choice).squeeze(-1))
        return torch.full_like(scores, float("-inf")).scatter(-1, choice, 0.0)

    def _draw(self, scores: torch.Tensor) -> torch.Tensor:
        if self.top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop_sorted = cum - sorted_scores.softmax(-1) > self.top_p  # keep the token crossing top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        cdf = scores.double().softmax(-1).cumsum(-1)  # (B, V), float64: exact enough over a large vocabulary
        target = counter_uniform(self.seeds.to(scores.device), self.step) * cdf[:, -1]
        # the first token whose CDF reaches the draw: its probability is > 0, so never a masked one
        return torch.searchsorted(cdf, target[:, None]).clamp(max=scores.shape[-1] - 1)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer, evaluation and the recipes' nodes need from a rollout engine
    (`rollout.engine`: HFRolloutEngine here, VLLMRolloutEngine in engines/vllm_rollout.py).

    A prompt may be `PromptIds` carrying its images' pixel tensors (data/images.py);
    the HF engine passes them to the model. `generate` returns a Batch with `prompts`/`prompt_mask` (B, P) left-padded,
    `responses`/`response_mask` (B, R) right-padded (R = params.max_new_tokens), and
    `rollout_log_probs` (B, R): the log-probability the engine gave each sampled token
    under softmax(logits / temperature) (0 where masked). Each sequence draws its
    randomness from its own seed, so placement does not change the samples. Every rank
    of a tensor-parallel engine calls `generate` together, each with its own prompts.

    `stop_token_ids`: the ids that end a response (`stop_token_ids()`); the first one
    generated is the response's last token.

    `batches_continuously`: one call takes every request at once and batches them as they
    run (vLLM): the rollout gives it the step's sequences in one call, not in chunks (each
    chunk would wait for its longest sequence, and the engine would batch only a chunk).

    `update_weights` replaces the engine's weights in place from a stream of (HF name,
    full tensor) pairs and records `version` (the trainer's step) as `weight_version`.
    `sleep` releases the engine's memory between its rollouts where it can (vLLM on GPU);
    `generate` and `update_weights` wake it. `close` frees the engine (not the trainer's
    process group)."""

    weight_version: int
    tensor_parallel_size: int
    stop_token_ids: tuple[int, ...]
    batches_continuously: bool

    def generate(self, prompts: list[list[int]], seeds: list[int] | None, params: SamplingParams) -> Batch: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def sleep(self) -> None: ...

    def close(self) -> None: ...


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def stop_token_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS and those the model's generation
    config names (`eos_token_id`, one or a list): an instruct model whose end of turn is
    not its tokenizer's EOS ends there (Gemma's `<end_of_turn>`, Qwen2.5-Instruct's
    `<|endoftext|>` beside `<|im_end|>`, Llama-3's `<|eot_id|>`), as HF's and vLLM's
    own generation stop."""
    extra = getattr(generation_config, "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return tuple(dict.fromkeys([tokenizer.eos_token_id, *extra]))


def response_mask_from(responses: torch.Tensor, stop_ids: Iterable[int]) -> torch.Tensor:
    """1 up to and including the first stop token; a response without one is all valid."""
    is_stop = torch.isin(responses, torch.tensor(list(stop_ids), dtype=responses.dtype))  # (B, R)
    after_stop = (is_stop.long().cumsum(-1) - is_stop.long()) > 0
    return (~after_stop).long()


class _SwapWeightsBetweenTokens:
    """A logits processor that runs after each token's forward: it records the weight
    version that computed the token's logits, then swaps in newer weights if
    `newer_weights()` has any, so that the next token is computed with them (the cache
    of the tokens before stays as the older weights computed it, as in verl's and
    AReaL's partial rollout)."""

    def __init__(self, engine: "HFRolloutEngine"):
        self.engine, self.versions = engine, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.versions.append(self.engine.weight_version)
        newer = self.engine.newer_weights()
        if newer is not None:
            self.engine.update_weights(newer[1], version=newer[0])
        return scores


@contextlib.contextmanager
def _blank_generation_config(model) -> Iterator[None]:
    """The model's generation_config, which HF's `generate` reads the fields a call leaves
    unset from, blank while it generates (a LoRA model's: its base's)."""
    from transformers import GenerationConfig

    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    own, hf_model.generation_config = hf_model.generation_config, GenerationConfig()
    try:
        yield
    finally:
        hf_model.generation_config = own


class HFRolloutEngine:
    """`shares_trainer_weights`: `model` is the actor's own module (a DDP replica, or one
    worker's), so the engine always generates with the latest weights and a weight push
    has nothing to copy. Its weights are the fp32 master copy; `compute_dtype` (bf16)
    generates on them under autocast, as the actor computes (an engine of its own loads
    its weights in the run's dtype instead).

    `newer_weights` (rollout.partial): a function returning (version, weights) when newer
    weights than the engine's have arrived, else None; it is asked after every token, and
    what it returns is swapped in before the next one. `generate` then also returns
    `rollout_weight_version` (B, R): the version that computed each token."""

    newer_weights: Callable[[], tuple[int, Iterable[tuple[str, torch.Tensor]]] | None] | None = None
    batches_continuously = False  # one generate() per micro-batch: a streamed chunk is a batch of its own

    def __init__(self, model, tokenizer, micro_batch_size: int = 128, shares_trainer_weights: bool = False,
                 compute_dtype: torch.dtype = torch.float32):
        self.model = model.eval()
        self.compute_dtype = compute_dtype
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.shares_trainer_weights = shares_trainer_weights
        self.weight_version, self.tensor_parallel_size = 0, 1
        self.stop_token_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        if not shares_trainer_weights:
            for p in self.model.parameters():
                p.requires_grad_(False)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if not self.shares_trainer_weights:
            params = self.model.state_dict(keep_vars=True)  # tied weights appear under each name
            for name, tensor in weights:  # in place, one tensor at a time
                params[name].data.copy_(tensor)
        self.weight_version = version

    def sleep(self) -> None:
        """Nothing to release: the HF model stays resident."""

    def close(self) -> None:
        self.model = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int] | None, params: SamplingParams) -> Batch:
        """The RolloutEngine contract: prompts, responses, masks and the engine's log-prob
        of each sampled token (an empty batch for no prompts)."""
        if not prompts:
            return Batch()
        chunks = []
        with computing_in(self.compute_dtype, next(self.model.parameters()).device):
            for start in range(0, len(prompts), self.micro_batch_size):
                chunk_seeds = None if seeds is None else seeds[start: start + self.micro_batch_size]
                chunks.append(self._generate_chunk(prompts[start: start + self.micro_batch_size], chunk_seeds, params))
        batch = Batch.concat([Batch({"prompts": ids, "prompt_mask": mask, "responses": resp,
                                     "rollout_log_probs": log_probs} | extra) for ids, mask, resp, log_probs, extra in chunks])
        mask = response_mask_from(batch["responses"], self.stop_token_ids)  # (B, R); re-padded prompts
        batch.tensors["response_mask"] = mask
        batch.tensors["rollout_log_probs"] = batch["rollout_log_probs"] * mask
        return batch

    def _shared_prompt_cache(self, ids: torch.Tensor, mask: torch.Tensor) -> dict:
        """The prefill of rows that share a prompt (GRPO's n samples of it), run once per
        distinct prompt: its keys and values for all but its last token, handed to each
        of its rows, so that `generate` starts from them (the last token still runs per
        row and gives the first logits). Empty where no two rows share a prompt, and for a
        model whose cache rows cannot share (`rows_can_share`: a hybrid linear-attention
        or SSM model)."""
        distinct, distinct_mask, row_prompt = distinct_prompts(ids, mask)
        if len(distinct) == len(ids) or ids.shape[1] < 2:
            return {}
        head_ids, head_mask = distinct[:, :-1], distinct_mask[:, :-1]
        positions = (head_mask.cumsum(-1) - 1).masked_fill(head_mask == 0, 1)  # as generate numbers them
        cache_arg, last = cache_arguments(self.model)
        cache = self.model(input_ids=head_ids, attention_mask=head_mask, position_ids=positions, use_cache=True,
                           **last).past_key_values
        if not rows_can_share(cache):
            return {}
        cache.batch_select_indices(row_prompt)
        return {cache_arg: cache}

    def _generate_chunk(self, prompts: list[list[int]], seeds: list[int] | None, params: SamplingParams):
        from transformers import GenerationConfig, LogitsProcessorList

        self.model.eval()  # a shared module comes back from training in train mode; training sets it again
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        processors = LogitsProcessorList()
        swaps = None
        if self.newer_weights is not None:
            swaps = _SwapWeightsBetweenTokens(self)
            processors.append(swaps)
        if not params.greedy:
            assert seeds is not None and len(seeds) == len(prompts), "sampling needs one seed per sequence"
        # A VLM's image placeholders are never generated (a response holding one would not
        # match its images in the scoring forward); their probability is left in the log-probs.
        picker = PerSequenceSampler(None if params.greedy else seeds, params.temperature, params.top_p,
                                    suppress=vision_token_ids(self.model.config))
        processors.append(picker)
        # An explicit config: a model's own generation_config (repetition penalty, top-k,
        # suppressed or forced tokens, ...) must not silently change the policy's
        # distribution in RL, and no processor of HF's runs before the picker, so it sees
        # the model's own logits. (HF fills every field left unset from the model's
        # config: neutral values are explicit here, and that config is a blank one while
        # generating, `_blank_generation_config`.)
        config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=params.max_new_tokens, use_cache=True,
                                  min_new_tokens=0, repetition_penalty=1.0, no_repeat_ngram_size=0,
                                  pad_token_id=self.tokenizer.pad_token_id,
                                  eos_token_id=list(self.stop_token_ids))
        images = {}
        if any(getattr(p, "pixel_values", None) is not None for p in prompts):  # PromptIds with images
            images = {k: v.to(device) for k, v in
                      model_inputs(image_fields(prompts), ids, self.model.config.image_token_id).items()}
        ids, mask = ids.to(device), mask.to(device)
        # a VLM's M-RoPE positions after a handed-in cache come from its previous call's state (another batch's)
        cache = {} if is_vision_language(self.model.config) else self._shared_prompt_cache(ids, mask)
        with _blank_generation_config(self.model):
            out = self.model.generate(input_ids=ids, attention_mask=mask,
                                      generation_config=config, logits_processor=processors, **images, **cache)
        resp = out[:, ids.shape[1]:].cpu()  # (B, R')
        log_probs = torch.stack(picker.log_probs, dim=1).cpu()  # (B, R')
        pad = params.max_new_tokens - resp.shape[1]
        if pad:  # every row stopped early
            resp = torch.nn.functional.pad(resp, (0, pad), value=self.tokenizer.pad_token_id)
            log_probs = torch.nn.functional.pad(log_probs, (0, pad))
        extra = {}
        if swaps is not None:  # the padding after the last token carries the last version
            versions = swaps.versions + [self.weight_version] * (params.max_new_tokens - len(swaps.versions))
            extra["rollout_weight_version"] = torch.tensor(versions, dtype=torch.long).expand(len(prompts), -1).clone()
        return ids, mask, resp, log_probs, extra
