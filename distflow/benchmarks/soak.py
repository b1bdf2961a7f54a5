"""Soak: the default task for many steps, and each process's host-memory slope.

    python benchmarks/soak.py --steps 200 --workers 4 --json benchmarks/soak.json
    distflow bench soak --steps 20 --workers 2          # a quick look

It runs `distflow train` (the embedded default task, `runtime.num_workers=N`) and, every
`--interval` seconds, reads the resident memory (VmRSS) of the launcher, of each worker
(the pid in its status file, with the step it is in) and of Ray's own processes (GCS,
raylet). The slope is a least-squares line of RSS against the step, over the steps after
`--warmup` (allocators and caches fill during the first steps), in MiB per 100 steps.
Flat means a slope near 0 compared with the process's size.
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

MIB = 1 << 20


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of `root` and every process below it."""
    parent, cmd = {}, {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        parent[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in cmd:
            found[pid] = cmd[pid]
        frontier += [p for p, pp in parent.items() if pp == pid]
    return found


def slope_per_100_steps(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y against x, times 100."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return float("nan") if var == 0 else 100 * sum((x - mx) * (y - my) for x, y in points) / var


class Sampler:
    """RSS samples per process role, each tagged with the step the workers are in."""

    def __init__(self, root: int, run_dir: Path):
        self.root, self.run_dir = root, run_dir
        self.samples: dict[str, list[tuple[int, int]]] = {}  # role -> [(step, rss)]

    def _worker_pids(self) -> dict[int, tuple[int, int]]:
        """rank -> (pid, step) from the workers' status files."""
        out = {}
        for path in (self.run_dir / "status").glob("rank-*.json"):
            try:
                status = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            out[status["rank"]] = (status["pid"], status["step"])
        return out

    def sample(self) -> None:
        workers = self._worker_pids()
        if not workers:
            return
        step = min(s for _, s in workers.values())
        tree = descendants(self.root)
        roles = {f"worker {rank}": pid for rank, (pid, _) in workers.items()}
        launchers = [pid for pid, cmd in tree.items() if "distflow.cli" in cmd]
        if launchers:  # the driver (inside the loopback namespace, the re-executed one) is the largest
            roles["launcher"] = max(launchers, key=lambda p: rss_bytes(p) or 0)
        for name in ("gcs_server", "raylet"):
            pids = [pid for pid, cmd in tree.items() if name in cmd.split(" ")[0]]
            if pids:
                roles[f"ray {name}"] = pids[0]
        rss = {role: rss_bytes(pid) for role, pid in roles.items()}
        if any(rss[f"worker {rank}"] is None for rank in workers):
            return  # a worker has ended: the run is shutting down, not training
        for role, value in rss.items():
            if value is not None:
                self.samples.setdefault(role, []).append((step, value))

    def report(self, warmup: int) -> list[dict]:
        rows = []
        for role, points in sorted(self.samples.items()):
            steady = [(s, r / MIB) for s, r in points if s > warmup]
            rows.append({"process": role, "samples": len(points), "rss_start_mib": points[0][1] / MIB,
                         "rss_after_warmup_mib": steady[0][1] if steady else float("nan"),
                         "rss_end_mib": points[-1][1] / MIB,
                         "slope_mib_per_100_steps": slope_per_100_steps(steady)})
        return rows


def run(steps: int, workers: int, interval: float, warmup: int, extra: list[str], out_dir: Path) -> dict:
    run_dir = out_dir / "run"
    cmd = [sys.executable, "-m", "distflow.cli", "train", f"runtime.num_workers={workers}",
           f"trainer.total_steps={steps}", f"trainer.output_dir={run_dir}", "trainer.progress=false",
           "trainer.save_final=false", *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    start = time.time()
    with open(out_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = Sampler(proc.pid, run_dir)
        try:
            while proc.poll() is None:
                sampler.sample()
                time.sleep(interval)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"the soak run failed (exit {proc.returncode}); see {out_dir / 'train.log'}")
    return {"steps": steps, "num_workers": workers, "warmup_steps": warmup, "interval_s": interval,
            "wall_seconds": time.time() - start, "overrides": extra, "processes": sampler.report(warmup)}


def table(result: dict) -> str:
    lines = [f"{result['steps']} steps, {result['num_workers']} workers, {result['wall_seconds'] / 60:.1f} min; "
             f"slope over steps {result['warmup_steps'] + 1}-{result['steps']}",
             "", "| process | RSS at start (MiB) | after warm-up | at end | slope (MiB / 100 steps) |",
             "|---|---|---|---|---|"]
    for p in result["processes"]:
        lines.append(f"| {p['process']} | {p['rss_start_mib']:.0f} | {p['rss_after_warmup_mib']:.0f} | "
                     f"{p['rss_end_mib']:.0f} | {p['slope_mib_per_100_steps']:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the slope")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value for the run")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="distflow-soak-") as tmp:
        result = run(args.steps, args.workers, args.interval, min(args.warmup, args.steps - 2),
                     args.overrides, Path(tmp))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
