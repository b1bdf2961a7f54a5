"""The launcher meter: what counts as payload, and a real Ray launch in both directions:
a worker that keeps its data gives 0 payload bytes, one that leaks a batch (in its
return value or in a file the launcher reads) is caught, byte for byte."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from distflow.runtime.meter import LauncherMeter, payload_bytes


def test_payload_bytes_counts_tensor_content_anywhere():
    obj = {"a": torch.zeros(10, 4, dtype=torch.int64), "b": [np.zeros(5, dtype=np.float32), b"xyz"],
           "c": {"d": (torch.ones(3, dtype=torch.float16),)}, "s": "a string", "n": 3.5}
    assert payload_bytes(obj) == 10 * 4 * 8 + 5 * 4 + 3 + 3 * 2


def test_a_list_of_numbers_is_payload_however_it_travels():
    assert payload_bytes({"ids": [101, 7, 2045]}) == 24  # token ids as a JSON or pickled list
    assert payload_bytes([[1, 2], [3, 4, 5]]) == 40
    assert payload_bytes({"steps": 3, "acc": 0.5, "run_dir": "/x", "flags": [True, False]}) == 0
    assert payload_bytes(("127.0.0.1", 29500)) == 0  # an address and a port: control


def test_files_read_are_metered_line_by_line(tmp_path):
    meter = LauncherMeter()
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward/mean": 0.4}) + "\n" + json.dumps({"ids": [1, 2, 3, 4]}) + "\n")
    assert meter.read_text(path) == path.read_text()
    summary = meter.summary()
    assert summary["received_by_source"]["metrics.jsonl"] == {"payload": 32, "control": len(path.read_bytes())}


def test_the_launchers_bar_follows_a_resumed_run_that_replaces_its_metrics_file(tmp_path):
    """A run killed at step 6 and resumed from step 3: the workers replace metrics.jsonl
    with the checkpoint's copy, then append; the bar starts at 3 and goes on from there."""
    from distflow.cli import LauncherProgress

    path = tmp_path / "metrics.jsonl"

    def lines(steps):
        return "".join(json.dumps({"step": s, "reward/mean": 0.5, "val/accuracy": 0.25}) + "\n" for s in steps)

    path.write_text(lines(range(7)))  # the killed launch's
    progress = LauncherProgress(tmp_path, total=10, enabled=True, meter=LauncherMeter())
    progress.poll()
    assert progress.bar is None  # not this launch's steps: no bar at 6 of 10 before the workers start
    (tmp_path / "copy").write_text(lines(range(4)))
    os.replace(tmp_path / "copy", path)
    progress.poll()
    # the restored steps are where the bar starts, not steps done now: the rate and ETA leave them out
    # (the bar counted 3 steps in the poll's instant, an ETA of seconds for an hour's run)
    assert progress.bar.n == 3 and progress.bar.format_dict["initial"] == 3
    with open(path, "a") as f:
        f.write(lines(range(4, 10)))
    progress.poll()
    assert progress.bar.n == 9
    progress.close()


@pytest.mark.slow
def test_a_real_launch_counts_zero_for_a_clean_worker_and_every_leaked_byte(tmp_path, monkeypatch):
    """Also: the workers start with the launcher's worker environment (offline, ...), which
    the launcher sets only for the launch."""
    from distflow.cli import LauncherProgress
    from distflow.runtime.process_group import WORKER_ENV
    from distflow.runtime.ray_launcher import launch_ray

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    unset = set(WORKER_ENV) - {"RAY_USAGE_STATS_ENABLED"}  # the launcher keeps that one here too: Ray's stats off
    for k in unset:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # an exported cluster address: a local launch starts its own Ray
    results, returned = {}, {}
    for name in ("clean", "leaky"):
        run_dir = tmp_path / name
        run_dir.mkdir()
        meter = LauncherMeter()
        progress = LauncherProgress(run_dir, total=1, enabled=True, meter=meter)  # it reads metrics.jsonl
        returned[name] = launch_ray(f"leaky_workers:{name}", (str(run_dir),), run_dir=run_dir, num_workers=2,
                                    device="cpu", collective_timeout_s=60, threads=1, on_poll=progress.poll,
                                    poll_s=0.2, meter=meter)
        progress.close()
        results[name] = json.loads((run_dir / "launcher.json").read_text())
    assert [r["started_with"] for r in returned["clean"]] == [WORKER_ENV, WORKER_ENV]
    assert not unset & set(os.environ)  # this process's environment is as it was
    clean, leaky = results["clean"], results["leaky"]
    assert clean["payload_bytes_received"] == 0
    assert clean["received_by_source"]["result"]["control"] > 0  # the meter saw the return values
    assert clean["received_by_source"]["metrics.jsonl"]["control"] > 0  # ... and the file it read
    assert leaky["received_by_source"]["result"]["payload"] == 4 * 8 * 8 + 6 * 8
    assert leaky["received_by_source"]["metrics.jsonl"]["payload"] == 3 * 8
    assert leaky["payload_bytes_received"] == 256 + 48 + 24


def test_a_resumed_run_replaces_the_earlier_runs_ray_temp_link(tmp_path):
    """A run folder whose path is too long for Ray's sockets gets a link to a short temp
    folder, removed at the end; the next run in the same folder (a resume) makes a new one."""
    from distflow.runtime.ray_launcher import ray_temp_dir

    run_dir = tmp_path / ("r" * 60)
    run_dir.mkdir()
    first, cleanup = ray_temp_dir(run_dir)
    assert cleanup == first and (run_dir / "ray").resolve() == Path(first).resolve()
    shutil.rmtree(cleanup)  # what the launcher does when the run ends: the link dangles
    second, cleanup = ray_temp_dir(run_dir)
    assert (run_dir / "ray").resolve() == Path(second).resolve() and Path(second).is_dir()
    shutil.rmtree(cleanup)


@pytest.mark.slow
def test_a_hung_worker_is_named_when_the_others_time_out_waiting_for_it(tmp_path, monkeypatch):
    """Rank 0 fails at the collective timeout in a barrier that rank 1, hung in its
    'generate' stage, never reaches: the launcher's line names rank 1 and its stage too."""
    from distflow.runtime.ray_launcher import WorkerFailed, launch_ray

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(WorkerFailed) as failed:
        launch_ray("leaky_workers:one_hangs", (str(tmp_path),), run_dir=tmp_path, num_workers=2, device="cpu",
                   collective_timeout_s=3, threads=1, poll_s=0.2)
    line = str(failed.value)
    assert line.startswith("worker 0 failed: ") and "\n" not in line, line
    assert line.endswith("; still running: worker 1 in stage 'generate' of step 3"), line
