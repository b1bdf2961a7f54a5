"""benchmarks/planner_scale.py: times the planner's two transitions per size and, with
--against, another checkout's planner on the same inputs (here: this checkout's own)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_times_both_planners_and_prints_their_ratio():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_scale.py"), "--workers", "4", "8",
                          "--per-rank", "16", "--repeats", "1", "--against", str(ROOT)],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 4 ") or line.startswith("| 8 ")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("4", "64"), ("8", "128")]
    for r in rows:
        seconds = [float(c) for c in r[2:6]]
        assert all(s > 0 for s in seconds)
        assert r[6].strip().endswith("x")
