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
    and 3; one ``GlobalView`` for the three, as the trainer's placement keeps between the
    moves of a step, so only the first gathers the metadata. Time: the three calls after a barrier, the slowest rank's, median over rounds (every reference alike). Bytes: the busiest
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

    Every mode runs two untimed warm-up rounds (process start-up, first connections,
    the coordinator's two alternating shared-memory slots), then ``--repeats`` timed
    rounds from the same initial placement; the median is reported. A token-imbalance
    section compares ``karmarkar_karp`` with ``contiguous_split`` (max/mean tokens per
    rank) on 1024 long-tailed lengths.

Both data paths use shared memory on one host (Ray's object store; the coordinator's
reused /dev/shm slots). What grows with the cluster is the driver's bytes and memory
(and, on real nodes, its network link): ``--cluster`` measures that link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

from distflow.benchmarks.dataplane_centralized import _centralized_child, run_centralized
from distflow.benchmarks.dataplane_cluster import main as cluster_main
from distflow.benchmarks.dataplane_common import (BASELINE_MODES, IMBALANCE_KS, IMBALANCE_SAMPLES, MODES,
                                                  PLANNING_ROWS_PER_RANK, VERL_MODES, Spec,
                                                  refuse_verl_modes_without_verl, sample_lengths)
from distflow.benchmarks.dataplane_coordinator import TOLERANCE, run_coordinator
from distflow.benchmarks.dataplane_report import (IMBALANCE_HEADERS, MAIN_HEADERS, PLANNING_HEADERS, _mib,
                                                  floor_lines, imbalance_rows, main_rows, planning_rows,
                                                  results_markdown, text_table, verl_lines)
from distflow.benchmarks.records import command_line
from distflow.coordinator.executor import GlobalView
from distflow.coordinator.layout import Layout
from distflow.coordinator.partition import contiguous_split, imbalance, karmarkar_karp
from distflow.coordinator.planner import SampleTable, plan_samples


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
# Planning at scale: what every rank computes besides moving bytes


def planning_records(workers: list[int], seq_len: int, repeats: int) -> list[dict[str, Any]]:
    """Per N, with PLANNING_ROWS_PER_RANK long-tailed samples a rank, each rank a
    contiguous block: the CPU seconds one rank (rank 0) spends per round on what a
    reshard computes besides moving bytes, in this process, for the three transitions
    of the coordinator mode: decoding the all-gathered (id, length) rows once, each
    plan (`plan_samples`, as every rank runs it), the `GlobalView` updates, and its
    own sends and new rows. The median of `repeats` rounds after one untimed."""
    records = []
    for n in workers:
        batch = PLANNING_ROWS_PER_RANK * n
        lengths = sample_lengths(batch, seq_len)
        gathered = [np.stack([ids, lengths[ids]], axis=1) for ids in map(np.asarray, contiguous_split([0] * batch, n))]
        dp, tp = Layout(n), Layout(n, tp_size=2)
        steps = (("DP->DP", dp, dp, "none"), ("DP->TP2", dp, tp, "kk"), ("TP2->DP", tp, dp, "kk"))
        laps: list[list[float]] = []
        for _ in range(1 + repeats):
            lap, view = [], GlobalView()
            for name, src, dst, balance in steps:
                start = time.process_time()
                if view.samples is None:
                    view.samples = SampleTable.gathered(gathered)
                plan = plan_samples(src, dst, view.samples, balance=balance, tolerance=TOLERANCE)
                view.update(plan)
                plan.sends_by_peer(0), plan.samples_for(0)
                lap.append(time.process_time() - start)
            laps.append(lap)
        per_step = [statistics.median(lap[i] for lap in laps[1:]) for i in range(len(steps))]
        records.append({"mode": "planning", "num_workers": n, "batch": batch, "seq_len": seq_len,
                        "cpu_seconds": sum(per_step), "cpu_seconds_per_transition": per_step, "where": "host"})
    return records


# ---------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distflow bench dataplane", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="N values (even)")
    p.add_argument("--batch", type=int, default=1024, help="sequences in the batch")
    p.add_argument("--seq-len", type=int, default=2048, help="padded width L")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported")
    p.add_argument("--baseline", choices=("ours", "verl"), default="ours",
                   help="the single controller to compare with: our imitation (pickle and zero-copy), or verl's own "
                        "DataProto dispatch (its default and numpy paths, beside our zero-copy imitation; needs verl)")
    p.add_argument("--modes", nargs="+", choices=MODES + VERL_MODES, help="instead of --baseline's set")
    p.add_argument("--json", help="append one JSON record per measurement to this file")
    p.add_argument("--results-md", help="write a markdown report (tables, command, machine)")
    p.add_argument("--plan-workers", type=int, nargs="+", default=[8, 64, 512],
                   help=f"N values of the planning section ({PLANNING_ROWS_PER_RANK} samples a rank, in one process)")
    p.add_argument("--quick", action="store_true",
                   help="workers [2], batch 64, seq-len 128, repeats 1, plan-workers [8]")
    p.add_argument("--cluster", action="store_true",
                   help="run on the emulated cluster instead (root; see `--cluster --help`)")
    # Internal: one centralized measurement in a fresh driver process.
    p.add_argument("--_child", choices=MODES[1:] + VERL_MODES, help=argparse.SUPPRESS)
    p.add_argument("--_ray-temp", help=argparse.SUPPRESS)
    p.add_argument("--_image-patches", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    return p


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.modes = args.modes or list(BASELINE_MODES[args.baseline])
    refuse_verl_modes_without_verl(parser, args.modes)
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
        return cluster_main([a for a in argv if a != "--cluster"])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args._child:
        spec = Spec(args.workers[0], args.batch, args.seq_len, args.repeats, args._image_patches)
        return _centralized_child(args._child, spec, args._ray_temp, args._out)
    if args.quick:
        args.workers, args.batch, args.seq_len, args.repeats, args.plan_workers = [2], 64, 128, 1, [8]
    _check_args(parser, args)
    command = command_line("python -m distflow.benchmarks.dataplane", argv)
    started, load_start = time.monotonic(), os.getloadavg()[0]
    imbalance_recs = imbalance_records(args.seq_len)
    planning_recs = planning_records(args.plan_workers, args.seq_len, args.repeats)
    out = open(args.json, "w") if args.json else None
    try:
        for record in imbalance_recs + planning_recs:
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
    for line in floor_lines(records) + verl_lines(records):
        print(line)
    print(f"\ntoken imbalance, {IMBALANCE_SAMPLES} long-tailed lengths (max/mean tokens per rank)")
    print(text_table(IMBALANCE_HEADERS, imbalance_rows(imbalance_recs)))
    print(f"\nplanning on every rank, {PLANNING_ROWS_PER_RANK} samples a rank (one rank's CPU seconds per round)")
    print(text_table(PLANNING_HEADERS, planning_rows(planning_recs)))
    if args.results_md:
        run = {"workers": args.workers, "batch": args.batch, "seq_len": args.seq_len, "repeats": args.repeats,
               "modes": args.modes, "wall_s": time.monotonic() - started,
               "load": (load_start, os.getloadavg()[0])}
        Path(args.results_md).write_text(results_markdown(records, imbalance_recs, planning_recs, command, run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
