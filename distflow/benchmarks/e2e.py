"""End to end: distributed vs centralized (single-controller) mode, on one host and on
the emulated cluster.

    python benchmarks/e2e.py --json benchmarks/e2e.jsonl --results-md benchmarks/E2E.md --plot benchmarks/e2e.png
    python benchmarks/e2e.py --quick             # one host, N=2, the default setting only
    .venv-verl/bin/python benchmarks/e2e.py --quick --baseline verl   # also verl's DataProto as the wire

Each measurement is one `distflow train` run of a few steps (the same config, seed and
graph in both modes; `scheduler.overlap=false` in both, since the single controller runs
one node at a time). Reported per run: tokens/s over the training steps, seconds per
stage (the slowest worker's, averaged over steps), the launcher's payload bytes
(distributed: 0) and, in centralized mode, the driver's payload bytes in and out, the
launcher/driver's peak RSS, and on the cluster the bytes through each host's link (from
the veths' counters). Scaling efficiency is tokens/s per worker relative to the
smallest worker count of the same mode, setting and place. `--baseline verl` (in verl's
environment, README: Benchmarks) adds the single controller with verl's own `DataProto`
as its wire (`runtime.centralized_wire`): `centralized-verl`, serialised by verl's
default torch.save, and `centralized-verl-numpy`; the distributed rows then also carry
their tokens/s over each of these.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from distflow.benchmarks.dataplane_common import VERL_MODES, refuse_verl_modes_without_verl
from distflow.benchmarks.records import command_line, save_results
from distflow.benchmarks.soak import descendants, rss_bytes

SETTINGS = {
    # the embedded default task (16 prompts x 8 samples, 32 new tokens)
    "default": [],
    # data-heavy: a large batch of long responses on the tiny model
    "heavy": ["data.train_batch_size=64", "algorithm.group_size=8", "actor.ppo_mini_batch_size=32",
              "rollout.max_new_tokens=96", "rollout.temperature=1.2"],
    # images: the dot-counting task on the tiny Qwen2-VL (examples/vlm/dots.yaml); its pixels go
    # with every sample through rollout, reference and update (images/batch_bytes per step)
    "vlm": ["model.path=builtin:tiny-dots-vl", "data.train_files=builtin:dots:train",
            "data.val_files=builtin:dots:test", "data.max_prompt_length=96"],
}
COMMON = ["trainer.progress=false", "trainer.save_final=false", "trainer.eval_every=0", "data.val_max_samples=8",
          "scheduler.overlap=false"]
# each mode's runtime settings; the verl ones (--baseline verl) send the single controller's
# batches as verl's own DataProto, serialised by verl (numpy arrays, or torch.save: its default)
MODE_ARGS = {"distributed": ["runtime.mode=distributed"], "centralized": ["runtime.mode=centralized"],
             "centralized-verl-numpy": ["runtime.mode=centralized", "runtime.centralized_wire=verl-numpy"],
             "centralized-verl": ["runtime.mode=centralized", "runtime.centralized_wire=verl"]}


def _launcher_peak(root: int, stop: threading.Event, out: list[int]) -> None:
    peak = 0
    while not stop.wait(0.5):
        pids = [p for p, cmd in descendants(root).items() if "distflow.cli" in cmd]
        peak = max([peak] + [rss_bytes(p) or 0 for p in pids])
    out.append(peak)


def run_once(setting: str, mode: str, workers: int, steps: int, out_dir: Path, prefix: list[str] = (),
             extra: list[str] = (), env: dict | None = None, where: str = "host") -> dict:
    run_dir = out_dir / f"{where}-{setting}-{mode}-{workers}"
    cmd = [*prefix, sys.executable, "-m", "distflow.cli", "train", *COMMON, *SETTINGS[setting], *extra,
           *MODE_ARGS[mode], f"runtime.num_workers={workers}", f"trainer.total_steps={steps}",
           f"trainer.output_dir={run_dir}"]
    env = dict(env or os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    start = time.time()
    with open(out_dir / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        stop, peak = threading.Event(), []
        watcher = threading.Thread(target=_launcher_peak, args=(proc.pid, stop, peak), daemon=True)
        watcher.start()
        code = proc.wait()
        stop.set()
        watcher.join()
    if code != 0:  # the log's end: its folder may be a temporary one, gone when this exits
        tail = "".join((out_dir / f"{run_dir.name}.log").read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"run {run_dir.name} failed (exit {code}); the end of its log:\n{tail}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    launcher = json.loads((run_dir / "launcher.json").read_text())
    measured = records[1:] or records  # the first step includes warm-up (allocations, first reshard plans)
    tokens = sum(r["tokens/total"] for r in measured)
    seconds = sum(r["time/step"] for r in measured)
    stages = sorted({k for r in measured for k in r if k.startswith("time/") and k != "time/step"})
    all_steps = len(records)
    return {"mode": mode, "setting": setting, "num_workers": workers, "steps": steps,
            "centralized_wire": launcher.get("centralized_wire"),
            # per step over all steps, for the projection's fits
            "tokens_per_step": sum(r["tokens/total"] for r in records) / all_steps,
            "peer_bytes_per_step": sum(r.get("coordinator/payload_sent_bytes", 0.0) for r in records) / all_steps,
            "driver_bytes_per_step": (launcher.get("driver_payload_bytes_received", 0)
                                      + launcher.get("driver_payload_bytes_sent", 0)) / all_steps,
            "driver_relay_seconds_per_step": launcher.get("driver_relay_seconds", 0.0) / all_steps,
            "image_bytes_per_step": sum(r.get("images/batch_bytes", 0.0) for r in records) / all_steps,
            "tokens_per_second": tokens / seconds, "step_seconds": seconds / len(measured),
            "stage_seconds": {k[5:]: sum(r.get(k, 0.0) for r in measured) / len(measured) for k in stages},
            "launcher_payload_bytes": launcher["payload_bytes_received"],
            "driver_bytes_in": launcher.get("driver_payload_bytes_received", 0),
            "driver_bytes_out": launcher.get("driver_payload_bytes_sent", 0),
            "launcher_peak_rss_bytes": peak[0] if peak else 0, "wall_seconds": time.time() - start,
            "reward_last": records[-1]["reward/mean"]}


def link_bytes(names: list[str]) -> dict[str, int]:
    """rx+tx bytes of each interface (host side of each host's veth)."""
    out = {}
    for name in names:
        base = Path(f"/sys/class/net/{name}/statistics")
        out[name] = int((base / "rx_bytes").read_text()) + int((base / "tx_bytes").read_text())
    return out


def on_host(settings: list[str], modes: list[str], workers: list[int], steps: int, out_dir: Path,
            keep: Callable[[dict], None]) -> list[dict]:
    records = []
    for setting in settings:
        for n in workers:
            for mode in modes:
                record = run_once(setting, mode, n, steps, out_dir) | {"where": "host"}
                keep(record)
                records.append(record)
    return records


def on_cluster(settings: list[str], modes: list[str], hosts: list[int], steps: int, rate_mbit: float,
               out_dir: Path, keep: Callable[[dict], None]) -> list[dict]:
    from distflow.runtime.cluster import ClusterSpec, EmulatedCluster, in_host, ray_env

    records = []
    for worker_hosts in hosts:
        spec = ClusterSpec(hosts=1 + worker_hosts, rate_mbit=rate_mbit, name="dfb")
        with EmulatedCluster(spec):
            veths = [spec.veth(i) for i in range(spec.hosts)]
            for setting in settings:
                for mode in modes:
                    before = link_bytes(veths)
                    record = run_once(setting, mode, worker_hosts, steps, out_dir, prefix=in_host(spec, 0, []),
                                      extra=[f"runtime.ray_address={spec.ray_address}"], env=ray_env(spec),
                                      where=f"cluster{spec.hosts}")
                    after = link_bytes(veths)
                    per_host = [after[v] - before[v] for v in veths]
                    record |= {"where": "cluster", "num_hosts": spec.hosts, "rate_mbit": rate_mbit,
                               "driver_link_bytes": per_host[0], "busiest_worker_link_bytes": max(per_host[1:]),
                               "link_bytes": per_host}
                    keep(record)
                    records.append(record)
    return records


def _keeper(path: str | None) -> Callable[[dict], None]:
    """Prints each record, and appends it to `path` as soon as it is measured (a later
    failure keeps it; the file is rewritten whole, with ratios, at the end)."""
    if path:
        Path(path).write_text("")

    def keep(record: dict) -> None:
        print(_line(record), flush=True)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
    return keep


def _line(r: dict) -> str:
    where = r["where"] + (f" ({r['num_hosts']} hosts)" if r["where"] == "cluster" else "")
    return (f"{r['setting']:8s} {where:18s} {r['mode']:12s} N={r['num_workers']}  {r['tokens_per_second']:8.0f} tok/s  "
            f"step {r['step_seconds']:.2f} s  driver in/out {r['driver_bytes_in'] / 1e6:.1f}/"
            f"{r['driver_bytes_out'] / 1e6:.1f} MB  launcher payload {r['launcher_payload_bytes']}  "
            f"peak RSS {r['launcher_peak_rss_bytes'] / 2**20:.0f} MiB")


def add_ratios_and_efficiency(records: list[dict]) -> None:
    by = {(r["where"], r["setting"], r["mode"], r["num_workers"]): r for r in records}
    for r in records:
        for mode in MODE_ARGS:  # distributed over each single-controller mode measured beside it
            other = by.get((r["where"], r["setting"], mode, r["num_workers"]))
            if r["mode"] == "distributed" and mode != "distributed" and other:
                r[f"speedup_vs_{mode}"] = r["tokens_per_second"] / other["tokens_per_second"]
        same = [x for x in records if (x["where"], x["setting"], x["mode"]) == (r["where"], r["setting"], r["mode"])]
        base = min(same, key=lambda x: x["num_workers"])
        r["scaling_efficiency"] = (r["tokens_per_second"] / r["num_workers"]) / (
            base["tokens_per_second"] / base["num_workers"])


def markdown(records: list[dict], command: str) -> str:
    lines = ["# End to end: distributed vs centralized (single-controller) mode", "",
             f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores, no GPU; the tiny model; `scheduler.overlap=false` in both modes; "
             "tokens/s over the training steps after the first.", "",
             "| setting | where | N | mode | tokens/s | distributed / centralized | step s | driver in / out MB "
             "| images MB per step | launcher payload B | launcher peak RSS MiB | driver link MB "
             "| busiest worker link MB | scaling eff. |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['setting']} | {r['where']}{' ' + str(r['num_hosts']) + ' hosts' if r['where'] == 'cluster' else ''} "
            f"| {r['num_workers']} | {r['mode']} | {r['tokens_per_second']:.0f} "
            f"| {format(r['speedup_vs_centralized'], '.2f') if 'speedup_vs_centralized' in r else '-'} "
            f"| {r['step_seconds']:.2f} "
            f"| {r['driver_bytes_in'] / 1e6:.1f} / {r['driver_bytes_out'] / 1e6:.1f} "
            f"| {r.get('image_bytes_per_step', 0) / 1e6:.1f} | {r['launcher_payload_bytes']} "
            f"| {r['launcher_peak_rss_bytes'] / 2**20:.0f} "
            f"| {r.get('driver_link_bytes', 0) / 1e6:.1f} | {r.get('busiest_worker_link_bytes', 0) / 1e6:.1f} "
            f"| {r['scaling_efficiency']:.2f} |")
    verl = [r for r in records if any(f"speedup_vs_{m}" in r for m in VERL_MODES)]
    if verl:
        lines += ["", "Against verl's own DataProto as the single controller's wire (`--baseline verl`): "
                      "distributed tokens/s over each mode's.", ""]
        lines += [f"- {r['setting']}, {r['where']}, N={r['num_workers']}: "
                  + "; ".join(f"{r[f'speedup_vs_{m}']:.2f}x {m}" for m in ("centralized", *VERL_MODES)
                              if f"speedup_vs_{m}" in r) for r in verl]
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["where"], r["setting"]) for r in records})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.5), squeeze=False)
    for ax, (where, setting) in zip(axes[0], groups):
        for mode, style in (("distributed", "o-"), ("centralized", "s--")):
            pts = sorted((r["num_workers"], r["tokens_per_second"]) for r in records
                         if (r["where"], r["setting"], r["mode"]) == (where, setting, mode))
            if pts:
                ax.plot(*zip(*pts), style, label=mode)
        ax.set_title(f"{setting}, {where}")
        ax.set_xlabel("workers")
        ax.set_ylabel("tokens/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4], help="worker counts on one host")
    parser.add_argument("--cluster-hosts", nargs="*", type=int, default=[2, 4],
                        help="worker hosts on the emulated cluster (needs root); none to skip")
    parser.add_argument("--rate-mbit", type=float, default=400.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="one host, N=2, default setting, 2 steps")
    parser.add_argument("--json", help="one record per measurement")
    parser.add_argument("--results-md", help="write the table here")
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--baseline", choices=("ours", "verl"), default="ours",
                        help="verl: also the single controller with verl's DataProto as its wire (needs verl)")
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.workers, args.cluster_hosts, args.steps = ["default"], [2], [], 2
    modes = ["distributed", "centralized", *(VERL_MODES if args.baseline == "verl" else ())]
    refuse_verl_modes_without_verl(parser, modes)
    keep = _keeper(args.json)
    with tempfile.TemporaryDirectory(prefix="distflow-e2e-") as tmp:
        records = on_host(args.settings, modes, args.workers, args.steps, Path(tmp), keep)
        if args.cluster_hosts:
            records += on_cluster(args.settings, modes, args.cluster_hosts, args.steps, args.rate_mbit, Path(tmp), keep)
    add_ratios_and_efficiency(records)
    page = markdown(records, command_line("python benchmarks/e2e.py", argv))
    save_results(args, records, page)
    if args.plot:
        plot(records, args.plot)
    print(page)
    return 0
