"""Evaluating a policy on held-out prompts, the same code in training and in `distflow eval`.

Greedy accuracy (a prompt counts when the rule-based scorer gives full marks) and the
mean reward (the configured reward function: `reward.custom_fn`, `reward.gsm8k_mode`; or,
as in training, what rollout.agent's `run` returned, or the environment's rewards with
reward.from_env),
and with `k` samples per prompt at a temperature mean@k (the mean accuracy of the
samples) and pass@k (a prompt counts when any of its k samples is right), overall, per `data_source` and per `extra_info["level"]` where rows have one,
plus response-length statistics. Each worker scores its own rows (every world-th of the
file's), and one object all-gather of a few sums per worker combines them: no worker
sees another's responses. Samples are seeded per (run seed, row, sample), so the numbers
do not depend on the number of workers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from distflow.collectives import all_gather_objects
from distflow.data.dataset import PromptRow
from distflow.engines.agent import FAILED_EPISODE_FIELDS, EpisodeRunner
from distflow.engines.reward import RewardRunner
from distflow.engines.rollout import RolloutEngine, SamplingParams, sample_seed
from distflow.trainer.nodes import score_responses, task

Tally = dict[str, list[float]]  # metric -> [sum, count]; summed over workers
_EVAL_STREAM = 7_340_033  # seeds of evaluation samples never equal a training step's


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    max_new_tokens: int
    k: int = 0  # samples per prompt for mean@k / pass@k; 0 = greedy only
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 1
    # the rollout's field that is the reward, as in training (nodes.rollout_reward_field)
    reward_field: str | None = None


def _groups(row: PromptRow, by_source: bool) -> list[str]:
    """The slices a row counts in: all rows, its level (if any) and its data source."""
    level = row.extra_info.get("level") if isinstance(row.extra_info, dict) else None
    return ([""] + ([f"/level_{level}"] if level is not None else [])
            + ([f"/data_source/{row.data_source}"] if by_source else []))


def _add(tally: Tally, name: str, value: float) -> None:
    entry = tally.setdefault(name, [0.0, 0.0])
    entry[0] += value
    entry[1] += 1


def _scored(engine: RolloutEngine, tokenizer, rows: list[PromptRow], ids: list[list[int]], seeds, params,
            reward_fn: RewardRunner, accuracy_fn: RewardRunner, episodes: EpisodeRunner | None,
            reward_field: str | None) -> tuple[torch.Tensor, ...]:
    """(rewards (B,), correct (B,), response lengths (B,), ended with a stop token (B,), failed (B,),
    the reward function's other numbers: `score_responses`' extras) of one generation
    (multi-turn episodes or an agent's samples with `episodes`; failed: its environment or
    agent raised); the rewards are the rollout's `reward_field` where the run takes them
    from the rollout."""
    nothing = torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.zeros(0), {}
    if not rows and engine.tensor_parallel_size == 1:
        return nothing
    if episodes is not None:
        tasks = [task(r.messages, r.ground_truth, r.data_source, r.extra_info) for r in rows]
        out = episodes.generate(ids, seeds, params, tasks)
    else:  # a tensor-parallel replica generates together, rows or not
        out = engine.generate(ids, seeds, params)
    if not rows:
        return nothing
    out.meta.update({"ground_truth": [r.ground_truth for r in rows], "data_source": [r.data_source for r in rows],
                     "extra_info": [r.extra_info for r in rows], "prompt_messages": [r.messages for r in rows]})
    rewards, correct, _, extras = score_responses(tokenizer, out, reward_fn, accuracy_fn)
    if reward_field is not None:
        rewards = out[reward_field]
    mask = out["response_mask"]
    lengths = mask.sum(-1)
    # ended: the last generated token is the end of sequence (an earlier turn's end does not end an episode
    # whose last turn was cut; padding after the response is not the model's)
    last = (mask.cumsum(-1) == lengths.unsqueeze(-1)) & mask.bool()
    ended = (torch.isin(out["responses"], torch.tensor(engine.stop_token_ids)) & last).any(-1)
    failed = next((out[f] for f in FAILED_EPISODE_FIELDS if f in out), torch.zeros(len(rows)))
    return rewards, correct, lengths, ended, failed, extras


def evaluate(engine: RolloutEngine, tokenizer, rows: list[PromptRow], ids: list[list[int]],
             reward_fn: RewardRunner, accuracy_fn: RewardRunner, settings: EvalSettings,
             by_source: bool = False, episodes: EpisodeRunner | None = None) -> dict[str, float]:
    """This worker's rows scored, combined over all workers (collective: every worker
    calls it, a worker of a tensor-parallel replica even with no rows)."""
    tally: Tally = {}
    greedy = SamplingParams(max_new_tokens=settings.max_new_tokens, greedy=True)
    rewards, correct, lengths, ended, failed, extras = _scored(engine, tokenizer, rows, ids, None, greedy, reward_fn,
                                                               accuracy_fn, episodes, settings.reward_field)
    for name, (total, samples) in extras.items():  # a reward function's own numbers (verl's reward_extra_info)
        entry = tally.setdefault(f"reward_extra/{name}", [0.0, 0.0])
        entry[0], entry[1] = entry[0] + total, entry[1] + samples
    for row, r, c, n, e, f in zip(rows, rewards.tolist(), correct.tolist(), lengths.tolist(), ended.tolist(),
                                  failed.tolist()):
        for group in _groups(row, by_source):
            _add(tally, f"accuracy{group}", c)
            _add(tally, f"reward{group}", r)
        if episodes is not None:  # an episode whose environment or agent raised counts as wrong: how many
            _add(tally, "failed_episodes", f)
        _add(tally, "response_length/mean", n)
        _add(tally, "response_length/clip_ratio", 0.0 if e else 1.0)
        tally["response_length/max"] = [max(tally.get("response_length/max", [0.0])[0], n), 1.0]
    if settings.k:
        _sampled(engine, tokenizer, rows, ids, reward_fn, accuracy_fn, settings, by_source, tally, episodes)
    return _combine(tally)


def _sampled(engine, tokenizer, rows, ids, reward_fn, accuracy_fn, settings: EvalSettings, by_source: bool,
             tally: Tally, episodes: EpisodeRunner | None) -> None:
    k = settings.k
    seeds = [sample_seed(settings.seed, _EVAL_STREAM, row.index, j) for row in rows for j in range(k)]
    params = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                            top_p=settings.top_p)
    # only accuracy is kept of the samples, as the greedy responses': a custom function's (its "acc", or its full
    # marks where the rule reads no answer from a row's ground truth), else the rule's alone (a reward model's
    # forwards would be thrown away)
    custom = isinstance(reward_fn, RewardRunner) and reward_fn.spec is not None
    _, correct, _, _, _, _ = _scored(engine, tokenizer, [r for r in rows for _ in range(k)],
                                     [p for p in ids for _ in range(k)], seeds, params,
                                     reward_fn if custom else accuracy_fn, accuracy_fn, episodes, None)
    per_row = correct.view(len(rows), k) if rows else correct.view(0, k)
    for row, samples in zip(rows, per_row.tolist()):
        for group in _groups(row, by_source):
            _add(tally, f"mean@{k}{group}", sum(samples) / k)
            _add(tally, f"pass@{k}{group}", 1.0 if max(samples) > 0.5 else 0.0)


def _combine(tally: Tally) -> dict[str, float]:
    totals: Tally = {}
    for part in all_gather_objects(tally):  # a few numbers per worker
        for name, (value, count) in part.items():
            entry = totals.setdefault(name, [0.0, 0.0])
            if name.endswith("/max"):
                entry[0], entry[1] = max(entry[0], value), 1.0
            else:
                entry[0] += value
                entry[1] += count
    if "accuracy" not in totals:
        totals["accuracy"] = [0.0, 0.0]
    totals["rows"] = [totals["accuracy"][1], 1.0]
    return {name: value / count if count else float("nan") for name, (value, count) in sorted(totals.items())}


def table(report: dict[str, float], k: int) -> str:
    """One screen: a line per slice with greedy accuracy, mean@k and pass@k, and the lengths."""
    slices = [""] + sorted({name[len("accuracy"):] for name in report if name.startswith("accuracy/")})
    if not report["rows"]:
        return "no prompts were scored (every held-out row was dropped as bad or too long)"
    head = f"{'slice':<28} {'greedy':>8} {'reward':>8}" + (f" {f'mean@{k}':>8} {f'pass@{k}':>8}" if k else "")
    lines = [head]
    for s in slices:
        line = f"{s.lstrip('/') or 'all':<28} {report[f'accuracy{s}']:>8.1%} {report[f'reward{s}']:>8.3f}"
        if k:
            line += f" {report[f'mean@{k}{s}']:>8.1%} {report[f'pass@{k}{s}']:>8.1%}"
        lines.append(line)
    scored = f"{int(report['rows'])} prompts"
    if "rows_chosen" in report and report["rows_chosen"] < report["rows_in_files"]:
        scored += (f" (data.val_max_samples={int(report['rows_chosen'])} of the {int(report['rows_in_files']):,} "
                   "rows of data.val_files; -1: all)")
    if report.get("skipped_rows"):
        scored += f", {int(report['skipped_rows'])} rows dropped as bad"
    if report.get("truncated_prompts"):
        scored += f", {int(report['truncated_prompts'])} prompts truncated to data.max_prompt_length"
    lines.append(f"{scored}; greedy responses: {report['response_length/mean']:.1f} tokens on "
                 f"average, at most {report['response_length/max']:.0f}, "
                 f"{report['response_length/clip_ratio']:.1%} cut at the token limit")
    if report.get("failed_episodes"):
        lines.append(f"{report['failed_episodes']:.1%} of the greedy episodes failed (their environment or agent "
                     "raised) and count as wrong")
    return "\n".join(lines)


def write_report(path: Path, report: dict[str, float], about: dict) -> None:
    """The report as JSON; a metric of no prompts (NaN) is null, as JSON has no NaN."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = {name: None if math.isnan(value) else value for name, value in report.items()}
    path.write_text(json.dumps({**about, "metrics": metrics}, indent=1, allow_nan=False))
