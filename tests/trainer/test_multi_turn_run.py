"""Multi-turn episodes in real runs: a user's environment (rollout.env=file.py:Class) that
asks every episode to check its answer once, so every trajectory holds an observation
the policy attends to and is not trained on; the run learns nothing wrong, counts turns
and tools, and 1 and 2 workers give the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ENV = '''
from distflow.engines.agent import EnvStep


class CheckOnce:
    """Asks for a check after the first answer; the second answer is final."""

    def __init__(self, toolbox):
        self.toolbox, self.asked = toolbox, False

    def reset(self, task):
        self.asked = False

    def step(self, text):
        if self.asked:
            return EnvStep([], True)
        self.asked = True
        return EnvStep([{"role": "user", "content": "Check it. Answer with ####."}], False,
                       {"tool_calls": len(self.toolbox.calls(text))})


def by_length(data_source, solution_str, ground_truth, extra_info):
    """A reward that differs within groups (the tiny model has never seen a check turn, so
    the task's own reward is 0 for all): the updates are non-trivial."""
    return (len(solution_str) % 5) / 4
'''
COMMON = ["rollout.max_turns=2", "rollout.max_new_tokens=24", "rollout.max_total_tokens=96", "rollout.tools=calculator", "trainer.total_steps=2",
          "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "algorithm.group_size=4",
          "data.val_max_samples=16", "trainer.progress=false", "trainer.save_final=false",
          "runtime.launcher=torchrun", "actor.lr_scheduler=constant", "actor.lr_warmup_steps=0"]


def _run(tmp_path, workers: int) -> list[dict]:
    out = tmp_path / f"w{workers}"
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", *COMMON, f"runtime.num_workers={workers}",
                           f"rollout.env={tmp_path / 'env.py'}:CheckOnce", f"reward.custom_fn={tmp_path / 'env.py'}:by_length",
                           f"trainer.output_dir={out}"],
                          cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_episodes_with_observations_train_alike_on_one_and_two_workers(tmp_path):
    (tmp_path / "env.py").write_text(ENV)
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    for a, b in zip(one[1:], two[1:], strict=True):
        assert a["turns/mean"] == 2.0 and b["turns/mean"] == 2.0  # every episode: answer, check, answer
        assert {"tool/calls", "tool/errors", "tool/timeouts"} <= set(a)
        for key in ("reward/mean", "response/length_mean", "tokens/total", "turns/mean", "tool/calls"):
            assert a[key] == b[key], (key, a["step"])
        for key in [k for k in a if k.startswith("actor/")]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"], a[key], b[key])
        assert a["actor/grad_norm"] > 0
    assert one[0]["val/accuracy"] == two[0]["val/accuracy"]  # the held-out evaluation runs the episodes too


def test_an_agent_written_against_the_openai_client_trains(tmp_path):
    """rollout.agent: examples/agents/arith_agent.py asks, and asks again for a #### line
    when the reply has none; its calls through the run's endpoint are the samples (the
    second request's messages become observation tokens) and its return value the reward."""
    agent = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agents", "arith_agent.py")
    out = tmp_path / "agent"
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train",
                           *[c for c in COMMON if not c.startswith("rollout.tools=")],
                           "runtime.num_workers=2", "trainer.total_steps=1", f"rollout.agent={os.path.abspath(agent)}:run",
                           f"trainer.output_dir={out}"], cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 < records[0]["val/accuracy"] < 1.0  # the held-out evaluation runs the agent too (greedy)
    for r in records[1:]:
        assert 1.0 <= r["turns/mean"] <= 2.0 and r["agent/failed"] == 0.0 and "agent/tool_calls" in r
        assert 0.0 < r["reward/mean"] < 1.0 and r["actor/grad_norm"] > 0
        assert r["response/length_mean"] <= 96  # completions and the follow-up within max_total_tokens
