"""What can be checked of the GPU paths on a machine without one: the process group's
device-to-backend map, and the GPU check's refusal to start."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from torch.distributed.distributed_c10d import BackendConfig

from distflow.runtime.process_group import group_backend

ROOT = Path(__file__).resolve().parents[2]


def test_on_gpu_cpu_tensors_go_over_gloo_and_cuda_tensors_over_nccl():
    """NCCL refuses CPU tensors, and the coordinator's metadata, the metrics and the
    object collectives are CPU tensors: the GPU group must map cpu to gloo."""
    assert BackendConfig(group_backend(use_cuda=True)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    assert group_backend(use_cuda=False) == "gloo"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the refusal without a GPU")
def test_the_gpu_check_refuses_in_one_line_without_a_gpu(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "gpu_check: no NVIDIA GPU here (nvidia-smi lists none); nothing was run\n"
    assert not (tmp_path / "out").exists()  # nothing installed, nothing written
