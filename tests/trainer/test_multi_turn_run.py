"""Multi-turn episodes in real runs: a user's environment (rollout.env=file.py:Class) that
asks every episode to check its answer once, so every trajectory holds an observation
the policy attends to and is not trained on; the run learns nothing wrong, counts turns
and tools, and 1 and 2 workers give the same run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import CHECK_ONCE_ENV, distflow_sweep, run_metrics

pytestmark = pytest.mark.slow

COMMON = ["rollout.max_turns=2", "rollout.max_new_tokens=24", "rollout.max_total_tokens=96", "trainer.total_steps=2",
          "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "algorithm.group_size=4",
          "data.val_max_samples=16", "trainer.progress=false", "trainer.save_final=false",
          "actor.lr_scheduler=constant", "actor.lr_warmup_steps=0"]
AGENT = Path(__file__).resolve().parents[2] / "examples" / "agents" / "arith_agent.py"
TOOLS = Path(__file__).resolve().parents[2] / "examples" / "tools" / "calculator.yaml"


def _overrides(yaml_file: Path) -> list[str]:
    """A config file's keys as section.key=value overrides (its run, in a sweep)."""
    return [f"{section}.{key}={value}" for section, keys in yaml.safe_load(yaml_file.read_text()).items()
            for key, value in keys.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The episodes on 1 and on 2 workers, the embedded tool task on 1 (its example's
    settings, 2 steps), the agent on 2, and DAPO's episodes on 2 workers straight and
    resumed from a 1-worker checkpoint (one launch per worker count)."""
    base = tmp_path_factory.mktemp("multi-turn")
    (base / "env.py").write_text(CHECK_ONCE_ENV)
    episodes = ["rollout.tools=calculator", f"rollout.env={base / 'env.py'}:CheckOnce",
                f"reward.custom_fn={base / 'env.py'}:by_length"]
    tools = [*_overrides(TOOLS), "trainer.total_steps=2", "trainer.eval_every=0", "data.val_max_samples=16"]
    dapo = [*episodes, "algorithm.name=dapo"]
    flaky = [*episodes[:1], f"rollout.env={base / 'env.py'}:FailsOneInEight", *episodes[2:]]
    folders = distflow_sweep({"w1": episodes, "tools": tools, "failing": flaky,
                              "failing_scored": [*flaky, "rollout.on_failed_episode=score_zero"],
                              "failing_dapo": [*flaky, "algorithm.name=dapo"],
                              "dapo_half": [*dapo, "trainer.total_steps=1", "trainer.save_final=true"]}, 1, base, COMMON)
    resume = f"trainer.resume={folders['dapo_half'] / 'checkpoints' / 'final'}"
    return folders | distflow_sweep({"w2": episodes, "agent": ["trainer.total_steps=1", f"rollout.agent={AGENT}:run"],
                                     "dapo": dapo, "dapo_resumed": [*dapo, resume]}, 2, base, COMMON)


def test_episodes_with_observations_train_alike_on_one_and_two_workers(runs):
    one, two = run_metrics(runs["w1"]), run_metrics(runs["w2"])
    for a, b in zip(one[1:], two[1:], strict=True):
        assert a["turns/mean"] == 2.0 and b["turns/mean"] == 2.0  # every episode: answer, check, answer
        assert {"tool/calls", "tool/errors", "tool/timeouts"} <= set(a)
        for key in ("reward/mean", "response/length_mean", "tokens/total", "turns/mean", "tool/calls"):
            assert a[key] == b[key], (key, a["step"])
        for key in [k for k in a if k.startswith("actor/")]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"], a[key], b[key])
        assert a["actor/grad_norm"] > 0
    assert one[0]["val/accuracy"] == two[0]["val/accuracy"]  # the held-out evaluation runs the episodes too


def test_multi_turn_dapo_resumes_on_another_worker_count_like_an_uninterrupted_run(runs):
    """DAPO's dynamic sampling over episodes (its refills run episodes too); step 1 run
    on 1 worker and checkpointed, step 2 resumed on 2, equals the 2-worker run straight."""
    want, got = run_metrics(runs["dapo"]), run_metrics(runs["dapo_resumed"])
    assert [r["step"] for r in got] == [0, 1, 2] and want[2]["turns/mean"] == 2.0
    for key in ("reward/mean", "response/length_mean", "tokens/total", "turns/mean", "tool/calls"):
        assert want[2][key] == got[2][key], key
    for key in [k for k in want[2] if k.startswith("actor/")]:
        assert want[2][key] == pytest.approx(got[2][key], rel=1e-4, abs=1e-6), key


def test_a_group_with_a_failed_episode_leaves_the_step_unless_failures_score_zero(runs):
    """rollout.on_failed_episode: an environment that raises in some episodes. By default
    (drop_group) their groups leave the step, so fewer tokens train than when the failed
    episodes train with reward 0 beside their groups (score_zero); the failures are counted
    alike either way, on the same samples, and the run trains on the groups left (none left:
    no update, where one worker's empty batch stopped the run)."""
    dropped, scored = run_metrics(runs["failing"]), run_metrics(runs["failing_scored"])
    first, second = dropped[1], scored[1]  # step 1: the same weights and seeds, so the same episodes
    assert first["env/failed"] == second["env/failed"] > 0
    assert 0 < first["env/dropped_groups"] < 4 and "env/dropped_groups" not in second
    assert first["tokens/total"] < second["tokens/total"] and first["actor/grad_norm"] > 0
    # step 2 (these seeds): every group has a failed episode; the worker's rows stay, masked, and nothing trains
    last = dropped[2]
    assert last["env/dropped_groups"] == 4 and last["drop_failed_groups/masked_instead_of_dropped"] == 1
    assert last["tokens/total"] == 0 and "actor/grad_norm" not in last and scored[2]["actor/grad_norm"] > 0
    # the held-out evaluation says how many of its episodes failed (they count as wrong)
    assert 0 < dropped[0]["val/failed_episodes"] < 1 and run_metrics(runs["w1"])[0]["val/failed_episodes"] == 0


def test_dapo_refills_the_groups_that_failed_episodes_dropped(runs):
    """DAPO over failing episodes: the refill rounds run episodes (and drop failed groups)
    until the step's groups are full, so every step trains on passing groups. In step 2
    (these seeds) every first-round group failed: they stay masked on the one worker, pass
    no group, and are refilled all the same (the refill had counted them as passing, and
    the step trained nothing)."""
    records = run_metrics(runs["failing_dapo"])
    for r in records[1:]:
        assert r["env/dropped_groups"] > 0 and r["dynamic_sampling/refill_rounds"] >= 1
        assert r["dynamic_sampling/passed_groups"] >= 4 and r["actor/grad_norm"] > 0
    assert records[2]["drop_failed_groups/masked_instead_of_dropped"] == 1 and records[2]["tokens/total"] > 0


def test_the_embedded_tool_task_calls_the_calculator_in_training_and_evaluation(runs):
    """examples/tools/calculator.yaml: the tool model's episodes call the calculator (Hermes
    format, well formed: its results come back), are scored on what the model generated,
    and the held-out evaluation runs them per level, the two-digit products included."""
    records = run_metrics(runs["tools"])
    assert set(records[0]) >= {f"val/accuracy/level_{k}" for k in (1, 2, 3, 4)}
    for r in records[1:]:
        assert 1.0 < r["turns/mean"] <= 2.0 and r["tool/calls"] > 0 and r["tool/errors"] <= r["tool/calls"] / 4
        assert 0.0 < r["reward/mean"] < 1.0 and r["actor/grad_norm"] > 0
    assert records[-1]["val/accuracy"] > 0.0


def test_an_agent_written_against_the_openai_client_trains(runs):
    """rollout.agent: examples/agents/arith_agent.py asks, and asks again for a #### line
    when the reply has none; its calls through the run's endpoint are the samples (the
    second request's messages become observation tokens) and its return value the reward."""
    records = run_metrics(runs["agent"])
    assert 0.0 < records[0]["val/accuracy"] < 1.0  # the held-out evaluation runs the agent too (greedy)
    for r in records[1:]:
        assert 1.0 <= r["turns/mean"] <= 2.0 and r["agent/failed"] == 0.0 and "agent/tool_calls" in r
        assert 0.0 < r["reward/mean"] < 1.0 and r["actor/grad_norm"] > 0
        assert r["response/length_mean"] <= 96  # completions and the follow-up within max_total_tokens
