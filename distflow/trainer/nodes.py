"""The node library: the callables the recipe graphs name (distflow/trainer/recipes.py).

Each is `fn(ctx, batch) -> Batch`: `batch` holds the node's declared inputs for the
samples on this worker, the result its declared outputs. `ctx` is the worker's
`WorkerContext` (engines, config, step, metrics) plus the node's `params`. A user's
node has exactly the same shape, so this file is also the reference for writing one.

Fields (one row per response, n rows per prompt):
  sample_id, sample_k                          meta: global id (prompt position * n + k); k
  uid, ground_truth, data_source, extra_info   meta, from the dataset
  group                                        (N,) the prompt's position in the step: GRPO's groups
  mini_batch                                   (N,) the PPO mini-batch of its prompt
  prompts, prompt_mask                         (N, P) left-padded
  pixel_values, image_grid_thw                 (N, patches, D), (N, images, 3): a VLM's images, padded per
                                               sample (data/images.py); absent for text-only data
  responses, response_mask                     (N, R) right-padded
  scores, accuracy                             (N,) reward, and the strict correctness metric
  baseline_scores                              (N,) ReMax: the reward of the prompt's greedy response
  ref_log_probs, old_log_probs, values         (N, R)
  rollout_log_probs                            (N, R) the engine's log-prob of each sampled token
  token_rewards                                (N, R) scores on the last token minus the KL penalty
  advantages, returns                          (N, R)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, Callable, Iterator, NamedTuple

import torch

from distflow.algos import core, kl
from distflow.algos.correction import rollout_correction
from distflow.algos.estimators import ADV_ESTIMATORS, ESTIMATOR_INFO, AdvantageInputs, Estimator, EstimatorInfo
from distflow.algos.estimators import estimator_info, get_adv_estimator
from distflow.collectives import all_reduce_sum, is_first_rank
from distflow.config import Config, overlong_buffer_tokens, response_token_budget
from distflow.coordinator.microbatch import local_micro_batches, plan_micro_batches
from distflow.data.batch import FILTERED_OUT, Batch, prompt_and_response_lengths
from distflow.data.dataset import DatasetError, PromptRow
from distflow.data.images import IMAGE_FIELDS, ImagePrompter, attach_images, decode_image, image_fields
from distflow.engines.actor import Actor
from distflow.engines.agent import COUNTS as EPISODE_COUNTS
from distflow.engines.agent import FAILED_EPISODE_FIELDS, EpisodeRunner
from distflow.engines.common import LogProbModel
from distflow.engines.critic import Critic
from distflow.engines.reward import FAILED, OK, TIMED_OUT, RewardRunner, rule_reads
from distflow.engines.reward_model import RewardModel
from distflow.engines.rollout import RolloutEngine, SamplingParams, left_pad, sample_seed
from distflow.plugins import load_callable
from distflow.trainer.metrics import MeanAccumulator


@dataclass
class WorkerContext:
    """What every node sees on this worker."""

    cfg: Config
    tokenizer: Any
    rollout: RolloutEngine
    actor: Actor
    ref: LogProbModel | None = None
    critic: Critic | None = None
    reward_fn: RewardRunner | RewardModel | None = None  # the configured reward, run safely, or reward.model_path
    accuracy_fn: RewardRunner | None = None  # the default (strict) reward: the accuracy metric
    overlap: bool = False  # scheduler.overlap as resolved for this worker: stream the rollout in chunks
    reward_kl: kl.FixedKLController | kl.AdaptiveKLController | None = None  # beta of KL in the reward
    episodes: EpisodeRunner | None = None  # rollout.max_turns > 1: multi-turn episodes instead of one generate
    step: int = 0
    acc: MeanAccumulator = field(default_factory=MeanAccumulator)  # the step's metrics, from any node's thread


# ---------------------------------------------------------------------------- prompts


def encode_prompt(tokenizer, row: PromptRow, images: ImagePrompter | None = None,
                  max_image_pixels: int | None = None, tools: list[dict] | None = None) -> list[int]:
    """The row's prompt ids; with `images` (a VLM's processor) a PromptIds holding its
    images' pixels; `tools`: the rollout's tool schemas, for the chat template."""
    from distflow.engines.common import render_prompt

    text = render_prompt(tokenizer, row.messages, tools)
    if images is None:
        if row.images:
            raise DatasetError("the row has images but model.path is a text-only model (its folder has no "
                               "preprocessor_config.json)")
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return images.encode(tokenizer, text, [decode_image(entry, max_image_pixels) for entry in row.images])


def source_batch(rows: list[tuple[int, tuple[int, int], PromptRow, list[int]]], cfg: Config, pad_id: int,
                 share: tuple[int, int] = (0, 1), images: ImagePrompter | None = None) -> Batch:
    """The step's source fields for this worker (pure CPU work, so it is prefetched):
    `rows` are (position in the step's global batch, draw, row, prompt ids) of its rollout
    replica, the draw being (epoch, refill round) of the position; with a TP group of
    size t, member j takes every t-th of the replica's sequences (`share`). `images`: a
    vision-language run's prompter, whose batches carry the image fields even where no
    row here has an image."""
    n, (member, size), mini = cfg.algorithm.group_size, share, cfg.actor.ppo_mini_batch_size
    seqs = [_Sequence(pos, draw, row, ids, k) for pos, draw, row, ids in rows for k in range(n)][member::size]
    if not seqs:
        return Batch()
    prompts, mask = left_pad([s.ids for s in seqs], pad_id)
    blank_image = (images.patch_width, images.pixel_dtype) if images else ()  # the fields' shape without an image
    return Batch({"prompts": prompts, "prompt_mask": mask, **image_fields([s.ids for s in seqs], *blank_image),
                  "group": torch.tensor([s.pos for s in seqs]),
                  "mini_batch": torch.tensor([(s.pos % cfg.data.train_batch_size) // mini for s in seqs])},
                 {"sample_id": [s.pos * n + s.k for s in seqs], "sample_k": [s.k for s in seqs],
                  "uid": [s.row.index for s in seqs], "draw": [list(s.draw) for s in seqs],
                  "ground_truth": [s.row.ground_truth for s in seqs],
                  "data_source": [s.row.data_source for s in seqs], "extra_info": [s.row.extra_info for s in seqs],
                  "prompt_messages": [s.row.messages for s in seqs]})


class _Sequence(NamedTuple):
    """One response to generate: its prompt's position in the step, draw, row and ids, and k."""

    pos: int
    draw: tuple[int, int]
    row: PromptRow
    ids: list[int]
    k: int


def sample_seeds(cfg: Config, step: int, batch: Batch) -> list[int]:
    """One seed per sequence, from (run seed, step, dataset row, k) and, where the row's
    draw is not the step's first epoch outside a refill round, that draw: a row drawn twice
    in one step (a DAPO refill round, a step across an epoch boundary) samples anew
    rather than repeating its group. (Only those draws carry it, so runs within one epoch
    keep the seeds, and the samples, they always had.)"""
    return [sample_seed(cfg.trainer.seed, step, uid, k, *draw) if any(draw) else
            sample_seed(cfg.trainer.seed, step, uid, k)
            for uid, k, draw in zip(batch["uid"], batch["sample_k"], batch["draw"])]


def task(messages: list[dict], ground_truth, data_source: str, extra_info: dict) -> dict:
    """What an environment's reset (or an agent) sees of one sample: its own copies of the
    row's messages and extra_info (one list serves the row's whole group, and a held-out
    row every evaluation: an agent appending to its prompt must not change the others')."""
    return {"prompt": copy.deepcopy(messages), "ground_truth": ground_truth, "data_source": data_source,
            "extra_info": copy.deepcopy(extra_info)}


def tasks_of(batch: Batch) -> list[dict]:
    """`task` of each row of `batch`."""
    return [task(*row) for row in zip(batch["prompt_messages"], batch["ground_truth"], batch["data_source"],
                                      batch["extra_info"])]


def unpad_prompts(batch: Batch) -> list[list[int]]:
    """Each row's prompt ids, with its images where the batch has some (PromptIds)."""
    return attach_images([ids[mask.bool()].tolist() for ids, mask in zip(batch["prompts"], batch["prompt_mask"])],
                         batch.tensors)


# ---------------------------------------------------------------------------- rollout and reward


def rollout(ctx: WorkerContext, batch: Batch) -> Iterator[tuple[range, Batch]]:
    """Streams responses in chunks of `scheduler.stream_chunk_size` sequences where the
    scheduler overlaps; one chunk of every sequence for an engine that batches a whole
    call as it runs (vLLM), a tensor-parallel replica (its members call together) and
    multi-turn episodes."""
    cfg = ctx.cfg
    prompts = unpad_prompts(batch)
    seeds = sample_seeds(cfg, ctx.step, batch)
    params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            max_new_tokens=cfg.rollout.max_new_tokens)
    if ctx.episodes is not None:  # multi-turn: every episode to its end, then one chunk
        out = ctx.episodes.generate(prompts, seeds, params, tasks_of(batch))
        failed = torch.zeros(len(prompts), dtype=torch.bool)
        for name in FAILED_EPISODE_FIELDS:  # every episode that failed, a refill round's and a dropped group's too
            if name in out and ctx.counts_rows:
                ctx.acc.add_total(name.replace("_", "/", 1), float(out[name].sum()))
                failed |= out[name].bool()
        if ctx.counts_rows:  # a step whose every episode failed learns nothing (trainer.max_bad_steps)
            ctx.acc.add_total("episodes/total", float(len(prompts)))
            ctx.acc.add_total("episodes/failed", float(failed.sum()))
        yield range(len(prompts)), out
    elif ctx.rollout.tensor_parallel_size > 1 or ctx.rollout.batches_continuously:
        out = ctx.rollout.generate(prompts, seeds, params)  # a replica's ranks generate together: one call each
        if prompts:
            yield range(len(prompts)), _generated(out)
    else:
        size = cfg.scheduler.stream_chunk_size if ctx.overlap else max(len(prompts), 1)
        for start in range(0, len(prompts), size):
            rows = range(start, min(start + size, len(prompts)))
            out = ctx.rollout.generate(prompts[rows.start:rows.stop], seeds[rows.start:rows.stop], params)
            yield rows, _generated(out)
    ctx.rollout.sleep()  # until the weight push (a no-op where the engine cannot release memory)


def _generated(out: Batch) -> Batch:
    """What a rollout adds to its rows: the responses, their masks, the engine's log-probs
    and, with rollout.partial, each token's weight version."""
    return Batch({k: out[k] for k in ("responses", "response_mask", "rollout_log_probs", "rollout_weight_version")
                  if k in out.tensors})


def score_responses(tokenizer, batch: Batch, reward_fn: RewardRunner | RewardModel, accuracy_fn: RewardRunner | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, list[float]]]:
    """(rewards, accuracy, status, extras): extras are the other numbers of a reward
    function's dict results, name -> [sum, samples] (`extras_of`); a function that returns
    an "acc" (verl's DAPO scorer) gives the accuracy itself. Otherwise accuracy is 1 where
    the rule-based scorer gives full marks (a code response passes every test), else 0 (and
    0 without `accuracy_fn`); where the rule reads no such ground truth (a structure, verl's
    search data), where the reward does (a custom function's full marks); status is OK,
    FAILED (raised or not a number) or TIMED_OUT per sample; a failed sample scores 0 and
    the run goes on. A reward model scores the batch at once, from the prompts'
    messages and the responses (an episode's: its turns and observations, `episode_messages`)."""
    shown = batch["response_mask"].bool()
    if "observation_mask" in batch:
        shown = shown | batch["observation_mask"].bool()
    shown = shown.long()
    texts = tokenizer.batch_decode(batch["responses"] * shown + tokenizer.pad_token_id * (1 - shown),
                                   skip_special_tokens=True)
    learned = isinstance(reward_fn, RewardModel)
    rewards, correct, status, extras = [], [], [], {}
    samples = list(zip(batch["data_source"], texts, batch["ground_truth"], reward_extra_info(batch)))
    results = [(0.0, OK, {})] * len(samples) if learned else reward_fn.scored_all(samples)
    for (src, text, gt, extra), (value, state, more) in zip(samples, results):
        rewards.append(value)
        status.append(state)
        for name, number in more.items():
            tally = extras.setdefault(name, [0.0, 0.0])
            tally[0], tally[1] = tally[0] + number, tally[1] + 1
        if "acc" in more:  # the function's own accuracy
            marks = more["acc"]
        elif accuracy_fn is reward_fn:
            marks = value
        elif accuracy_fn is None:
            marks = 0.0
        elif rule_reads(src, gt):
            marks = accuracy_fn(src, text, gt, extra)[0]
        else:  # a ground truth the rule reads no answer from: the custom function's full marks
            marks = 0.0 if learned else value
        correct.append(1.0 if marks >= 1.0 else 0.0)
    scores, status = torch.tensor(rewards, dtype=torch.float32), torch.tensor(status, dtype=torch.long)
    if learned:  # a non-finite score (an overflow) scores 0 and counts as failed, as a function's does
        after = batch["episode_messages"] if "episode_messages" in batch else \
            [[{"role": "assistant", "content": text}] for text in texts]
        scores = reward_fn.score([[*prompt, *rest] for prompt, rest in zip(batch["prompt_messages"], after)])
        bad = ~torch.isfinite(scores)
        scores, status = scores.masked_fill(bad, 0.0), status.masked_fill(bad, FAILED)
    return scores, torch.tensor(correct, dtype=torch.float32), status, extras


def reward_extra_info(batch: Batch) -> list:
    """Each row's extra_info as a reward function sees it: a deep copy with what verl's reward
    managers add, `num_turns` (as verl counts them: the prompt, each assistant turn and each
    observation between them; 2 for one turn) and `rollout_reward_scores` (what the rollout
    scored: {"env": the environment's rewards} or {"agent": what rollout.agent returned});
    an extra_info that is not a mapping is passed as it is."""
    n = len(batch["extra_info"])
    assistant = batch["num_turns"].tolist() if "num_turns" in batch else [1] * n
    observations = [0] * n
    if "observation_mask" in batch:  # the runs of observation tokens
        starts = batch["observation_mask"].diff(dim=1, prepend=torch.zeros_like(batch["observation_mask"][:, :1]))
        observations = (starts == 1).sum(dim=1).tolist()
    given = next(((name, batch[f"{name}_scores"].tolist()) for name in ("env", "agent") if f"{name}_scores" in batch),
                 None)
    return [{**copy.deepcopy(extra), "num_turns": 1 + int(a) + int(o),
             "rollout_reward_scores": {} if given is None else {given[0]: given[1][i]}} if isinstance(extra, dict)
            else extra for i, (extra, a, o) in enumerate(zip(batch["extra_info"], assistant, observations))]


def rollout_reward_field(cfg: Config) -> str | None:
    """The rollout's field that is the reward, where the run takes it from the rollout:
    what rollout.agent's `run` returned, or with reward.from_env the sum of the
    environment's rewards (the reward node, and held-out evaluation, read it)."""
    return "agent_scores" if cfg.rollout.agent is not None else "env_scores" if cfg.reward.from_env else None


def reward(ctx: WorkerContext, batch: Batch) -> Batch:
    scores, correct, status, extras = score_responses(ctx.tokenizer, batch, ctx.reward_fn, ctx.accuracy_fn)
    given = rollout_reward_field(ctx.cfg)  # rollout.agent's return value / reward.from_env's sum of the
    if given is not None:                  # environment's rewards is the reward; accuracy as always
        scores, status = batch[given], torch.zeros_like(status)
    if ctx.counts_rows:  # every sample scored, a refill round's and those a filter drops later too
        ctx.acc.add_total("reward/scored", float(len(status)))
        ctx.acc.add_total("reward/failed", float((status == FAILED).sum()))
        ctx.acc.add_total("reward/timed_out", float((status == TIMED_OUT).sum()))
        for name, (total, samples) in extras.items():  # the function's own numbers, over the samples giving each
            ctx.acc.add(f"reward_extra/{name}", total, samples)
    return Batch({"scores": scores, "accuracy": correct, "reward_status": status})


def overlong_penalty(ctx: WorkerContext, batch: Batch) -> Batch:
    """DAPO's soft overlong punishment, added to the score (`overlong_buffer_tokens` > 0):
    a response's length against rollout.max_new_tokens; a multi-turn episode's (its turns
    and the tool or environment tokens between them) against its budget,
    rollout.max_total_tokens (0: max_new_tokens per turn, max_turns of them)."""
    length = batch["response_mask"].sum(-1)
    if "observation_mask" in batch:
        length = length + batch["observation_mask"].sum(-1)
    return Batch({"shaped_scores": batch["scores"] + _overlong(ctx.cfg, length)})


def _overlong(cfg: Config, length: torch.Tensor) -> torch.Tensor:
    """DAPO's penalty of responses of `length` tokens against the run's budget."""
    a = cfg.algorithm
    return core.overlong_reward_penalty(length, response_token_budget(cfg), overlong_buffer_tokens(cfg),
                                        a.overlong_penalty_factor)


def dynamic_sampling(ctx: WorkerContext, batch: Batch) -> Batch:
    """algorithm.dynamic_sampling (DAPO): keep only groups whose rewards differ (an
    all-equal group has no signal)."""
    scores, groups = batch[ctx.params["reward_field"]], batch["group"]
    keep = torch.zeros(len(groups), dtype=torch.bool)
    for g in groups.unique():
        rows = groups == g
        keep[rows] = bool(scores[rows].max() > scores[rows].min())
    return Batch({"kept": keep})


def drop_failed_groups(ctx: WorkerContext, batch: Batch) -> Batch:
    """rollout.on_failed_episode=drop_group: keep only the prompt groups none of whose
    episodes failed (an environment or an agent that raised). A failure says nothing about
    the policy: scored 0 it would push the policy away from what it sampled, and the group's
    other samples would be judged against that 0."""
    failed, groups = batch[ctx.params["failed_field"]].bool(), batch["group"]
    bad = groups[failed].unique()
    if ctx.counts_rows:
        ctx.acc.add_total(ctx.params["failed_field"].split("_")[0] + "/dropped_groups", float(len(bad)))
    return Batch({"no_failed_episode": ~torch.isin(groups, bad)})


def greedy_baseline(ctx: WorkerContext, batch: Batch) -> Batch:
    """ReMax's baseline: one greedy response per prompt group on this worker, scored by
    the run's reward function (and DAPO's overlong shaping, where the samples have it);
    every sample of the group gets that score."""
    groups = batch["group"].tolist()
    first: dict[int, int] = {}  # group -> its first row here
    for row, group in enumerate(groups):
        first.setdefault(group, row)
    rows = list(first.values())
    prompts = unpad_prompts(batch.select(rows))
    # every rank asks, with no rows too (a rank the filter emptied): a tensor-parallel engine gathers its replica's
    out = ctx.rollout.generate(prompts, None, SamplingParams(max_new_tokens=ctx.cfg.rollout.max_new_tokens,
                                                             greedy=True))
    ctx.rollout.sleep()  # it woke for these, after the rollout's sleep: asleep again before the update
    if not rows:
        return Batch({"baseline_scores": torch.zeros(0, dtype=torch.float32)})
    out.meta.update({k: [batch[k][i] for i in rows]
                     for k in ("ground_truth", "data_source", "extra_info", "prompt_messages") if k in batch})
    scores, _, _, _ = score_responses(ctx.tokenizer, out, ctx.reward_fn, None)
    if overlong_buffer_tokens(ctx.cfg):  # shaped as the samples' scores are (overlong_penalty)
        scores = scores + _overlong(ctx.cfg, out["response_mask"].sum(-1))
    by_group = dict(zip(first, scores.tolist()))
    return Batch({"baseline_scores": torch.tensor([by_group[g] for g in groups], dtype=torch.float32)})


# ---------------------------------------------------------------------------- forwards


def _micro_policy(cfg: Config) -> dict[str, int]:
    if cfg.actor.use_dynamic_bsz:
        return {"max_tokens": cfg.actor.max_tokens_per_micro_batch}
    return {"micro_batch_size": cfg.actor.micro_batch_size}


def micro_batches(batch: Batch, cfg: Config) -> list[list[int]]:
    """The same number of micro-batches on every rank (FSDP's lockstep): a collective."""
    return plan_micro_batches(prompt_and_response_lengths(batch), **_micro_policy(cfg))


def ref_log_prob(ctx: WorkerContext, batch: Batch) -> Batch:
    """The replicated reference needs no lockstep, so its micro-batches are local."""
    micro = local_micro_batches(prompt_and_response_lengths(batch), **_micro_policy(ctx.cfg))
    return Batch({"ref_log_probs": ctx.ref.compute_log_probs(batch, micro)})


def old_log_prob(ctx: WorkerContext, batch: Batch) -> Batch:
    return Batch({"old_log_probs": ctx.actor.compute_log_probs(batch, micro_batches(batch, ctx.cfg))})


def critic_values(ctx: WorkerContext, batch: Batch) -> Batch:
    return Batch({"values": ctx.critic.compute_values(batch, micro_batches(batch, ctx.cfg))})


# ---------------------------------------------------------------------------- advantage


def _summed_over_workers(ctx) -> Callable[..., list[float]]:
    """`all_reduce_sum` of numbers about this worker's rows, each row counted once: a
    worker whose rows another member of its replica counts adds zeros
    (`NodeContext.counts_rows`)."""
    return lambda *values: all_reduce_sum(*(values if ctx.counts_rows else [0.0] * len(values)))


def kl_in_reward(ctx: WorkerContext, batch: Batch) -> Batch:
    """algorithm.use_kl_in_reward: token rewards = the score on the last token minus
    beta * KL(sampler || reference) on every token, with beta from the controller; the
    controller then sees the batch's mean KL over all workers (a collective)."""
    a, mask = ctx.cfg.algorithm, batch["response_mask"].float()
    scores = core.token_level_rewards(batch[ctx.params["reward_field"]], mask)  # (B, R)
    beta = ctx.reward_kl.value
    rewards, per_token = kl.kl_penalized_rewards(scores, batch["rollout_log_probs"], batch["ref_log_probs"], mask,
                                                 beta, resolve_kl(a.reward_kl_type))
    seq_kl = kl.sequence_mean_kl(per_token, mask)  # (B,); 0 for a row with no tokens (a filter's masked rows)
    rows = float((mask.sum(-1) > 0).sum())  # the responses that have a KL
    total, count = _summed_over_workers(ctx)(float(seq_kl.sum()), rows)
    current_kl = total / max(count, 1.0)
    ctx.reward_kl.update(current_kl, int(count))
    ctx.acc.add("reward_kl/penalty", float(seq_kl.sum()), rows)
    ctx.acc.add("reward_kl/coef", beta, 1.0)
    return Batch({"token_rewards": rewards})


@lru_cache(maxsize=None)  # once per run, not per micro-batch (a file.py is executed to load it)
def resolve_kl(spec: str) -> Callable:
    """algorithm.kl_type / reward_kl_type: a registered KL estimator's name, or
    `module:function` / `file.py:function`; `+` after either: its straight-through variant."""
    if ":" not in spec:
        return kl.get_kl(spec)
    plus = spec.endswith("+")
    fn = load_callable(spec[:-1] if plus else spec, "KL estimator")
    return kl.straight_through(fn) if plus else fn


def resolve_estimator(spec: str) -> tuple[Estimator, EstimatorInfo]:
    """A registered name, or `module:function` / `file.py:function` (importing it runs its
    `@register_adv_est`, which says what it needs; an unregistered function needs nothing)."""
    if ":" not in spec:
        return get_adv_estimator(spec), estimator_info(spec)
    fn = load_callable(spec, "algorithm.estimator")
    name = next((n for n, f in ADV_ESTIMATORS.items() if f is fn), None)
    return fn, ESTIMATOR_INFO[name] if name else EstimatorInfo((), False)


def advantage(ctx: WorkerContext, batch: Batch) -> Batch:
    """The configured estimator through the one registry signature; whitening is over
    the whole step's batch (all-reduced), so 1 and N workers agree."""
    a = ctx.cfg.algorithm
    estimator, info = resolve_estimator(ctx.params["estimator"])
    rewards, mask = batch[ctx.params["reward_field"]], batch["response_mask"].float()
    token_rewards = rewards if rewards.dim() == 2 else core.token_level_rewards(rewards, mask)  # (B, R)
    inputs = AdvantageInputs(token_rewards=token_rewards, mask=mask, group_ids=batch["group"],
                             values=batch["values"] if "values" in info.needs else None,
                             baseline=batch["baseline_scores"] if "baseline" in info.needs else None,
                             gamma=a.gamma, lam=a.lam,
                             whiten=partial(core.batch_whiten, sum_fn=_summed_over_workers(ctx)))
    advantages, returns = estimator(inputs)
    return Batch({"advantages": advantages, "returns": returns} if "values" in info.needs
                 else {"advantages": advantages})


# ---------------------------------------------------------------------------- updates


def make_policy_loss(cfg: Config, num_tokens: float, num_seqs: float, policy_loss: str = "vanilla"):
    """The actor loss for one mini-batch, normalised by its global token/sequence counts."""
    a = cfg.algorithm
    counts = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs}
    loss_impl = core.get_policy_loss(policy_loss)

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor, micro: Batch):
        mask = micro["response_mask"].float()  # (B, R)
        old = (micro["old_log_probs"] if "old_log_probs" in micro else
               micro["rollout_log_probs"] if a.old_log_probs_from == "rollout" else log_probs.detach())
        tokens = float(mask.sum())
        weights, metrics = None, {}
        if a.rollout_correction != "off":  # the engine's probabilities are not the trainer's
            fix = rollout_correction(old, micro["rollout_log_probs"], mask, a.rollout_correction,
                                     a.rollout_correction_cap)
            weights = fix.weights
            metrics = {"rollout_correction/mismatch_kl": float(fix.mismatch_kl) * tokens,
                       "rollout_correction/weight_mean": float(fix.weight_mean) * tokens,
                       "rollout_correction/corrected_fraction": float(fix.corrected_fraction) * tokens,
                       "rollout_correction/weight_max": float(fix.weight_max)}
        pg = loss_impl(old, log_probs, micro["advantages"], mask, clip_ratio_low=a.clip_ratio_low,
                       clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                       loss_agg_mode=a.loss_agg_mode, token_weights=weights, **counts)
        loss = pg.loss
        def token_sum(mean: torch.Tensor) -> float:  # a token mean as a sum; the step divides by all its tokens
            return float(mean) * tokens if tokens else 0.0  # an empty (lockstep-only) micro-batch

        metrics |= {"pg_loss": float(pg.loss.detach()), "clip_frac": token_sum(pg.clip_frac),
                    "clip_frac_lower": token_sum(pg.clip_frac_lower), "approx_kl": token_sum(pg.approx_kl),
                    "entropy": float((entropy.detach() * mask).sum()), "tokens": tokens}
        if a.use_kl_loss:
            kl_loss = kl.kl_penalty(log_probs, micro["ref_log_probs"], resolve_kl(a.kl_type))
            loss = loss + a.kl_coef * core.agg_loss(kl_loss, mask, a.loss_agg_mode, **counts)
            metrics["kl"] = float((kl_loss.detach() * mask).sum())
        if a.entropy_coef:
            loss = loss - a.entropy_coef * core.agg_loss(entropy, mask, a.loss_agg_mode, **counts)
        return loss, metrics

    return loss_fn


def make_value_loss(cfg: Config, num_tokens: float, num_seqs: float):
    def loss_fn(values: torch.Tensor, _, micro: Batch):
        mask = micro["response_mask"].float()
        loss, clip = core.value_loss_clipped(values, micro["values"], micro["returns"], mask,
                                             cfg.critic.value_clip, cfg.algorithm.loss_agg_mode,
                                             global_num_tokens=num_tokens, global_num_seqs=num_seqs)
        tokens = float(mask.sum())
        return loss, {"vf_loss": float(loss.detach()), "vf_clip_frac": float(clip) * tokens if tokens else 0.0,
                      "tokens": tokens}

    return loss_fn


def _mini_batches(ctx: WorkerContext, batch: Batch, engine, make_loss, prefix: str) -> None:
    """PPO epochs over mini-batches. A mini-batch is a fixed set of prompts of the step's
    global batch (its `mini_batch` field), wherever their samples live, so the updates
    do not depend on the number of workers or the layout."""
    cfg, acc = ctx.cfg, ctx.acc
    num_minibatches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    losses: dict[str, float] = {}  # summed over the updates that ran (not a mini-batch with no tokens, nor a skipped one)
    updates = 0
    for _ in range(cfg.actor.ppo_epochs):
        for index in range(num_minibatches):
            mini = batch.select((batch["mini_batch"] == index).nonzero().flatten())
            # sequences as agg_loss counts them: rows with a token (a filter's masked rows have none)
            num_tokens, num_seqs = all_reduce_sum(float(mini["response_mask"].sum()),
                                                  float((mini["response_mask"].sum(-1) > 0).sum()))
            if not num_tokens:  # nothing to learn from anywhere (every response empty)
                continue
            if not len(mini):  # none of this mini-batch's samples live here: run in lockstep on a masked row
                mini = batch.select([0])
                mini.tensors["response_mask"] = torch.zeros_like(mini["response_mask"])
            micro = micro_batches(mini, cfg)
            acc.add(f"{prefix}/micro_batches", float(len(micro)), 1.0)  # per update, the same on every rank
            sums = engine.train_mini_batch(mini, micro, make_loss(num_tokens, num_seqs))
            # a count, from one rank (a skip is the same on every rank: the norm is global)
            acc.add_total(f"{prefix}/skipped_updates", sums["skipped"] if is_first_rank() else 0.0)
            if sums["skipped"]:  # a non-finite loss or gradient: its losses and metrics are left out, as its update
                continue
            updates += 1
            for name, value in sums.items():
                if name in ("skipped", "tokens"):
                    continue
                if name.endswith("_loss"):
                    losses[name] = losses.get(name, 0.0) + value
                elif name == "grad_norm":  # identical on every rank
                    acc.add(f"{prefix}/grad_norm", value, 1.0)
                elif name.endswith("_max"):  # the largest over micro-batches, then over ranks
                    acc.add_max(name if "/" in name else f"{prefix}/{name}", value)
                else:
                    acc.add(name if "/" in name else f"{prefix}/{name}", value, sums["tokens"])
    for name, total in losses.items():  # the mean over the updates that ran, the same count on every rank
        acc.add_total(f"{prefix}/{name}", total / updates)
    engine.release_gradients()


def actor_update(ctx: WorkerContext, batch: Batch) -> None:
    policy_loss = ctx.params.get("policy_loss", "vanilla")
    if ctx.cfg.algorithm.mask_truncated_responses:  # for the loss alone: the step's other nodes see every token
        cut = truncated(batch, ctx.rollout.stop_token_ids)
        batch = Batch({**batch.tensors, "response_mask": batch["response_mask"] * ~cut[:, None]}, batch.meta)
    _mini_batches(ctx, batch, ctx.actor, lambda t, s: make_policy_loss(ctx.cfg, t, s, policy_loss), "actor")


def truncated(batch: Batch, stop_ids) -> torch.Tensor:
    """(N,) bool: the responses whose last token is no stop token, cut at their token budget
    (TRL's is_truncated; an episode's last assistant token: its last turn was cut)."""
    mask = batch["response_mask"].bool()
    last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)  # the last generated token's column
    ends = batch["responses"].gather(1, last[:, None]).squeeze(1)
    return mask.any(-1) & ~torch.isin(ends, torch.tensor(list(stop_ids), dtype=ends.dtype))


def critic_update(ctx: WorkerContext, batch: Batch) -> None:
    _mini_batches(ctx, batch, ctx.critic, lambda t, s: make_value_loss(ctx.cfg, t, s), "critic")


# ---------------------------------------------------------------------------- after the graph


def record_rollout_metrics(batch: Batch, acc: MeanAccumulator, budget: int, episodes: bool = False) -> None:
    """The step's rows as they trained: those a filter masked instead of dropping them
    (`FILTERED_OUT`, dag/scheduler.py) are left out, as dropped rows are. `budget`: a
    response's tokens (`response_token_budget`): the share that reached it is
    `response/clip_ratio`, as verl counts its response_length/clip_ratio."""
    if FILTERED_OUT in batch:
        batch = batch.select((~batch[FILTERED_OUT]).nonzero().flatten().tolist())
    n = len(batch)
    reward_field = "shaped_scores" if "shaped_scores" in batch else "scores"
    acc.add("reward/mean", float(batch[reward_field].sum()) if n else 0.0, n)
    acc.add("reward/accuracy", float(batch["accuracy"].sum()) if n else 0.0, n)
    # a response's tokens: a multi-turn episode's tool and environment tokens too, as the forward sees them
    lengths = torch.tensor([r for _, r in prompt_and_response_lengths(batch)] if n else [0], dtype=torch.float32)
    acc.add("response/length_mean", float(lengths.sum()), n)
    acc.add_max("response/length_max", float(lengths.max()))
    acc.add("response/clip_ratio", float((lengths >= budget).sum()) if n else 0.0, n)
    acc.add_total("tokens/total", float(lengths.sum() + (batch["prompt_mask"].sum() if n else 0)))
    if "pixel_values" in batch:  # a VLM's: the bytes the step's images take in the batch (padded per sample)
        acc.add_total("images/batch_bytes", float(sum(batch[f].numel() * batch[f].element_size()
                                                      for f in IMAGE_FIELDS)))
    if episodes:  # multi-turn: turns (or an agent's calls) per sample, tool calls, errors and timeouts of the step
        acc.add("turns/mean", float(batch["num_turns"].sum()) if n else 0.0, n)
        for name in (*EPISODE_COUNTS, "agent_tool_calls", "agent_out_of_budget"):
            if name in batch and name not in FAILED_EPISODE_FIELDS:  # counted as they happen (rollout)
                acc.add_total(name.replace("_", "/", 1), float(batch[name].sum()) if n else 0.0)
