"""torchrun entry: the same worker program as under Ray, without Ray.

    torchrun --standalone --nproc-per-node=2 -m distflow.train [--config FILE] [key=value ...]

`--runs FILE.json` (a list of override lists) runs several configurations one after
another in the same workers and process group: a sweep pays the start-up once (the
recipe tests and benchmarks/scheduler.py use it). The key=value arguments apply to all;
a run's own settings override them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from distflow.cli import check_graph, check_inputs
from distflow.config import ConfigError, load_config
from distflow.runtime import netns
from distflow.runtime.process_group import headline, init_process_group, process_group_closed_on_exit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distflow.train")
    parser.add_argument("--config")
    parser.add_argument("--runs", help="JSON file: a list of override lists, run one after another")
    parser.add_argument("--eval-k", type=int, default=None,
                        help="evaluate model.path instead of training (distflow eval): k samples per prompt")
    parser.add_argument("overrides", nargs="*")
    args, rest = parser.parse_known_args(argv)  # overrides after --config too, as `distflow train` takes them
    if any("=" not in r or r.startswith("-") for r in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = [*args.overrides, *rest]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    runs = json.loads(open(args.runs).read()) if args.runs else [[]]
    launch = [f"runtime.num_workers={world}", "runtime.launcher=torchrun"]
    try:
        configs = [load_config(args.config, [*args.overrides, *run, *launch], training=args.eval_k is None)
                   for run in runs]
        check_sweep(configs)
    except ConfigError as e:
        return _refused(e, rank)
    cfg = configs[0]
    init_process_group(rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                       int(os.environ.get("MASTER_PORT", 29500)), cfg.runtime.device,
                       cfg.runtime.collective_timeout_s, cfg.runtime.threads_per_worker)
    folder: list[str] = []  # the run folder once known: where a failure's traceback goes
    try:
        return _run(args, configs, rank, folder)
    except Exception as e:  # one line here (every rank may fail, the others as echoes); the traceback in a file
        if not folder:
            raise
        path = Path(folder[0]) / f"worker-{rank}-traceback.txt"
        path.write_text(traceback.format_exc())
        print(f"distflow: worker {rank} failed: {headline(e)} (traceback: {path})", file=sys.stderr)
        return 1


def _run(args, configs: list, rank: int, folder: list[str]) -> int:
    """The runs of `configs` one after another in this process group; `folder` gets each
    run's folder as it starts."""
    cfg = configs[0]
    with process_group_closed_on_exit():
        from distflow.trainer.loop import run_eval_worker, run_worker

        if args.eval_k is not None:
            if code := _refused_inputs(cfg, rank, training=False) or _take_folder(cfg, rank, folder, "eval"):
                return code
            return _evaluate(cfg, args.eval_k, rank, run_eval_worker)

        for cfg in configs:
            if code := _refused_inputs(cfg, rank) or _take_folder(cfg, rank, folder):  # checked when its turn
                return code  # comes: it may resume an earlier run's
            summary = run_worker(cfg.to_dict(), cfg.trainer.output_dir, progress=cfg.trainer.progress)
            if rank == 0:
                print(f"heldout_accuracy_initial={summary['heldout_accuracy_initial']:.3f} "
                      f"heldout_accuracy_final={summary['heldout_accuracy_final']:.3f} "
                      f"run folder: {cfg.trainer.output_dir}")
    return 0


def _take_folder(cfg, rank: int, folder: list[str], kind: str | None = None) -> int:
    """One run folder for all ranks (trainer.output_dir, or a new one rank 0 makes: see
    `new_run_dir`), set as cfg.trainer.output_dir and in `folder`: 0; 2 and one line
    where another launch holds it. Rank 0 records the config there as `distflow train`
    and `distflow eval` do, where they did not launch this (their torchrun path records it
    before it starts the workers)."""
    from distflow.cli import HELD_FOLDER_ENV, new_run_dir, record_config, record_eval_config

    holder: list = [None]
    if rank == 0:
        try:
            run_dir = new_run_dir(cfg, kind)
            holder[0] = str(run_dir)
            if os.environ.get(HELD_FOLDER_ENV) != str(run_dir):  # started by torchrun itself
                cfg.trainer.output_dir = str(run_dir)
                (record_eval_config if kind == "eval" else record_config)(run_dir, cfg)
        except ConfigError as e:
            holder[0] = e
    dist.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], ConfigError):  # another launch holds it: every rank stops
        return _refused(holder[0], rank)
    cfg.trainer.output_dir = holder[0]
    folder[:] = [holder[0]]
    return 0


def _refused(error: Exception, rank: int) -> int:
    if rank == 0:
        print(f"distflow: error: {error}", file=sys.stderr)
    return 2


def _refused_inputs(cfg, rank: int, training: bool = True) -> int:
    """What `distflow train` checks before it launches, checked on every worker here (so
    all refuse alike): 2 and one line where something is wrong, else 0."""
    try:
        check_inputs(cfg, training=training)
        if training:
            check_graph(cfg)
        if cfg.runtime.network == "loopback" and not netns.inside():  # `distflow train` makes the namespace
            raise ConfigError("runtime.network=loopback: torchrun's own entry runs on the host network; launch with "
                              "`distflow train runtime.launcher=torchrun` (it runs the workers in a loopback-only "
                              "namespace), or use runtime.network=auto")
    except ValueError as e:  # ConfigError, GraphError: one line
        return _refused(e, rank)
    return 0


def check_sweep(configs: list) -> None:
    """Runs that can follow one another in one launch: each in a folder of its own (a later
    run in an earlier one's would resume its checkpoints and train nothing), and a
    disaggregated run only last (it leaves the workers in its role groups)."""
    folders = [os.path.realpath(os.path.expanduser(c.trainer.output_dir)) for c in configs if c.trainer.output_dir]
    for folder in folders:
        if folders.count(folder) > 1:
            raise ConfigError(f"--runs: {folders.count(folder)} runs have trainer.output_dir={folder}; give each "
                              "its own (or none: each then gets a new folder)")
    if any(c.runtime.placement == "disaggregated" for c in configs[:-1]):
        raise ConfigError("--runs: runtime.placement=disaggregated leaves the workers in its role groups; "
                          "put that run last or give it a launch of its own")


def _evaluate(cfg, k: int, rank: int, run_eval_worker) -> int:
    from pathlib import Path

    from distflow.trainer.evaluation import table

    report_path = Path(cfg.trainer.output_dir) / "eval.json"
    report = run_eval_worker(cfg.to_dict(), str(report_path), k)
    if rank == 0:
        print(table(report, k))
        print(f"report: {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
