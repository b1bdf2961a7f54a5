"""The soak benchmark's measuring parts, on real processes (no training run)."""

from __future__ import annotations

import json
import subprocess
import sys

from distflow.benchmarks.soak import MIB, Sampler, descendants, rss_bytes, slope_per_100_steps, table


def test_the_slope_is_a_least_squares_line_per_100_steps():
    assert abs(slope_per_100_steps([(s, 500 + 0.3 * s) for s in range(20, 200)]) - 30.0) < 1e-9
    assert slope_per_100_steps([(s, 500.0) for s in range(10)]) == 0.0
    noisy = [(s, 500 + (7 if s % 2 else -7)) for s in range(100)]
    assert abs(slope_per_100_steps(noisy)) < 0.5


def test_the_sampler_finds_workers_by_their_status_files_and_the_process_tree(tmp_path):
    # a "launcher" with one child standing in for a worker that grows by 8 MiB per step
    grow = ("import sys, time\nchunks = []\nfor step in range(1, 6):\n"
            "    chunks.append(bytearray(8 << 20))\n    print(step, flush=True)\n    sys.stdin.readline()\n")
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                 f"subprocess.run([sys.executable, '-c', {grow!r}])"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        sampler, status = Sampler(launcher.pid, tmp_path), tmp_path / "status"
        status.mkdir()
        for _ in range(5):
            step = int(launcher.stdout.readline())
            worker = next(pid for pid in descendants(launcher.pid) if pid != launcher.pid)
            (status / "rank-0.json").write_text(json.dumps({"rank": 0, "pid": worker, "step": step, "stage": "x"}))
            sampler.sample()
            launcher.stdin.write("\n")
            launcher.stdin.flush()
        assert rss_bytes(launcher.pid) > 0
    finally:
        launcher.kill()
        launcher.wait()
    assert [s for s, _ in sampler.samples["worker 0"]] == [1, 2, 3, 4, 5]
    report = {row["process"]: row for row in sampler.report(warmup=1)}
    assert abs(report["worker 0"]["slope_mib_per_100_steps"] - 800) < 80  # 8 MiB per step
    assert report["worker 0"]["rss_end_mib"] - report["worker 0"]["rss_start_mib"] > 30
    assert "| worker 0 |" in table({"steps": 5, "num_workers": 1, "wall_seconds": 1.0, "warmup_steps": 1,
                                    "processes": list(report.values())})
    assert MIB == 1 << 20
