"""Experiment tracking through the real libraries: what TensorBoard's event reader, the W&B
offline run file and MLflow's client read back equals what was logged. A real 2-worker
run's trackers against its metrics.jsonl: test_real_model.py."""

from __future__ import annotations

import json

import pytest

from distflow.config import ConfigError, load_config
from distflow.trainer.tracking import Trackers
from tracking_readers import (assert_same, by_key, mlflow_status, read_mlflow, read_tensorboard, read_wandb,
                              wandb_exit_code)

ALL = "trainer.logger=jsonl,tensorboard,wandb,mlflow"
RECORDS = [  # magnitudes apart, so a value under the wrong step or key shows
    {"step": 0, "val/accuracy": 0.25},
    {"step": 1, "reward/mean": 4.5, "actor/loss": -0.045, "time/step": 1.5},
    {"step": 2, "reward/mean": 45.0, "actor/loss": -0.45, "time/step": 2.5, "val/accuracy": 0.5},
    {"step": 3, "reward/mean": 450.0, "actor/loss": -4.5, "time/step": 3.5},
]


def test_each_tracker_reads_back_what_was_logged(tmp_path):
    cfg = load_config(None, [ALL, "algorithm.group_size=7"])
    trackers = Trackers(cfg, tmp_path, rank=0)
    for record in RECORDS:
        trackers.log(record)
    trackers.close()
    expected = by_key(RECORDS)
    assert_same(read_tensorboard(tmp_path), expected)
    history, config = read_wandb(tmp_path)
    assert_same(history, expected)
    assert config["algorithm"]["group_size"] == 7
    metrics, params, tags = read_mlflow(tmp_path)
    assert_same(metrics, expected)
    assert params["algorithm.group_size"] == "7"
    assert tags["version.torch"].startswith("2.") and "git_commit" in tags
    assert wandb_exit_code(tmp_path) == 0 and mlflow_status(tmp_path) == "FINISHED"


def test_a_resumed_run_continues_its_wandb_and_mlflow_runs(tmp_path):
    """A run resumed in its folder logs into the W&B and MLflow runs it started (one run
    per training run, as a user compares them), and a setting the resume changes is
    tagged; a run started afresh in another folder gets runs of its own."""
    import glob

    from mlflow.tracking import MlflowClient

    first = Trackers(load_config(None, [ALL, "trainer.total_steps=2"]), tmp_path, rank=0)
    for record in RECORDS[:2]:
        first.log(record)
    first.close(failed=True)  # the launch that stopped
    again = Trackers(load_config(None, [ALL, "trainer.total_steps=4"]), tmp_path, rank=0, resumed=True)
    for record in RECORDS[2:]:
        again.log(record)
    again.close()
    metrics, params, tags = read_mlflow(tmp_path)  # one run holds every step
    assert_same(metrics, by_key(RECORDS))
    assert params["trainer.total_steps"] == "2" and tags["resumed.trainer.total_steps"] == "4"
    assert mlflow_status(tmp_path) == "FINISHED"
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and len({r.rsplit("-", 1)[1] for r in runs}) == 1  # two launches, one W&B run id
    first_ids = json.loads((tmp_path / "trackers.json").read_text())
    other = tmp_path / "other"
    Trackers(load_config(None, [ALL]), other, rank=0, resumed=True).close()  # no earlier ids there: new runs
    other_ids = json.loads((other / "trackers.json").read_text())
    assert other_ids["mlflow"] != first_ids["mlflow"] and other_ids["wandb"] != first_ids["wandb"]
    client = MlflowClient(tracking_uri=f"sqlite:///{other / 'mlflow.db'}")
    assert [r.info.run_id for r in client.search_runs([e.experiment_id for e in client.search_experiments()])] \
        == [other_ids["mlflow"]]
    assert glob.glob(str(other / "wandb" / "offline-run-*"))[0].endswith(other_ids["wandb"])
    # a launch with MLflow alone keeps the W&B id for a later launch with both
    Trackers(load_config(None, ["trainer.logger=jsonl,mlflow"]), tmp_path, rank=0, resumed=True).close()
    assert json.loads((tmp_path / "trackers.json").read_text()) == first_ids


def test_a_rollback_gets_new_wandb_and_mlflow_runs_holding_the_checkpoint_s_steps(tmp_path):
    """Resumed from an earlier checkpoint than its last (or from another run's), a run's later
    steps are not the ones its W&B and MLflow runs logged: W&B online kept the abandoned
    branch's value of every step up to its last (it takes no step twice), MLflow showed both
    branches in one run. It gets new runs, given the checkpoint's steps first; the abandoned
    branch's runs stay as they were."""
    cfg = load_config(None, [ALL])
    first = Trackers(cfg, tmp_path, rank=0)
    for record in RECORDS:
        first.log(record)
    first.close()
    first_ids = json.loads((tmp_path / "trackers.json").read_text())
    branch = [{"step": 2, "reward/mean": 7.0, "actor/loss": -0.7, "time/step": 2.0},
              {"step": 3, "reward/mean": 70.0, "actor/loss": -7.0, "time/step": 3.0}]
    again = Trackers(cfg, tmp_path, rank=0, resumed=True, start_step=1, history=RECORDS[:2], new_branch=True)
    for record in branch:
        again.log(record)
    again.close()
    ids = json.loads((tmp_path / "trackers.json").read_text())
    assert ids["wandb"] != first_ids["wandb"] and ids["mlflow"] != first_ids["mlflow"]
    expected = by_key(RECORDS[:2] + branch)
    assert_same(read_wandb(tmp_path, ids["wandb"])[0], expected)
    assert_same(read_mlflow(tmp_path, ids["mlflow"])[0], expected)
    assert_same(read_mlflow(tmp_path, first_ids["mlflow"])[0], by_key(RECORDS))
    assert_same(read_tensorboard(tmp_path), expected)  # one folder's writer: the steps after the checkpoint purged
    # resumed into a folder that has no runs yet (another run's checkpoint): its new runs hold the checkpoint's steps
    other = tmp_path / "other"
    Trackers(cfg, other, rank=0, resumed=True, start_step=1, history=RECORDS[:2]).close()
    assert_same(read_mlflow(other)[0], by_key(RECORDS[:2]))
    assert_same(read_wandb(other)[0], by_key(RECORDS[:2]))
    assert_same(read_tensorboard(other), by_key(RECORDS[:2]))  # its first event files too


def test_tensorboard_shows_a_resumed_run_s_steps_once(tmp_path):
    """A launch that stopped after logging steps 1-3 with its last checkpoint at step 1: the
    resumed launch logs steps 2 and 3 again. TensorBoard showed both launches' values of
    those steps, a zig-zag; the resumed writer now purges what came after its checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, ["trainer.logger=jsonl,tensorboard"])
    first = Trackers(cfg, tmp_path, rank=0)
    for step in (1, 2, 3):
        first.log({"step": step, "reward/mean": float(step)})
    first.close()
    again = Trackers(cfg, tmp_path, rank=0, resumed=True, start_step=1)
    for step in (2, 3):
        again.log({"step": step, "reward/mean": 10.0 * step})
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_a_failed_run_is_marked_failed(tmp_path):
    trackers = Trackers(load_config(None, [ALL]), tmp_path, rank=0)
    trackers.log(RECORDS[1])
    trackers.close(failed=True)
    assert wandb_exit_code(tmp_path) == 1 and mlflow_status(tmp_path) == "FAILED"


def test_a_tracker_that_fails_to_start_leaves_none_open(tmp_path, monkeypatch):
    """W&B refusing to start (online without a key) after MLflow started: the MLflow run was
    left RUNNING, an orphan the next launch did not continue either."""
    from distflow.trainer import tracking

    def refuse(*args, **kwargs):
        raise RuntimeError("wandb: api_key not configured")

    monkeypatch.setattr(tracking, "WandbTracker", refuse)
    with pytest.raises(RuntimeError, match="api_key"):
        Trackers(load_config(None, ["trainer.logger=jsonl,mlflow,wandb"]), tmp_path, rank=0)
    assert mlflow_status(tmp_path) == "FAILED"


def test_only_rank_0_tracks(tmp_path):
    trackers = Trackers(load_config(None, [ALL]), tmp_path, rank=1)
    trackers.log(RECORDS[1])
    trackers.close()
    assert list(tmp_path.iterdir()) == []


def test_logger_errors_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^trainer.logger='jsonl,tensorbord': unknown logger 'tensorbord'; "
                                          r"choose from jsonl, tensorboard, wandb, mlflow$"):
        load_config(None, ["trainer.logger=jsonl,tensorbord"])
    with pytest.raises(ConfigError, match=r"^trainer.logger='wandb': must include jsonl .*trainer.logger=jsonl,wandb$"):
        load_config(None, ["trainer.logger=wandb"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.logger=jsonl,mlflow"])
    assert str(e.value) == ("trainer.logger='jsonl,mlflow': the mlflow package is not installed; "
                            'pip install "distflow[tracking]"')


def test_the_framework_commit_is_its_own_checkouts_not_a_repository_around_it(tmp_path):
    import subprocess
    from pathlib import Path

    from distflow.trainer.tracking import source_commit

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True)

    git("init", "-q")
    (tmp_path / "venv" / "lib").mkdir(parents=True)  # an install inside the user's repository
    (tmp_path / "a").write_text("a")
    git("add", "a")
    git("-c", "user.email=u@x", "-c", "user.name=u", "commit", "-qm", "users")
    head = git("rev-parse", "HEAD").stdout.strip()
    assert source_commit(tmp_path) == head  # a checkout of its own
    assert source_commit(tmp_path / "venv" / "lib") is None  # the user's repository around it
    assert source_commit(Path(tmp_path.anchor) / "nonexistent-distflow-source") is None
