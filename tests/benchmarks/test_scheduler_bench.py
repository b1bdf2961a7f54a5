"""The scheduler benchmark's bookkeeping on hand-made records; one real quick run."""

from __future__ import annotations

import json

import pytest

from distflow.benchmarks import scheduler as bench


def _record(overlap, step, update, node):
    return {"setting": "default", "overlap": overlap, "num_workers": 2, "steps": 3, "step_seconds": step,
            "before_update_seconds": step - update, "tokens_per_second": 1.0, "nodes": {"rollout": node}}


def test_summary_takes_medians_and_ratios():
    records = [_record(True, 2.0, 1.0, 0.5), _record(False, 3.0, 1.0, 0.7), _record(True, 2.2, 1.2, 0.6),
               _record(False, 2.6, 1.1, 0.9), _record(True, 9.0, 1.0, 0.4), _record(False, 2.8, 1.0, 0.8)]
    (s,) = bench.summarise(records)
    assert s["overlap_on_seconds"] == 2.2 and s["overlap_off_seconds"] == 2.8
    assert s["ratio"] == pytest.approx(2.2 / 2.8)
    assert s["before_update_on_seconds"] == pytest.approx(1.0) and s["before_update_off_seconds"] == pytest.approx(1.8)
    assert s["nodes_on"]["rollout"] == 0.5 and s["nodes_off"]["rollout"] == 0.8
    text = bench.markdown([s], "python benchmarks/scheduler.py", 1.0)
    assert "| default | 2 | 2.200 | 2.800 | 0.786 |" in text


def test_before_update_subtracts_update_and_sync_nodes():
    record = {"time/step": 5.0, "time/actor_update": 2.0, "time/critic_update": 1.0, "time/weight_sync": 0.5,
              "time/rollout": 1.0}
    assert bench.before_update(record) == 1.5


@pytest.mark.slow
def test_quick_real_run_writes_records(tmp_path):
    out = tmp_path / "s.jsonl"
    assert bench.main(["--settings", "default", "--steps", "2", "--repeats", "1", "--json", str(out),
                       "--results-md", str(tmp_path / "s.md"), "--work-dir", str(tmp_path / "w")]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["overlap"] for r in records] == [True, False]
    assert all(r["step_seconds"] > 0 and "rollout" in r["nodes"] for r in records)
    assert "ratio on/off" in (tmp_path / "s.md").read_text()
