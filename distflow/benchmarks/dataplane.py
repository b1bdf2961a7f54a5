"""Data-plane benchmark: the Data Coordinator against a single-controller (verl-style) driver.

What moves
    One padded RL batch of B sequences x L tokens: ``input_ids`` and ``attention_mask``
    (int64), ``old_log_probs`` and ``advantages`` (float32), all full width L as padded
    batches are, plus one ``ground_truth`` string per sample. Per-sample token lengths are
    long-tailed (seeded lognormal around L/8, clipped to [L/16, L]); they set the attention
    mask and drive the planner's balancing. The batch goes through three consecutive stage
    transitions on N workers:

    1. DP(N) -> DP(N)          the same layout;
    2. DP(N) -> Layout(N, 2)   TP pairs: both members need their replica's samples;
    3. Layout(N, 2) -> DP(N)   back.

Modes
    ``coordinator``: N spawned processes form one gloo group on 127.0.0.1. Each builds its
    own B/N rows (a contiguous block of sample ids, as a rollout produces them); no driver
    is in the data path. It calls ``reshard`` for each transition: ``balance="none"`` for
    1 (local cache: zero payload bytes), ``"kk"`` with the trainer's 2% tolerance for 2
    and 3. Time: the three calls after a barrier, max over ranks. Bytes: the busiest
    rank's payload plus metadata, sent plus received (``TransferStats``).

    ``centralized-pickle`` / ``centralized-zerocopy``: N Ray actors hold the rows. For
    every transition the Ray driver ``ray.get``s each source shard, concatenates,
    cuts equal-count chunks for the destination layout (a TP pair gets the same chunk on
    both members; back to DP it reads one member per pair) and sends each chunk with
    ``actor.receive.remote(chunk)``, waiting for all: verl's DP_COMPUTE_PROTO data path,
    which also goes through the driver when the layout does not change. Shards travel as
    dicts of torch tensors (pickled by Ray) or of numpy arrays (Ray's zero-copy path).
    Time: the three transitions, in the driver. Bytes: what the driver received plus
    sent. Each measurement runs in a fresh driver subprocess, so its peak RSS (VmHWM) is
    its own and not an earlier mode's.

    Every mode runs one untimed warm-up round (process start-up, first connections),
    then ``--repeats`` timed rounds from the same initial placement; the median is
    reported. A token-imbalance section compares ``karmarkar_karp`` with
    ``contiguous_split`` (max/mean tokens per rank) on 1024 long-tailed lengths.

Both data paths use shared memory on one host (Ray's object store; the coordinator's
reused /dev/shm slots). What grows with the cluster is the driver's bytes and memory
(and, on real nodes, its network link): ``--cluster`` measures that link.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from distflow.coordinator.layout import Layout
from distflow.coordinator.planner import contiguous_split, imbalance, karmarkar_karp

MODES = ("coordinator", "centralized-pickle", "centralized-zerocopy")
TRANSITIONS = ("DP->DP", "DP->TP2", "TP2->DP")
FIELD_DTYPES = {"input_ids": torch.int64, "attention_mask": torch.int64,
                "old_log_probs": torch.float32, "advantages": torch.float32}
SEED = 0
VOCAB = 32_000
WARMUP_ROUNDS = 1
IMBALANCE_SAMPLES, IMBALANCE_KS = 1024, (2, 4, 8)
# The trainer's value (stages.stage_reshard): keep data in place unless balancing gains
# more than 2%, so TP2->DP does not reshuffle everything for a negligible gain.
TOLERANCE = 0.02
TIMEOUT_S = 900  # one measurement, generous for N=8 on 2 shared cores
# Ray's unix sockets live under <temp>/session_*/sockets/ and must fit in 107 bytes.
_MAX_RAY_TEMP_LEN = 44


@dataclass(frozen=True)
class Spec:
    """One measurement's size."""

    num_workers: int
    batch: int
    seq_len: int
    repeats: int

    @property
    def batch_bytes(self) -> int:
        """Tensor bytes of the whole batch (strings not counted)."""
        per_token = sum(torch.empty(0, dtype=d).element_size() for d in FIELD_DTYPES.values())
        return self.batch * self.seq_len * per_token


# ---------------------------------------------------------------------------------
# The batch


def sample_lengths(n: int, seq_len: int, seed: int = SEED) -> np.ndarray:
    """Long-tailed token counts: lognormal around L/8, clipped to [L/16, L]."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=np.log(seq_len / 8), sigma=1.0, size=n)
    return np.clip(np.rint(raw), max(1, seq_len // 16), seq_len).astype(np.int64)


def shard_ids(rank: int, spec: Spec) -> list[int]:
    """Sample ids `rank` holds at the start: a contiguous block, as a rollout leaves them."""
    return contiguous_split([0] * spec.batch, spec.num_workers)[rank]


def make_shard(rank: int, spec: Spec) -> tuple[dict[str, torch.Tensor], list[str], list[int], list[int]]:
    """This rank's rows, built locally: (tensors, ground truths, sample ids, token lengths)."""
    ids = shard_ids(rank, spec)
    lengths = sample_lengths(spec.batch, spec.seq_len)[ids]
    gen = torch.Generator().manual_seed(SEED * 1009 + rank)
    n, width = len(ids), spec.seq_len
    mask = (torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]).to(torch.int64)
    tensors = {"input_ids": torch.randint(VOCAB, (n, width), generator=gen) * mask,
               "attention_mask": mask,
               "old_log_probs": -5.0 * torch.rand(n, width, generator=gen) * mask,
               # GRPO: one advantage per sequence, broadcast over its tokens
               "advantages": torch.randn(n, 1, generator=gen) * mask}
    assert {k: v.dtype for k, v in tensors.items()} == FIELD_DTYPES
    return tensors, [str(s * 37 % 9973) for s in ids], ids, lengths.tolist()


def _record(mode: str, spec: Spec, laps: list[list[float]], busiest: int,
            peak_rss: int | None, **extra: Any) -> dict[str, Any]:
    """One JSON record; `laps` holds each timed round's per-transition seconds."""
    return {"mode": mode, "num_workers": spec.num_workers, "batch": spec.batch,
            "seq_len": spec.seq_len, "seconds": statistics.median(sum(lap) for lap in laps),
            "busiest_process_bytes": busiest, "driver_peak_rss_bytes": peak_rss,
            "batch_bytes": spec.batch_bytes, "where": "host", "repeats": spec.repeats,
            "transition_seconds": dict(zip(TRANSITIONS, (statistics.median(c) for c in zip(*laps)))),
            **extra}


# ---------------------------------------------------------------------------------
# Mode (a): the Data Coordinator


def _coordinator_rounds(rank: int, spec: Spec) -> dict[str, Any]:
    """Warm-up plus timed rounds of the three reshards on this rank; maxima over ranks."""
    import torch.distributed as dist

    from distflow.coordinator.executor import TransferStats, reshard
    from distflow.data.batch import Batch

    tensors, ground_truth, ids, _ = make_shard(rank, spec)
    start_batch = Batch(tensors, {"ground_truth": ground_truth})
    length_of = sample_lengths(spec.batch, spec.seq_len).tolist()
    dp, tp = Layout(spec.num_workers), Layout(spec.num_workers, tp_size=2)
    steps = [(dp, dp, "none"), (dp, tp, "kk"), (tp, dp, "kk")]
    laps: list[list[float]] = []
    moved, rows = 0, 0
    row_bytes = spec.batch_bytes // spec.batch
    sizes: list[list[int]] = []  # per transition: payload bytes this rank sent to each peer
    for rnd in range(WARMUP_ROUNDS + spec.repeats):
        stats = TransferStats()
        batch, batch_ids, marks, sizes = start_batch, ids, [], []
        dist.barrier()
        start = time.perf_counter()
        for src, dst, balance in steps:
            batch, batch_ids, plan = reshard(batch, batch_ids, [length_of[s] for s in batch_ids], src, dst,
                                             balance=balance, tolerance=TOLERANCE, stats=stats)
            marks.append(time.perf_counter())
            sizes.append([row_bytes * sum(m.dst == p for m in plan.sends(rank)) for p in range(spec.num_workers)])
        if rnd >= WARMUP_ROUNDS:
            laps.append([b - a for a, b in zip([start] + marks, marks)])
            moved = stats.payload_sent + stats.payload_received + stats.meta_sent + stats.meta_received
            rows = len(batch_ids)
    raw = _raw_transport_seconds(sizes, spec)
    # Max over ranks: the slowest rank sets the stage time, the busiest sets the bytes.
    totals = torch.tensor([[sum(lap)] + lap for lap in laps], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    busiest = torch.tensor([moved], dtype=torch.int64)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    held = torch.tensor([rows], dtype=torch.int64)
    dist.all_reduce(held)  # every sample must end on exactly one rank
    return {"laps": totals[:, 1:].tolist(), "busiest": int(busiest), "rows": int(held), "raw": raw}


def _raw_transport_seconds(sizes: list[list[int]], spec: Spec) -> dict[str, float]:
    """The transport's own time for the coordinator's payload: the same bytes per peer
    pair (rows times their tensor bytes; no planning, packing, headers or copies), three
    transitions per round, the same rounds as the coordinator, two ways: one plain gloo
    `all_to_all_single` per transition, and plain `isend`/`irecv` to every peer at once
    (what the coordinator's wire path does). Median of the timed rounds, max over ranks."""
    import torch.distributed as dist

    world = spec.num_workers
    recv_sizes = torch.empty(len(sizes), world, dtype=torch.int64)
    dist.all_to_all_single(recv_sizes.view(-1), torch.tensor(sizes, dtype=torch.int64).t().contiguous().view(-1))
    recv_sizes = recv_sizes.view(world, len(sizes)).t().tolist()
    moving = torch.tensor([sum(out) for out in sizes], dtype=torch.int64)
    dist.all_reduce(moving)  # a transition in which no rank sends anything has no exchange
    send = [torch.ones(sum(out), dtype=torch.uint8) for out in sizes]
    recv = [torch.empty(sum(inn), dtype=torch.uint8) for inn in recv_sizes]
    rank = dist.get_rank()

    def alltoall(out, inn, sb, rb) -> None:
        dist.all_to_all_single(rb, sb, inn, out)

    def p2p(out, inn, sb, rb) -> None:
        works = [dist.irecv(chunk, src=p) for p, chunk in enumerate(rb.split(inn)) if inn[p] and p != rank]
        works += [dist.isend(chunk, dst=p) for p, chunk in enumerate(sb.split(out)) if out[p] and p != rank]
        for work in works:
            work.wait()

    took = []
    for exchange in (alltoall, p2p):
        rounds = []
        for rnd in range(WARMUP_ROUNDS + spec.repeats):
            dist.barrier()
            start = time.perf_counter()
            for out, inn, sb, rb, active in zip(sizes, recv_sizes, send, recv, moving.tolist()):
                if active:
                    exchange(out, inn, sb, rb)
            if rnd >= WARMUP_ROUNDS:
                rounds.append(time.perf_counter() - start)
        took.append(statistics.median(rounds))
    took = torch.tensor(took, dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return {"raw_alltoall_seconds": float(took[0]), "raw_p2p_seconds": float(took[1])}


def _coordinator_entry(rank: int, spec: Spec, port: int, results: Any) -> None:
    """A spawned coordinator process: join the gloo group, measure, report, leave."""
    import torch.distributed as dist

    from distflow.runtime.process_group import init_process_group

    try:
        init_process_group(rank, spec.num_workers, "127.0.0.1", port, "cpu", TIMEOUT_S, threads=1)
        results.put((rank, _coordinator_rounds(rank, spec), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect_ranks(results: Any, procs: list[Any]) -> dict[int, Any]:
    """Every rank's report; fails fast when a rank dies or reports an error."""
    deadline = time.monotonic() + TIMEOUT_S
    got: dict[int, Any] = {}
    while len(got) < len(procs):
        try:
            rank, value, error = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"coordinator rank {dead[0]} exited with code "
                                   f"{procs[dead[0]].exitcode} before reporting") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator ranks {sorted(set(range(len(procs))) - set(got))} "
                                   f"did not report within {TIMEOUT_S} s") from None
            continue
        if error:
            raise RuntimeError(f"coordinator rank {rank} failed:\n{error}")
        got[rank] = value
    return got


def _stop_processes(procs: list[Any], grace_s: float = 10.0) -> None:
    """Join our own children; kill (by their PID) any still alive after the grace time."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_coordinator(spec: Spec) -> dict[str, Any]:
    """Mode (a) on `spec.num_workers` fresh processes."""
    import torch.multiprocessing as mp

    from distflow.runtime.process_group import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_coordinator_entry, args=(r, spec, port, results), daemon=True)
             for r in range(spec.num_workers)]
    try:
        for p in procs:
            p.start()
        report = _collect_ranks(results, procs)[0]
    finally:
        _stop_processes(procs)
        results.close()
    if report["rows"] != spec.batch:
        raise RuntimeError(f"coordinator ended with {report['rows']} rows in all, expected {spec.batch}")
    return _record("coordinator", spec, report["laps"], report["busiest"], None, **report["raw"])


# ---------------------------------------------------------------------------------
# Modes (b) and (c): a single-controller driver in the data path


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
    destination group, send it to each member, wait. Returns driver bytes in + out."""
    parts = ray.get([a.shard.remote() for a in sources], timeout=TIMEOUT_S)
    received = sum(_shard_bytes(p) for p in parts)
    chunks = _chunks(_concat(parts, as_numpy), len(dests), as_numpy)
    del parts  # release the object-store copies before the next stage
    acks = [a.receive.remote(chunk) for group, chunk in zip(dests, chunks) for a in group]
    sent = sum(_shard_bytes(chunk) * len(group) for group, chunk in zip(dests, chunks))
    ray.get(acks, timeout=TIMEOUT_S)
    return received + sent


def _proc_status(key: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _centralized_rounds(ray: Any, mode: str, spec: Spec) -> dict[str, Any]:
    """Warm-up plus timed rounds of the three driver-mediated transitions."""
    # Imported by name so Ray pickles the actor class by reference, also when this file
    # runs as __main__ (the child driver is started with `python -m`).
    from distflow.benchmarks.dataplane import _Holder as holder_cls

    as_numpy = mode == "centralized-zerocopy"
    remote_cls = ray.remote(num_cpus=1)(holder_cls)
    actors = [remote_cls.remote(r, asdict(spec), as_numpy) for r in range(spec.num_workers)]
    ray.get([a.rows.remote() for a in actors], timeout=TIMEOUT_S)
    rss_before = _proc_status("VmRSS")
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
            total += _transition(ray, sources, dests, as_numpy)
            marks.append(time.perf_counter())
        rows = sum(ray.get([a.rows.remote() for a in actors], timeout=TIMEOUT_S))
        if rows != spec.batch:
            raise RuntimeError(f"{mode} ended with {rows} rows in all, expected {spec.batch}")
        if rnd >= WARMUP_ROUNDS:
            laps.append([b - a for a, b in zip(marks, marks[1:])])
            moved = total
    return _record(mode, spec, laps, moved, _proc_status("VmHWM"), driver_rss_before_bytes=rss_before)


def _centralized_child(mode: str, spec: Spec, ray_temp: str, out_path: str) -> int:
    """The fresh driver process of one centralized measurement (`--_child`)."""
    # A SIGTERM from the parent (timeout) unwinds through `finally`, so Ray is shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from distflow.runtime.process_group import WORKER_ENV

    # "-pickle" means Ray's default tensor path; pin it in case the environment opts in
    # to Ray's zero-copy torch serializer. The local Ray instance and its workers inherit
    # this environment (a runtime_env would defeat Ray's prestarted workers: slower start).
    os.environ.update({**WORKER_ENV, "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "0"})
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
           "--repeats", str(spec.repeats), "--_ray-temp", tmp, "--_out", str(out)]
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


# ---------------------------------------------------------------------------------
# Token imbalance of the balancer against the naive split


def imbalance_records(seq_len: int) -> list[dict[str, Any]]:
    """max/mean tokens per rank for Karmarkar-Karp and contiguous chunks, k in 2, 4, 8."""
    weights = sample_lengths(IMBALANCE_SAMPLES, seq_len).tolist()
    records = []
    for k in IMBALANCE_KS:
        for mode, parts in (("imbalance-kk", karmarkar_karp(weights, k)),
                            ("imbalance-contiguous", contiguous_split(weights, k))):
            records.append({"mode": mode, "num_workers": k, "batch": IMBALANCE_SAMPLES,
                            "seq_len": seq_len, "imbalance": imbalance(weights, parts), "where": "host"})
    return records


# ---------------------------------------------------------------------------------
# Reporting


MAIN_HEADERS = ["N", "mode", "seconds", "x coordinator", "s per transition (DP->DP / DP->TP2 / TP2->DP)",
                "busiest process MiB", "busiest / batch", "driver peak RSS MiB", "plain all_to_all s",
                "plain isend/irecv s"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """One row per measurement; centralized seconds also as a ratio over the coordinator's."""
    coordinator = {r["num_workers"]: r["seconds"] for r in records if r["mode"] == "coordinator"}
    rows = []
    for r in records:
        base = coordinator.get(r["num_workers"])
        rss = r["driver_peak_rss_bytes"]
        rows.append([str(r["num_workers"]), r["mode"], f"{r['seconds']:.4f}",
                     f"{r['seconds'] / base:.2f}" if base else "-",
                     " / ".join(f"{s:.4f}" for s in r["transition_seconds"].values()),
                     _mib(r["busiest_process_bytes"]), f"{r['busiest_process_bytes'] / r['batch_bytes']:.2f}",
                     "-" if rss is None else _mib(rss),
                     *(f"{r[k]:.4f}" if r.get(k) is not None else "-"
                       for k in ("raw_alltoall_seconds", "raw_p2p_seconds"))])
    return rows


def imbalance_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    by_k: dict[int, dict[str, float]] = {}
    for r in records:
        by_k.setdefault(r["num_workers"], {})[r["mode"]] = r["imbalance"]
    return [[str(k), f"{v['imbalance-kk']:.4f}", f"{v['imbalance-contiguous']:.4f}"] for k, v in by_k.items()]


IMBALANCE_HEADERS = ["k", "Karmarkar-Karp max/mean", "contiguous max/mean"]


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [headers, *rows])


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def machine_info() -> dict[str, str]:
    """What the numbers were measured on."""
    import ray

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    return {"nproc": str(len(os.sched_getaffinity(0))), "cpu model": model,
            "memory": f"{_proc_meminfo_gib():.1f} GiB", "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__, "numpy": np.__version__,
            "os": platform.platform(), "niceness": str(os.nice(0))}


def _proc_meminfo_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


CAVEATS = """\
- **Single host.** Both data paths use shared memory here: Ray's object store for the
  centralized modes, and the coordinator's same-host transport (`/dev/shm` files, only
  sizes through gloo). The coordinator's real advantage is that no process carries the
  whole batch: on a cluster the driver's network link carries `busiest / batch` times
  the batch per step. That link is measured on an emulated cluster in a later issue;
  here only bytes, driver memory and single-host time are.
- **Few cores.** All N workers (and, for the centralized modes, the driver and Ray's own
  processes) share the cores listed below, so larger N adds CPU contention to both
  modes; the load average shows what else was running. With more ranks than cores the
  coordinator's rank 0 plans alone and broadcasts the plan; with a core per rank every
  rank runs the same pure planner itself.
- **Plain all_to_all, plain isend/irecv.** On the coordinator's row: the same payload
  bytes per rank pair through one plain gloo `all_to_all_single` per transition, and
  through plain `isend`/`irecv` to every peer at once (the coordinator's own wire path),
  in the same processes after the timed rounds (no planning, packing, headers or copies;
  127.0.0.1 sockets, not shared memory): what the bytes alone cost through the
  collective backend.
- **Bytes.** Coordinator: the busiest rank's payload plus metadata (lengths all-gather,
  size exchange, JSON headers with the ground-truth strings), sent plus received, over
  the three transitions. Centralized: tensor/array bytes plus UTF-8 string bytes the
  driver received and sent (Ray's framing not counted). `batch` is the tensor bytes of
  the whole batch.
- **Placement.** The coordinator balances tokens (Karmarkar-Karp, 2% tolerance) while the
  centralized path cuts equal-count chunks, so the two end with different placements."""


def results_markdown(records: list[dict[str, Any]], imbalance_recs: list[dict[str, Any]],
                     command: str, run: dict[str, Any]) -> str:
    """The RESULTS file: what was measured, the tables, the command, the machine."""
    spec = Spec(1, run["batch"], run["seq_len"], run["repeats"])
    machine = "\n".join(f"- {k}: {v}" for k, v in machine_info().items())
    return f"""# Data-plane benchmark: Data Coordinator vs single-controller driver

Generated by `distflow.benchmarks.dataplane`; its module docstring has the method.

## What was measured

- **Batch:** {spec.batch} sequences x {spec.seq_len} tokens, {_mib(spec.batch_bytes)} MiB of tensors
  (`input_ids`, `attention_mask` int64; `old_log_probs`, `advantages` float32; full width,
  as padded batches are) plus one `ground_truth` string per sample. Token lengths are
  long-tailed (lognormal around L/8, clipped to [L/16, L], seed {SEED}) and drive the planner.
- **Three stage transitions on N workers:** DP(N) -> DP(N), DP(N) -> TP pairs
  (`Layout(N, tp_size=2)`), and back to DP(N).
- **coordinator:** N processes in one gloo group on 127.0.0.1, each building its own B/N
  rows; `balance="none"` for the same-layout step (local cache: no payload), Karmarkar-Karp
  with the trainer's 2% tolerance for the other two. Time = the three `reshard` calls
  after a barrier, max over ranks.
- **centralized-pickle / -zerocopy:** N Ray actors hold the rows; per transition the Ray
  driver gathers every shard, concatenates, splits and dispatches (verl's
  DP_COMPUTE_PROTO path), shards as torch tensors (pickled) or numpy arrays (zero-copy).
  Time = the three transitions in the driver, a fresh driver process per measurement,
  whose peak RSS (VmHWM) is `driver peak RSS`.
- `seconds`: median over {spec.repeats} timed round(s), after {WARMUP_ROUNDS} untimed warm-up round.
  `x coordinator`: seconds over the coordinator's at the same N (above 1: the
  coordinator is faster). `busiest / batch`: the busiest process's bytes over the batch's.

## Command

```
{command}
```

- settings: workers {run['workers']}, batch {spec.batch}, seq-len {spec.seq_len}, repeats {spec.repeats}
- modes: {', '.join(run['modes'])}
- whole run: {run['wall_s']:.0f} s; load average (1 min) at start / end: {run['load'][0]:.2f} / {run['load'][1]:.2f}

## Results

{markdown_table(MAIN_HEADERS, main_rows(records))}

## Token imbalance ({IMBALANCE_SAMPLES} long-tailed lengths, L={spec.seq_len})

Largest rank's tokens over the mean (1.0 is perfect balance).

{markdown_table(IMBALANCE_HEADERS, imbalance_rows(imbalance_recs))}

## Machine

{machine}

## Caveats

{CAVEATS}
"""


# ---------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distflow bench dataplane", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="N values (even)")
    p.add_argument("--batch", type=int, default=1024, help="sequences in the batch")
    p.add_argument("--seq-len", type=int, default=2048, help="padded width L")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--json", help="append one JSON record per measurement to this file")
    p.add_argument("--results-md", help="write a markdown report (tables, command, machine)")
    p.add_argument("--quick", action="store_true", help="workers [2], batch 64, seq-len 128, repeats 1")
    p.add_argument("--cluster", action="store_true",
                   help="run on the emulated cluster instead (root; see `--cluster --help`)")
    # Internal: one centralized measurement in a fresh driver process.
    p.add_argument("--_child", choices=MODES[1:], help=argparse.SUPPRESS)
    p.add_argument("--_ray-temp", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    return p


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for n in args.workers:
        if n < 2 or n % 2:
            parser.error(f"--workers {n}: each N must be even and >= 2 (the TP layout has pairs)")
        if args.batch < n:
            parser.error(f"--batch {args.batch} is smaller than N={n}; every rank needs a sample")
    if args.seq_len < 16 or args.repeats < 1:
        parser.error("--seq-len must be >= 16 and --repeats >= 1")


def _emit(out: IO[str] | None, record: dict[str, Any]) -> None:
    if out is not None:
        out.write(json.dumps(record) + "\n")
        out.flush()  # records survive a later measurement's failure


def _measure_all(args: argparse.Namespace, out: IO[str] | None) -> list[dict[str, Any]]:
    records = []
    for n in args.workers:
        spec = Spec(n, args.batch, args.seq_len, args.repeats)
        for mode in args.modes:
            print(f"dataplane: N={n} {mode} ...", file=sys.stderr, flush=True)
            record = run_coordinator(spec) if mode == "coordinator" else run_centralized(mode, spec)
            records.append(record)
            _emit(out, record)
    return records


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--cluster" in argv:  # the emulated cluster: distflow/benchmarks/dataplane_cluster.py
        from distflow.benchmarks.dataplane_cluster import main as cluster_main

        return cluster_main([a for a in argv if a != "--cluster"])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._child:
        spec = Spec(args.workers[0], args.batch, args.seq_len, args.repeats)
        return _centralized_child(args._child, spec, args._ray_temp, args._out)
    if args.quick:
        args.workers, args.batch, args.seq_len, args.repeats = [2], 64, 128, 1
    _check_args(parser, args)
    command = "python -m distflow.benchmarks.dataplane " + shlex.join(argv)
    started, load_start = time.monotonic(), os.getloadavg()[0]
    imbalance_recs = imbalance_records(args.seq_len)
    out = open(args.json, "w") if args.json else None
    try:
        for record in imbalance_recs:
            _emit(out, record)
        records = _measure_all(args, out)
    except (RuntimeError, TimeoutError) as e:
        print(f"dataplane: error: {e}", file=sys.stderr)
        return 1
    finally:
        if out is not None:
            out.close()
    print(f"B={args.batch} x L={args.seq_len}, batch {_mib(Spec(1, args.batch, args.seq_len, 1).batch_bytes)} MiB, "
          f"median of {args.repeats}; x coordinator = seconds / coordinator seconds at the same N")
    print(text_table(MAIN_HEADERS, main_rows(records)))
    print(f"\ntoken imbalance, {IMBALANCE_SAMPLES} long-tailed lengths (max/mean tokens per rank)")
    print(text_table(IMBALANCE_HEADERS, imbalance_rows(imbalance_recs)))
    if args.results_md:
        run = {"workers": args.workers, "batch": args.batch, "seq_len": args.seq_len, "repeats": args.repeats,
               "modes": args.modes, "wall_s": time.monotonic() - started,
               "load": (load_start, os.getloadavg()[0])}
        Path(args.results_md).write_text(results_markdown(records, imbalance_recs, command, run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
