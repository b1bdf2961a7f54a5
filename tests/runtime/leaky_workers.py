"""Worker programs for the launcher's tests: one that keeps its data to itself (and
tells the environment it was started with), one that leaks batch data to the launcher in
each way the launcher can receive it, and one whose rank 1 hangs."""

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distflow.runtime.process_group import WORKER_ENV


def _metrics(run_dir: str, record: dict) -> None:
    if dist.get_rank() == 0:
        with open(Path(run_dir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def clean(run_dir: str) -> dict:
    _metrics(run_dir, {"step": 1, "reward/mean": 0.45, "val/accuracy": 0.5})
    return {"steps": 1, "heldout_accuracy_final": 0.5, "run_dir": run_dir, "started_with": _start_environment()}


def _start_environment() -> dict:
    """WORKER_ENV's variables as this process was started with them (the worker's own later
    changes to os.environ do not show in /proc/self/environ)."""
    entries = (e.decode().split("=", 1) for e in Path("/proc/self/environ").read_bytes().split(b"\0") if b"=" in e)
    return {k: v for k, v in entries if k in WORKER_ENV}


def leaky(run_dir: str) -> dict:
    # rank 0: 4x8 int64 responses in its return value (256 bytes) and 3 token ids in its
    # metrics record (24 bytes); rank 1: a plain list of 6 token ids (48 bytes)
    _metrics(run_dir, {"step": 1, "reward/mean": 0.45, "val/accuracy": 0.5, "responses": [5, 6, 7]})
    if dist.get_rank() == 0:
        return {"steps": 1, "responses": torch.zeros(4, 8, dtype=torch.long)}
    return {"steps": 1, "responses": [[1, 2, 3], [4, 5, 6]]}


def one_hangs(run_dir: str) -> dict:
    """Rank 1 hangs in a stage (its status file says which, as a trainer's does); rank 0
    waits for it in a barrier until the collective timeout fails it."""
    if dist.get_rank() == 1:
        status = Path(run_dir) / "status"
        status.mkdir(exist_ok=True)
        (status / "rank-1.json").write_text(json.dumps({"rank": 1, "step": 3, "stage": "generate"}))
        time.sleep(600)
    dist.barrier()
    return {"steps": 1}
