"""The recipe nodes' own math, on one process with hand-computed values."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from distflow.config import load_config
from distflow.data.batch import Batch
from distflow.trainer import nodes


class Ctx:
    def __init__(self, params, *overrides):
        self.cfg, self.params = load_config(None, list(overrides)), params
        self.counts_rows = True  # one process: its rows count


MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 1, 1])


def test_grpo_advantage_node_uses_the_registered_estimator():
    out = nodes.advantage(Ctx({"estimator": "grpo", "reward_field": "scores"}),
                          Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS}))
    # group 0: rewards (1, 0): mean 0.5, std 0.7071 -> +-0.7071; group 1: equal rewards -> 0
    expected = torch.tensor([0.7071, -0.7071, 0.0, 0.0]).unsqueeze(-1) * MASK
    assert torch.allclose(out["advantages"], expected, atol=1e-4)


class Scorer:
    """A reward runner's contract (`RewardRunner`) around `fn(src, text, truth, extra) -> (score, status)`."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def scored(self, *args):
        return (*self.fn(*args), {})

    def scored_all(self, samples):
        return [self.scored(*args) for args in samples]


def _on_valid(values: list[float]) -> torch.Tensor:
    """Hand-computed values for the valid tokens of MASK, in row order, as a (4, 3) tensor."""
    out = torch.zeros(MASK.shape)
    out[MASK.bool()] = torch.tensor(values)
    return out


def test_reinforce_plus_plus_whitens_over_the_batch():
    out = nodes.advantage(Ctx({"estimator": "reinforce_plus_plus", "reward_field": "scores"}),
                          Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS}))
    # returns-to-go (gamma 1) on the 9 valid tokens: 1 1 | 0 0 0 | 1 | 1 1 1; mean 2/3,
    # unbiased variance (6 - 9 * 4/9) / 8 = 1/4: whitened 1 -> +2/3, 0 -> -4/3
    a, b = 2 / 3, -4 / 3
    torch.testing.assert_close(out["advantages"], _on_valid([a, a, b, b, b, a, a, a, a]), atol=1e-6, rtol=0)


def test_reinforce_plus_plus_baseline_centres_by_group_then_whitens():
    out = nodes.advantage(Ctx({"estimator": "reinforce_plus_plus_baseline", "reward_field": "scores"}),
                          Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS}))
    # centred: group 0 (1, 0) -> +0.5 (2 tokens), -0.5 (3 tokens); group 1 (1, 1) -> 0 (4 tokens);
    # mean -1/18, unbiased variance (1.25 - 9/324) / 8; whitened:
    up, down, zero = 1.4213380625, -1.1370704500, 0.1421338063
    torch.testing.assert_close(out["advantages"], _on_valid([up, up, down, down, down, zero, zero, zero, zero]),
                               atol=1e-6, rtol=0)


def test_gae_node_returns_whitened_advantages_and_returns():
    values = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.1, 0.0], [0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = nodes.advantage(Ctx({"estimator": "gae", "reward_field": "scores"}, "algorithm.gamma=1.0", "algorithm.lam=1.0"),
                          Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS, "values": values}))
    # gamma = lam = 1: the return of every valid token is the sequence's reward
    assert torch.equal(out["returns"], REWARDS.unsqueeze(-1) * MASK)
    # advantages before whitening: reward - value = .5 .5 | -.2 -.1 0 | .7 | 1 1 1 (mean 4.4/9)
    expected = [0.0228664775, 0.0228664775, -1.4177216072, -1.2119233093, -1.0061250115, 0.4344630732,
                1.0518579666, 1.0518579666, 1.0518579666]
    torch.testing.assert_close(out["advantages"], _on_valid(expected), atol=1e-6, rtol=0)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    out = nodes.dynamic_sampling(Ctx({"reward_field": "scores"}),
                                 Batch({"scores": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]),
                                        "group": torch.tensor([0, 0, 1, 1, 2, 2])}))
    assert out["kept"].tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("buffer", ["algorithm.overlong_buffer_len=4", "algorithm.overlong_buffer_fraction=0.5",
                                    "algorithm.overlong_buffer_len=4 algorithm.overlong_buffer_fraction=0.1"])
def test_overlong_penalty_ramps_over_the_buffer(buffer):
    """The buffer in tokens, or as a share of the budget (DAPO's recipe: it scales with
    rollout.max_new_tokens, as the paper's 4096 of 20480); tokens, where given, win."""
    ctx = Ctx({}, *buffer.split(), "rollout.max_new_tokens=8")
    mask = torch.tensor([[1] * 4 + [0] * 4, [1] * 6 + [0] * 2, [1] * 8])
    out = nodes.overlong_penalty(ctx, Batch({"scores": torch.ones(3), "response_mask": mask}))
    assert out["shaped_scores"].tolist() == [1.0, 0.5, 0.0]  # penalties 0, -0.5, -1


def test_dapo_s_overlong_buffer_scales_with_the_response_budget_and_a_fraction_of_0_turns_it_off():
    """The paper's 4096 of 20480 tokens. (The length's doc said "0 = off" while the recipe's
    fraction stayed on: 0 leaves it to the fraction, as config.json files have recorded it.)"""
    from distflow.config import ConfigError, overlong_buffer_tokens
    from distflow.trainer.recipes import recipe_graph

    assert overlong_buffer_tokens(load_config(None, ["algorithm.name=dapo"])) == 6  # of 32: the default run's
    assert overlong_buffer_tokens(load_config(None, ["algorithm.name=dapo", "rollout.max_new_tokens=20480"])) == 4096
    assert overlong_buffer_tokens(load_config(None, ["algorithm.name=dapo", "algorithm.overlong_buffer_len=0"])) == 6
    off = load_config(None, ["algorithm.name=dapo", "algorithm.overlong_buffer_fraction=0"])
    assert overlong_buffer_tokens(off) == 0 and "overlong_penalty" not in [n.name for n in recipe_graph(off).nodes]
    # a multi-turn episode's buffer is checked against the episode's budget, not one turn's
    turns = ["rollout.max_turns=2", "rollout.tools=calculator", "rollout.max_total_tokens=200"]
    assert overlong_buffer_tokens(load_config(None, ["algorithm.overlong_buffer_len=100", *turns])) == 100
    with pytest.raises(ConfigError, match=r"^algorithm.overlong_buffer_len=300: must be <= the episode's token budget "
                                          r"\(rollout.max_total_tokens, else max_new_tokens x max_turns\)=200$"):
        load_config(None, ["algorithm.overlong_buffer_len=300", *turns])


def test_overlong_penalty_weighs_a_multi_turn_episode_against_its_budget():
    """Two turns of 5 tokens under a per-turn limit of 8 are not long; the episode's
    budget (max_total_tokens, tool tokens included) is what an episode fills."""
    ctx = Ctx({}, "algorithm.overlong_buffer_len=4", "rollout.max_new_tokens=8", "rollout.max_turns=2",
              "rollout.tools=calculator")
    mask = torch.tensor([[1] * 5 + [0] * 2 + [1] * 5 + [0] * 4, [1] * 8 + [0] * 4 + [1] * 4])
    observed = torch.tensor([[0] * 5 + [1] * 2 + [0] * 9, [0] * 8 + [1] * 4 + [0] * 4])
    out = nodes.overlong_penalty(ctx, Batch({"scores": torch.ones(2), "response_mask": mask,
                                             "observation_mask": observed}))
    assert out["shaped_scores"].tolist() == [1.0, 0.0]  # 12 of 16: none; 16 of 16: -1
    ctx = Ctx({}, "algorithm.overlong_buffer_len=4", "rollout.max_new_tokens=8", "rollout.max_turns=2",
              "rollout.tools=calculator", "rollout.max_total_tokens=14")
    out = nodes.overlong_penalty(ctx, Batch({"scores": torch.ones(2), "response_mask": mask,
                                             "observation_mask": observed}))
    assert out["shaped_scores"].tolist() == [0.5, 0.0]  # 12 of 14: -0.5; 16 of 14: -1


class StepCtx(Ctx):
    """A node's context with the parts the KL-in-reward and ReMax nodes use."""

    def __init__(self, params, *overrides, **parts):
        from distflow.trainer.metrics import MeanAccumulator

        super().__init__(params, *overrides)
        self.acc = MeanAccumulator()
        self.__dict__.update(parts)


class GradientsOfTheLoss:
    """An actor's `train_mini_batch` contract: the loss of each mini-batch on log-probs of 0,
    and its gradient per token, kept."""

    def __init__(self):
        self.grads: list[torch.Tensor] = []

    def train_mini_batch(self, mini, micro, loss_fn):
        log_probs = torch.zeros(mini["response_mask"].shape, requires_grad=True)
        loss, metrics = loss_fn(log_probs, torch.zeros_like(log_probs), mini)
        loss.backward()
        self.grads.append(log_probs.grad)
        return {"skipped": 0.0, **metrics}

    def release_gradients(self):
        pass


@pytest.mark.parametrize("masked", [False, True])
def test_mask_truncated_responses_leaves_cut_responses_out_of_the_policy_loss(masked):
    """DAPO's overlong filtering, TRL's mask_truncated_completions: a response whose last token
    is no stop token (cut at rollout.max_new_tokens) gets no gradient and its tokens are not
    counted; one that ends on its stop token at the budget is whole; the others' are the
    mean over their own tokens; the batch the step's other nodes see keeps every token."""
    from types import SimpleNamespace

    ctx = StepCtx({}, f"algorithm.mask_truncated_responses={str(masked).lower()}", "rollout.max_new_tokens=3",
                  "algorithm.use_kl_loss=false", "algorithm.rollout_correction=off", "data.train_batch_size=4",
                  "actor.ppo_mini_batch_size=4", "algorithm.group_size=1")
    ctx.actor, ctx.rollout, stop, pad = GradientsOfTheLoss(), SimpleNamespace(stop_token_ids=(2, 7)), 2, 0
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    responses = torch.tensor([[5, stop, pad], [5, 6, 8], [7, pad, pad], [5, 6, 7]])  # row 1 alone is cut
    batch = Batch({"responses": responses, "response_mask": mask, "prompt_mask": torch.ones(4, 2, dtype=torch.long),
                   "advantages": torch.ones(4, 3), "mini_batch": torch.zeros(4, dtype=torch.long)})
    nodes.actor_update(ctx, batch)
    (grad,) = ctx.actor.grads
    kept = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]]) if masked else mask
    # token-mean of -advantage * ratio: -1 / (kept tokens) on each kept token
    torch.testing.assert_close(grad, -kept / kept.sum())
    assert batch["response_mask"] is mask  # the step's batch is left as it was


def test_kl_in_reward_node_subtracts_beta_kl_and_feeds_the_controller():
    from distflow.algos.kl import make_kl_controller

    ctrl = make_kl_controller("adaptive", 0.1, target=0.05, horizon=100)
    ctx = StepCtx({"reward_field": "scores"}, "algorithm.reward_kl_type=k1", reward_kl=ctrl)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = nodes.kl_in_reward(ctx, Batch({"scores": torch.tensor([1.0, 45.0]), "response_mask": mask,
                                         "rollout_log_probs": torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0]]),
                                         "ref_log_probs": torch.tensor([[-1.5, -2.0, -0.25], [-0.6, -0.2, 0.0]])}))
    # k1 = (0.5, 0, -0.25) | (0.5, 0, masked); beta 0.1 before the update
    torch.testing.assert_close(out["token_rewards"], torch.tensor([[-0.05, 0.0, 1.025], [-0.05, 45.0, 0.0]]))
    # mean per-sequence KL (0.25/3 + 0.25) / 2 = 1/6: error clipped to +0.2, 2 samples: beta *= 1 + 0.2 * 2 / 100
    assert ctrl.value == pytest.approx(0.1 * 1.004)
    metrics = ctx.acc.reduce()
    assert metrics["reward_kl/coef"] == pytest.approx(0.1) and metrics["reward_kl/penalty"] == pytest.approx(1 / 6)


def test_kl_in_reward_leaves_rows_without_tokens_out_of_the_mean_kl():
    """A filter's masked rows have no tokens, so no KL: counted as a KL of 0 they pulled the
    controller's mean and the metric down (two real rows and two masked: half of it)."""
    from distflow.algos.kl import make_kl_controller

    ctrl = make_kl_controller("adaptive", 0.1, target=0.05, horizon=100)
    ctx = StepCtx({"reward_field": "scores"}, "algorithm.reward_kl_type=k1", reward_kl=ctrl)
    batch = Batch(dict(KL_BATCH))
    padded = Batch.concat([batch, batch])
    padded.tensors["response_mask"][2:] = 0
    nodes.kl_in_reward(ctx, padded)
    assert ctrl.value == pytest.approx(0.1 * 1.004)  # as with the two rows alone
    assert ctx.acc.reduce()["reward_kl/penalty"] == pytest.approx(1 / 6)


KL_BATCH = {"scores": torch.tensor([1.0, 45.0]), "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
            "rollout_log_probs": torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0]]),
            "ref_log_probs": torch.tensor([[-1.5, -2.0, -0.25], [-0.6, -0.2, 0.0]])}


def _replicated_rows(rank, world):
    """Both ranks hold the same rows, as the members of one rollout replica do in the
    groups layout; only the first counts them (what the scheduler tells each node)."""
    from distflow.algos.kl import make_kl_controller

    ctrl = make_kl_controller("adaptive", 0.1, target=0.05, horizon=100)
    ctx = StepCtx({"reward_field": "scores"}, "algorithm.reward_kl_type=k1", reward_kl=ctrl)
    ctx.counts_rows = rank == 0
    nodes.kl_in_reward(ctx, Batch(dict(KL_BATCH)))
    ctx.params = {"estimator": "reinforce_plus_plus", "reward_field": "scores"}
    out = nodes.advantage(ctx, Batch({"scores": REWARDS, "response_mask": MASK, "group": GROUPS}))
    return ctrl.value, out["advantages"]


def test_a_replica_s_members_holding_the_same_rows_count_them_once_over_workers():
    """The KL controller's step and the batch-wide whitening see each row once: two
    members of one replica give what one worker holding the rows alone gives."""
    from helpers import run_gloo

    alone = _replicated_rows(0, 1)
    for value, advantages in run_gloo(_replicated_rows, 2):
        assert value == pytest.approx(alone[0], rel=1e-12)  # 0.1 * 1.004, not 1.008: two samples, not four
        torch.testing.assert_close(advantages, alone[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("continuous", [False, True])
def test_the_rollout_streams_chunks_but_gives_an_engine_that_batches_as_it_runs_every_sequence_at_once(continuous):
    """vLLM was called once per chunk of scheduler.stream_chunk_size (64) sequences under
    overlap (on by default on a GPU): it batched 64 at a time, each chunk waiting for its
    longest. The HF engine streams chunks; one that batches continuously gets one call."""
    from distflow.engines.common import load_causal_lm, load_tokenizer
    from distflow.engines.rollout import HFRolloutEngine

    class Recording(HFRolloutEngine):
        batches_continuously = continuous

        def generate(self, prompts, seeds, params):
            self.calls.append(len(prompts))
            return super().generate(prompts, seeds, params)

    tok = load_tokenizer("builtin:tiny-arith")
    engine = Recording(load_causal_lm("builtin:tiny-arith"), tok)
    engine.calls = []
    ctx = StepCtx({}, "scheduler.stream_chunk_size=2", "rollout.max_new_tokens=4", rollout=engine, step=1,
                  overlap=True, episodes=None)
    prompts = torch.tensor([[5, 6, 7]] * 5)
    batch = Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts), "uid": torch.arange(5),
                   "sample_k": torch.zeros(5, dtype=torch.long), "draw": torch.zeros(5, 2, dtype=torch.long)})
    chunks = list(nodes.rollout(ctx, batch))
    assert engine.calls == ([5] if continuous else [2, 2, 1])
    assert [list(rows) for rows, _ in chunks] == ([[0, 1, 2, 3, 4]] if continuous else [[0, 1], [2, 3], [4]])
    assert sum(len(out["responses"]) for _, out in chunks) == 5


def test_greedy_baseline_scores_one_greedy_response_per_group():
    class Engine:  # records what it was asked; answers each prompt with its own last token
        def __init__(self):
            self.calls = []

        def generate(self, prompts, seeds, params):
            self.calls.append((prompts, seeds, params.greedy))
            responses = torch.tensor([[p[-1]] for p in prompts])
            return Batch({"responses": responses, "response_mask": torch.ones_like(responses)})

        def sleep(self):
            self.calls.append("sleep")

    class Tokenizer:
        pad_token_id = 0

        def batch_decode(self, ids, skip_special_tokens):
            return [f"#### {int(row[0])}" for row in ids]

    reward_fn = Scorer(lambda src, text, gt, extra: (float(text == f"#### {gt}"), 0))

    engine = Engine()
    ctx = StepCtx({}, rollout=engine, tokenizer=Tokenizer(), reward_fn=reward_fn)
    prompts = torch.tensor([[0, 5, 7], [0, 5, 7], [4, 5, 9], [4, 5, 9]])
    batch = Batch({"prompts": prompts, "prompt_mask": (prompts > 0).long(), "group": torch.tensor([3, 3, 8, 8])},
                  {"ground_truth": ["7", "7", "1", "1"], "data_source": ["a"] * 4, "extra_info": [{}] * 4})
    out = nodes.greedy_baseline(ctx, batch)
    assert engine.calls[0] == ([[5, 7], [4, 5, 9]], None, True)  # one greedy prompt per group, padding removed
    assert engine.calls[1:] == ["sleep"]  # the engine it woke sleeps again before the update (vLLM on a GPU)
    assert out["baseline_scores"].tolist() == [1.0, 1.0, 0.0, 0.0]  # group 3 answers 7 (right), group 8 answers 9
    # with DAPO's overlong shaping the baseline is shaped as the samples are: its 1 token is 1 into the
    # 2-token buffer before the 2-token limit, -0.5
    shaped = StepCtx({}, "rollout.max_new_tokens=2", "algorithm.overlong_buffer_len=2",
                     "algorithm.overlong_penalty_factor=1.0", rollout=Engine(), tokenizer=Tokenizer(), reward_fn=reward_fn)
    assert nodes.greedy_baseline(shaped, batch)["baseline_scores"].tolist() == [0.5, 0.5, -0.5, -0.5]
    # a rank the filter left without rows still asks (a tensor-parallel engine gathers its replica's prompts)
    empty = nodes.greedy_baseline(ctx, batch.select([]))
    assert engine.calls[-2:] == [([], None, True), "sleep"] and empty["baseline_scores"].shape == (0,)


def test_a_row_drawn_twice_in_one_step_samples_anew():
    """20 rows, 16 prompts a step: step 2 takes the last 4 rows of epoch 0 and 12 of
    epoch 1, so some rows come twice; a refill round draws rows again too. Every
    sequence of the step gets its own seed; the step's first-epoch draws keep theirs."""
    from distflow.coordinator.layout import Layout
    from distflow.engines.rollout import sample_seed
    from distflow.trainer.loop import PromptSource, RefillPrompts

    cfg = load_config(None, ["data.train_files=builtin:arith:train:20", "data.train_batch_size=16",
                             "actor.ppo_mini_batch_size=16", "algorithm.group_size=2"])
    source = PromptSource(cfg, Layout(1), 0, pad_id=0)
    step = source.prepare(2)
    assert len(set(step["uid"])) < 16 and {tuple(d) for d in step["draw"]} == {(0, 0), (1, 0)}
    refill = RefillPrompts(source, source.prefetch_tokenizer, nodes.WorkerContext(cfg, None, None, None, step=2))
    rounds = [step, refill.prompts(1), refill.prompts(2)]
    seeds = [s for batch in rounds for s in nodes.sample_seeds(cfg, 2, batch)]
    assert len(seeds) == 3 * 32 and len(set(seeds)) == len(seeds)
    first = [i for i, d in enumerate(step["draw"]) if d == [0, 0]]
    assert [nodes.sample_seeds(cfg, 2, step)[i] for i in first] == \
        [sample_seed(cfg.trainer.seed, 2, step["uid"][i], step["sample_k"][i]) for i in first]


def test_refill_rounds_shuffle_the_dataset_once_an_epoch_not_once_a_step(monkeypatch):
    """A refill round's stream is a seeded permutation of the whole dataset: made anew each
    step, it cost ~0.5 s a round at 1M rows. Steps 2 and 3 fall in one epoch of 20 rows."""
    import random

    from distflow.coordinator.layout import Layout
    from distflow.trainer.loop import PromptSource, RefillPrompts

    cfg = load_config(None, ["data.train_files=builtin:arith:train:20", "data.train_batch_size=4",
                             "actor.ppo_mini_batch_size=4", "algorithm.group_size=2"])
    source = PromptSource(cfg, Layout(1), 0, pad_id=0)
    ctx = nodes.WorkerContext(cfg, None, None, None, step=2)
    refill = RefillPrompts(source, source.prefetch_tokenizer, ctx)
    shuffles, shuffle = [], random.Random.shuffle
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: (shuffles.append(len(x)), shuffle(self, x))[1])
    first = [refill.prompts(1)["uid"], refill.prompts(2)["uid"]]
    ctx.step = 3
    second = [refill.prompts(1)["uid"], refill.prompts(2)["uid"]]
    assert shuffles == [20, 20]  # one permutation per round's stream, kept for the epoch
    fresh = RefillPrompts(source, source.prefetch_tokenizer, ctx)  # the same draw as a run resumed at step 3
    assert [fresh.prompts(1)["uid"], fresh.prompts(2)["uid"]] == second != first


def test_the_loss_metric_is_the_mean_over_the_updates_that_ran():
    """Four mini-batches, the second's responses all empty (a refill's renumbering or a
    filter can leave one so): it is skipped, and the loss shown is the mean of the updates
    that ran; an update skipped for a non-finite gradient is counted, and its norm is not
    averaged in."""
    class Engine:
        def __init__(self):
            self.calls, self.released_after = 0, []

        def train_mini_batch(self, mini, micro, loss_fn):
            self.calls += 1
            skipped = self.calls == 3  # a non-finite gradient: the update is skipped, its norm reads 0
            return {"pg_loss": 3.0, "grad_norm": 0.0 if skipped else 2.0, "skipped": float(skipped),
                    "tokens": float(mini["response_mask"].sum())}

        def release_gradients(self):
            self.released_after.append(self.calls)

    ctx = StepCtx({}, "data.train_batch_size=4", "actor.ppo_mini_batch_size=1", "algorithm.group_size=1")
    batch = Batch({"prompts": torch.ones(4, 2, dtype=torch.long), "prompt_mask": torch.ones(4, 2, dtype=torch.long),
                   "response_mask": torch.tensor([[1, 1], [0, 0], [1, 0], [1, 1]]), "mini_batch": torch.arange(4)})
    normalisers, engine = [], Engine()
    nodes._mini_batches(ctx, batch, engine, lambda tokens, seqs: normalisers.append((tokens, seqs)), "actor")
    assert engine.released_after == [3]  # the gradients are freed once, after the last update (not kept to the next)
    metrics = ctx.acc.reduce()
    assert normalisers == [(2.0, 1.0), (1.0, 1.0), (2.0, 1.0)]  # a row without tokens is no sequence, as in agg_loss
    assert metrics["actor/pg_loss"] == 3.0  # over the 3 updates that ran, not the 4 mini-batches
    assert metrics["actor/grad_norm"] == 2.0  # the skipped update's 0 left out (it read 1.33)
    assert metrics["actor/skipped_updates"] == 1.0  # a count (it read 0.25)


def test_failed_rewards_are_counted_where_they_are_scored_and_episode_lengths_hold_their_observations():
    """A DAPO filter drops a group whose reward function failed on every sample (all 0:
    no signal): counted at the end of the step, from the kept rows, the failures never
    showed. And a multi-turn episode's length is its turns and the tool's tokens between
    them, as the forward (and the overlong budget) sees it."""
    from distflow.engines.reward import FAILED, OK
    from distflow.trainer.metrics import MeanAccumulator

    class Tokenizer:
        pad_token_id = 0

        def batch_decode(self, ids, skip_special_tokens):
            return ["x"] * len(ids)

    status = iter([FAILED, FAILED, OK])
    ctx = StepCtx({}, tokenizer=Tokenizer(), reward_fn=Scorer(lambda *args: (0.0, next(status))))
    ctx.accuracy_fn = ctx.reward_fn
    batch = Batch({"responses": torch.ones(3, 2, dtype=torch.long), "response_mask": torch.ones(3, 2, dtype=torch.long)},
                  {"ground_truth": ["1"] * 3, "data_source": ["a"] * 3, "extra_info": [{}] * 3})
    nodes.reward(ctx, batch)
    assert ctx.acc.reduce()["reward/failed"] == 2.0
    acc = MeanAccumulator()
    episode = Batch({"prompt_mask": torch.ones(1, 10, dtype=torch.long), "response_mask": torch.tensor([[1] * 5 + [0] * 6 + [1] * 5]),
                     "observation_mask": torch.tensor([[0] * 5 + [1] * 6 + [0] * 5]), "scores": torch.ones(1),
                     "accuracy": torch.ones(1), "num_turns": torch.tensor([2])})
    nodes.record_rollout_metrics(episode, acc, 16, episodes=True)
    metrics = acc.reduce()
    assert metrics["response/length_mean"] == 16 and metrics["tokens/total"] == 26
    assert metrics["response/clip_ratio"] == 1.0  # its 16 tokens are the whole budget: cut there, as verl counts it
    acc = MeanAccumulator()
    nodes.record_rollout_metrics(episode, acc, 17, episodes=True)
    assert acc.reduce()["response/clip_ratio"] == 0.0
    # rows a filter masked instead of dropping (too few kept for the training ranks) are left out, as dropped rows are
    from distflow.data.batch import FILTERED_OUT

    acc = MeanAccumulator()
    two = Batch.concat([episode, episode])
    two.tensors["scores"] = torch.tensor([1.0, 0.0])
    two.tensors[FILTERED_OUT] = torch.tensor([False, True])
    nodes.record_rollout_metrics(two, acc, 64, episodes=True)
    assert acc.reduce()["reward/mean"] == 1.0


def _move_to_train(rank: int, world: int, mini_batch_size: int):
    """Rank 0 holds mini-batch 0's long responses, rank 1 mini-batch 1's; both the same
    tokens in all. The trainer's placement moves the rows to the training layout."""
    from distflow.coordinator.layout import Layout
    from distflow.coordinator.store import LocalStore
    from distflow.trainer.loop import make_placement

    cfg = load_config(None, ["data.train_batch_size=4", f"actor.ppo_mini_batch_size={mini_batch_size}",
                             "runtime.num_workers=2"])
    lengths = [40, 40, 4, 4, 4, 4, 4, 4] if rank == 0 else [4, 4, 4, 4, 4, 4, 40, 40]  # rows 0-3: mini-batch 0
    store = LocalStore()
    store.put(Batch({"prompt_mask": torch.ones(8, 1, dtype=torch.long),
                     "response_mask": (torch.arange(40) < torch.tensor(lengths)[:, None]).long(),
                     "mini_batch": torch.tensor([0] * 4 + [1] * 4)},
                    {"sample_id": [rank * 8 + i for i in range(8)]}))
    make_placement(cfg, Layout(world), Layout(world)).move(store, "local", "train")
    batch = store.all()
    tokens = batch["response_mask"].sum(-1)
    return [int(tokens[batch["mini_batch"] == m].sum()) for m in (0, 1)]


def test_the_trainer_s_placement_balances_each_mini_batch_over_the_ranks():
    """Two mini-batches, each with its long responses on one rank: the step's rows were
    balanced already (nothing moved) while each update ran 88 response tokens on one rank
    against 16 on the other. With one mini-batch the step's balance is all there is."""
    from helpers import run_gloo

    assert run_gloo(_move_to_train, 2, 2) == [[52, 52], [52, 52]]
    assert run_gloo(_move_to_train, 2, 4) == [[88, 16], [16, 88]]  # one mini-batch: nothing moves


def test_each_sample_s_task_has_its_own_prompt_and_extra_info():
    """The n samples of a prompt share its row: an agent or environment appending to its
    `prompt` (or writing into `extra_info`) must not change the other samples' or the row's
    (a held-out row serves every evaluation)."""
    from distflow.data.dataset import PromptRow

    cfg = load_config(None, ["algorithm.group_size=4"])
    row = PromptRow(index=0, messages=[{"role": "user", "content": "3+4"}], ground_truth="7", data_source="arith",
                    extra_info={"level": 1})
    tasks = nodes.tasks_of(nodes.source_batch([(0, (0, 0), row, [5, 6, 7])], cfg, pad_id=0))
    assert len(tasks) == 4
    tasks[0]["prompt"].append({"role": "assistant", "content": "7"})
    tasks[0]["prompt"][0]["content"] = "changed"
    tasks[0]["extra_info"]["level"] = 9
    assert [t["prompt"] for t in tasks[1:]] == [[{"role": "user", "content": "3+4"}]] * 3
    assert row.messages == [{"role": "user", "content": "3+4"}] and row.extra_info == {"level": 1}
    assert [t["extra_info"] for t in tasks[1:]] == [{"level": 1}] * 3


def test_a_reward_function_sees_an_episode_as_verl_s_reward_managers_show_it(tmp_path):
    """The response text holds the observations between the turns (verl decodes the whole
    response), and extra_info (a copy) verl's `num_turns` (the prompt, each assistant turn
    and each observation: 2 for one turn) and the rollout's own scores."""
    from distflow.config import BUILTIN_MODEL
    from distflow.engines.common import load_tokenizer
    from distflow.engines.reward import RewardRunner

    tok = load_tokenizer(BUILTIN_MODEL)
    (tmp_path / "seen.py").write_text(
        "import json\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    with open(ground_truth, 'a') as f:\n"
        "        f.write(json.dumps([solution_str, extra_info]) + '\\n')\n"
        "    return 1.0\n")
    pieces = ["A", " B", " C", " D", " E"]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in pieces]
    width = sum(map(len, ids)) + 2
    responses = torch.full((2, width), tok.pad_token_id)
    responses[:, :sum(map(len, ids))] = torch.tensor([t for piece in ids for t in piece])
    kinds = [k for k, piece in zip([1, 0, 1, 0, 1], ids) for _ in piece] + [0, 0]  # turn, observation, turn, ...
    response_mask = torch.tensor([kinds, [1] * len(ids[0]) + [0] * (width - len(ids[0]))])
    observation_mask = torch.tensor([[1.0 - k if i < width - 2 else 0.0 for i, k in enumerate(kinds)], [0.0] * width])
    log = tmp_path / "log.jsonl"
    extra = [{"level": 1}, {"level": 2}]
    batch = Batch({"responses": responses, "response_mask": response_mask, "observation_mask": observation_mask,
                   "num_turns": torch.tensor([3.0, 1.0]), "env_scores": torch.tensor([0.5, 0.0])},
                  {"ground_truth": [str(log)] * 2, "data_source": ["x"] * 2, "extra_info": extra})
    nodes.score_responses(tok, batch, RewardRunner(f"{tmp_path / 'seen.py'}:score", 0), None)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert seen == [["A B C D E", {"level": 1, "num_turns": 6, "rollout_reward_scores": {"env": 0.5}}],
                    ["A", {"level": 2, "num_turns": 2, "rollout_reward_scores": {"env": 0.0}}]]
    assert extra == [{"level": 1}, {"level": 2}]  # the batch's own, unchanged


def test_a_reward_functions_other_numbers_are_logged_and_its_acc_is_the_accuracy(tmp_path):
    """verl's DAPO scorer returns {"score", "acc", "pred"}: "acc" is the sample's accuracy
    (it came from the default rule, on the user's data), and every other number is a
    metric, reward_extra/<name>, at the step (and at the held-out evaluation); text is not."""
    from distflow.engines.reward import RewardRunner

    body = ("(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    right = solution_str == ground_truth\n"
            "    return {'score': 1.0 if right else -1.0, 'acc': right, 'pred': solution_str, 'length': len(solution_str)}\n")
    (tmp_path / "dapo_like.py").write_text(f"def score{body}async def judged{body}")  # a plain one and an LLM judge's

    class Tokenizer:
        pad_token_id = 0

        def batch_decode(self, ids, skip_special_tokens):
            return ["7", "8", "77"]

    batch = Batch({"responses": torch.ones(3, 2, dtype=torch.long), "response_mask": torch.ones(3, 2, dtype=torch.long)},
                  {"ground_truth": ["7", "7", "7"], "data_source": ["x"] * 3, "extra_info": [{}] * 3})
    for timeout_s, name in itertools.product((0.0, 30.0), ("score", "judged")):  # in this process, and in the child
        runner = RewardRunner(f"{tmp_path / 'dapo_like.py'}:{name}", timeout_s)
        ctx = StepCtx({}, tokenizer=Tokenizer(), reward_fn=runner)
        ctx.accuracy_fn = RewardRunner(None, 0)  # the default rule: it reads '77' as wrong and '7' right, as acc does
        out = nodes.reward(ctx, batch)
        assert out["scores"].tolist() == [1.0, -1.0, -1.0] and out["accuracy"].tolist() == [1.0, 0.0, 0.0]
        metrics = ctx.acc.reduce()
        assert metrics["reward_extra/acc"] == pytest.approx(1 / 3) and metrics["reward_extra/length"] == 4 / 3
        assert "reward_extra/pred" not in metrics
        runner.close()
    # "acc" is the accuracy also where the rule would read otherwise: here it scores every row right
    (tmp_path / "lenient.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'acc': 1}\n")
    ctx = StepCtx({}, tokenizer=Tokenizer(), reward_fn=RewardRunner(f"{tmp_path / 'lenient.py'}:score", 0))
    ctx.accuracy_fn = RewardRunner(None, 0)
    assert nodes.reward(ctx, batch)["accuracy"].tolist() == [1.0, 1.0, 1.0]
