"""The asynchronous-training benchmark's bookkeeping on hand-made records and traces (its
runs are `distflow train` runs, which tests/trainer/test_disaggregated.py and test_e2e.py
exercise in both placements)."""

from __future__ import annotations

import json

import pytest

from distflow.benchmarks import async_rl


def _throughput(setting, config, tps, idle):
    return {"kind": "throughput", "setting": setting, "config": config, "steps": 8, "tokens_per_second": tps,
            "step_seconds": 2.0, "idle_fraction": idle, "response_length_mean": 23.0,
            "version_lag_mean": 1.0 if config == "async-k1" else 0.0}


def test_ratios_and_the_table():
    records = [_throughput("default", "colocated", 4000.0, {"worker": 0.01}),
               _throughput("default", "async-k0", 2000.0, {"train": 0.4, "rollout": 0.6}),
               _throughput("default", "async-k1", 3000.0, {"train": 0.0, "rollout": 0.3})]
    records += [{"kind": "accuracy", "setting": "default", "config": c, "seed": s, "heldout_initial": 0.2,
                 "heldout_final": f, "heldout_by_step": [], "wall_seconds": 1.0}
                for c, s, f in [("colocated", 1, 0.5), ("colocated", 2, 0.6), ("async-k1", 1, 0.52),
                                ("async-k1", 2, 0.56)]]
    async_rl.add_ratios(records)
    assert records[2]["vs_colocated"] == 0.75 and records[2]["vs_disaggregated_sync"] == 1.5
    text = async_rl.markdown(records, "python benchmarks/async.py")
    assert "| default | async-k1 | 3000 | 0.75 | 1.50 | 2.00 | train 0.00, rollout 0.30 | 1.00 | 0.00 | 23.0 |" in text
    assert "| async-k1 | 1, 2 | 20.0% | 52.0% / 56.0% | 54.0% | -1.0 |" in text  # mean 54% vs 55%
    # a run without the colocated configuration: no ratio to it (it read 0.00)
    alone = [_throughput("default", "async-k0", 2000.0, {"train": 0.4}), _throughput("default", "async-k1", 3000.0,
                                                                                     {"train": 0.0})]
    async_rl.add_ratios(alone)
    assert "| default | async-k1 | 3000 | - | 1.50 |" in async_rl.markdown(alone, "python benchmarks/async.py")


def test_colocated_idle_is_each_ranks_wait_at_the_first_collective(tmp_path):
    # rank 0 reaches the move to the training layout at 1.0 s into the step, rank 1 at 1.5 s: rank 0 waits
    # 0.5 s there, and both start the update together (the update's start alone made the wait 0)
    for rank, start in ((0, 1.0), (1, 1.5)):
        events = [{"cat": "rollout", "ts": 0.0}, {"cat": "ref_log_prob", "ts": 0.8e6},
                  {"cat": "reshard_train", "ts": start * 1e6}, {"cat": "actor_update", "ts": 1.6e6},
                  {"name": "thread_name", "ph": "M"}]
        path = tmp_path / "traces" / f"step_3_rank_{rank}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events}))
    assert async_rl.colocated_idle(tmp_path, 3) == pytest.approx([0.5, 0.0])
