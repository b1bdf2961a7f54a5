"""Synchronous colocated vs asynchronous disaggregated training, on the same cores.

    python benchmarks/async.py --json benchmarks/async.jsonl --results-md benchmarks/ASYNC.md
    python benchmarks/async.py --quick      # the default setting, 3 steps, no accuracy runs

Throughput: each configuration is one `distflow train` run of `--steps` steps (torchrun,
GRPO, the same seed); tokens/s over the steps after the first, counting the time the
trainer waited for samples. Configurations: `colocated` (2 workers that both generate
and train, the default), and 1 rollout worker + 1 train worker (`disaggregated`) with
max_staleness 0 (synchronous), 1 and 2, and 1 with rollout.partial (weights swapped in
between two tokens; "samples that changed weights mid-way" is the fraction whose tokens
came from more than one weight version). Settings: the embedded default, and `heavy`
(responses allowed up to 96 tokens, at temperature 1.2; the tiny model still ends most
of them near 24 tokens, so its tail is short), and `generation-bound` (8 sequences per
generate call, so generating a step takes longer than training one: the only setting
here in which weights arrive while a rollout worker generates, which rollout.partial
is for).

Idle time per worker and step: a colocated worker waits in the update's first
collective for the other worker to finish generating (from the per-rank traces: the
latest rank's start of the first collective node minus this rank's); a train worker
waits for samples (`time/wait_for_samples`), a rollout worker for weights
(`async/rollout_wait_for_weights_s`).

Accuracy: `--accuracy-seeds` full runs (trainer.total_steps, the default 60) of the
default setting per configuration: held-out accuracy at the end, at equal samples
(every configuration trains on the same number of samples per step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distflow.benchmarks.records import command_line, save_results

SETTINGS = {"default": [], "heavy": ["rollout.max_new_tokens=96", "rollout.temperature=1.2"],
            "generation-bound": ["rollout.micro_batch_size=8"]}
CONFIGS = {
    "colocated": ["runtime.num_workers=2"],
    "async-k0": ["runtime.placement=disaggregated", "algorithm.max_staleness=0"],
    "async-k1": ["runtime.placement=disaggregated", "algorithm.max_staleness=1"],
    "async-k2": ["runtime.placement=disaggregated", "algorithm.max_staleness=2"],
    "async-k1-partial": ["runtime.placement=disaggregated", "algorithm.max_staleness=1", "rollout.partial=true"],
}
COMMON = ["runtime.launcher=torchrun", "trainer.progress=false", "trainer.save_final=false", "trainer.resume=off"]
# where a colocated step's workers first meet: the move to the training layout (its metadata all-gather),
# or a collective node where that move is not traced
COLLECTIVE_NODES = ("reshard_train", "old_log_prob", "actor_update")


def _run(args: list[str], run_dir: Path) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "distflow.cli", "train", *COMMON, *args, f"trainer.output_dir={run_dir}"]
    with open(f"{run_dir}.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise SystemExit(f"run {run_dir.name} failed (exit {code}); see {run_dir}.log")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def colocated_idle(run_dir: Path, step: int) -> list[float]:
    """Seconds each rank waited at the step's first collective for the slowest rank."""
    starts = []
    for path in sorted((run_dir / "traces").glob(f"step_{step}_rank_*.json")):
        events = json.loads(path.read_text())["traceEvents"]
        starts.append(min(e["ts"] for e in events if e.get("cat") in COLLECTIVE_NODES) / 1e6)
    return [max(starts) - s for s in starts]


def throughput(setting: str, config: str, steps: int, out: Path) -> dict:
    run_dir = out / f"{setting}-{config}"
    traced = ",".join(str(s) for s in range(2, steps + 1))
    records = _run([*SETTINGS[setting], *CONFIGS[config], f"trainer.total_steps={steps}", "trainer.eval_every=0",
                    "data.val_max_samples=8", f"trainer.trace_steps={traced}"], run_dir)
    measured = records[2:] or records[1:]  # step 1 warms up (allocations, the pipeline filling)
    seconds = [r["time/step"] + r["time/wait_for_samples"] for r in measured]
    tokens = sum(r["tokens/total"] for r in measured)
    if config == "colocated":
        idle = {"worker": [sum(colocated_idle(run_dir, r["step"])) / 2 / s for r, s in zip(measured, seconds)]}
    else:
        idle = {"train": [r["time/wait_for_samples"] / s for r, s in zip(measured, seconds)],
                "rollout": [r["async/rollout_wait_for_weights_s"] / s for r, s in zip(measured, seconds)]}
    return {"kind": "throughput", "setting": setting, "config": config, "steps": steps,
            "tokens_per_second": tokens / sum(seconds), "step_seconds": sum(seconds) / len(seconds),
            "idle_fraction": {k: sum(v) / len(v) for k, v in idle.items()},
            "response_length_mean": sum(r["response/length_mean"] for r in measured) / len(measured),
            "version_lag_mean": sum(r.get("async/version_lag_mean", 0.0) for r in measured) / len(measured),
            "partial_samples": sum(r.get("async/partial_samples", 0.0) for r in measured) / len(measured)}


def accuracy(config: str, seed: int, out: Path) -> dict:
    start = time.time()
    records = _run([*CONFIGS[config], f"trainer.seed={seed}"], out / f"accuracy-{config}-seed{seed}")
    held = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    return {"kind": "accuracy", "setting": "default", "config": config, "seed": seed,
            "heldout_initial": held[0][1], "heldout_final": held[-1][1], "heldout_by_step": held,
            "wall_seconds": time.time() - start}


def add_ratios(records: list[dict]) -> None:
    base = {r["setting"]: r for r in records if r["kind"] == "throughput" and r["config"] == "colocated"}
    sync = {r["setting"]: r for r in records if r["kind"] == "throughput" and r["config"] == "async-k0"}
    for r in records:
        if r["kind"] == "throughput":
            if r["setting"] in base:
                r["vs_colocated"] = r["tokens_per_second"] / base[r["setting"]]["tokens_per_second"]
            if r["setting"] in sync:
                r["vs_disaggregated_sync"] = r["tokens_per_second"] / sync[r["setting"]]["tokens_per_second"]


def markdown(records: list[dict], command: str) -> str:
    lines = ["# Asynchronous disaggregated vs synchronous colocated training", "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores, no GPU; the embedded tiny model; GRPO; 2 processes in every "
             "configuration (colocated: 2 workers; disaggregated: 1 rollout + 1 train worker).", "",
             "| setting | configuration | tokens/s | vs colocated | vs disaggregated k=0 | step s | idle fraction "
             "| mean version lag | samples that changed weights mid-way | response length |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in records if r["kind"] == "throughput"):
        idle = ", ".join(f"{k} {v:.2f}" for k, v in r["idle_fraction"].items())
        lines.append(f"| {r['setting']} | {r['config']} | {r['tokens_per_second']:.0f} "
                     f"| {format(r['vs_colocated'], '.2f') if 'vs_colocated' in r else '-'} | {format(r['vs_disaggregated_sync'], '.2f') if 'vs_disaggregated_sync' in r else '-'} "
                     f"| {r['step_seconds']:.2f} | {idle} | {r['version_lag_mean']:.2f} "
                     f"| {r.get('partial_samples', 0.0):.2f} | {r['response_length_mean']:.1f} |")
    acc = [r for r in records if r["kind"] == "accuracy"]
    if acc:
        lines += ["", "Held-out accuracy (greedy, 256 problems) after the full run, at equal samples:", "",
                  "| configuration | seeds | before | after, per seed | after, mean | vs colocated (points) |",
                  "|---|---|---|---|---|---|"]
        mean = {}
        for config in dict.fromkeys(r["config"] for r in acc):
            rows = [r for r in acc if r["config"] == config]
            mean[config] = sum(r["heldout_final"] for r in rows) / len(rows)
        for config, m in mean.items():
            rows = [r for r in acc if r["config"] == config]
            delta = 100 * (m - mean["colocated"]) if "colocated" in mean else float("nan")
            lines.append(f"| {config} | {', '.join(str(r['seed']) for r in rows)} | {rows[0]['heldout_initial']:.1%} "
                         f"| {' / '.join(format(r['heldout_final'], '.1%') for r in rows)} | {m:.1%} | {delta:+.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench async", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["default", "heavy"], choices=list(SETTINGS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=8, help="steps of each throughput run")
    parser.add_argument("--accuracy-seeds", nargs="*", type=int, default=[1, 2],
                        help="full runs per configuration for the held-out accuracy; none to skip")
    parser.add_argument("--accuracy-configs", nargs="+", default=["colocated", "async-k1", "async-k2"],
                        choices=list(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="default setting, 3 steps, no accuracy runs")
    parser.add_argument("--json", help="one record per measurement")
    parser.add_argument("--results-md", help="write the table here")
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.steps, args.accuracy_seeds = ["default"], 3, []
    records = []
    with tempfile.TemporaryDirectory(prefix="distflow-async-") as tmp:
        for setting in args.settings:
            for config in args.configs:
                records.append(throughput(setting, config, args.steps, Path(tmp)))
                print(json.dumps(records[-1]), flush=True)
        for seed in args.accuracy_seeds:
            for config in args.accuracy_configs:
                records.append(accuracy(config, seed, Path(tmp)))
                print(json.dumps({k: v for k, v in records[-1].items() if k != "heldout_by_step"}), flush=True)
    add_ratios(records)
    page = markdown(records, command_line("python benchmarks/async.py", argv))
    save_results(args, records, page)
    print(page)
    return 0
