"""Scheduler benchmark: step time with overlap and streaming on versus
`scheduler.overlap=false`, the same config, seed and workers, in one invocation.

    python benchmarks/scheduler.py                       # both settings, about 4 min here
    python benchmarks/scheduler.py --settings default --steps 3 --repeats 1   # quick

Settings:
  default  the embedded task and model with the README's defaults (2 workers).
  compute  a 13.7M-parameter random Llama (hidden 512, 4 layers) on the same task,
           1 worker with 1 intra-op thread, so the machine has a core for a second
           node. Here the reference scores rollout chunk i while chunk i+1 generates.

Method: for each setting one torchrun launch runs every measurement one after another
(`python -m distflow.train --runs`), alternating overlap on/off `--repeats` times. A
measurement's step time is the median of its steps after the first; a mode's is the
median over its repeats. ratio = overlap on / overlap off (below 1: overlap is faster).
Overlap only changes the part of the step before the updates (rollout, reward,
reference, advantage), so that part is also reported on its own ("before update": the
step minus the update and weight-sync nodes), free of the updates' run-to-run noise.
Per-node times are each node's summed span seconds (max over workers), medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from distflow.benchmarks.records import command_line, save_results

COMMON = ["trainer.eval_every=0", "trainer.progress=false", "trainer.save_final=false", "data.val_max_samples=8"]
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {"workers": 2, "overrides": []},
    "compute": {"workers": 1, "model": {"hidden_size": 512, "num_layers": 4, "num_heads": 8,
                                        "intermediate_size": 1536},
                "overrides": ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                              "runtime.threads_per_worker=1", "scheduler.stream_chunk_size=32"]},
}


def build_model(folder: Path, spec: dict[str, int]) -> str:
    from distflow.engines.tiny_model import TinyModelSpec, build_model as build, build_tokenizer

    if not (folder / "config.json").exists():
        tok = build_tokenizer()
        build(tok, TinyModelSpec(**spec), seed=0).save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


def run_setting(name: str, steps: int, repeats: int, work: Path) -> list[dict[str, Any]]:
    setting = SETTINGS[name]
    overrides = [*COMMON, f"trainer.total_steps={steps}", *setting["overrides"]]
    if "model" in setting:
        overrides.append(f"model.path={build_model(work / f'model-{name}', setting['model'])}")
    runs, dirs = [], []
    for rep in range(repeats):
        for overlap in (True, False):
            out = work / f"{name}-{'on' if overlap else 'off'}-{rep}"
            runs.append([f"scheduler.overlap={str(overlap).lower()}", f"trainer.output_dir={out}"])
            dirs.append((overlap, out))
    spec = work / f"runs-{name}.json"
    spec.write_text(json.dumps(runs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={setting['workers']}",
           "-m", "distflow.train", "--runs", str(spec), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if proc.returncode != 0:
        raise SystemExit(f"scheduler benchmark: the {name} runs failed:\n{proc.stderr[-4000:]}")
    records = []
    for overlap, out in dirs:
        history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
        timed = history[1:] or history
        nodes = sorted(k for k in timed[0] if k.startswith("time/") and k != "time/step")
        records.append({"setting": name, "overlap": overlap, "num_workers": setting["workers"], "steps": steps,
                        "step_seconds": statistics.median(r["time/step"] for r in timed),
                        "before_update_seconds": statistics.median(before_update(r) for r in timed),
                        "tokens_per_second": statistics.median(r["perf/tokens_per_second"] for r in timed),
                        "nodes": {k[5:]: statistics.median(r.get(k, 0.0) for r in timed) for k in nodes}})
    return records


def before_update(record: dict[str, float]) -> float:
    after = sum(v for k, v in record.items() if k.startswith("time/") and k.endswith(("_update", "weight_sync")))
    return record["time/step"] - after


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r["setting"] for r in records):
        mode = {ov: [r for r in records if r["setting"] == name and r["overlap"] is ov] for ov in (True, False)}
        on, off = (statistics.median(r["step_seconds"] for r in mode[ov]) for ov in (True, False))
        pre_on, pre_off = (statistics.median(r["before_update_seconds"] for r in mode[ov]) for ov in (True, False))
        nodes = {ov: {k: statistics.median(r["nodes"].get(k, 0.0) for r in mode[ov]) for k in mode[ov][0]["nodes"]}
                 for ov in (True, False)}
        out.append({"setting": name, "num_workers": mode[True][0]["num_workers"], "overlap_on_seconds": on,
                    "overlap_off_seconds": off, "ratio": on / off, "before_update_on_seconds": pre_on,
                    "before_update_off_seconds": pre_off, "before_update_ratio": pre_on / pre_off, "nodes_on": nodes[True], "nodes_off": nodes[False]})
    return out


def markdown(summary: list[dict[str, Any]], command: str, seconds: float) -> str:
    lines = ["# Scheduler benchmark: overlap and streaming on vs off", "",
             "Generated by `distflow.benchmarks.scheduler`; its module docstring has the method.", "",
             "| setting | workers | step s, on | step s, off | ratio on/off | before update s, on | off | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['setting']} | {s['num_workers']} | {s['overlap_on_seconds']:.3f} | "
                     f"{s['overlap_off_seconds']:.3f} | {s['ratio']:.3f} | {s['before_update_on_seconds']:.3f} | "
                     f"{s['before_update_off_seconds']:.3f} | {s['before_update_ratio']:.3f} |")
    for s in summary:
        lines += ["", f"Per-node seconds, `{s['setting']}` (on / off):", ""]
        lines += [f"- {k}: {s['nodes_on'][k]:.3f} / {s['nodes_off'].get(k, 0.0):.3f}" for k in s["nodes_on"]]
    lines += ["", "## Command", "", "```", command, "```", "",
              f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
              f"no GPU; the whole benchmark took {seconds:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench scheduler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=["default", "compute"])
    parser.add_argument("--steps", type=int, default=6, help="steps per measurement (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per mode")
    parser.add_argument("--json", help="write one record per measurement (JSON lines)")
    parser.add_argument("--results-md", help="write the table as markdown")
    parser.add_argument("--work-dir", help="folder for runs and the benchmark model (default: a temp folder)")
    args = parser.parse_args(argv)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="distflow-bench-sched-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        records = [r for name in args.settings for r in run_setting(name, args.steps, args.repeats, work)]
    summary = summarise(records)
    for s in summary:
        print(f"{s['setting']:>8} ({s['num_workers']} worker(s)): overlap on {s['overlap_on_seconds']:.3f} s/step, "
              f"off {s['overlap_off_seconds']:.3f} s/step, ratio {s['ratio']:.3f}; before the update: "
              f"{s['before_update_on_seconds']:.3f} vs {s['before_update_off_seconds']:.3f} s, "
              f"ratio {s['before_update_ratio']:.3f}")
    command = command_line("python benchmarks/scheduler.py", argv)
    save_results(args, records, markdown(summary, command, time.time() - start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
