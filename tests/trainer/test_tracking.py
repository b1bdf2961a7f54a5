"""Experiment tracking through the real libraries: what TensorBoard's event reader, the W&B
offline run file and MLflow's client read back equals what was logged (and, in a real
2-worker run, what metrics.jsonl holds)."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from distflow.config import ConfigError, load_config
from distflow.trainer.tracking import Trackers

ALL = "trainer.logger=jsonl,tensorboard,wandb,mlflow"


def read_tensorboard(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _wandb_records(path: str):
    """The protobuf records of a W&B transaction log (.wandb: a LevelDB-style log of 32 KiB
    blocks after a 7-byte file header; each chunk has a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, head = Path(path).read_bytes(), 32768, 7
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + head <= len(data):
        left = block - pos % block
        if left < head:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos: pos + head])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + head: pos + head + length]
        pos += head + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict]:
    """(metric -> step -> value, the run's config) from the offline run."""
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history: dict[str, dict[int, float]] = {}
    config = {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, {})[int(items["_step"])] = value
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return history, config


def read_mlflow(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "distflow"]
    (run,) = client.search_runs([experiment.experiment_id])
    metrics = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in run.data.metrics}
    return metrics, run.data.params, run.data.tags


RECORDS = [  # magnitudes apart, so a value under the wrong step or key shows
    {"step": 0, "val/accuracy": 0.25},
    {"step": 1, "reward/mean": 4.5, "actor/loss": -0.045, "time/step": 1.5},
    {"step": 2, "reward/mean": 45.0, "actor/loss": -0.45, "time/step": 2.5, "val/accuracy": 0.5},
    {"step": 3, "reward/mean": 450.0, "actor/loss": -4.5, "time/step": 3.5},
]


def _by_key(records: list[dict]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in r.items():
            if k != "step":
                out.setdefault(k, {})[r["step"]] = v
    return out


def _close(read: dict[str, dict[int, float]], expected: dict[str, dict[int, float]]) -> None:
    assert set(read) == set(expected), (sorted(read), sorted(expected))
    for key, steps in expected.items():
        assert set(read[key]) == set(steps), key
        for step, value in steps.items():
            if math.isnan(value):
                assert math.isnan(read[key][step]), (key, step)
            else:
                assert read[key][step] == pytest.approx(value, rel=1e-6), (key, step, read[key][step], value)


def test_each_tracker_reads_back_what_was_logged(tmp_path):
    cfg = load_config(None, [ALL, "algorithm.group_size=7"])
    trackers = Trackers(cfg, tmp_path, rank=0)
    for record in RECORDS:
        trackers.log(record)
    trackers.close()
    expected = _by_key(RECORDS)
    _close(read_tensorboard(tmp_path), expected)
    history, config = read_wandb(tmp_path)
    _close(history, expected)
    assert config["algorithm"]["group_size"] == 7
    metrics, params, tags = read_mlflow(tmp_path)
    _close(metrics, expected)
    assert params["algorithm.group_size"] == "7"
    assert tags["version.torch"].startswith("2.") and "git_commit" in tags


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


@pytest.mark.slow
def test_a_two_worker_run_tracks_what_metrics_jsonl_holds(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", "runtime.launcher=torchrun", ALL,
                           "trainer.total_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                           "algorithm.group_size=4", "data.val_max_samples=16", "rollout.max_new_tokens=16",
                           "trainer.progress=false", "trainer.save_final=false", f"trainer.output_dir={out}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = _by_key(records)
    assert "reward/mean" in expected and "val/accuracy/level_1" in expected
    _close(read_tensorboard(out), expected)
    _close(read_wandb(out)[0], expected)
    _close(read_mlflow(out)[0], expected)
