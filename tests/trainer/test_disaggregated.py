"""runtime.placement=disaggregated: rollout workers and train workers apart, samples
streamed rank to rank, weights pushed back, a staleness bound and the off-policy
correction (trainer/disaggregated.py). That max_staleness=0 is the colocated run is
tested beside the other placements in test_e2e.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from distflow.config import ConfigError, load_config
from distflow.data.batch import Batch
from distflow.trainer.disaggregated import changed_weights_mid_sample, sample_versions
from helpers import CHECK_ONCE_ENV, distflow_train, run_metrics
from distflow.trainer.nodes import make_policy_loss
from distflow.trainer.recipes import ROLLOUT_ROLES, build_graph

SMALL = ["trainer.total_steps=3", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
         "algorithm.group_size=4", "data.val_max_samples=16", "rollout.max_new_tokens=24",
         "trainer.eval_every=0", "trainer.progress=false", "trainer.save_final=false"]
DISAGGREGATED = ["runtime.placement=disaggregated", "runtime.train_workers=1", "runtime.rollout_workers=1"]


def _halves(*overrides: str) -> tuple[list[str], list[str]]:
    rollout, train = build_graph(load_config(None, list(overrides))).split(ROLLOUT_ROLES)
    return [n.name for n in rollout.nodes], [n.name for n in train.nodes]


def test_the_graph_cuts_between_generation_and_training():
    assert _halves() == (["rollout", "reward"], ["ref_log_prob", "advantage", "actor_update"])
    # DAPO: its refilling filter and the shaping generate and score, on the rollout side
    assert _halves("algorithm.name=dapo") == (["rollout", "reward", "dynamic_sampling", "overlong_penalty"],
                                              ["advantage", "actor_update"])
    # samples up to a version old: the proximal policy's log-probs are recomputed before the update
    assert _halves(*DISAGGREGATED, "algorithm.max_staleness=1")[1] == [
        "ref_log_prob", "advantage", "old_log_prob", "actor_update"]
    # KL in the reward needs the reference, which trains' side holds
    rollout, train = _halves("algorithm.use_kl_in_reward=true")
    assert "kl_in_reward" in train and rollout == ["rollout", "reward"]
    rollout, train = _halves("algorithm.name=ppo")
    assert rollout == ["rollout", "reward"] and {"critic_values", "critic_update"} <= set(train)


def test_placement_settings_are_checked_in_one_line():
    cfg = load_config(None, [*DISAGGREGATED, "runtime.train_workers=2", "runtime.rollout_workers=3",
                             "data.train_batch_size=6", "actor.ppo_mini_batch_size=6"])
    assert cfg.runtime.num_workers == 5
    assert cfg.algorithm.rollout_correction == "off"  # synchronous: the sampler is the trainer's policy
    cfg = load_config(None, [*DISAGGREGATED, "algorithm.max_staleness=2"])
    assert cfg.algorithm.rollout_correction == "token_tis"  # decoupled PPO by default
    # synchronous but in bf16: the rollout worker's copy is bf16 weights, not the trainer's fp32 under autocast
    assert load_config(None, [*DISAGGREGATED, "model.dtype=bfloat16"]).algorithm.rollout_correction == "token_tis"
    assert load_config(None, ["model.dtype=bfloat16"]).algorithm.rollout_correction == "off"  # colocated: its own
    cases = {
        ("algorithm.max_staleness=1",): "algorithm.max_staleness=1: colocated workers alternate",
        (*DISAGGREGATED, "runtime.mode=centralized"): "runtime.placement=disaggregated: the single-controller",
        (*DISAGGREGATED, "runtime.rollout_workers=3"): "data.train_batch_size=16: must be divisible by the number of rollout replicas, runtime.rollout_workers",
        (*DISAGGREGATED, "algorithm.max_staleness=1", "algorithm.old_log_probs_from=rollout",
         "algorithm.rollout_correction=token_tis"): "algorithm.rollout_correction='token_tis': with",
        ("rollout.partial=true",): "rollout.partial=true: weights change during a generation only when",
        (*DISAGGREGATED, "rollout.partial=true", "rollout.max_turns=2", "rollout.tools=calculator"):
            "rollout.partial=true: the token-by-token swap is built for the HF engine",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_config(None, list(overrides))


def _loss(*overrides: str, with_old: bool, advantages=(1.0, -1.0, 0.5)) -> tuple[float, dict]:
    """The policy loss of one 3-token sequence, as the update computes it."""
    cfg = load_config(None, [*overrides, "algorithm.use_kl_loss=false"])
    log = lambda *p: torch.tensor([[math.log(x) for x in p]])  # noqa: E731
    micro = Batch({"response_mask": torch.ones(1, 3), "advantages": torch.tensor([advantages]),
                   "rollout_log_probs": log(0.1, 0.5, 0.2)} | ({"old_log_probs": log(0.4, 0.5, 0.3)} if with_old else {}))
    loss, metrics = make_policy_loss(cfg, 3.0, 1.0)(log(0.5, 0.4, 0.3).requires_grad_(), torch.zeros(1, 3), micro)
    return float(loss.detach()), metrics


def test_decoupled_ppo_and_behaviour_ratio_against_hand_computed_values():
    # decoupled PPO: ratio to the proximal policy r = [1.25, 0.8, 1.0], clipped at 1.2 for A > 0;
    # behaviour weight min(prox / behav, cap=2) = [2 (4 truncated), 1, 1.5]
    # loss = -(2 * 1.2 * 1 + 1 * 0.8 * -1 + 1.5 * 1.0 * 0.5) / 3
    loss, metrics = _loss(*DISAGGREGATED, "algorithm.max_staleness=1", with_old=True)
    assert loss == pytest.approx(-(2.4 - 0.8 + 0.75) / 3, abs=1e-6)
    assert metrics["rollout_correction/weight_mean"] / 3 == pytest.approx((2 + 1 + 1.5) / 3, abs=1e-6)
    assert metrics["rollout_correction/corrected_fraction"] / 3 == pytest.approx(1 / 3, abs=1e-6)
    # token-level masking instead: the token whose ratio 4 is outside [1/2, 2] is not trained on
    loss, _ = _loss(*DISAGGREGATED, "algorithm.max_staleness=1", "algorithm.rollout_correction=token_mask",
                    with_old=True)
    assert loss == pytest.approx(-(0 - 0.8 + 0.5) / 3, abs=1e-6)
    # the PPO ratio against the sampler's own log-probs: r = [5, 0.8, 1.5], clipped to [0.8, 1.2]
    loss, metrics = _loss(*DISAGGREGATED, "algorithm.max_staleness=1", "algorithm.old_log_probs_from=rollout",
                          with_old=False)
    assert loss == pytest.approx(-(1.2 - 0.8 + 0.6) / 3, abs=1e-6)
    assert not any(k.startswith("rollout_correction/") for k in metrics)
    # logged as token sums: the mean of old - new log-prob, and no negative-advantage ratio past clip_ratio_c=3
    assert metrics["approx_kl"] == pytest.approx(math.log(0.1 / 0.5) + math.log(0.5 / 0.4) + math.log(0.2 / 0.3))
    assert metrics["clip_frac_lower"] == 0.0


def test_the_dual_clip_bound_is_logged_where_it_wins():
    # r = [5, 0.8, 1.5] against the sampler's log-probs; the first token's advantage is negative,
    # so its -A * r = 5 is capped at -A * clip_ratio_c = 3: one token of three
    loss, metrics = _loss(*DISAGGREGATED, "algorithm.max_staleness=1", "algorithm.old_log_probs_from=rollout",
                          with_old=False, advantages=(-1.0, -1.0, 0.5))
    assert loss == pytest.approx(-(-3.0 - 0.8 + 0.6) / 3, abs=1e-6)
    assert metrics["clip_frac_lower"] == pytest.approx(1.0)  # a token sum: 1/3 of 3 tokens


def test_partial_samples_are_counted_by_their_first_token_and_flagged_when_weights_changed_mid_way():
    """rollout.partial: a sample's staleness is its first token's version; it is partial when a
    later response token came from newer weights. Tokens past its response do not count."""
    versions = torch.tensor([[3, 3, 3, 9], [3, 4, 4, 4], [3, 3, 4, 4], [2, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    batch = Batch({"rollout_weight_version": versions, "response_mask": mask})
    batch.tensors["weight_version"] = sample_versions(batch, engine_version=4)
    assert batch["weight_version"].tolist() == [3, 3, 3, 2]
    assert changed_weights_mid_sample(batch).tolist() == [False, True, False, False]
    plain = Batch({"response_mask": mask})  # without rollout.partial: the engine's version at the step's start
    assert sample_versions(plain, engine_version=4).tolist() == [4, 4, 4, 4]


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_asynchronous_dapo_stays_within_its_staleness_and_resumes(tmp_path):
    """DAPO with max_staleness=1, 2 train workers and 1 rollout worker (on Ray, resumed
    under torchrun): step 2 is generated while step 1 trains (it cannot
    wait for weights it is allowed to be behind), the correction measures the gap, no
    payload reaches the launcher; a resumed run continues without repeating a step and
    regenerates what was in flight with the checkpoint's weights. The resumed run swaps
    weights in during generation (rollout.partial): whatever arrives mid-way, every sample
    is counted by its first token's version and stays within the bound."""
    out = tmp_path / "run"
    common = [*SMALL, *DISAGGREGATED, "runtime.train_workers=2", "algorithm.name=dapo", "algorithm.max_staleness=1",
              "trainer.save_final=true", f"trainer.output_dir={out}"]
    distflow_train([*common, "trainer.total_steps=2"], tmp_path)
    launcher = json.loads((out / "launcher.json").read_text())  # Ray's launcher meters what it receives
    assert launcher["payload_bytes_received"] == 0 and launcher["control_bytes_received"] > 0
    # resumed with sharded training (FSDP2) and a learning rate that moves the greedy answers within 2 steps: the train
    # side's evaluation engine takes the gathered weights when it evaluates (and only then)
    distflow_train([*common, "trainer.total_steps=4", "runtime.launcher=torchrun", "rollout.partial=true",
                    "actor.strategy=fsdp2", "actor.lr=1e-3"], tmp_path)
    records = run_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[1]["async/version_lag_max"] == 0  # the starting weights are version 0
    assert records[2]["async/version_lag_1"] == 1.0  # generated before step 1's update existed
    assert records[3]["async/version_lag_max"] == 0  # after the resume: regenerated with step 2's weights
    for r in records[1:]:
        assert r["async/version_lag_max"] <= 1 and r["async/dropped_stale_samples"] == 0
        assert 0 < r["rollout_correction/weight_mean"] <= 2.0
        assert r["rollout_correction/mismatch_kl"] > -1e-6  # k3 >= 0, up to float32 rounding
        assert "dynamic_sampling/refill_rounds" in r  # the filter ran on the rollout side
    assert records[2]["rollout_correction/mismatch_kl"] > 1e-7  # one update apart: the policies differ
    for r in records[3:]:  # the resumed steps, with rollout.partial: whether a swap lands mid-generation is timing
        assert "async/swaps_during_generation" in r and "async/partial_samples" in r
    assert "async/partial_samples" not in records[2] and "async/swaps_during_generation" not in records[2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["placement"] == "disaggregated" and summary["steps"] == 4
    assert summary["actor_strategy"] == "fsdp2"
    # the final held-out number is the final policy's: `distflow eval` of the final checkpoint gives it
    evaluated = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "eval", f"model.path={out / 'checkpoints' / 'final'}",
                           "data.val_max_samples=16", "rollout.max_new_tokens=24", "runtime.launcher=torchrun",
                           "runtime.num_workers=1", f"trainer.output_dir={evaluated}"], cwd=tmp_path,
                          capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = json.loads((evaluated / "eval.json").read_text())["metrics"]["accuracy"]
    assert accuracy == summary["heldout_accuracy_final"] != summary["heldout_accuracy_initial"]


@pytest.mark.slow
def test_multi_turn_episodes_train_apart_from_their_rollout_and_drop_failed_groups_there(tmp_path):
    """Multi-turn episodes with a tool and an environment that fails now and then, on a
    rollout worker apart from the trainer, one step behind: the failed groups are dropped
    (or, when every group failed, masked) on the rollout side before the samples are sent,
    and the trainer trains on what is left."""
    (tmp_path / "env.py").write_text(CHECK_ONCE_ENV)
    out = tmp_path / "run"
    distflow_train([*SMALL, *DISAGGREGATED, "algorithm.max_staleness=1", "rollout.max_turns=2",
                    "rollout.tools=calculator", f"rollout.env={tmp_path / 'env.py'}:FailsOneInEight",
                    f"reward.custom_fn={tmp_path / 'env.py'}:by_length", "rollout.max_total_tokens=96",
                    "trainer.trace_steps=2", f"trainer.output_dir={out}"], tmp_path)
    # both sides' traces (the rollout worker, job rank 1, wrote none)
    assert sorted(p.name for p in (out / "traces").iterdir()) == ["step_2_rank_0.json", "step_2_rank_1.json"]
    assert any(e.get("cat") == "rollout" for e in json.loads((out / "traces" / "step_2_rank_1.json").read_text())
               ["traceEvents"])
    records = run_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert sum(r["env/failed"] for r in records[1:]) >= sum(r["env/dropped_groups"] for r in records[1:]) > 0
    trained = [r for r in records[1:] if "actor/grad_norm" in r]
    assert trained and all(r["actor/grad_norm"] > 0 and r["turns/mean"] > 1.0 for r in trained)
    for r in records[1:]:
        assert r["async/version_lag_max"] <= 1
        assert ("actor/grad_norm" in r) == ("drop_failed_groups/masked_instead_of_dropped" not in r)
