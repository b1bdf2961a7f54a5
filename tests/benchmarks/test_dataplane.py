"""The data-plane benchmark at its --quick size: every mode reports, the coordinator's
busiest process moves fewer bytes than the centralized driver, Karmarkar-Karp beats the
contiguous split on token balance, and the planning section reports."""

import json

import pytest

from distflow.benchmarks.dataplane import main

pytestmark = pytest.mark.slow

KEYS = {"mode", "num_workers", "batch", "seq_len", "seconds", "busiest_process_bytes",
        "driver_peak_rss_bytes", "batch_bytes", "where"}
CENTRALIZED = ("centralized-pickle", "centralized-zerocopy")


def test_quick_run_reports_every_mode(tmp_path):
    jsonl, md = tmp_path / "r.jsonl", tmp_path / "R.md"
    assert main(["--quick", "--json", str(jsonl), "--results-md", str(md)]) == 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    by_mode = {r["mode"]: r for r in records if "seconds" in r}
    assert set(by_mode) == {"coordinator", *CENTRALIZED}
    for r in by_mode.values():
        assert KEYS <= set(r), r
        assert r["seconds"] > 0 and r["where"] == "host" and r["num_workers"] == 2
        assert r["batch_bytes"] == 64 * 128 * (8 + 8 + 4 + 4)
    coordinator = by_mode["coordinator"]
    assert coordinator["driver_peak_rss_bytes"] is None
    assert coordinator["busiest_process_bytes"] > 0  # DP -> TP pairs really moves data
    # the plain-transport references moved the same payload and were timed
    assert coordinator["raw_alltoall_seconds"] > 0 and coordinator["raw_p2p_seconds"] > 0
    assert coordinator["shm_floor_seconds"] > 0  # the plain /dev/shm copies of the same bytes
    assert coordinator["shm_fresh_files_seconds"] > 0  # the same, through files made per transfer
    # the CPU each rank spent per round, the coordinator's and the copies', and the cores they shared
    assert coordinator["cpu_seconds_per_rank"] > 0 and coordinator["shm_floor_cpu_seconds"] > 0
    assert coordinator["cores"] >= 1
    assert "CPU per rank and round: coordinator" in md.read_text()
    # the fixed costs: the same reshards of one-column rows, and one gloo barrier
    assert coordinator["one_column_seconds"] > 0 and coordinator["one_column_cpu_seconds"] > 0
    assert coordinator["barrier_seconds"] > 0
    assert "the fixed costs: the same reshards of one-column rows" in md.read_text()
    # where the time goes: the payload phases and the one metadata all-gather of the step
    assert {"metadata", "plan", "pack", "sizes", "receive"} <= set(coordinator["phase_seconds"])
    # and each phase's CPU on the calling thread, which waits do not count: never above its seconds
    assert set(coordinator["phase_cpu_seconds"]) == set(coordinator["phase_seconds"])
    assert coordinator["phase_cpu_seconds"]["plan"] > 0
    assert all(cpu <= 1.01 * coordinator["phase_seconds"][k] + 1e-4  # two clocks: allow their granularity
               for k, cpu in coordinator["phase_cpu_seconds"].items())
    assert "its phases' CPU (s per rank" in md.read_text()
    for mode in CENTRALIZED:
        r = by_mode[mode]
        assert coordinator["busiest_process_bytes"] < r["busiest_process_bytes"]
        # the driver takes each non-trivial transition's batch in and sends it out again
        assert r["busiest_process_bytes"] >= 2 * r["batch_bytes"]
        assert r["driver_peak_rss_bytes"] > 0

    kk = {r["num_workers"]: r["imbalance"] for r in records if r["mode"] == "imbalance-kk"}
    contiguous = {r["num_workers"]: r["imbalance"] for r in records if r["mode"] == "imbalance-contiguous"}
    assert set(kk) == set(contiguous) == {2, 4, 8}
    assert all(1.0 <= kk[k] <= contiguous[k] for k in kk)

    # what every rank computes besides moving bytes, at --quick's one size: 8 ranks of 256 samples
    planning = [r for r in records if r["mode"] == "planning"]
    assert [(r["num_workers"], r["batch"]) for r in planning] == [(8, 2048)]
    assert len(planning[0]["cpu_seconds_per_transition"]) == 3 and planning[0]["cpu_seconds"] > 0

    report = md.read_text()
    assert "## Planning on every rank, at scale" in report and "| 8 | 2048 |" in report
    assert "| N | mode | seconds | x coordinator |" in report
    for mode in ("coordinator", *CENTRALIZED):
        assert f"| 2 | {mode} |" in report
    assert "python -m distflow.benchmarks.dataplane --quick" in report and "nproc" in report
    assert "## Against shared memory's floor" in report and "x the plain shared-memory copies" in report
    assert "the same copies through files made per transfer take" in report


def test_images_make_the_drivers_peak_grow_with_the_batch_and_the_budget_stops_it(tmp_path):
    """The VLM setting: pixels are most of the batch; the driver moves every byte of it
    twice per transition and its peak memory grows with the batch, a coordinator rank's
    by its share; the stated budget ends a mode's measurements at its first batch over it."""
    from distflow.benchmarks import dataplane_vlm
    from distflow.benchmarks.dataplane_common import IMAGE_PATCH_FEATURES, image_patches_of

    assert image_patches_of(1.0) == 72 * 72 and image_patches_of(0.05) == 16 * 16  # 1008 and 224 pixels a side
    jsonl, md = tmp_path / "vlm.jsonl", tmp_path / "VLM.md"
    assert dataplane_vlm.main(["--workers", "2", "--batch", "4", "8", "--seq-len", "64", "--megapixels", "0.05",
                               "--memory-budget-gib", "64", "--json", str(jsonl), "--results-md", str(md)]) == 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    by = {(r["mode"], r["batch"]): r for r in records}
    assert set(by) == {(m, b) for m in ("coordinator", "centralized-zerocopy") for b in (4, 8)}
    for (mode, batch), r in by.items():
        pixels = batch * 256 * IMAGE_PATCH_FEATURES * 4
        assert r["image_patches"] == 256 and r["batch_bytes"] > pixels > 0.9 * r["batch_bytes"]
        assert r["within_budget"] and r["busiest_process_peak_rss_bytes"] > 0
    for batch in (4, 8):
        central, coordinator = by[("centralized-zerocopy", batch)], by[("coordinator", batch)]
        assert central["busiest_process_bytes"] >= 2 * central["batch_bytes"]
        assert coordinator["busiest_process_bytes"] < central["busiest_process_bytes"] / 2
    assert "largest batch within 64 GiB: 8" in md.read_text()
    # a budget below what any process needs: each mode stops after its first batch
    low = dataplane_vlm.measure(2, [4, 8], 64, 0.05, ["coordinator"], 1, budget_bytes=1, log=lambda s: None)
    assert [(r["batch"], r["within_budget"]) for r in low] == [(4, False)]
    (line,) = dataplane_vlm.summary_lines(low)
    assert line.endswith("none measured; over it at 4")


def _slowest(rank, world):
    from distflow.benchmarks.dataplane_coordinator import _slowest_rank_median

    return _slowest_rank_median([[1.0, 3.0, 5.0], [2.0, 1.0, 9.0]][rank])


def test_a_round_is_its_slowest_rank_s_for_the_coordinator_and_every_reference():
    """Each round's slowest rank, then the median over rounds: rounds (2, 3, 9) give 3.
    The floors took each rank's median, then the slowest (max(3, 2) = 3 here, but lower
    whenever the slow rank changes from round to round), and the coordinator the sum of
    each transition's slowest rank, which a late rank's shorter wait in the next
    transition does not offset."""
    from distflow.benchmarks.dataplane_common import Spec, _record
    from helpers import run_gloo

    assert run_gloo(_slowest, 2) == [3.0, 3.0]
    spec = Spec(num_workers=2, batch=8, seq_len=4, repeats=2)
    laps = [[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]]  # each transition's slowest rank
    assert _record("coordinator", spec, laps, 0, None)["seconds"] == pytest.approx(0.6)
    assert _record("coordinator", spec, laps, 0, None, round_seconds=[0.4, 0.5])["seconds"] == pytest.approx(0.45)
