"""The data-plane benchmark's report: the text and markdown tables, the machine it ran on,
the caveats, and the RESULTS markdown file (`--results-md`).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distflow.benchmarks.dataplane_common import (IMBALANCE_SAMPLES, PLANNING_ROWS_PER_RANK, SEED, WARMUP_ROUNDS,
                                                  Spec)

MAIN_HEADERS = ["N", "mode", "seconds", "x coordinator", "s per transition (DP->DP / DP->TP2 / TP2->DP)",
                "busiest process MiB", "busiest / batch", "driver peak RSS MiB", "plain all_to_all s",
                "plain isend/irecv s", "plain shm copies s"]


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
                       for k in ("raw_alltoall_seconds", "raw_p2p_seconds", "shm_floor_seconds"))])
    return rows


def floor_lines(records: list[dict[str, Any]]) -> list[str]:
    """Per N: the coordinator's seconds over the plain shared-memory copies of the same
    bytes, and where its time goes (per phase, the slowest rank's median)."""
    lines = []
    for r in records:
        if r["mode"] != "coordinator" or not r.get("shm_floor_seconds"):
            continue
        phases = ", ".join(f"{k} {v:.4f}" for k, v in sorted(r.get("phase_seconds", {}).items(),
                                                            key=lambda kv: -kv[1]))
        lines.append(f"N={r['num_workers']}: coordinator {r['seconds'] / r['shm_floor_seconds']:.2f}x the plain "
                     f"shared-memory copies ({r['shm_floor_seconds']:.4f} s); its phases (s, slowest rank): {phases}")
        if r.get("phase_cpu_seconds"):
            cpu = ", ".join(f"{k} {v:.4f}" for k, v in sorted(r["phase_cpu_seconds"].items(), key=lambda kv: -kv[1]))
            lines.append(f"N={r['num_workers']}: its phases' CPU (s per rank, the calling thread's, waits "
                         f"excluded, mean over ranks): {cpu}")
        if r.get("shm_fresh_files_seconds"):
            lines.append(f"N={r['num_workers']}: the same copies through files made per transfer take "
                         f"{r['shm_fresh_files_seconds']:.4f} s: the coordinator is "
                         f"{r['seconds'] / r['shm_fresh_files_seconds']:.2f}x that")
        if r.get("cpu_seconds_per_rank") and r.get("shm_floor_cpu_seconds"):
            lines.append(_cpu_line(r))
        if r.get("one_column_seconds"):
            lines.append(f"N={r['num_workers']}: the fixed costs: the same reshards of one-column rows (the same "
                         f"plans, moves and synchronisations, almost no bytes) take {r['one_column_seconds']:.4f} s, "
                         f"{r['one_column_seconds'] / r['shm_floor_seconds']:.2f}x the plain copies, with "
                         f"{r['one_column_cpu_seconds']:.4f} s of CPU per rank; one gloo barrier takes "
                         f"{r['barrier_seconds']:.4f} s")
    return lines


def _cpu_line(r: dict[str, Any]) -> str:
    """A round's CPU seconds per rank (its gloo threads included), and where ranks
    outnumber cores, the CPU seconds each core has to run per round."""
    n, cores = r["num_workers"], r["cores"]
    line = (f"N={n}: CPU per rank and round: coordinator {r['cpu_seconds_per_rank']:.4f} s, the plain copies "
            f"{r['shm_floor_cpu_seconds']:.4f} s")
    if cores < n:
        line += (f"; {n} ranks on {cores} cores: {n * r['cpu_seconds_per_rank'] / cores:.4f} s and "
                 f"{n * r['shm_floor_cpu_seconds'] / cores:.4f} s of CPU per core and round")
    return line


def verl_lines(records: list[dict[str, Any]]) -> list[str]:
    """Against verl's own dispatch, per N: the ratios in this run, and whether every
    actor ended with the same rows (digests) under verl's path as under our imitation."""
    by = {(r["num_workers"], r["mode"]): r for r in records}
    lines = []
    for n in sorted({r["num_workers"] for r in records}):
        numpy_path, default = by.get((n, "centralized-verl-numpy")), by.get((n, "centralized-verl"))
        ours, coordinator = by.get((n, "centralized-zerocopy")), by.get((n, "coordinator"))
        if numpy_path is None and default is None:
            continue
        parts = []
        for name, verl in (("numpy path", numpy_path), ("default path", default)):
            if verl is not None and coordinator is not None:
                parts.append(f"coordinator {verl['seconds'] / coordinator['seconds']:.2f}x faster than verl's {name}")
        if ours is not None and numpy_path is not None:
            parts.append(f"our zero-copy imitation takes {ours['seconds'] / numpy_path['seconds']:.2f}x verl's numpy "
                         "path's time")
            same = all(v.get("shard_digests") == ours["shard_digests"] for v in (numpy_path, default) if v is not None)
            parts.append("every actor's rows equal to the imitation's (digests)" if same
                         else "ROWS DIFFER from the imitation's")
        lines.append(f"N={n}: " + "; ".join(parts))
    return lines


def imbalance_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    by_k: dict[int, dict[str, float]] = {}
    for r in records:
        by_k.setdefault(r["num_workers"], {})[r["mode"]] = r["imbalance"]
    return [[str(k), f"{v['imbalance-kk']:.4f}", f"{v['imbalance-contiguous']:.4f}"] for k, v in by_k.items()]


IMBALANCE_HEADERS = ["k", "Karmarkar-Karp max/mean", "contiguous max/mean"]


def planning_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    return [[str(r["num_workers"]), str(r["batch"]), f"{r['cpu_seconds']:.4f}",
             " / ".join(f"{t:.4f}" for t in r["cpu_seconds_per_transition"])] for r in records]


PLANNING_HEADERS = ["N", "samples", "CPU s per round", "CPU s per transition (DP->DP / DP->TP2 / TP2->DP)"]


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
  modes; the load average shows what else was running. Every coordinator rank runs
  the same pure planner itself, so no plan is sent.
- **Plain all_to_all, plain isend/irecv.** On the coordinator's row: the same payload
  bytes per rank pair through one plain gloo `all_to_all_single` per transition, and
  through plain `isend`/`irecv` to every peer at once (the coordinator's own wire path),
  in the same processes after the timed rounds (no planning, packing, headers or copies;
  127.0.0.1 sockets, not shared memory): what the bytes alone cost through the
  collective backend. `plain shm copies`: the same bytes through /dev/shm, two plain
  copies and a barrier per transition: what they cost on one host at the least.
- **Bytes.** Coordinator: the busiest rank's payload plus metadata (lengths all-gather,
  size exchange, JSON headers with the ground-truth strings), sent plus received, over
  the three transitions. Centralized: tensor/array bytes plus UTF-8 string bytes the
  driver received and sent (Ray's framing not counted). `batch` is the tensor bytes of
  the whole batch.
- **Placement.** The coordinator balances tokens (Karmarkar-Karp, 2% tolerance) while the
  centralized path cuts equal-count chunks, so the two end with different placements."""


def _section(title: str, intro: str, lines: list[str]) -> str:
    """A markdown section of bullet lines; nothing when there are none."""
    return f"## {title}\n\n{intro}\n\n" + "\n".join(f"- {line}" for line in lines) + "\n\n" if lines else ""


def _floor_section(records: list[dict[str, Any]]) -> str:
    return _section("Against shared memory's floor",
                    "`plain shm copies`: the coordinator's payload bytes per rank pair written into mapped /dev/shm "
                    "files and read out by the peer, one barrier per transition, files and buffers made and touched "
                    "beforehand. Files made per transfer: the same copies, each transfer making its file and the "
                    "receiver its buffer, as a copy that keeps nothing between transfers does (page faults and "
                    "allocation included). Phases: `PhaseTimes` in "
                    "`distflow/coordinator/executor.py`.", floor_lines(records))


def _verl_section(records: list[dict[str, Any]]) -> str:
    return _section("Against verl's own dispatch",
                    "`centralized-verl` and `centralized-verl-numpy` run verl's DataProto code (concat, chunk, one "
                    "object-store put per chunk) with its default (torch.save) and numpy serialisation, on the same "
                    "actors and batch.", verl_lines(records))


def results_markdown(records: list[dict[str, Any]], imbalance_recs: list[dict[str, Any]],
                     planning_recs: list[dict[str, Any]], command: str, run: dict[str, Any]) -> str:
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
  after a barrier, the slowest rank's, median over rounds (the references alike).
- **centralized-pickle / -zerocopy:** N Ray actors hold the rows; per transition the Ray
  driver gathers every shard, concatenates, splits and dispatches (verl's
  DP_COMPUTE_PROTO path), shards as torch tensors (pickled) or numpy arrays (zero-copy).
  Time = the three transitions in the driver, a fresh driver process per measurement,
  whose peak RSS (VmHWM) is `driver peak RSS`.
- `seconds`: median over {spec.repeats} timed round(s), after {WARMUP_ROUNDS} untimed warm-up rounds.
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

{_floor_section(records)}{_verl_section(records)}## Token imbalance ({IMBALANCE_SAMPLES} long-tailed lengths, L={spec.seq_len})

Largest rank's tokens over the mean (1.0 is perfect balance).

{markdown_table(IMBALANCE_HEADERS, imbalance_rows(imbalance_recs))}

## Planning on every rank, at scale

Every rank computes the same plan itself, so what planning costs, every rank pays each
step. One rank's CPU seconds per round, in one process, for the three transitions above
at N ranks with {PLANNING_ROWS_PER_RANK} long-tailed samples each: decoding the all-gathered
(id, length) rows once, each plan, the `GlobalView` updates and its own sends and new
rows; the median of {spec.repeats} rounds (`planning_records` in
`distflow/benchmarks/dataplane.py`).

{markdown_table(PLANNING_HEADERS, planning_rows(planning_recs))}

## Machine

{machine}

## Caveats

{CAVEATS}
"""
