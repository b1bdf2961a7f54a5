"""Bad input during a run, for real: a reward function that raises or hangs on some
samples (scored 0, counted, the run goes on), and NaN advantages (updates skipped and
counted, the run stops clearly after trainer.max_bad_steps, marked failed in MLflow, and a
resume goes on counting; a trainer that fails to build opens no tracker run)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tracking_readers import mlflow_status

pytestmark = pytest.mark.slow

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "algorithm.group_size=4",
         "data.val_max_samples=8", "rollout.max_new_tokens=24", "trainer.eval_every=0", "trainer.progress=false",
         "trainer.save_final=false", "runtime.launcher=torchrun"]


def _train(args, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "distflow.cli", "train", *SMALL, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _dataset_with_bad_rows(path):
    """16 arithmetic rows of which 6 are malformed and 2 have over-long prompts."""
    from distflow.data.tasks import arith

    rows = [json.dumps(r) for r in arith.verl_rows("train", 16)]
    for i in (1, 4, 6):
        rows[i] = json.dumps({"prompt": [{"role": "user", "content": " "}], "reward_model": {"ground_truth": "1"}})
    for i in (8, 10, 13):
        rows[i] = json.dumps({"prompt": "What is 2+2?", "reward_model": {"style": "rule"}})  # no ground truth
    for i in (2, 11):
        row = json.loads(rows[i])
        row["prompt"][0]["content"] = "Ignore this. " * 200 + row["prompt"][0]["content"]
        rows[i] = json.dumps(row)
    path.write_text("\n".join(rows) + "\n")


def test_a_reward_that_raises_or_hangs_scores_zero_and_the_run_goes_on(tmp_path):
    """Bad input of every kind in one run: a reward function that raises or hangs on some
    samples; hostile programs run in the code sandbox from the reward process (writing
    outside its folder, opening a socket, allocating 8 GiB); and a dataset with malformed
    rows and over-long prompts under on_bad_row=skip, on_long_prompt=truncate."""
    _dataset_with_bad_rows(tmp_path / "train.jsonl")
    escape = tmp_path / "escaped.txt"
    hostile = [f"open({str(escape)!r}, 'w').write('x')", "import socket; socket.create_connection(('127.0.0.1', 22))",
               "x = bytearray(8 * 1024 ** 3)"]
    (tmp_path / "flaky.py").write_text(
        "import json, os, time\n"
        "from distflow.engines.sandbox import code_score\n"
        f"HOSTILE = {hostile!r}\n"
        f"HUNG = {str(tmp_path / 'hung')!r}\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if '3' in solution_str:\n"
        "        raise ValueError('cannot score a three')\n"
        "    if extra_info['split'] == 'train' and not os.path.exists(HUNG):  # the first training sample without a\n"
        "        # three hangs, whatever was sampled (the held-out evaluation before step 1 scores test rows)\n"
        "        open(HUNG, 'w').close()\n"
        "        time.sleep(600)\n"
        "    program = HOSTILE[len(solution_str) % len(HOSTILE)]  # every other sample: one of them\n"
        "    value = code_score('code', program, json.dumps({'inputs': [''], 'outputs': ['ok']}))\n"
        f"    open({str(tmp_path / 'hostile.log')!r}, 'a').write(f'{{value}}\\n')\n"
        "    return value\n")
    out = tmp_path / "run"
    proc = _train(["trainer.total_steps=1", "data.val_max_samples=2", f"reward.custom_fn={tmp_path / 'flaky.py'}:score",
                   "reward.timeout_s=1", f"trainer.output_dir={out}", f"data.train_files={tmp_path / 'train.jsonl'}",
                   "data.val_files=builtin:arith:test",
                   "data.on_bad_row=skip", "data.on_long_prompt=truncate"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert sum(r["reward/failed"] for r in records) > 0 and sum(r["reward/timed_out"] for r in records) > 0
    assert "ValueError: cannot score a three" in proc.stderr  # the first traceback, once per worker
    assert proc.stderr.count("reward function failed") <= 2
    assert not escape.exists()
    assert records[0]["data/skipped_rows"] > 0 and records[0]["data/truncated_prompts"] > 0
    assert "skipping a bad row" in proc.stderr and "train.jsonl: line" in proc.stderr
    scores = (tmp_path / "hostile.log").read_text().split()
    assert scores and set(scores) == {"0.0"}  # each hostile program ran, was contained and scored 0


def test_a_reward_that_fails_on_every_sample_stops_the_run_after_max_bad_steps(tmp_path):
    """Every sample scoring 0 because every call raised is no training signal: the run went
    on to its end with all-zero rewards and reported success. It now stops after
    trainer.max_bad_steps such steps, in one line; a step where some samples scored is not
    one of them (the run above). Disaggregated, see the next test."""
    (tmp_path / "broken.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return extra_info['missing_key']\n")
    out = tmp_path / "run"
    proc = _train(["trainer.total_steps=4", "trainer.max_bad_steps=2", f"reward.custom_fn={tmp_path / 'broken.py'}:score",
                   "reward.timeout_s=0", f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "stopping at step 2: 2 steps in a row could score no sample (trainer.max_bad_steps=2)" in proc.stderr
    assert "KeyError: 'missing_key'" in proc.stderr  # the first traceback, as before
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [(r["reward/scored"], r["reward/failed"]) for r in records] == [(16.0, 16.0), (16.0, 16.0)]


def test_an_agent_that_fails_on_every_sample_stops_the_run_after_max_bad_steps(tmp_path):
    """The reward scored every failed episode (0, no failure of its own), so a rollout.agent
    raising on every sample trained nothing to the end and reported success."""
    (tmp_path / "agent.py").write_text("async def run(client, row):\n    raise ConnectionError('no such service')\n")
    out = tmp_path / "run"
    proc = _train(["trainer.total_steps=4", "trainer.max_bad_steps=2", f"rollout.agent={tmp_path / 'agent.py'}:run",
                   f"trainer.output_dir={out}"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "stopping at step 2: 2 steps in a row had every episode fail (trainer.max_bad_steps=2)" in proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [(r["episodes/total"], r["episodes/failed"], r["agent/failed"]) for r in records] == [(16.0, 16.0, 16.0)] * 2


def _stop_where_one_rank_saw_the_counts(rank: int, world: int) -> str:
    """Train rank 0 alone holds the rollout side's reward counts, as in a disaggregated run."""
    from types import SimpleNamespace

    from distflow.config import load_config
    from distflow.trainer.loop import Trainer

    trainer = SimpleNamespace(stream=object(), bad_steps=1, cfg=load_config(None, ["trainer.max_bad_steps=2"]))
    metrics = {"reward/scored": 16.0, "reward/failed": 16.0} if rank == 0 else {}
    try:
        Trainer._check_bad_steps(trainer, 2, metrics)
    except RuntimeError as e:
        return str(e)
    return "went on"


def test_every_disaggregated_train_worker_stops_where_one_saw_no_sample_scored():
    """The rollout side's counts reach one train worker; the others stop with it, on the same
    line, rather than wait for it in their next collective."""
    from helpers import run_gloo

    stops = run_gloo(_stop_where_one_rank_saw_the_counts, 2)
    assert stops[0] == stops[1] and stops[0].startswith("stopping at step 2: 2 steps in a row could score no sample")


def test_nan_updates_are_skipped_and_the_run_stops_after_max_bad_steps(tmp_path):
    (tmp_path / "nan_adv.py").write_text(
        "import torch\n"
        "from distflow.data.batch import Batch\n"
        "def advantage(ctx, batch):\n"
        "    return Batch({'advantages': torch.full(batch['response_mask'].shape, float('nan'))})\n")
    (tmp_path / "graph.yaml").write_text(
        "base: grpo\nnodes:\n  - {name: advantage, role: advantage, fn: 'nan_adv.py:advantage',"
        " inputs: [scores, response_mask, group], outputs: [advantages]}\n")
    out = tmp_path / "run"
    args = ["trainer.total_steps=5", "trainer.max_bad_steps=2", f"algorithm.graph={tmp_path / 'graph.yaml'}",
            f"trainer.output_dir={out}", "trainer.save_every=1", "trainer.logger=jsonl,mlflow"]
    proc = _train(args, tmp_path)
    assert proc.returncode == 1
    assert "stopping at step 2: 2 steps in a row had a non-finite loss or gradient" in proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["actor/skipped_updates"] for r in records] == [1.0, 1.0]
    # a skipped update's losses and metrics are left out with it: they were NaN, and made the step's NaN
    assert all(not math.isnan(v) for r in records for v in r.values() if isinstance(v, float))
    assert not any("actor/pg_loss" in r or "actor/entropy" in r for r in records)
    assert mlflow_status(out) == "FAILED"
    # resumed from step 1, whose step was already bad: the run of bad steps goes on counting
    proc = _train(args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "stopping at step 2: 2 steps in a row" in proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in records] == [1, 2]
    # a trainer that fails to build (PPO resumed from GRPO's checkpoint, which has no critic)
    # closes what it built and opens no tracker run
    failed = tmp_path / "ppo"
    proc = _train(["trainer.total_steps=2", "algorithm.name=ppo", f"trainer.resume={out / 'checkpoints' / 'step_1'}",
                   f"trainer.output_dir={failed}", "trainer.logger=jsonl,mlflow"], tmp_path)
    assert proc.returncode == 1 and "has no critic, but this recipe trains one" in proc.stderr
    assert not (failed / "mlflow.db").exists()
