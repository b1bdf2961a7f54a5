"""The task graph in real runs: a user's nodes from YAML, a per-step Chrome trace, and a
node that raises on one worker failing the whole run with its name and rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "extend_grpo" / "graph.yaml"
SMALL = ["trainer.total_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
         "algorithm.group_size=4", "data.val_max_samples=16", "rollout.max_new_tokens=24",
         "trainer.eval_every=0", "trainer.progress=false", "trainer.save_final=false"]


def _train(args, cwd, timeout=300) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", *SMALL, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_user_nodes_from_yaml_run_and_show_in_metrics_and_trace(tmp_path):
    out = tmp_path / "run"
    proc, _ = _train([f"algorithm.graph={EXAMPLE}", "runtime.launcher=torchrun", "trainer.trace_steps=2",
                      "scheduler.overlap=true",
                      "scheduler.stream_chunk_size=4", f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    for node in ("format_bonus", "drop_truncated_groups", "advantage", "rollout", "reward", "ref_log_prob"):
        assert f"time/{node}" in last, node
    for rank in (0, 1):
        trace = json.loads((out / "traces" / f"step_2_rank_{rank}.json").read_text())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = {e["cat"] for e in spans}
        assert {"rollout", "reward", "format_bonus", "actor_update"} <= names
        # streaming: the reward scored rollout chunk 0 before the rollout's last chunk ended
        rollout_end = max(e["ts"] + e["dur"] for e in spans if e["cat"] == "rollout")
        first_reward = next(e for e in spans if e["name"] == "reward[0]")
        assert first_reward["ts"] < rollout_end
    assert not (out / "traces" / "step_1_rank_0.json").exists()


def test_a_node_raising_on_one_worker_fails_the_run_with_its_name_and_rank(tmp_path):
    (tmp_path / "explode.py").write_text(
        "import torch.distributed as dist\n"
        "def explode(ctx, batch):\n"
        "    if dist.get_rank() == 1 and ctx.step == 2:\n"
        "        raise RuntimeError('poisoned sample')\n"
        "    return None\n")
    (tmp_path / "graph.yaml").write_text(
        "base: grpo\nnodes:\n  - {name: explode, role: custom, fn: 'explode.py:explode', inputs: [scores],"
        " outputs: []}\n")
    out = tmp_path / "run"
    proc, seconds = _train([f"algorithm.graph={tmp_path / 'graph.yaml'}", f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-4000:]
    # the Ray launcher's one line names the worker, the node and the step; the other worker did not hang
    errors = [line for line in proc.stderr.splitlines() if line.startswith("distflow: error:")]
    assert len(errors) == 1, errors
    assert ("worker 1 failed: NodeFailed: node 'explode' failed on worker 1 in step 2: RuntimeError: poisoned sample"
            in errors[0])
    # the worker's full traceback, down to the user's line, is kept in the run folder
    assert "raise RuntimeError('poisoned sample')" in (out / "worker-1-traceback.txt").read_text()
    print(f"failed run stopped after {seconds:.1f} s")
