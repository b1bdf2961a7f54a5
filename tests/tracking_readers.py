"""Reading a run's trackers back with each library's own reader (the tests' side of
distflow/trainer/tracking.py): TensorBoard's event accumulator, the W&B offline run's
protobuf records, MLflow's client."""

from __future__ import annotations

import glob
import json
import math
import struct
import time
from pathlib import Path

import pytest


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


def read_wandb(run_dir: Path, run_id: str = "*") -> tuple[dict[str, dict[int, float]], dict]:
    """(metric -> step -> value, the run's config) from the offline run (the one of `run_id`)."""
    (path,) = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / "run-*.wandb"))
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
            config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "config":  # set after the run started
            config |= {i.key: json.loads(i.value_json) for i in record.config.update}
    return history, config


def wandb_exit_code(run_dir: Path, wait_s: float = 30.0) -> int:
    """The exit code the offline run was finished with. W&B's service process may write the
    exit record a moment after `finish` returns (seen on a loaded machine): read again
    until it is there, for up to `wait_s`."""
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + wait_s
    while True:
        codes = [r.exit.exit_code for r in _wandb_records(path) if r.WhichOneof("record_type") == "exit"]
        if codes or time.monotonic() > deadline:
            (code,) = codes
            return code
        time.sleep(0.2)


def mlflow_status(run_dir: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return run.info.status  # FINISHED, FAILED, RUNNING


def read_mlflow(run_dir: Path, run_id: str | None = None) -> tuple[dict[str, dict[int, float]], dict, dict]:
    """(metric -> step -> value, params, tags) of the experiment's one run (or of `run_id`)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "distflow"]
    (run,) = [client.get_run(run_id)] if run_id else client.search_runs([experiment.experiment_id])
    metrics = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in run.data.metrics}
    return metrics, run.data.params, run.data.tags


def by_key(records: list[dict]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in r.items():
            if k != "step":
                out.setdefault(k, {})[r["step"]] = v
    return out


def check_trackers_hold(run_dir: Path, records: list[dict]) -> None:
    """Every tracker of a run folder holds what its metrics.jsonl holds."""
    expected = by_key(records)
    assert_same(read_tensorboard(run_dir), expected)
    assert_same(read_wandb(run_dir)[0], expected)
    assert_same(read_mlflow(run_dir)[0], expected)


def assert_same(read: dict[str, dict[int, float]], expected: dict[str, dict[int, float]]) -> None:
    assert set(read) == set(expected), (sorted(read), sorted(expected))
    for key, steps in expected.items():
        assert set(read[key]) == set(steps), key
        for step, value in steps.items():
            if math.isnan(value):
                assert math.isnan(read[key][step]), (key, step)
            else:
                assert read[key][step] == pytest.approx(value, rel=1e-6), (key, step, read[key][step], value)
