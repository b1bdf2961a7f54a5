"""The named stages of one RL step on one worker. Each reads fields from the worker's
local store and adds the fields it produces; the step loop calls them in order.

    prompts -> rollout -> reward -> advantage -> ref_log_prob -> old_log_prob
            -> actor_update -> weight_sync

With rollout TP groups (rollout.tensor_parallel_size > 1) two reshards join in: after
reward, the replica's halves are gathered on every member (advantage needs whole GRPO
groups); after advantage, the samples move to the balanced data-parallel training
layout, streamed in micro-batch chunks into ref_log_prob.

Fields (one row per response, n rows per prompt, prompts interleaved over replicas):
  sample_id, sample_k                          meta: position * n + k in the step; k
  uid, ground_truth, data_source, extra_info   meta, from the dataset
  group                                        (N,) prompt id: GRPO's groups
  mini_batch                                   (N,) the PPO mini-batch of its prompt
  prompts, prompt_mask                         (N, P) left-padded
  responses, response_mask                     (N, R) right-padded
  rewards, accuracy                            (N,)
  ref_log_probs, old_log_probs                 (N, R)
  advantages                                   (N, R)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distflow.algos import core
from distflow.config import Config
from distflow.coordinator.executor import TransferStats, reshard
from distflow.coordinator.layout import Layout
from distflow.coordinator.microbatch import local_micro_batches, plan_micro_batches
from distflow.coordinator.store import LocalStore
from distflow.coordinator.stream import stream_reshard
from distflow.data.batch import Batch
from distflow.data.dataset import PromptRow
from distflow.engines.actor import FSDPActor, ReferenceModel
from distflow.engines.reward import RewardFn, default_compute_score
from distflow.engines.rollout import HFRolloutEngine, SamplingParams, sample_seed
from distflow.trainer.metrics import MeanAccumulator


def _all_reduce_sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return float(t)


class PromptTooLong(ValueError):
    pass


def tokenize_prompts(tokenizer, rows: list[PromptRow], max_len: int) -> list[list[int]]:
    from distflow.engines.common import render_prompt

    out = []
    for row in rows:
        ids = tokenizer(render_prompt(tokenizer, row.messages), add_special_tokens=False)["input_ids"]
        if len(ids) > max_len:
            raise PromptTooLong(f"prompt {row.index} has {len(ids)} tokens > data.max_prompt_length={max_len}")
        out.append(ids)
    return out


Sequence_ = tuple[int, PromptRow, list[int], int]  # (position in the step's batch, row, prompt ids, k)


def prepare_sequences(rows: list[tuple[int, PromptRow]], cfg: Config, tokenizer,
                      share: tuple[int, int] = (0, 1)) -> list[Sequence_]:
    """This worker's sequences for a step (pure CPU work, so it can be prefetched):
    `rows` are (position in the step's global batch, row) of its rollout replica; with a
    TP group of size t, member j takes every t-th of the replica's sequences (`share`)."""
    n, (member, size) = cfg.algorithm.group_size, share
    ids = tokenize_prompts(tokenizer, [r for _, r in rows], cfg.data.max_prompt_length)
    return [(pos, row, p, k) for (pos, row), p in zip(rows, ids) for k in range(n)][member::size]


def stage_prompts(store: LocalStore, seqs: list[Sequence_], cfg: Config) -> list[list[int]]:
    n, mini = cfg.algorithm.group_size, cfg.actor.ppo_mini_batch_size
    store.put(Batch({"group": torch.tensor([r.index for _, r, _, _ in seqs]),
                     "mini_batch": torch.tensor([pos // mini for pos, _, _, _ in seqs])}, {
        "sample_id": [pos * n + k for pos, _, _, k in seqs], "sample_k": [k for _, _, _, k in seqs],
        "uid": [r.index for _, r, _, _ in seqs], "ground_truth": [r.ground_truth for _, r, _, _ in seqs],
        "data_source": [r.data_source for _, r, _, _ in seqs], "extra_info": [r.extra_info for _, r, _, _ in seqs],
    }))
    return [p for _, _, p, _ in seqs]


def stage_rollout(store: LocalStore, prompt_ids: list[list[int]], rollout: HFRolloutEngine,
                  cfg: Config, step: int) -> None:
    b = store.get("uid", "sample_k")
    seeds = [sample_seed(cfg.trainer.seed, step, uid, k) for uid, k in zip(b["uid"], b["sample_k"])]
    params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            max_new_tokens=cfg.rollout.max_new_tokens)
    store.put(rollout.generate(prompt_ids, seeds, params))


def score_responses(tokenizer, batch: Batch, reward_fn: RewardFn) -> tuple[torch.Tensor, torch.Tensor]:
    texts = tokenizer.batch_decode(batch["responses"] * batch["response_mask"]
                                   + tokenizer.pad_token_id * (1 - batch["response_mask"]),
                                   skip_special_tokens=True)
    rewards, correct = [], []
    for text, gt, src, extra in zip(texts, batch["ground_truth"], batch["data_source"], batch["extra_info"]):
        correct.append(default_compute_score(src, text, gt, extra))
        rewards.append(correct[-1] if reward_fn is default_compute_score else float(reward_fn(src, text, gt, extra)))
    return torch.tensor(rewards, dtype=torch.float32), torch.tensor(correct, dtype=torch.float32)


def stage_reward(store: LocalStore, tokenizer, reward_fn: RewardFn) -> None:
    batch = store.get("responses", "response_mask", "ground_truth", "data_source", "extra_info")
    rewards, correct = score_responses(tokenizer, batch, reward_fn)
    store.put(Batch({"rewards": rewards, "accuracy": correct}))


def _scoring_view(store: LocalStore) -> Batch:
    return store.get("prompts", "prompt_mask", "responses", "response_mask")


def sequence_lengths(batch: Batch) -> list[int]:
    return (batch["prompt_mask"].sum(-1) + batch["response_mask"].sum(-1)).tolist()


def _micro_policy(cfg: Config) -> dict[str, int]:
    if cfg.actor.use_dynamic_bsz:
        return {"max_tokens": cfg.actor.max_tokens_per_micro_batch}
    return {"micro_batch_size": cfg.actor.micro_batch_size}


def micro_batches(batch: Batch, cfg: Config) -> list[list[int]]:
    """The same number of micro-batches on every rank (FSDP's lockstep)."""
    return plan_micro_batches(sequence_lengths(batch), **_micro_policy(cfg))


def stage_ref_log_prob(store: LocalStore, ref: ReferenceModel | None, cfg: Config) -> None:
    if ref is not None:
        view = _scoring_view(store)
        store.put(Batch({"ref_log_probs": ref.compute_log_probs(view, micro_batches(view, cfg))}))


def on_policy(cfg: Config) -> bool:
    """One optimizer step per rollout: the behaviour policy is the current policy, so the
    old log-probs equal the current ones (detached) and need no extra forward."""
    return cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size


def stage_old_log_prob(store: LocalStore, actor: FSDPActor, cfg: Config) -> None:
    if not on_policy(cfg):
        view = _scoring_view(store)
        store.put(Batch({"old_log_probs": actor.compute_log_probs(view, micro_batches(view, cfg))}))


def stage_reshard(store: LocalStore, src: Layout, dst: Layout, balance: str, stats: TransferStats) -> None:
    """Move the step's samples from layout `src` to `dst` (Data Coordinator); with equal
    layouts and balance="none" nothing moves."""
    batch = store.all()
    new, _, _ = reshard(batch, batch["sample_id"], sequence_lengths(batch), src, dst,
                        balance=balance, tolerance=0.02, stats=stats)
    store.replace(new)


def stage_stream_reshard_ref(store: LocalStore, src: Layout, dst: Layout, ref: ReferenceModel | None,
                             cfg: Config, stats: TransferStats) -> None:
    """Reshard to the training layout in micro-batch chunks (double-buffered): the
    reference model scores chunk i while chunk i+1 is in flight."""
    batch = store.all()
    chunks = stream_reshard(batch, batch["sample_id"], sequence_lengths(batch), src, dst,
                            lambda lengths: local_micro_batches(lengths, **_micro_policy(cfg)),
                            balance="kk", tolerance=0.02, stats=stats)
    pieces = []
    for _, (chunk, _) in chunks:
        if not len(chunk):  # this rank has nothing in this chunk; the replicated reference needs no lockstep
            continue
        if ref is not None:
            view = Batch({k: chunk[k] for k in ("prompts", "prompt_mask", "responses", "response_mask")})
            chunk.tensors["ref_log_probs"] = ref.compute_log_probs(view, [list(range(len(chunk)))])
        pieces.append(chunk)
    store.replace(Batch.concat(pieces))


def stage_advantage(store: LocalStore, cfg: Config) -> None:
    b = store.get("rewards", "response_mask", "group")
    estimator = core.get_adv_estimator(cfg.algorithm.name)
    advantages, _ = estimator(rewards=b["rewards"], mask=b["response_mask"].float(), group_ids=b["group"])
    store.put(Batch({"advantages": advantages}))


def make_policy_loss(cfg: Config, num_tokens: float, num_seqs: float):
    """The actor loss for one mini-batch, normalised by its global token/sequence counts."""
    a = cfg.algorithm
    counts = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs}

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor, micro: Batch):
        mask = micro["response_mask"].float()  # (B, R)
        old = micro["old_log_probs"] if "old_log_probs" in micro else log_probs.detach()
        pg = core.policy_loss_vanilla(old, log_probs, micro["advantages"], mask,
                                      clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                                      clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, **counts)
        loss = pg.loss
        tokens = float(mask.sum())
        clip = float(pg.clip_frac) * tokens if tokens else 0.0  # an empty (lockstep-only) micro-batch
        metrics = {"pg_loss": float(pg.loss.detach()), "clip_frac": clip,
                   "entropy": float((entropy.detach() * mask).sum()), "tokens": tokens}
        if a.use_kl_loss:
            kl = core.kl_penalty(log_probs, micro["ref_log_probs"], a.kl_type)
            loss = loss + a.kl_coef * core.agg_loss(kl, mask, a.loss_agg_mode, **counts)
            metrics["kl"] = float((kl.detach() * mask).sum())
        if a.entropy_coef:
            loss = loss - a.entropy_coef * core.agg_loss(entropy, mask, a.loss_agg_mode, **counts)
        return loss, metrics

    return loss_fn


def stage_actor_update(store: LocalStore, actor: FSDPActor, cfg: Config, acc: MeanAccumulator) -> None:
    """PPO epochs over mini-batches. A mini-batch is a fixed set of prompts of the step's
    global batch (its `mini_batch` field), wherever their samples live, so the updates
    do not depend on the number of workers or the layout."""
    fields = ["prompts", "prompt_mask", "responses", "response_mask", "advantages", "mini_batch"]
    fields += ["ref_log_probs"] if cfg.algorithm.use_kl_loss else []
    fields += [] if on_policy(cfg) else ["old_log_probs"]
    batch = store.get(*fields)
    num_minibatches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    for _ in range(cfg.actor.ppo_epochs):
        for index in range(num_minibatches):
            mini = batch.select((batch["mini_batch"] == index).nonzero().flatten())
            num_tokens = _all_reduce_sum(float(mini["response_mask"].sum()))
            num_seqs = _all_reduce_sum(float(len(mini)))
            if not len(mini):  # none of this mini-batch's samples live here: run in lockstep on a masked row
                mini = batch.select([0])
                mini.tensors["response_mask"] = torch.zeros_like(mini["response_mask"])
            sums = actor.train_mini_batch(mini, micro_batches(mini, cfg),
                                          make_policy_loss(cfg, num_tokens, num_seqs))
            acc.add_total("actor/pg_loss", sums["pg_loss"] / (num_minibatches * cfg.actor.ppo_epochs))
            for name in ("clip_frac", "entropy", "kl"):
                if name in sums:
                    acc.add(f"actor/{name}", sums[name], sums["tokens"])
            acc.add("actor/grad_norm", sums["grad_norm"], 1.0)  # identical on every rank


def stage_weight_sync(actor: FSDPActor, rollout: HFRolloutEngine) -> None:
    rollout.load_weights(actor.full_state_dict())


def record_rollout_metrics(store: LocalStore, acc: MeanAccumulator) -> None:
    b = store.get("rewards", "accuracy", "response_mask", "prompt_mask")
    n = len(b)
    acc.add("reward/mean", float(b["rewards"].sum()), n)
    acc.add("reward/accuracy", float(b["accuracy"].sum()), n)
    lengths = b["response_mask"].sum(-1).float()
    acc.add("response/length_mean", float(lengths.sum()), n)
    acc.add_max("response/length_max", float(lengths.max()))
    acc.add_total("tokens/total", float(lengths.sum() + b["prompt_mask"].sum()))
