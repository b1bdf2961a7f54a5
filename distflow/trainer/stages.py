"""The named stages of one RL step on one worker. Each reads fields from the worker's
local store and adds the fields it produces; the step loop calls them in order.

    prompts -> rollout -> reward, ref_log_prob, old_log_prob -> advantage -> actor_update
              -> weight_sync

Fields (one row per response, n rows per prompt, prompts interleaved over ranks):
  uid, ground_truth, data_source, extra_info   meta, from the dataset
  group                                        (N,) prompt id: GRPO's groups
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
from distflow.coordinator.store import LocalStore
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


def stage_prompts(store: LocalStore, rows: list[PromptRow], cfg: Config, tokenizer) -> list[list[int]]:
    """This worker's prompts for the step, each repeated group_size times."""
    n = cfg.algorithm.group_size
    ids = tokenize_prompts(tokenizer, rows, cfg.data.max_prompt_length)
    store.put(Batch({"group": torch.tensor([r.index for r in rows for _ in range(n)])}, {
        "uid": [r.index for r in rows for _ in range(n)],
        "ground_truth": [r.ground_truth for r in rows for _ in range(n)],
        "data_source": [r.data_source for r in rows for _ in range(n)],
        "extra_info": [r.extra_info for r in rows for _ in range(n)],
    }))
    return [p for p in ids for _ in range(n)]


def stage_rollout(store: LocalStore, prompt_ids: list[list[int]], rollout: HFRolloutEngine,
                  cfg: Config, step: int) -> None:
    n = cfg.algorithm.group_size
    uids = store.get("uid")["uid"]
    seeds = [sample_seed(cfg.trainer.seed, step, uid, k % n) for k, uid in enumerate(uids)]
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


def stage_ref_log_prob(store: LocalStore, ref: ReferenceModel | None, cfg: Config) -> None:
    if ref is not None:
        store.put(Batch({"ref_log_probs": ref.compute_log_probs(_scoring_view(store), cfg.actor.micro_batch_size)}))


def on_policy(cfg: Config) -> bool:
    """One optimizer step per rollout: the behaviour policy is the current policy, so the
    old log-probs equal the current ones (detached) and need no extra forward."""
    return cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size


def stage_old_log_prob(store: LocalStore, actor: FSDPActor, cfg: Config) -> None:
    if not on_policy(cfg):
        store.put(Batch({"old_log_probs": actor.compute_log_probs(_scoring_view(store), cfg.actor.micro_batch_size)}))


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
        metrics = {"pg_loss": float(pg.loss.detach()), "clip_frac": float(pg.clip_frac) * tokens,
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
    fields = ["prompts", "prompt_mask", "responses", "response_mask", "advantages"]
    fields += ["ref_log_probs"] if cfg.algorithm.use_kl_loss else []
    fields += [] if on_policy(cfg) else ["old_log_probs"]
    batch = store.get(*fields)
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_mini = cfg.actor.ppo_mini_batch_size // world * cfg.algorithm.group_size
    num_minibatches = cfg.actor.ppo_epochs * (len(batch) // local_mini)
    for _ in range(cfg.actor.ppo_epochs):
        for mini in batch.split(local_mini):
            num_tokens = _all_reduce_sum(float(mini["response_mask"].sum()))
            num_seqs = _all_reduce_sum(float(len(mini)))
            sums = actor.train_mini_batch(mini, cfg.actor.micro_batch_size,
                                          make_policy_loss(cfg, num_tokens, num_seqs))
            acc.add_total("actor/pg_loss", sums["pg_loss"] / num_minibatches)
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
