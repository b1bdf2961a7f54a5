"""The end-to-end benchmark's bookkeeping on hand-made records (its runs are `distflow
train` runs, which the e2e and cluster tests exercise in both modes)."""

from __future__ import annotations

import pytest

from distflow.benchmarks import e2e


def _record(mode, n, tps, where="host"):
    return {"mode": mode, "setting": "heavy", "where": where, "num_workers": n, "tokens_per_second": tps,
            "step_seconds": 1.0, "driver_bytes_in": 0 if mode == "distributed" else 2e6,
            "driver_bytes_out": 0 if mode == "distributed" else 3e6, "launcher_payload_bytes": 0,
            "launcher_peak_rss_bytes": 300 << 20} | ({"num_hosts": n + 1, "driver_link_bytes": 5e6,
                                                     "busiest_worker_link_bytes": 2e6} if where == "cluster" else {})


def test_ratios_scaling_efficiency_table_and_plot(tmp_path):
    records = [_record("distributed", 2, 200.0), _record("centralized", 2, 100.0),
               _record("distributed", 4, 380.0), _record("centralized", 4, 120.0),
               _record("distributed", 4, 300.0, "cluster"), _record("centralized", 4, 100.0, "cluster")]
    e2e.add_ratios_and_efficiency(records)
    assert records[0]["speedup_vs_centralized"] == 2.0 and records[2]["speedup_vs_centralized"] == pytest.approx(380 / 120)
    assert records[2]["scaling_efficiency"] == pytest.approx(0.95)  # 380/4 over 200/2
    assert records[3]["scaling_efficiency"] == pytest.approx(0.6)
    assert "speedup_vs_centralized" not in records[1]
    text = e2e.markdown(records, "python benchmarks/e2e.py")
    assert "| heavy | host | 4 | distributed | 380 | 3.17 |" in text
    assert "| heavy | cluster 5 hosts | 4 | distributed | 300 | 3.00 |" in text
    e2e.plot(records, str(tmp_path / "e2e.png"))
    assert (tmp_path / "e2e.png").stat().st_size > 1000
