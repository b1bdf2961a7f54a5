"""Modes (b) and (c) of the data-plane benchmark: a single-controller (verl-style) driver
in the data path; and verl's own, where verl is installed.

N Ray actors (`_Holder`) hold the rows; for every transition the driver gathers every
shard, concatenates, cuts equal-count chunks and sends them out. In the verl modes the
actors hold verl `DataProto`s and the driver runs verl's own code for it: the outputs
concatenated with `DataProto.concat` (collect_dp_compute_data_proto), cut with
`DataProto.chunk` (the DP_COMPUTE_PROTO dispatch), each chunk put into the object store
once and its reference sent to every member of the destination group (dispatch_nd_compute's
`parallel_put`), serialised by verl's `DataProto.__getstate__`: torch.save by default,
numpy arrays with VERL_DATAPROTO_SERIALIZATION_METHOD=numpy. After the rounds every actor
reports a digest of the rows it holds, so the verl modes' shards are checked equal to
ours. On one host each
measurement runs in a fresh driver subprocess (`python -m distflow.benchmarks.dataplane
--_child MODE`, which calls `_centralized_child`); on the emulated cluster the driver on
host 0 calls `_centralized_rounds` (see `dataplane_cluster`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distflow.benchmarks.dataplane_common import (TIMEOUT_S, VERL_MODES, WARMUP_ROUNDS, Spec, _record, make_shard,
                                                  proc_status)
from distflow.coordinator.layout import Layout
from distflow.coordinator.partition import contiguous_split

# Ray's unix sockets live under <temp>/session_*/sockets/ and must fit in 107 bytes.
_MAX_RAY_TEMP_LEN = 44


class _Holder:
    """A centralized-mode worker (a Ray actor): holds its rows between transitions."""

    def __init__(self, rank: int, spec: dict[str, int], as_numpy: bool) -> None:
        tensors, ground_truth, _, _ = make_shard(rank, Spec(**spec))
        shard: dict[str, Any] = {k: v.numpy() for k, v in tensors.items()} if as_numpy else tensors
        self.initial = {**shard, "ground_truth": ground_truth}
        self.current = self.initial

    def rows(self) -> int:
        return len(self.current["ground_truth"])

    def reset(self) -> int:
        self.current = self.initial
        return self.rows()

    def shard(self) -> dict[str, Any]:
        return self.current

    def receive(self, chunk: dict[str, Any]) -> int:
        self.current = chunk
        return self.rows()  # a small ack, so the driver can wait for delivery

    def digest(self) -> str:
        return shard_digest({k: v for k, v in self.current.items() if k != "ground_truth"},
                            list(self.current["ground_truth"]))


class _VerlHolder(_Holder):
    """The same rows as a verl DataProto (tensors in its TensorDict, ground truths as a
    numpy object array, as verl keeps non-tensor fields)."""

    def __init__(self, rank: int, spec: dict[str, int], as_numpy: bool) -> None:
        import numpy as np
        from verl import DataProto

        tensors, ground_truth, _, _ = make_shard(rank, Spec(**spec))
        self.initial = DataProto.from_dict(tensors=tensors, non_tensors={"ground_truth": np.array(ground_truth,
                                                                                               dtype=object)})
        self.current = self.initial

    def rows(self) -> int:
        return len(self.current)

    def digest(self) -> str:
        return shard_digest(dict(self.current.batch.items()), list(self.current.non_tensor_batch["ground_truth"]))


def shard_digest(tensors: dict[str, Any], ground_truth: list[str]) -> str:
    """A hash of a shard's rows in order: every field's bytes, then the strings."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        value = tensors[name]
        h.update(name.encode())
        h.update((value.numpy() if isinstance(value, torch.Tensor) else np.ascontiguousarray(value)).tobytes())
    h.update("\0".join(ground_truth).encode())
    return h.hexdigest()


def _shard_bytes(shard: dict[str, Any]) -> int:
    """Array/tensor bytes plus UTF-8 bytes of the strings: what the driver really handles."""
    total = 0
    for value in shard.values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        else:
            total += sum(len(s.encode()) for s in value)
    return total


def _concat(parts: list[dict[str, Any]], as_numpy: bool) -> dict[str, Any]:
    cat = np.concatenate if as_numpy else torch.cat
    return {k: [s for p in parts for s in p[k]] if k == "ground_truth" else cat([p[k] for p in parts])
            for k in parts[0]}


def _chunks(merged: dict[str, Any], k: int, as_numpy: bool) -> list[dict[str, Any]]:
    """Equal-count contiguous chunks, as DataProto.chunk cuts them."""
    out = []
    for part in contiguous_split([0] * len(merged["ground_truth"]), k):
        lo, hi = part[0], part[-1] + 1
        # Pickling a torch view ships its whole storage (the full batch), so tensors are
        # cloned as verl's DataProto does (consolidate); numpy views pickle only their bytes.
        out.append({name: v[lo:hi] if as_numpy or name == "ground_truth" else v[lo:hi].clone()
                    for name, v in merged.items()})
    return out


def _transition(ray: Any, sources: list[Any], dests: list[list[Any]], as_numpy: bool) -> int:
    """Gather every source shard into the driver, concatenate, cut one chunk per
    destination group, put it in the object store once and send its reference to each
    member (as verl's dispatch does: a group's members read one copy), wait. Returns
    driver bytes in + out."""
    parts = ray.get([a.shard.remote() for a in sources], timeout=TIMEOUT_S)
    received = sum(_shard_bytes(p) for p in parts)
    chunks = _chunks(_concat(parts, as_numpy), len(dests), as_numpy)
    del parts  # release the object-store copies before the next stage
    refs = [ray.put(chunk) for chunk in chunks]
    acks = [a.receive.remote(ref) for group, ref in zip(dests, refs) for a in group]
    sent = sum(_shard_bytes(chunk) for chunk in chunks)  # one put per chunk, however many members read it
    ray.get(acks, timeout=TIMEOUT_S)
    return received + sent


def _verl_transition(ray: Any, sources: list[Any], dests: list[list[Any]]) -> int:
    """verl's path for the same transition: collect (DataProto.concat), chunk, one object
    store put per chunk, its reference to every member of the group. Returns driver bytes."""
    from verl import DataProto

    parts = ray.get([a.shard.remote() for a in sources], timeout=TIMEOUT_S)
    received = sum(_verl_bytes(p) for p in parts)
    chunks = DataProto.concat(parts).chunk(len(dests))
    del parts
    refs = [ray.put(chunk) for chunk in chunks]
    acks = [a.receive.remote(ref) for group, ref in zip(dests, refs) for a in group]
    sent = sum(_verl_bytes(chunk) for chunk in chunks)  # one put per chunk, however many members read it
    ray.get(acks, timeout=TIMEOUT_S)
    return received + sent


def _verl_bytes(data: Any) -> int:
    return (sum(v.numel() * v.element_size() for v in data.batch.values())
            + sum(len(s.encode()) for s in data.non_tensor_batch["ground_truth"]))


def _centralized_rounds(ray: Any, mode: str, spec: Spec) -> dict[str, Any]:
    """Warm-up plus timed rounds of the three driver-mediated transitions."""
    as_numpy = mode == "centralized-zerocopy"
    verl = mode in VERL_MODES
    transition = _verl_transition if verl else lambda r, src, dst: _transition(r, src, dst, as_numpy)
    # This module never runs as __main__, so Ray pickles the actor class by reference.
    remote_cls = ray.remote(num_cpus=1)(_VerlHolder if verl else _Holder)
    actors = [remote_cls.remote(r, asdict(spec), as_numpy) for r in range(spec.num_workers)]
    ray.get([a.rows.remote() for a in actors], timeout=TIMEOUT_S)
    rss_before = proc_status("VmRSS")
    singles = [[a] for a in actors]
    pairs = [[actors[r] for r in group] for group in Layout(spec.num_workers, tp_size=2).dp_groups()]
    # Back to DP the driver reads one member per TP pair (verl collects from tp rank 0).
    steps = [(actors, singles), (actors, pairs), ([g[0] for g in pairs], singles)]
    laps: list[list[float]] = []
    moved = 0
    for rnd in range(WARMUP_ROUNDS + spec.repeats):
        ray.get([a.reset.remote() for a in actors], timeout=TIMEOUT_S)
        marks, total = [time.perf_counter()], 0
        for sources, dests in steps:
            total += transition(ray, sources, dests)
            marks.append(time.perf_counter())
        rows = sum(ray.get([a.rows.remote() for a in actors], timeout=TIMEOUT_S))
        if rows != spec.batch:
            raise RuntimeError(f"{mode} ended with {rows} rows in all, expected {spec.batch}")
        if rnd >= WARMUP_ROUNDS:
            laps.append([b - a for a, b in zip(marks, marks[1:])])
            moved = total
    digests = ray.get([a.digest.remote() for a in actors], timeout=TIMEOUT_S)
    peak = proc_status("VmHWM")  # the driver: the busiest process of a single controller
    return _record(mode, spec, laps, moved, peak, driver_rss_before_bytes=rss_before, shard_digests=digests,
                   busiest_process_peak_rss_bytes=peak)


def _centralized_child(mode: str, spec: Spec, ray_temp: str, out_path: str) -> int:
    """The fresh driver process of one centralized measurement (`--_child`)."""
    # A SIGTERM from the parent (timeout) unwinds through `finally`, so Ray is shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from distflow.runtime.process_group import WORKER_ENV

    # "-pickle" means Ray's default tensor path; pin it in case the environment opts in
    # to Ray's zero-copy torch serializer. The local Ray instance and its workers inherit
    # this environment (a runtime_env would defeat Ray's prestarted workers: slower start).
    os.environ.update({**WORKER_ENV, "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "0"})
    if mode == "centralized-verl-numpy":  # verl's switch; its actors inherit it
        os.environ["VERL_DATAPROTO_SERIALIZATION_METHOD"] = "numpy"
    import ray

    try:
        ray.init(num_cpus=spec.num_workers, include_dashboard=False, _temp_dir=ray_temp,
                 _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
        record = _centralized_rounds(ray, mode, spec)
        Path(out_path).write_text(json.dumps(record))
        return 0
    finally:
        ray.shutdown()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def run_centralized(mode: str, spec: Spec) -> dict[str, Any]:
    """Modes (b)/(c): one fresh driver subprocess with its own Ray instance."""
    tmp = tempfile.mkdtemp(prefix="dfray-", dir="/tmp")
    if len(tmp) > _MAX_RAY_TEMP_LEN:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"Ray temp dir {tmp} is longer than {_MAX_RAY_TEMP_LEN} characters")
    out, log = Path(tmp, "result.json"), Path(tmp, "driver.log")
    cmd = [sys.executable, "-m", "distflow.benchmarks.dataplane", "--_child", mode,
           "--workers", str(spec.num_workers), "--batch", str(spec.batch), "--seq-len", str(spec.seq_len),
           "--repeats", str(spec.repeats), "--_image-patches", str(spec.image_patches),
           "--_ray-temp", tmp, "--_out", str(out)]
    proc: subprocess.Popen | None = None
    try:
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            code = proc.wait(timeout=TIMEOUT_S)
        if code != 0 or not out.exists():
            raise RuntimeError(f"{mode} driver (N={spec.num_workers}) exited with code {code}:\n{_tail(log)}")
        return json.loads(out.read_text())
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{mode} driver (N={spec.num_workers}) ran past {TIMEOUT_S} s:\n{_tail(log)}") from None
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()  # our own child, by PID; its finally shuts Ray down
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
