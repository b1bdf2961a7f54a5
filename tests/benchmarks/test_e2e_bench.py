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


def test_the_projection_fits_costs_from_records_and_prints_its_assumptions(tmp_path, capsys):
    import json

    from distflow.benchmarks import projection

    records = []
    for tokens in (1e4, 4e4):  # the driver relays 60 bytes per token at 1 ns per byte; peers send 20 per token
        records.append({"mode": "centralized", "where": "host", "num_workers": 2, "tokens_per_step": tokens,
                        "driver_bytes_per_step": 60 * tokens, "driver_relay_seconds_per_step": 60 * tokens * 1e-9,
                        "peer_bytes_per_step": 0})
        records.append({"mode": "distributed", "where": "host", "num_workers": 2, "tokens_per_step": tokens,
                        "driver_bytes_per_step": 0, "driver_relay_seconds_per_step": 0, "peer_bytes_per_step": 20 * tokens})
    path = tmp_path / "e2e.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert projection.fit(records) == pytest.approx({"driver_bytes_per_token": 60, "worker_bytes_per_token": 20,
                                                     "driver_seconds_per_byte": 1e-9, "driver_seconds_per_step": 0},
                                                    abs=1e-12)
    out = tmp_path / "p.json"
    assert projection.main(["--records", str(path), "--plot", str(tmp_path / "p.png"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "A MODEL, NOT A MEASUREMENT" in text and "nic_gbit = 100.0" in text and "driver_bytes_per_token = 60" in text
    rows = json.loads(out.read_text())["rows"]
    ratios = [r["ratio"] for r in rows]
    assert all(a < b for a, b in zip(ratios, ratios[1:]))  # the driver's link is what grows with the GPUs
    assert rows[0]["compute_s"] == rows[-1]["compute_s"]  # weak scaling: the same work per GPU


def test_vlm_runs_add_a_line_with_images(tmp_path, capsys):
    """Runs with images: their bytes beyond the text's, per byte of pixels, are fitted
    apart from the text costs, and every GPU count gains a VLM row."""
    import json

    from distflow.benchmarks import projection

    records = []
    for tokens, images in ((1e4, 0), (4e4, 0), (1e4, 5e6), (2e4, 2e7)):
        # the driver relays 60 B per token and 3 B per pixel byte; peers send 20 per token and 1 per pixel byte
        driver = 60 * tokens + 3 * images
        records += [{"mode": "centralized", "where": "host", "num_workers": 2, "tokens_per_step": tokens,
                     "image_bytes_per_step": images, "driver_bytes_per_step": driver,
                     "driver_relay_seconds_per_step": driver * 1e-9, "peer_bytes_per_step": 0},
                    {"mode": "distributed", "where": "host", "num_workers": 2, "tokens_per_step": tokens,
                     "image_bytes_per_step": images, "driver_bytes_per_step": 0, "driver_relay_seconds_per_step": 0,
                     "peer_bytes_per_step": 20 * tokens + images}]
    assert projection.fit(records) == pytest.approx({"driver_bytes_per_token": 60, "worker_bytes_per_token": 20,
                                                     "driver_seconds_per_byte": 1e-9, "driver_seconds_per_step": 0,
                                                     "driver_bytes_per_image_byte": 3, "worker_bytes_per_image_byte": 1},
                                                    abs=1e-9)
    path, out = tmp_path / "e2e.jsonl", tmp_path / "p.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert projection.main(["--records", str(path), "--megapixels", "2", "--json", str(out)]) == 0
    assert "with 2 MP images" in capsys.readouterr().out
    for row in json.loads(out.read_text())["rows"]:
        # 1,428 x 1,428 pixels: 10,404 patches of 1,176 float32 each, 2,601 image tokens per sample
        assert row["vlm_driver_bytes"] == pytest.approx(
            60 * row["tokens_per_step"] + (60 * 2601 + 3 * 10404 * 1176 * 4) * 4 * 8 * row["gpus"])
        assert row["vlm_ratio"] > row["ratio"]  # the pixels weigh on the driver's link far more than on a node's


def test_a_failed_run_reports_the_end_of_its_log(tmp_path):
    with pytest.raises(SystemExit) as e:  # refused by the config check, before any Ray
        e2e.run_once("default", "centralized", 0, 2, tmp_path)
    message = str(e.value)
    assert message.startswith("run host-default-centralized-0 failed (exit ")
    assert "the end of its log:" in message and "runtime.num_workers" in message
