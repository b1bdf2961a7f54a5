"""benchmarks/minibatch_balance.py: the per-mini-batch straggler without and with the
mini-batch labels, on a few draws."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_mini_batch_balanced_has_the_smaller_straggler(capsys):
    main = runpy.run_path(str(ROOT / "benchmarks" / "minibatch_balance.py"))["main"]
    assert main(["--workers", "4", "--seeds", "3", "--prompts", "64"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    step, each = (float(r[2]) for r in rows)
    assert [r[1].strip() for r in rows] == ["the step", "each mini-batch"] and 1.0 <= each < step
