"""`distflow` command line.

    distflow train [--config FILE] [section.key=value ...]
    distflow build-tiny-model --out DIR [--tools | --vision] [--steps N]
    distflow make-data --split train --num 1000 --out FILE.parquet
    distflow bench dataplane [--quick] [--workers N ...] [--json FILE] [--results-md FILE]
    distflow bench dataplane-vlm [--batch 8 16 32 64] [--megapixels 1] [--memory-budget-gib 4] [--json FILE]
    distflow bench scheduler [--settings default compute] [--json FILE] [--results-md FILE]
    distflow bench e2e [--quick] [--json FILE] [--results-md FILE] [--plot FILE]
    distflow bench project [--records benchmarks/e2e.jsonl] [--plot FILE]
    distflow bench soak [--steps 200] [--workers 4] [--json FILE]
    distflow bench engines [--quick] [--json FILE] [--results-md FILE]
    distflow bench trl [--steps 60] [--json FILE] [--results-md FILE]
    distflow bench async [--quick] [--json FILE] [--results-md FILE]
    distflow bench checkpointing [--quick] [--json FILE] [--results-md FILE]
    distflow bench tools [--episodes 64] [--env-workers 1 8] [--json FILE] [--results-md FILE]
    distflow bench agents [--agents 64 256] [--turns 3] [--json FILE] [--results-md FILE]
    distflow cluster up|down|status [--hosts 5] [--rate-mbit 400] [--delay-ms 0]
    distflow dag show [RECIPE] [--out PATH] [--config FILE] [section.key=value ...]
    distflow dag recipes
    distflow eval [--k K] model.path=DIR data.val_files=FILE [section.key=value ...]
    distflow export CHECKPOINT --out DIR [--merge] [--dtype bfloat16]
    distflow runs [ROOT]
    distflow plot RUN [RUN ...] [--out FILE]

A config or input error found before launch prints one line and exits with code 2; a
failed worker (a bad data row or a user's function among the causes) exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from distflow.config import (BUILTIN_MODEL, Config, ConfigError, load_config, relocated_file_spec, reward_fn_specs,
                             tool_names, validate)
from distflow.data.dataset import BUILTIN_TASKS, write_builtin_parquet
from distflow.runtime import netns

EXIT_USAGE, EXIT_FAILED = 2, 1
WORKER_ENTRY = "distflow.trainer.loop:run_worker"
EVAL_ENTRY = "distflow.trainer.loop:run_eval_worker"


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"distflow: error: {message}", file=sys.stderr)
    return code


def new_run_dir(cfg: Config, kind: str | None = None) -> Path:
    """trainer.output_dir, or a new folder runs/<date-time>-<kind: the algorithm's name by
    default>[-<n>] (two runs started in the same second get their own), held by this
    process (`hold_run_folder`).
    Where a worker was when an earlier launch in the folder stopped (status/) is cleared:
    this launch's failures name its own stages."""
    if cfg.trainer.output_dir:
        path = Path(cfg.trainer.output_dir).expanduser()
        path.mkdir(parents=True, exist_ok=True)
    else:
        stem = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind or Path(cfg.algorithm.name).stem}"
        path, n = stem, 1
        stem.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                path.mkdir()  # atomic: only one run gets each name
                break
            except FileExistsError:
                n += 1
                path = stem.with_name(f"{stem.name}-{n}")
    path = path.resolve()
    hold_run_folder(path)
    shutil.rmtree(path / "status", ignore_errors=True)
    return path


_HELD_FOLDERS: dict[str, object] = {}  # run folder -> its open lock file, held until this process exits
HELD_FOLDER_ENV = "DISTFLOW_HELD_RUN_FOLDER"  # the folder torchrun's launcher holds, for the workers it starts


def hold_run_folder(path: Path) -> None:
    """A lock on `path` (flock on its .lock file, which names the holder's pid) for as long
    as this process runs: a second launch into the folder while one runs there (a
    scheduler's retry, a double submit) would write the same checkpoints and metrics, and
    is refused in one line. Taken once per process; not again by the workers of a
    launcher that holds it (torchrun's, told through the environment, `_exec_torchrun`)."""
    key = str(path)
    if key in _HELD_FOLDERS or os.environ.get(HELD_FOLDER_ENV) == key:
        return
    try:
        lock = open(path / ".lock", "a+")
    except OSError as e:
        raise ConfigError(f"trainer.output_dir={path}: cannot write its lock file ({e.strerror})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ConfigError(f"trainer.output_dir={path}: another launch (pid {holder}) is running in this folder; "
                          "wait for it to end, or choose another folder") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _HELD_FOLDERS[key] = lock


def record_config(run_dir: Path, cfg: Config) -> None:
    """The launch's config as config.json. Where the folder holds an earlier launch's that
    differs (a run resumed with other settings), that one is kept as config-<n>.json,
    n = 1 for the oldest, and the settings that changed are named on stderr."""
    path, text = run_dir / "config.json", json.dumps(cfg.to_dict(), indent=1)
    if path.is_file() and path.read_text() != text:
        from distflow.trainer.checkpoint import set_aside_numbered

        kept = set_aside_numbered(path)
        try:
            changed = changed_settings(json.loads(kept.read_text()), cfg.to_dict())
        except ValueError:  # not JSON: an edited file
            changed = ["(the earlier file is not JSON)"]
        print(f"distflow: this folder's earlier launch had other settings (kept as {kept.name}): "
              f"{'; '.join(changed)}", file=sys.stderr)
    path.write_text(text)


def record_eval_config(run_dir: Path, cfg: Config) -> None:
    """An evaluation's config as eval-config.json: the settings its numbers depend on (top_p,
    max_new_tokens, the seed, val_max_samples...), under a name of its own, so that an
    evaluation in a training run's folder leaves that run's config.json as it is."""
    (run_dir / "eval-config.json").write_text(json.dumps(cfg.to_dict(), indent=1))


def changed_settings(before: dict, now: dict, shown: int = 8) -> list[str]:
    """`section.key before -> now` for every setting of two configs' dicts that differs
    (one missing from either is shown as -), at most `shown` of them and a count of the rest."""
    def flat(config: dict) -> dict[str, Any]:
        return {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
                for key, value in values.items()}

    def shown_value(config: dict[str, Any], key: str) -> str:
        return json.dumps(config[key]) if key in config else "-"

    old, new = flat(before), flat(now)
    changes = [f"{key} {shown_value(old, key)} -> {shown_value(new, key)}"
               for key in sorted(old.keys() | new.keys()) if shown_value(old, key) != shown_value(new, key)]
    return changes[:shown] + ([f"and {len(changes) - shown} more"] if len(changes) > shown else [])


def check_inputs(cfg: Config, training: bool = True) -> None:
    """Cheap checks of what the config names, before anything starts: files and their
    types, parquet footers, the run folder, the reward function's file or module, a
    checkpoint to resume from (contents are read by the workers). Without `training`
    (`distflow eval`), what only training reads is not looked at."""
    from distflow.data.dataset import DatasetError, has_a_row, open_source, parse_builtin
    from distflow.plugins import check_callable

    for key in ("train_files", "val_files") if training else ("val_files",):
        spec, rows = getattr(cfg.data, key), 0
        sources = [s.strip() for s in spec.split(",") if s.strip()]
        if key == "train_files" and not sources:
            raise ConfigError("data.train_files: empty; name the training data (files, or builtin:TASK:SPLIT)")
        for source in sources:
            if source.startswith("builtin:"):
                try:
                    parse_builtin(source)
                except DatasetError as e:
                    raise ConfigError(f"data.{key}: {e}") from None
                continue
            if not os.path.isfile(os.path.expanduser(source)):
                raise ConfigError(f"data.{key}={source!r}: no such file")
            if not source.endswith((".parquet", ".jsonl", ".json")):
                raise ConfigError(f"data.{key}={source!r}: unknown file type; expected .parquet, .jsonl or .json")
            if source.endswith(".parquet"):  # its footer only: a file that is not parquet stops here
                try:
                    rows += open_source(source).num_rows
                except DatasetError as e:
                    raise ConfigError(f"data.{key}: {e}") from None
            else:
                try:
                    rows += has_a_row(source)
                except OSError as e:
                    raise ConfigError(f"data.{key}={source!r}: cannot be read ({e.strerror or e})") from None
        if sources and not any(s.startswith("builtin:") for s in sources) and not rows:
            raise ConfigError(f"data.{key}={spec!r}: no rows in the dataset")
    if not cfg.data.val_files:
        raise ConfigError(f"data.val_files: not set, and data.train_files={cfg.data.train_files!r} is not a built-in "
                          "task: name held-out files in the same format (data.val_files=FILE), on which the run's "
                          "held-out accuracy is measured")
    run_dir = Path(cfg.trainer.output_dir or "").expanduser()
    if cfg.trainer.output_dir and run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"trainer.output_dir={cfg.trainer.output_dir!r}: exists and is not a folder")
    for spec in reward_fn_specs(cfg):
        check_callable(spec, "reward.custom_fn")
    if cfg.reward.model_path is not None:
        from distflow.engines.reward_model import RewardModelError, check_reward_model

        try:
            check_reward_model(cfg.reward.model_path)
        except RewardModelError as e:
            raise ConfigError(f"reward.model_path: {e}") from None
    if cfg.rollout.tool_schemas is not None:
        from distflow.engines.tools import schemas

        try:
            schemas(tool_names(cfg), cfg.rollout.tool_schemas)
        except ValueError as e:
            raise ConfigError(f"rollout.tool_schemas: {e}") from None
    if cfg.rollout.max_turns > 1 or cfg.rollout.agent is not None:
        from distflow.engines.common import has_chat_template

        if not has_chat_template(cfg.model.path):
            raise ConfigError(f"model.path={cfg.model.path!r}: its tokenizer has no chat template, which multi-turn "
                              "episodes (rollout.max_turns > 1) and rollout.agent render every turn's messages with; "
                              "use a model whose tokenizer has one, or add one to it (tokenizer.chat_template)")
    if training and cfg.actor.lora_rank:
        from distflow.engines.common import resolve_model_path
        from distflow.engines.lora import is_adapter_folder

        if is_adapter_folder(resolve_model_path(cfg.model.path)):
            raise ConfigError(f"model.path={cfg.model.path!r}: a LoRA checkpoint; a new adapter on it would be saved "
                              "against its base without it: merge it first (distflow export PATH --out DIR "
                              "--merge) or train it whole without actor.lora_rank")
    if training and cfg.trainer.resume not in ("auto", "off"):
        from distflow.trainer.checkpoint import CheckpointError, resolve

        try:
            resolve(cfg.trainer.resume, Path("."))
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
    if cfg.runtime.device == "cuda" and cfg.runtime.ray_address is None:  # a cluster's GPUs are on its nodes
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("runtime.device='cuda': no CUDA device is visible; use auto or cpu")
    from distflow.engines.common import check_vision_model, takes_images

    if takes_images(cfg.model.path):
        try:
            check_vision_model(cfg.model.path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.data.on_long_prompt == "truncate":  # it stopped the run at the step that drew one
            raise ConfigError(f"data.on_long_prompt=truncate: model.path={cfg.model.path} is a vision-language model, "
                              "whose image prompts cannot be truncated; use skip or error")
    if cfg.rollout.engine == "vllm":

        if takes_images(cfg.model.path):  # training's graph refuses it too; evaluation builds none
            raise ConfigError(f"rollout.engine=vllm: model.path={cfg.model.path} is a vision-language model, which "
                              "generates with the HF engine here (vLLM gets token ids, not the images)")
        if importlib.util.find_spec("vllm") is None:
            from distflow.engines.vllm_rollout import INSTALL_HINT

            raise ConfigError(INSTALL_HINT)


class LauncherProgress:
    """The launcher's view of the run: it tails rank 0's metrics.jsonl (metrics only,
    never batch data: the meter checks) and draws the progress bar."""

    def __init__(self, run_dir: Path, total: int, enabled: bool, meter):
        self.path, self.offset, self.bar, self.last_val = run_dir / "metrics.jsonl", 0, None, None
        self.total, self.enabled, self.meter, self.file_id = total, enabled, meter, None
        self.earlier = self._identity()  # an earlier launch's file: the workers move or replace it

    def poll(self) -> None:
        """Reads only what was appended since the last poll, whole lines only. The steps
        a file holds when first read are the ones a resumed run restored (its checkpoint's
        copy replaces the file) or were done before the first poll: the bar starts there,
        and its rate and ETA count only the steps after. The file an earlier launch left,
        until this one's workers move it aside or replace it, is not shown."""
        if not self.enabled:
            return
        from distflow.trainer.metrics import progress_postfix

        identity = self._identity()
        if identity is None or identity == self.earlier:
            return
        first_read = identity[:2] != self.file_id or identity[2] < self.offset
        if first_read:
            self.file_id, self.offset = identity[:2], 0
        text = self.meter.read_text(self.path, self.offset)
        complete = text[:text.rfind("\n") + 1]
        try:
            records = [json.loads(line) for line in complete.splitlines()]
        except ValueError:  # replaced between the stat and the read: the next poll reads it from the start
            self.file_id = None
            return
        self.offset += len(complete.encode())
        steps = [r for r in records if r.get("step", 0) > 0]
        for record in records:
            self.last_val = record.get("val/accuracy", self.last_val)
        if first_read:
            self._start_bar(steps[-1]["step"] if steps else 0)
            steps = steps[-1:]
        for record in steps:
            self.bar.update(record["step"] - self.bar.n)
            self.bar.set_postfix(progress_postfix(record, self.last_val))

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return None
        return stat.st_dev, stat.st_ino, stat.st_size

    def _start_bar(self, done: int) -> None:
        from tqdm import tqdm

        if self.bar is not None:
            self.bar.close()
        self.bar = tqdm(total=self.total, initial=done, desc="train", unit="step", dynamic_ncols=True)

    def close(self) -> None:  # the launcher polled once more when the workers finished
        if self.bar is not None:
            self.bar.close()


def check_graph(cfg: Config):
    """The run's task graph, validated and its callables imported: fails before any worker starts."""
    from distflow.trainer.recipes import build_graph

    graph = build_graph(cfg)
    graph.resolve()
    return graph


def _driver_graph(cfg: Config, graph) -> list | None:
    """runtime.mode=centralized: the graph the driver runs; None in distributed mode."""
    if cfg.runtime.mode != "centralized":
        return None
    from distflow.runtime.centralized import NodeSpec

    return [NodeSpec(n, graph.by_name[n].layout, tuple(graph.by_name[n].inputs), tuple(graph.by_name[n].outputs))
            for n in graph.order]


def _loopback_rerun(cfg: Config, command: list[str]) -> int | None:
    """runtime.network: the same command again inside a loopback-only network namespace
    (its exit code), or None to go on here (inside one already, or on the host network)."""
    if cfg.runtime.ray_address is not None or cfg.runtime.network == "host" or netns.inside():
        return None
    if cfg.runtime.network == "auto" and "wandb" in cfg.trainer.logger and cfg.trainer.wandb_mode == "online":
        return None  # W&B online reaches its server: the host network
    try:
        return netns.run_in_loopback_namespace(["-m", "distflow.cli", *command])
    except netns.NamespaceUnavailable as e:
        if cfg.runtime.network == "loopback":
            return _fail(f"runtime.network=loopback: this machine cannot make a network namespace ({e}; it "
                         "needs root or unprivileged user namespaces); use runtime.network=host")
        print(f"distflow: no loopback-only network namespace here ({e}); on the host network", file=sys.stderr)
        return None


def _config_argv(args: argparse.Namespace) -> list[str]:
    return [*(["--config", args.config] if args.config else []), *args.overrides]


def in_ray_job(cfg: Config, training: bool = True) -> Config:
    """Under `ray job submit` the run joins the job's cluster, as verl's `ray.init()` does: Ray
    gives the entrypoint that cluster's GCS address as $RAY_ADDRESS, and its job config, where
    `runtime.ray_address` is not set. Elsewhere an exported $RAY_ADDRESS is left alone (a
    private Ray starts; verl users often have one set for other tools)."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if cfg.runtime.ray_address is not None or cfg.runtime.launcher != "ray" or not address:
        return cfg
    from distflow.runtime.ray_launcher import RAY_JOB_CONFIG_ENV

    if RAY_JOB_CONFIG_ENV not in os.environ:
        return cfg
    cfg.runtime.ray_address = address
    print(f"distflow: a Ray job: joining its cluster at {address} (runtime.ray_address)", file=sys.stderr)
    return validate(cfg, training)


def cmd_train(args: argparse.Namespace) -> int:
    try:
        cfg = in_ray_job(load_config(args.config, args.overrides))
        check_inputs(cfg)
    except ValueError as e:  # ConfigError
        return _fail(str(e))
    code = _loopback_rerun(cfg, ["train", *_config_argv(args)])  # which checks the graph itself
    if code is not None:
        return code
    try:
        graph = check_graph(cfg)
        filters = [n.name for n in graph.nodes if n.role == "filter"]
        if cfg.runtime.mode == "centralized" and filters:
            why = {"dynamic_sampling": "algorithm.dynamic_sampling=false",
                   "drop_failed_groups": "rollout.on_failed_episode=score_zero"}
            ways = [why[n] for n in filters if n in why]
            raise ConfigError(f"runtime.mode='centralized': the graph of {cfg.algorithm.name} has the filter node(s) "
                              f"{', '.join(filters)}; filters run in distributed mode only"
                              + (f" (without them: {', '.join(ways)})" if ways else ""))
        if cfg.runtime.mode == "centralized":
            from distflow.runtime.centralized import make_wire

            make_wire(cfg.runtime.centralized_wire)  # verl's wires need verl here
        _check_cluster(cfg)
        run_dir = new_run_dir(cfg)
    except ValueError as e:  # ConfigError, GraphError; a run folder another launch holds
        return _fail(str(e))
    cfg.trainer.output_dir = str(run_dir)
    record_config(run_dir, cfg)
    print(f"distflow: run folder {run_dir}", file=sys.stderr)
    if cfg.runtime.launcher == "torchrun":
        return _exec_torchrun(cfg, _config_argv(args))
    from distflow.runtime.meter import LauncherMeter

    meter = LauncherMeter()  # everything this process receives from the run, files included
    progress = LauncherProgress(run_dir, cfg.trainer.total_steps, cfg.trainer.progress, meter)
    try:
        results = _launch(cfg, run_dir, WORKER_ENTRY, (cfg.to_dict(), str(run_dir), False), progress.poll, meter,
                          _driver_graph(cfg, graph))
    finally:
        progress.close()
    if isinstance(results, int):
        return results
    _print_summary(results[0])
    return 0


def _check_cluster(cfg: Config) -> None:
    """A cluster must answer now (host network), and its workers, which do not run in this
    folder, get the local files the config names as absolute paths."""
    if cfg.runtime.ray_address is not None:
        from distflow.runtime.ray_launcher import check_ray_address

        check_ray_address(cfg.runtime.ray_address)
        with_absolute_paths(cfg)


def with_absolute_paths(cfg: Config) -> None:
    """The relative paths of local files and folders in `cfg` made absolute (data files,
    model.path, algorithm.graph, trainer.resume, rollout.tool_schemas, reward.model_path,
    and the file.py of reward.custom_fn, rollout.env, rollout.agent, algorithm.estimator,
    kl_type and reward_kl_type); names that are no local path (builtin:..., modules,
    registered names) stay as they are."""
    def absolute(path: str) -> str:
        local = os.path.expanduser(path.strip())
        return os.path.abspath(local) if os.path.exists(local) else path

    def file_of(spec: str | None) -> str | None:
        return None if spec is None else relocated_file_spec(spec, absolute)

    d = cfg.data
    d.train_files, d.val_files = (",".join(absolute(s) for s in files.split(",") if s.strip())
                                  for files in (d.train_files, d.val_files))
    cfg.model.path = absolute(cfg.model.path)
    if cfg.algorithm.graph is not None:
        cfg.algorithm.graph = absolute(cfg.algorithm.graph)
    if cfg.trainer.resume not in ("auto", "off"):
        cfg.trainer.resume = absolute(cfg.trainer.resume)
    cfg.reward.custom_fn = file_of(cfg.reward.custom_fn)
    cfg.rollout.env, cfg.rollout.agent = file_of(cfg.rollout.env), file_of(cfg.rollout.agent)
    if cfg.rollout.tool_schemas is not None:
        cfg.rollout.tool_schemas = absolute(cfg.rollout.tool_schemas)
    if cfg.reward.model_path is not None:
        cfg.reward.model_path = absolute(cfg.reward.model_path)
    a = cfg.algorithm
    a.estimator, a.kl_type, a.reward_kl_type = file_of(a.estimator), file_of(a.kl_type), file_of(a.reward_kl_type)


def _launch(cfg: Config, run_dir: Path, entry: str, entry_args: tuple, on_poll, meter, centralized=None):
    """Every worker runs `entry(*entry_args)` under Ray; their results, or the exit code of a failure."""
    from distflow.runtime.ray_launcher import ClusterTooSmall, Stopped, WorkerFailed, launch_ray
    from distflow.trainer.loop import balanced_within

    try:
        return launch_ray(entry, entry_args, run_dir=run_dir, num_workers=cfg.runtime.num_workers,
                          device=cfg.runtime.device, collective_timeout_s=cfg.runtime.collective_timeout_s,
                          threads=cfg.runtime.threads_per_worker, on_poll=on_poll,
                          ray_address=cfg.runtime.ray_address, centralized=centralized,
                          centralized_wire=cfg.runtime.centralized_wire, balance_within=balanced_within(cfg),
                          meter=meter)
    except WorkerFailed as e:
        return _fail(str(e), EXIT_FAILED)
    except ClusterTooSmall as e:
        return _fail(str(e))
    except Stopped as e:  # Ctrl-C, SIGTERM or SIGHUP: the workers were stopped
        return _fail(f"stopped by signal {signal.Signals(e.signum).name}; last stage per worker: "
                     f"{_worker_stages(run_dir)}", 128 + e.signum)
    except Exception as e:  # Ray's own (a cluster of another Ray version, a lost head node): one line, the rest kept
        import traceback

        from distflow.runtime.process_group import headline

        path = run_dir / "launcher-traceback.txt"
        path.write_text(traceback.format_exc())
        return _fail(f"the launch failed: {headline(e)} (traceback: {path})", EXIT_FAILED)


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate model.path (any HF folder or checkpoint) on data.val_files, on the workers."""
    try:
        if args.k < 0:
            raise ConfigError(f"--k={args.k}: must be >= 0 (0 = greedy only)")
        cfg = in_ray_job(load_config(args.config, args.overrides, training=False), training=False)
        check_inputs(cfg, training=False)
        _check_cluster(cfg)
    except ValueError as e:
        return _fail(str(e))
    code = _loopback_rerun(cfg, ["eval", f"--k={args.k}", *_config_argv(args)])
    if code is not None:
        return code
    try:
        run_dir = new_run_dir(cfg, kind="eval")
    except ConfigError as e:  # a folder another launch holds
        return _fail(str(e))
    cfg.trainer.output_dir = str(run_dir)
    record_eval_config(run_dir, cfg)
    report = run_dir / "eval.json"
    if cfg.runtime.launcher == "torchrun":
        return _exec_torchrun(cfg, [f"--eval-k={args.k}", *_config_argv(args)])
    from distflow.runtime.meter import LauncherMeter
    from distflow.trainer.evaluation import table

    results = _launch(cfg, run_dir, EVAL_ENTRY, (cfg.to_dict(), str(report), args.k), None, LauncherMeter())
    if isinstance(results, int):
        return results
    print(table(results[0], args.k))
    print(f"report: {report}")
    return 0


def _exec_torchrun(cfg: Config, argv: list[str]) -> int:
    """torchrun's launcher in this process (torch is imported already for the graph
    check; a `python -m torch.distributed.run` child would import it again)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={cfg.runtime.num_workers}",
                                         "-m", "distflow.train", *argv,
                                         f"trainer.output_dir={cfg.trainer.output_dir}"])
    os.environ[HELD_FOLDER_ENV] = cfg.trainer.output_dir  # its workers, this process's children, do not take it again
    try:
        run(args)
    except ChildFailedError as e:  # each failed worker said why in a line of its own; then where each one was
        return _fail(f"torchrun workers failed (exit {e.get_first_failure()[1].exitcode}); last stage per "
                     f"worker: {_worker_stages(Path(cfg.trainer.output_dir))}", EXIT_FAILED)
    except SignalException as e:  # Ctrl-C or a kill: torchrun has stopped the workers
        return _fail(f"stopped by signal {e.sigval.name}; last stage per worker: "
                     f"{_worker_stages(Path(cfg.trainer.output_dir))}", 128 + int(e.sigval))
    return 0


def _worker_stages(run_dir: Path) -> str:
    found = []
    for path in sorted((run_dir / "status").glob("rank-*.json")):
        status = json.loads(path.read_text())
        found.append(f"rank {status['rank']} '{status['stage']}' of step {status['step']}")
    return ", ".join(found) or "none recorded (they failed before the first stage)"


def _print_summary(summary: dict) -> None:
    keys = ("heldout_accuracy_initial", "heldout_accuracy_final", "reward_first", "reward_last",
            "steps", "num_workers", "wall_seconds", "tokens_per_second", "network")
    print("  ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}"
                    for k in keys if k in summary))
    print(f"run folder: {summary['run_dir']}")
    print("  " + ", ".join(run_files(Path(summary["run_dir"]))))


def run_files(run_dir: Path) -> list[str]:
    """What a finished run left for a person to open."""
    names = ["metrics.jsonl", "reward.png", "summary.json", "checkpoints/final", "tensorboard", "wandb", "mlflow.db"]
    return [str(run_dir / n) for n in names if (run_dir / n).exists()]


def cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from distflow.engines.tiny_model import ASSET_DIR, TOOL_SFT, SFTSpec, build_tiny_model

    if args.tools and args.vision:
        return _fail("build-tiny-model takes --tools or --vision, not both")
    if args.tools:  # continues from the shipped default model
        sft = TOOL_SFT if args.steps is None else dataclasses.replace(TOOL_SFT, steps=args.steps)
        record = build_tiny_model(args.out, sft=sft, base=ASSET_DIR)
    elif args.vision:  # a Qwen2-VL whose language model starts as the shipped default model
        from distflow.engines.tiny_vlm import VISION_SFT, build_tiny_vlm

        record = build_tiny_vlm(args.out, sft=VISION_SFT if args.steps is None else
                                dataclasses.replace(VISION_SFT, steps=args.steps))
    else:
        record = build_tiny_model(args.out, sft=SFTSpec() if args.steps is None else SFTSpec(steps=args.steps))
    print(json.dumps({k: record[k] for k in ("num_parameters", "build_seconds")} | record["history"][-1]))
    return 0


def cmd_make_data(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if out.is_dir() or out.suffix != ".parquet":
        return _fail(f"--out={args.out!r}: name the .parquet file to write")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        print(write_builtin_parquet(str(out), args.task, args.split, args.num, args.seed))
    except ValueError as e:  # more rows than the task has
        return _fail(f"--num={args.num}: {e}")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    from distflow.runtime.cluster import main as cluster_main

    return cluster_main(args.cluster_args)


# `distflow bench NAME ...` runs distflow.benchmarks.<module>.main(...)
BENCHMARKS = {
    "dataplane": ("dataplane", "Data Coordinator vs single-controller data path (--cluster: the emulated cluster)"),
    "dataplane-vlm": ("dataplane_vlm", "the same with a 1-megapixel image per sample, at growing batch sizes"),
    "scheduler": ("scheduler", "task-graph overlap and streaming on vs off"),
    "e2e": ("e2e", "distributed vs centralized mode, one host and the emulated cluster"),
    "project": ("projection", "a model fitted to the e2e records: step time at 8-512 GPUs, both modes"),
    "soak": ("soak", "many steps of the default task; host-memory slope per process"),
    "engines": ("engines", "rollout engines: HF generate vs vLLM, tokens/s, start-up, weight sync (needs vLLM)"),
    "trl": ("peer_trl", "distflow train vs TRL's GRPOTrainer, same model, data, reward and wall budget (needs TRL)"),
    "async": ("async_rl", "synchronous colocated vs asynchronous disaggregated training on the same cores"),
    "checkpointing": ("checkpointing", "an actor update's kept activations, peak memory and time with and without "
                                       "gradient checkpointing"),
    "tools": ("tools", "episodes calling the python tool: environments stepped one after another vs on threads"),
    "agents": ("agents", "rollout.agent's endpoint: the engine calls a step's agents make, against one per turn"),
}


def cmd_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"distflow.benchmarks.{BENCHMARKS[args.benchmark][0]}")
    return module.main(args.bench_args)


def cmd_dag_show(args: argparse.Namespace) -> int:
    """Print the graph and write pictures: the DOT source and Mermaid text always, PNG and
    SVG rendered by Graphviz where `dot` exists, otherwise a PNG drawn with matplotlib."""
    import shutil

    from distflow.dag.draw import draw_png

    if args.algorithm and "=" in args.algorithm:  # no recipe name given, only overrides
        args.overrides, args.algorithm = [args.algorithm, *args.overrides], None
    overrides = list(args.overrides) + ([f"algorithm.name={args.algorithm}"] if args.algorithm else [])
    try:
        cfg = load_config(args.config, overrides)
        graph = check_graph(cfg)
    except ValueError as e:
        return _fail(str(e))
    from distflow.trainer.recipes import describe_recipe

    name = Path(cfg.algorithm.name).stem
    title = name + (f" + {cfg.algorithm.graph}" if cfg.algorithm.graph else "")
    print(describe_recipe(cfg))
    print(f"\n{title}: {len(graph.nodes)} nodes, in the order every worker runs them\n{graph.describe()}")
    out = Path(args.out or f"dag-{name}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".dot").write_text(graph.to_dot(title))
        out.with_suffix(".mmd").write_text(graph.to_mermaid())
        written = [out.with_suffix(".dot"), out.with_suffix(".mmd")]
        if shutil.which("dot"):
            for fmt in ("png", "svg"):
                subprocess.run(["dot", f"-T{fmt}", str(out.with_suffix(".dot")), "-o",
                                str(out.with_suffix(f".{fmt}"))], check=True, capture_output=True, text=True)
                written.append(out.with_suffix(f".{fmt}"))
        else:  # no Graphviz here: a PNG drawn with matplotlib
            written.append(draw_png(graph, out.with_suffix(".png"), title))
    except OSError as e:
        return _cannot_write(out, e)
    except subprocess.CalledProcessError as e:
        return _fail(f"--out {out}: Graphviz's dot failed: {((e.stderr or '').strip().splitlines() or [e])[-1]}")
    print("wrote " + ", ".join(map(str, written)))
    return 0


def cmd_dag_recipes(args: argparse.Namespace) -> int:
    from distflow.trainer.recipes import recipe_table

    print(recipe_table(), end="")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint as a shareable HF folder (a LoRA adapter merged into its base with --merge)."""
    from distflow.trainer.checkpoint import CheckpointError, export

    try:
        written = export(Path(args.checkpoint), Path(args.out), args.merge, args.dtype)
    except CheckpointError as e:
        return _fail(str(e))
    print(f"wrote {args.out}: {', '.join(written)}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """The run folders under `root` (newest first), one line each."""
    from distflow.trainer.report import run_summary_row

    root = Path(args.root)
    newest_first = sorted(root.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True)
    folders = [p.parent for p in newest_first]
    if not folders:
        return _fail(f"{root}: no run folders (folders with a metrics.jsonl)")
    print(f"{'run':<40} {'algorithm':<28} {'steps':>5}  {'status':<10} {'held-out':<15} {'reward':>7} {'wall':>7}")
    for folder in folders:
        r = run_summary_row(folder)
        heldout = f"{r['heldout'][0]:.1%} -> {r['heldout'][1]:.1%}" if r["heldout"] else "-"
        reward = f"{r['reward_last']:.3f}" if r["reward_last"] is not None else "-"
        wall = f"{r['wall_s']:.0f} s" if r["wall_s"] is not None else "-"
        print(f"{folder.name:<40} {Path(r['algorithm']).stem:<28} {r['steps']:>5}  {r['status']:<10} "
              f"{heldout:<15} {reward:>7} {wall:>7}")
    return 0


def _cannot_write(out: Path, e: OSError) -> int:
    """--out's one line where it cannot be written: why, and the path that refused."""
    return _fail(f"--out {out}: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}")


def cmd_plot(args: argparse.Namespace) -> int:
    """Several runs' reward and held-out accuracy overlaid in one PNG."""
    from distflow.trainer.report import read_history, write_overlay

    try:
        histories = [read_history(Path(run)) for run in args.runs]
    except ValueError as e:
        return _fail(str(e))
    names = [Path(run).resolve().name for run in args.runs]
    if len(set(names)) < len(names):  # sweep/a/seed0 and sweep/b/seed0: named by their whole paths
        names = [str(run) for run in args.runs]
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_overlay(dict(zip(names, histories)), out)
    except OSError as e:
        return _cannot_write(out, e)
    except ValueError as e:  # matplotlib's: a suffix it cannot write ('Format 'xyz' is not supported ...')
        return _fail(f"--out {out}: {e}")
    print(f"wrote {args.out}")
    return 0


def _at_least_one(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run RL training (default: GRPO on the built-in task)")
    train.add_argument("--config", help="YAML file with sections model, data, rollout, algorithm, ...")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. trainer.total_steps=50")
    train.set_defaults(fn=cmd_train)
    tiny = sub.add_parser("build-tiny-model", help=f"rebuild the embedded default model ({BUILTIN_MODEL})")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--steps", type=int, default=None)
    tiny.add_argument("--tools", action="store_true", help="the tool-using model (builtin:tiny-arith-tools), "
                                                          "fine-tuned from the default one on calculator traces")
    tiny.add_argument("--vision", action="store_true", help="the vision-language model (builtin:tiny-dots-vl): a "
                                                           "Qwen2-VL on the default one, fine-tuned to count dots")
    tiny.set_defaults(fn=cmd_build_tiny_model)
    data = sub.add_parser("make-data", help="write the built-in task as a verl-format parquet file")
    data.add_argument("--task", choices=tuple(BUILTIN_TASKS), default="arith",
                      help="arith-tools: the tool task (a fourth level, two-digit products)")
    data.add_argument("--split", choices=("train", "test"), default="train")
    data.add_argument("--num", type=_at_least_one, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--out", required=True)
    data.set_defaults(fn=cmd_make_data)
    bench = sub.add_parser("bench", help="benchmarks; `distflow bench dataplane --help` for options")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    # prefix_chars="+": these parsers claim no "-" options, so every option after the
    # benchmark's name (--help included) reaches the benchmark's own parser untouched.
    for name, (_, help_text) in BENCHMARKS.items():
        one = bench_sub.add_parser(name, add_help=False, prefix_chars="+", help=help_text)
        one.add_argument("bench_args", nargs=argparse.REMAINDER)
        one.set_defaults(fn=cmd_bench)
    cluster = sub.add_parser("cluster", add_help=False, prefix_chars="+",
                             help="an emulated cluster on this machine (network namespaces, shaped links, Ray); "
                                  "`distflow cluster --help`")
    cluster.add_argument("cluster_args", nargs=argparse.REMAINDER)
    cluster.set_defaults(fn=cmd_cluster)
    dag = sub.add_parser("dag", help="the algorithm's task graph")
    dag_sub = dag.add_subparsers(dest="dag_command", required=True)
    show = dag_sub.add_parser("show", help="print the graph and write a picture (DOT/PNG/SVG or Mermaid)")
    show.add_argument("algorithm", nargs="?", help="a recipe name (default: algorithm.name of the config)")
    show.add_argument("--out", help="path without suffix for the picture files (default: dag-ALGORITHM)")
    show.add_argument("--config", help="YAML config (e.g. with algorithm.graph)")
    show.add_argument("overrides", nargs="*", help="section.key=value")
    show.set_defaults(fn=cmd_dag_show)
    table = dag_sub.add_parser("recipes", help="the built-in recipes as a markdown table (made from their files)")
    table.set_defaults(fn=cmd_dag_recipes)
    ev = sub.add_parser("eval", help="evaluate a HF model folder or checkpoint (model.path) on data.val_files: "
                                     "greedy accuracy, mean@k and pass@k, per data source and level")
    ev.add_argument("--k", type=int, default=0, help="samples per prompt at rollout.temperature (0: greedy only)")
    ev.add_argument("--config", help="YAML config")
    ev.add_argument("overrides", nargs="*", help="section.key=value, e.g. model.path=runs/x/checkpoints/final")
    ev.set_defaults(fn=cmd_eval)
    export = sub.add_parser("export", help="a checkpoint as a plain HF folder, without what only resuming needs")
    export.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/x/checkpoints/final")
    export.add_argument("--out", required=True, help="a new folder")
    export.add_argument("--merge", action="store_true", help="a LoRA checkpoint: merge the adapter into its base, "
                                                             "in fp32 (host memory for the fp32 model), then --dtype")
    export.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="cast the weights (default: as trained, fp32 master weights)")
    export.set_defaults(fn=cmd_export)
    runs = sub.add_parser("runs", help="list run folders with their summary")
    runs.add_argument("root", nargs="?", default="runs", help="the folder holding run folders (default: runs)")
    runs.set_defaults(fn=cmd_runs)
    plot = sub.add_parser("plot", help="overlay several runs' reward and held-out accuracy in one PNG")
    plot.add_argument("runs", nargs="+", help="run folders")
    plot.add_argument("--out", default="runs.png")
    plot.set_defaults(fn=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # section.key=value overrides may come anywhere, after --config or --k too (as Hydra's do);
    # argparse gives a positional list only the run of them before the first option
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
