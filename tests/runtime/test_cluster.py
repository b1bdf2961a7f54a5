"""The emulated cluster, for real: namespaces, shaped veths, a Ray cluster across them, a
DistFlow run on it, and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from distflow.runtime import cluster
from distflow.runtime.cluster import ClusterError, ClusterSpec, EmulatedCluster, leftovers

needs_root = pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                                reason="the emulated cluster needs root on Linux (CI has it)")

RECEIVER = """
import socket
s = socket.socket()
s.bind(("0.0.0.0", 5001))
s.listen()
print("listening", flush=True)
conn, _ = s.accept()
total = 0
while chunk := conn.recv(1 << 20):
    total += len(chunk)
print(total, flush=True)
"""
SENDER = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], 5001))
start = time.perf_counter()
for _ in range(int(sys.argv[2])):
    conn.sendall(b"x" * (1 << 20))
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print(time.perf_counter() - start)
"""


@needs_root
def test_hosts_talk_over_shaped_links_and_everything_is_torn_down_even_on_an_error():
    spec = ClusterSpec(hosts=3, rate_mbit=80, name="dft")
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(spec, with_ray=False) as c:
            for i in range(spec.hosts):  # each host has its own address on eth0, and both ends are shaped
                shown = c.run(i, ["ip", "-j", "addr", "show", "eth0"], capture_output=True, text=True).stdout
                assert spec.address(i) in shown
                assert "rate 80Mbit" in c.run(i, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True,
                                               text=True).stdout
            receiver = subprocess.Popen(cluster.in_host(spec, 2, [sys.executable, "-c", RECEIVER]),
                                        stdout=subprocess.PIPE, text=True)
            assert receiver.stdout.readline().strip() == "listening"
            megabytes = 20
            sent = c.run(0, [sys.executable, "-c", SENDER, spec.address(2), str(megabytes)],
                         capture_output=True, text=True, timeout=60)
            assert int(receiver.stdout.readline()) == megabytes << 20
            receiver.wait(10)
            # 20 MiB over an 80 Mbit/s link cannot take less than about 2 s: the shaping is real
            assert float(sent.stdout) > 0.8 * (megabytes << 20) * 8 / 80e6
            raise RuntimeError("boom")
    assert leftovers(spec) == []


def test_without_root_the_cluster_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"):
        cluster.check_prerequisites()


def test_a_ray_address_that_does_not_answer_is_one_line_before_anything_starts(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "distflow.cli", "train", "runtime.ray_address=127.0.0.1:1"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 30
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "runtime.ray_address='127.0.0.1:1': nothing answers there" in lines[0]
    assert not (tmp_path / "runs").exists()


PROBE = """
import json, os
from pathlib import Path
from distflow.engines.reward import default_compute_score

def score(data_source, solution_str, ground_truth, extra_info=None):
    path = Path(__file__).parent / f"probe-{os.getppid()}.json"
    if not path.exists():  # from the worker's reward process: which host is this?
        interfaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]]
        path.write_text(json.dumps({"netns": os.readlink("/proc/self/ns/net"), "interfaces": interfaces,
                                    "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
                                    "wandb_mode": os.environ.get("WANDB_MODE")}))
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


@needs_root
@pytest.mark.slow
def test_a_run_on_a_ray_cluster_across_hosts_places_one_worker_per_host(tmp_path):
    """The first run is a Ray job's entrypoint, the others name the cluster."""
    spec = ClusterSpec(hosts=3, rate_mbit=400, name="dfe")
    (tmp_path / "probe.py").write_text(PROBE)  # a module on the launcher's PYTHONPATH, not the nodes'
    out = tmp_path / "run"
    # as `ray job submit` starts an entrypoint: $RAY_ADDRESS the cluster's GCS address, the job's config, whose
    # env_vars the workers get too (WANDB_MODE: the launcher forwards it as well, which Ray refuses unless told)
    job = {"RAY_ADDRESS": spec.ray_address,
           "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"env_vars": {"WANDB_MODE": "offline"}},
                                                      "metadata": {}})}
    with EmulatedCluster(spec) as c:
        proc = c.run(0, [sys.executable, "-m", "distflow.cli", "train",
                         "runtime.num_workers=2", "trainer.total_steps=1", "data.train_batch_size=4",
                         "actor.ppo_mini_batch_size=4", "algorithm.group_size=4", "data.val_max_samples=4",
                         "rollout.max_new_tokens=16", "trainer.progress=false", "trainer.save_final=false",
                         "reward.custom_fn=probe:score", f"trainer.output_dir={out}"],
                     env={"PYTHONPATH": str(tmp_path), "WANDB_MODE": "offline"} | job,
                     capture_output=True, text=True, timeout=400, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert f"a Ray job: joining its cluster at {spec.ray_address}" in proc.stderr
        # the data-plane benchmark on the same cluster: the driver's link carries the batch, the coordinator's don't
        from distflow.benchmarks.dataplane import Spec
        from distflow.benchmarks.dataplane_cluster import measure

        bench = {r["mode"]: r for r in measure(Spec(2, 64, 128, 1), ["coordinator", "centralized-zerocopy"], 400,
                                               cluster=spec)}
        # rollout and training apart, each on a host of its own, samples and weights over the links
        apart = tmp_path / "apart"
        disaggregated = c.run(0, [sys.executable, "-m", "distflow.cli", "train", f"runtime.ray_address={spec.ray_address}",
                                  "runtime.placement=disaggregated", "algorithm.max_staleness=1",
                                  "trainer.total_steps=2", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                                  "algorithm.group_size=4", "data.val_max_samples=4", "rollout.max_new_tokens=16",
                                  "trainer.progress=false", "trainer.save_final=false", f"trainer.output_dir={apart}"],
                              capture_output=True, text=True, timeout=400, cwd=tmp_path)
        too_many = c.run(0, [sys.executable, "-m", "distflow.cli", "train", f"runtime.ray_address={spec.ray_address}",
                             "runtime.num_workers=4", f"trainer.output_dir={tmp_path / 'run2'}"],
                         capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert leftovers(spec) == []
    assert disaggregated.returncode == 0, disaggregated.stderr[-4000:]
    apart_summary = json.loads((apart / "summary.json").read_text())
    assert apart_summary["network"] == "cluster" and apart_summary["placement"] == "disaggregated"
    apart_steps = [json.loads(line) for line in (apart / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["step"] for r in apart_steps] == [1, 2] and apart_steps[1]["async/version_lag_1"] == 1.0
    assert json.loads((apart / "launcher.json").read_text())["payload_bytes_received"] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["network"] == "cluster" and summary["steps"] == 1
    step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1]
    assert step["coordinator/shm_sent_bytes"] == 0  # hosts exchange over their links, never through /dev/shm
    probes = [json.loads(p.read_text()) for p in tmp_path.glob("probe-*.json")]
    # two workers, on two different hosts (namespaces), each with the host's eth0
    assert len(probes) == 2 and len({p["netns"] for p in probes}) == 2
    assert all(p["interfaces"] == ["lo", "eth0"] or sorted(p["interfaces"]) == ["eth0", "lo"] for p in probes)
    assert all(p["gloo"] == "eth0" for p in probes)
    assert all(p["wandb_mode"] == "offline" for p in probes)  # the launcher's, as its PYTHONPATH that found probe
    for r in bench.values():
        assert r["where"] == "cluster" and r["num_hosts"] == 3 and r["wire_floor_seconds"] > 0 and r["seconds"] > 0
    central, coordinator = bench["centralized-zerocopy"], bench["coordinator"]
    assert central["driver_link_bytes"] > 2 * central["batch_bytes"]  # in and out through host 0
    assert coordinator["driver_link_bytes"] < central["driver_link_bytes"] / 4
    assert too_many.returncode == 2 and "runtime.num_workers=4: the Ray cluster at" in too_many.stderr


def test_a_ray_jobs_entrypoint_joins_its_cluster_and_an_exported_address_alone_does_not(monkeypatch, capsys):
    from distflow.cli import in_ray_job
    from distflow.config import ConfigError, load_config

    monkeypatch.setenv("RAY_ADDRESS", "198.18.0.1:6379")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert in_ray_job(load_config()).runtime.ray_address is None  # exported for other tools: a private Ray
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    assert in_ray_job(load_config()).runtime.ray_address == "198.18.0.1:6379"
    assert "a Ray job: joining its cluster at 198.18.0.1:6379" in capsys.readouterr().err
    named = in_ray_job(load_config(overrides=["runtime.ray_address=198.18.0.9:6379"]))
    assert named.runtime.ray_address == "198.18.0.9:6379"  # the user's own choice stands
    assert in_ray_job(load_config(overrides=["runtime.launcher=torchrun"])).runtime.ray_address is None
    with pytest.raises(ConfigError, match="cannot be loopback-only"):
        in_ray_job(load_config(overrides=["runtime.network=loopback"]))
