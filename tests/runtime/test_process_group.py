"""Worker process set-up (runtime/process_group.py) that is not the group itself."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

# A fresh process: allocates and touches a 16 MiB tensor, frees it, and prints how much
# of it left the resident set (KiB); with argv[1] == "keep", keep_freed_memory() first.
FREE_AND_MEASURE = """
import sys
import torch
from distflow.runtime.process_group import keep_freed_memory

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

if sys.argv[1] == "keep":
    assert keep_freed_memory()
t = torch.ones(4 << 20)  # float32: 16 MiB, every page touched
held = rss_kib()
del t
print(held - rss_kib())
"""


def _released_kib(mode: str) -> int:
    proc = subprocess.run([sys.executable, "-c", FREE_AND_MEASURE, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_stay_in_the_heap_for_the_next_allocation():
    # glibc's default maps a 16 MiB block on its own and returns it when freed: the next
    # tensor of that size faults in fresh pages; a worker keeps it for reuse instead
    assert _released_kib("default") > 12 << 10
    assert _released_kib("keep") < 1 << 10


# A one-rank group, then a thread that waits while the main thread aborts (as a C++
# library's std::terminate would).
ABORT_IN_A_WORKER = """
import os, threading, time
from distflow.runtime.process_group import free_port, init_process_group

init_process_group(0, 1, "127.0.0.1", free_port(), "cpu", 60, 1)

def waiting_for_a_peer():
    time.sleep(60)

threading.Thread(target=waiting_for_a_peer, name="peer", daemon=True).start()
time.sleep(0.2)
os.abort()
"""


def _no_core_file() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_a_worker_killed_by_a_fatal_signal_prints_every_thread_s_python_stack(tmp_path):
    proc = subprocess.run([sys.executable, "-c", ABORT_IN_A_WORKER], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, preexec_fn=_no_core_file)
    assert proc.returncode != 0
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-2000:]
    assert "in waiting_for_a_peer" in proc.stderr and "<module>" in proc.stderr, proc.stderr[-2000:]


def test_workers_get_a_gpu_each_or_all_run_on_cpu(monkeypatch):
    """On a host with 1 GPU (its count stands in for a GPU here): 2 workers would share it
    and fail in NCCL, so `auto` puts them on CPU and `cuda` says why not; the trainer's
    device follows what was chosen."""
    import torch

    from distflow.config import load_config
    from distflow.runtime import process_group
    from distflow.trainer.loop import worker_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert process_group.uses_cuda("auto") and process_group.uses_cuda("cuda")
    assert not process_group.uses_cuda("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not process_group.uses_cuda("auto")
    with pytest.raises(RuntimeError, match=r"^runtime.device=cuda: 2 workers on this host and 1 GPUs; each worker "
                                           r"needs its own"):
        process_group.uses_cuda("cuda")
    monkeypatch.setenv(process_group.DEVICE_ENV, "cpu")
    assert worker_device(load_config(None, [])) == torch.device("cpu")


FORMING = """
import datetime, json, sys, time, torch
import torch.distributed as dist
from distflow.runtime import process_group
from distflow.runtime.process_group import free_port, init_process_group
process_group.RENDEZVOUS_TIMEOUT_S = 3
start = time.monotonic()
try:  # a group of 2 whose second worker never comes (it cannot reach rank 0)
    init_process_group(0, 2, "127.0.0.1", free_port(), "cpu", 1800, 1)
except RuntimeError as e:
    failed = [str(e), time.monotonic() - start]
try:  # a worker that cannot reach rank 0's address (nothing listens there)
    init_process_group(1, 2, "127.0.0.1", free_port(), "cpu", 1800, 1)
except RuntimeError as e:
    failed.append(str(e))
init_process_group(0, 1, "127.0.0.1", free_port(), "cpu", 1800, 1)
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print(json.dumps(failed + [backend.options._timeout.total_seconds()]))
dist.destroy_process_group()
"""


def test_a_group_that_does_not_form_fails_within_the_rendezvous_timeout_not_the_collective_one():
    """A worker that cannot reach rank 0 (a node's wrong network interface) left every
    worker waiting runtime.collective_timeout_s (30 min) in silence."""
    out = subprocess.run([sys.executable, "-c", FORMING], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    message, seconds, unreachable, collective_timeout = json.loads(out.stdout.strip().splitlines()[-1])
    assert message.startswith("worker 0: the process group of 2 did not form within 3 s at rank 0's 127.0.0.1:")
    assert "GLOO_SOCKET_IFNAME" in message and "\n" not in message
    assert unreachable.startswith("worker 1: the process group of 2 did not form within 3 s at rank 0's 127.0.0.1:")
    assert seconds < 60
    assert collective_timeout == 1800  # once formed, collectives wait runtime.collective_timeout_s
