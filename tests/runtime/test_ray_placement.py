"""Workers on a Ray cluster: packed onto as few nodes as fit them, each node holding a run
of consecutive ranks (a TP group or a rollout replica's members share a node), on the
emulated cluster (a Ray head and two nodes of 2 CPUs, each in its own network namespace)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from distflow.runtime.cluster import ClusterSpec, EmulatedCluster, leftovers

needs_root = pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                                reason="the emulated cluster needs root on Linux (CI has it)")

PLACE = """
import json, sys
import ray
from distflow.runtime.ray_launcher import ClusterTooSmall, _packed_by_node, check_ray_address

address = sys.argv[1]
ray.init(address=address, _node_ip_address=check_ray_address(address), configure_logging=False)

@ray.remote(num_cpus=1)
class Where:
    def host(self):
        return ray.util.get_node_ip_address()

group, options, on_node = _packed_by_node(4, use_gpu=False, ray_address=address)
actors = [Where.options(**options[r]).remote() for r in range(4)]
hosts = ray.get([a.host.remote() for a in actors], timeout=120)
for a in actors:
    ray.kill(a)
ray.util.remove_placement_group(group)
try:
    _packed_by_node(5, use_gpu=False, ray_address=address, timeout_s=3)
    refused = ""
except ClusterTooSmall as e:
    refused = str(e)
ray.shutdown()
print(json.dumps({"hosts": hosts, "refused": refused, "on_node": on_node}))
"""


@pytest.mark.slow
@needs_root
def test_ranks_fill_a_node_before_the_next(tmp_path):
    spec = ClusterSpec(hosts=3, rate_mbit=400, cpus_per_host=2, name="dfp")
    with EmulatedCluster(spec) as c:
        proc = c.run(0, [sys.executable, "-c", PLACE, spec.ray_address], capture_output=True, text=True,
                     timeout=300, cwd=tmp_path)
    assert leftovers(spec) == []
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    hosts = out["hosts"]  # Ray's SPREAD gave them out host by host in turn: A B A B
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2]
    assert set(hosts) == {spec.address(1), spec.address(2)}
    # each rank is told its node's workers (LOCAL_WORLD_SIZE): two, not the run's four
    assert out["on_node"] == [2, 2, 2, 2]
    assert out["refused"].startswith(f"runtime.num_workers=5: the Ray cluster at {spec.ray_address} could not place")


def test_bundles_ray_interleaved_over_nodes_are_given_out_node_by_node():
    """Where Ray put a PACK group's bundles on nodes A B A B C (the emulated cluster's PACK
    filled its nodes in order, so the test above does not reach this), ranks 0-1 take A's
    bundles, 2-3 B's and 4 C's."""
    from distflow.runtime.ray_launcher import bundles_by_node

    assert bundles_by_node({0: "A", 1: "B", 2: "A", 3: "B", 4: "C"}, 5) == [0, 2, 1, 3, 4]
    assert bundles_by_node({0: "B", 1: "A", 2: "B"}, 3) == [0, 2, 1]


def test_a_dead_workers_line_names_its_pid_node_and_rays_exit_detail():
    from distflow.runtime.ray_launcher import death_detail

    # Ray 2.60's ActorDiedError text: a worker SIGKILLed (as the kernel's OOM killer does), and one Ray's
    # memory monitor killed
    killed = ("The actor died unexpectedly before finishing this task.\n\tclass_name: _Worker\n\tactor_id: 47f1\n"
              "\tpid: 21725\n\tnamespace: 190a\n\tip: 198.18.0.2\nThe actor is dead because its worker process has "
              "died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
              "error code 2. End of file. Some common causes include: (1) the process was killed by the OOM killer")
    assert death_detail(killed) == "pid 21725 on 198.18.0.2, Worker unexpectedly exits with a connection error code 2."
    low_memory = killed.replace("SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error "
                                "code 2. End of file.", "NODE_OUT_OF_MEMORY Worker exit detail: Task was killed due "
                                "to the node running low on memory.")
    assert death_detail(low_memory).endswith("Task was killed due to the node running low on memory.")
    assert death_detail("The actor died.") == ""


def test_cluster_workers_get_the_launchers_library_settings_not_its_host_identity():
    from distflow.runtime.ray_launcher import forwarded_env

    launcher = {"PYTHONPATH": "/home/me/rewards", "HF_HOME": "/shared/hf", "WANDB_MODE": "offline",
                "DISTFLOW_SANDBOX": "own-uid", "DISTFLOW_HOST_ID": "login-node", "DISTFLOW_NETNS": "loopback",
                "GLOO_SOCKET_IFNAME": "eth9", "NCCL_IB_HCA": "mlx5_0", "HOME": "/home/me",
                # what a local run's memory and compilers use (a setting that avoided OOM locally applies there too)
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCHINDUCTOR_CACHE_DIR": "/shared/ind",
                "TRITON_CACHE_DIR": "/shared/triton", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert forwarded_env(launcher) == {"PYTHONPATH": "/home/me/rewards:${PYTHONPATH}",  # before the node's own
                                       "HF_HOME": "/shared/hf", "WANDB_MODE": "offline", "DISTFLOW_SANDBOX": "own-uid",
                                       "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                       "TORCHINDUCTOR_CACHE_DIR": "/shared/ind", "TRITON_CACHE_DIR": "/shared/triton",
                                       "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_a_ray_address_that_is_not_the_clusters_gcs_says_so():
    """RAY_ADDRESS often holds the Ray client's ray:// or the jobs API's http:// address: each
    was 'nothing answers there'; an IPv6 address in brackets is reached."""
    import socket

    from distflow.runtime.ray_launcher import check_ray_address

    for address, scheme in (("ray://head:10001", "ray"), ("http://head:8265", "http")):
        with pytest.raises(ValueError, match=rf"^runtime.ray_address='{scheme}://head:\d+': a {scheme}:// address; "
                                             r"give the cluster's GCS address, host:port"):
            check_ray_address(address)
    with socket.socket(socket.AF_INET6) as server:
        server.bind(("::1", 0))
        server.listen()
        assert check_ray_address(f"[::1]:{server.getsockname()[1]}", timeout_s=5) == "::1"


WAIT_FOR_ROOM = """
import json, os, shutil, signal, sys, threading, time
from pathlib import Path
import ray
from distflow.runtime.ray_launcher import Stopped, _packed_by_node, _record, ray_temp_dir

temp, cleanup = ray_temp_dir(Path(sys.argv[1]))
ray.init(address="local", num_cpus=1, include_dashboard=False, _temp_dir=temp, configure_logging=False)
try:
    signal.signal(signal.SIGINT, _record)  # as launch_ray sets it
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the cluster is too busy
    start = time.monotonic()
    try:
        _packed_by_node(2, use_gpu=False, ray_address="local", timeout_s=120)
        stopped = None
    except Stopped as e:
        stopped = e.signum
    groups = [g["state"] for g in ray.util.placement_group_table().values()]
    print(json.dumps({"stopped": stopped, "seconds": time.monotonic() - start, "groups": groups}))
finally:
    ray.shutdown()
    if cleanup:
        shutil.rmtree(cleanup, ignore_errors=True)
"""


@pytest.mark.slow
def test_ctrl_c_while_waiting_for_room_on_a_cluster_stops_the_wait_and_frees_the_placement_group(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-c", WAIT_FOR_ROOM, str(tmp_path)], capture_output=True, text=True,
                          timeout=200, env=os.environ | {"RAY_USAGE_STATS_ENABLED": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stopped"] == 2  # SIGINT, within a poll of it: it waited the whole 120 s before
    assert out["seconds"] < 60
    assert out["groups"] == ["REMOVED"]
