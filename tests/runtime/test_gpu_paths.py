"""What can be checked of the GPU paths on a machine without one: the process group's
device-to-backend map, a Ray worker's device index, and the GPU check's refusal to start."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from torch.distributed.distributed_c10d import BackendConfig

from distflow.runtime.process_group import group_backend
from distflow.runtime.ray_launcher import gpu_index

ROOT = Path(__file__).resolve().parents[2]


def test_on_gpu_cpu_tensors_go_over_gloo_and_cuda_tensors_over_nccl():
    """NCCL refuses CPU tensors, and the coordinator's metadata, the metrics and the
    object collectives are CPU tensors: the GPU group must map cpu to gloo."""
    assert BackendConfig(group_backend(use_cuda=True)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    assert group_backend(use_cuda=False) == "gloo"


def test_a_ray_worker_uses_the_gpu_ray_gave_it_under_either_visibility():
    """By default Ray narrows each actor's CUDA_VISIBLE_DEVICES to its GPU: index 0. Under
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (vLLM setups set it) every actor sees the
    node's list, and the GPU Ray gave it is its place there: not every worker on cuda:0."""
    assert gpu_index(3, "3") == 0  # Ray's default
    assert gpu_index(3, None) == 3 and gpu_index("5", "") == 5  # NOSET, the node's list not set
    assert gpu_index(6, "4,5,6,7") == 2  # NOSET on a node started with CUDA_VISIBLE_DEVICES=4,5,6,7
    with pytest.raises(RuntimeError, match="Ray gave this worker GPU 1, which CUDA_VISIBLE_DEVICES='4,5' does not"):
        gpu_index(1, "4,5")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the refusal without a GPU")
def test_the_gpu_check_refuses_in_one_line_without_a_gpu(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "gpu_check: no NVIDIA GPU here (nvidia-smi lists none); nothing was run\n"
    assert not (tmp_path / "out").exists()  # nothing installed, nothing written
