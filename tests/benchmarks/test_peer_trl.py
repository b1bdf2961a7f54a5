"""The TRL peer benchmark: a short real run where TRL is installed, and the one line it
answers with where it is not."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HAS_TRL = importlib.util.find_spec("trl") is not None


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distflow.cli", "bench", "trl", *args], cwd=tmp_path,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(HAS_TRL, reason="checks the answer without TRL")
def test_without_trl_the_benchmark_says_so_in_one_line(tmp_path):
    proc = _bench(tmp_path, "--steps", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "distflow bench trl: TRL is not importable in this Python (README: Benchmarks)"


@pytest.mark.trl
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed here (README: Benchmarks; .ci/run runs these)")
def test_both_frameworks_train_in_the_same_budget_and_are_scored_alike(tmp_path):
    """3 DistFlow steps set the budget; TRL trains until it has used it. The benchmark's
    evaluator gives DistFlow's own held-out numbers on DistFlow's saved model, so both
    frameworks are scored by the same code."""
    proc = _bench(tmp_path, "--steps", "3", "--json", str(tmp_path / "p.jsonl"), "--results-md", str(tmp_path / "P.md"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert (ours["framework"], theirs["framework"], ours["steps"]) == ("distflow", "trl", 3)
    assert theirs["steps"] >= 1 and theirs["train_seconds"] >= ours["train_seconds"]
    assert ours["heldout_initial"] == pytest.approx(ours["own_heldout_initial"], abs=1e-9)
    assert ours["heldout_final"] == pytest.approx(ours["own_heldout_final"], abs=1e-9)
    assert ours["tokens_per_s"] > 0 and theirs["tokens_per_s"] > 0
    assert "DistFlow / TRL tokens/s:" in (tmp_path / "P.md").read_text()
