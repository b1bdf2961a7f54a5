"""Mode (a) of the data-plane benchmark: the Data Coordinator, no driver in the data path.

N spawned processes form one gloo group on 127.0.0.1, each builds its own rows and calls
`reshard` for the three transitions. After the timed rounds the same processes time the
same payload (the raw-transport references) through plain gloo `all_to_all_single`, plain
`isend`/`irecv`, and plain copies through /dev/shm: into prepared files (the one-host
floor) and into files made per transfer. They report the seconds per phase of the
coordinator's reshards (`PhaseTimes`). On the emulated cluster each host's worker runs
`_coordinator_rounds` (see `dataplane_cluster`).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import queue
import statistics
import time
import traceback
from typing import Any

import torch

from distflow.benchmarks.dataplane_common import (TIMEOUT_S, WARMUP_ROUNDS, Spec, _record, make_shard, proc_status,
                                                  token_lengths)
from distflow.coordinator.layout import Layout

# The trainer's value (stages.stage_reshard): keep data in place unless balancing gains
# more than 2%, so TP2->DP does not reshuffle everything for a negligible gain.
TOLERANCE = 0.02


def _coordinator_rounds(rank: int, spec: Spec, one_host: bool = True) -> dict[str, Any]:
    """Warm-up plus timed rounds of the three reshards on this rank; maxima over ranks.
    `one_host`: all ranks share /dev/shm, so its floor is measured too, and the fixed
    costs: the same reshards of the same samples (the same plans, moves and
    synchronisations) with every tensor field one column wide, and one gloo barrier."""
    import torch.distributed as dist

    from distflow.data.batch import Batch

    tensors, ground_truth, ids, _ = make_shard(rank, spec)
    length_of = token_lengths(spec).tolist()  # every sample's, as their holders would tell
    laps, cpu, phases, moved, rows, plans = _reshard_rounds(Batch(tensors, {"ground_truth": ground_truth}), ids,
                                                             length_of, spec)
    row_bytes = spec.batch_bytes // spec.batch
    # per transition: payload bytes this rank sent to each peer (outside the timed rounds)
    sizes = [[row_bytes * len(plan.sends_by_peer(rank).get(p, ())) for p in range(spec.num_workers)]
             for plan in plans]
    # the reshards' peak, before the references below allocate their own buffers
    peak = torch.tensor([proc_status("VmHWM")], dtype=torch.int64)
    raw = _raw_transport_seconds(sizes, spec)
    if one_host:
        raw["shm_floor_seconds"], raw["shm_floor_cpu_seconds"], raw["shm_fresh_files_seconds"] = \
            _shm_copy_times(sizes, spec)
        narrow = Batch({k: v[:, :1].contiguous() for k, v in tensors.items()}, {"ground_truth": ground_truth})
        fixed_laps, fixed_cpu = _reshard_rounds(narrow, ids, length_of, spec)[:2]
        raw["one_column_seconds"] = _slowest_rank_median([sum(lap) for lap in fixed_laps])
        raw["one_column_cpu_seconds"] = _mean_over_ranks(statistics.median(fixed_cpu))
        raw["barrier_seconds"] = _median_round_seconds(spec, dist.barrier)[0]
    names = sorted({k for t in phases for k in t})
    phase_s = torch.tensor([statistics.median(t.get(k, 0.0) for t in phases) for k in names], dtype=torch.float64)
    dist.all_reduce(phase_s, op=dist.ReduceOp.MAX)  # per phase, the slowest rank's median
    phase_cpu = torch.tensor([statistics.median(t.cpu.get(k, 0.0) for t in phases) for k in names],
                             dtype=torch.float64)
    dist.all_reduce(phase_cpu)  # per phase, the mean over ranks of each rank's median
    # Max over ranks: the slowest rank sets the stage time, the busiest sets the bytes. A round's time is
    # its slowest rank's (the three reshards from the barrier until the last rank is done), as for the
    # references; each transition's the slowest rank's of that transition (a breakdown: they need not add up)
    round_seconds = _slowest_per_round([sum(lap) for lap in laps])
    totals = torch.tensor(laps, dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    busiest = torch.tensor([moved], dtype=torch.int64)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
    held = torch.tensor([rows], dtype=torch.int64)
    dist.all_reduce(held)  # every sample must end on exactly one rank
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    cpu_s = torch.tensor([statistics.median(cpu)], dtype=torch.float64)
    dist.all_reduce(cpu_s)
    return {"laps": totals.tolist(), "rounds": round_seconds, "busiest": int(busiest), "rows": int(held), "raw": raw,
            "phases": dict(zip(names, phase_s.tolist())),
            "phase_cpu": dict(zip(names, (phase_cpu / spec.num_workers).tolist())), "peak_rss": int(peak),
            "cpu": float(cpu_s) / spec.num_workers}


def _reshard_rounds(start_batch, ids: list[int], length_of: list[int], spec: Spec):
    """The three reshards from `start_batch` (this rank's rows `ids`), warm-up rounds
    untimed: per timed round its seconds per transition, CPU seconds (this process's,
    its gloo threads included) and `PhaseTimes`; then the last round's bytes moved, rows
    held at the end, and plans."""
    import torch.distributed as dist

    from distflow.coordinator.executor import GlobalView, PhaseTimes, TransferStats, reshard

    dp, tp = Layout(spec.num_workers), Layout(spec.num_workers, tp_size=2)
    steps = [(dp, dp, "none"), (dp, tp, "kk"), (tp, dp, "kk")]
    laps: list[list[float]] = []
    cpu: list[float] = []
    phases: list[PhaseTimes] = []
    for rnd in range(WARMUP_ROUNDS + spec.repeats):
        stats, times, view = TransferStats(), PhaseTimes(), GlobalView()  # one step's rows
        batch, batch_ids, marks, plans = start_batch, ids, [], []
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for src, dst, balance in steps:
            batch, batch_ids, plan = reshard(batch, batch_ids, [length_of[s] for s in batch_ids], src, dst,
                                             balance=balance, tolerance=TOLERANCE, stats=stats, times=times,
                                             view=view)
            marks.append(time.perf_counter())
            plans.append(plan)
        if rnd >= WARMUP_ROUNDS:
            cpu.append(time.process_time() - start_cpu)
            laps.append([b - a for a, b in zip([start] + marks, marks)])
            phases.append(times)
    moved = stats.payload_sent + stats.payload_received + stats.meta_sent + stats.meta_received
    return laps, cpu, phases, moved, len(batch_ids), plans


def _slowest_per_round(rounds: list[float]) -> list[float]:
    """Each timed round's slowest rank (a collective; every rank timed the same rounds
    from the same barrier)."""
    import torch.distributed as dist

    slowest = torch.tensor(rounds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _slowest_rank_median(rounds: list[float]) -> float:
    """The median over rounds of each round's slowest rank: how the coordinator and every
    reference are measured."""
    return statistics.median(_slowest_per_round(rounds))


def _mean_over_ranks(value: float) -> float:
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


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
    active = _active_transitions(sizes)
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

    def exchanges(exchange) -> None:
        for t in active:
            exchange(sizes[t], recv_sizes[t], send[t], recv[t])

    took = [_median_round_seconds(spec, lambda: exchanges(exchange))[0] for exchange in (alltoall, p2p)]
    return {"raw_alltoall_seconds": took[0], "raw_p2p_seconds": took[1]}


def _shm_copy_times(sizes: list[list[int]], spec: Spec) -> tuple[float, float, float]:
    """The coordinator's payload, the same bytes per peer pair, copied through /dev/shm
    with no planning and no headers, two ways:

    - the floor: each rank writes into a mapped file per (transition, peer), a barrier,
      then the peer reads it into a receive buffer: two copies and one synchronisation
      per transition, with every file and buffer made and touched before the timed
      rounds (no page faults or allocation);
    - with fresh files: the same, but each transfer makes its file (and the receiver its
      buffer), as a copy that keeps nothing between transfers does: the page faults and
      allocation that the floor leaves out.

    Returns the floor's median round (max over ranks), its CPU seconds per rank and round
    (mean over ranks), and the fresh-files copy's median round (max over ranks)."""
    import torch.distributed as dist

    world, rank = spec.num_workers, dist.get_rank()
    token = torch.tensor([int.from_bytes(os.urandom(6), "little")], dtype=torch.int64)
    dist.broadcast(token, src=0)  # names this measurement's files alike on every rank
    token = int(token)

    def path(t: int, src: int, dst: int, transfer: str = "mapped") -> str:
        return f"/dev/shm/distflow-floor-{token}-{transfer}-{t}-{src}-{dst}"

    outgoing = {}
    for t, out in enumerate(sizes):
        for p, n in enumerate(out):
            if n and p != rank:
                outgoing[t, p] = torch.from_file(path(t, rank, p), shared=True, size=n, dtype=torch.uint8)
    dist.barrier()
    incoming = {}
    try:
        for t in range(len(sizes)):
            for p in range(world):
                if p != rank and os.path.exists(path(t, p, rank)):
                    incoming[t, p] = torch.from_file(path(t, p, rank), shared=True,
                                                     size=os.stat(path(t, p, rank)).st_size, dtype=torch.uint8)
    finally:
        dist.barrier()
        for t, p in outgoing:
            os.unlink(path(t, rank, p))
    source = {key: torch.ones_like(slot) for key, slot in outgoing.items()}
    received = {key: torch.empty_like(slot) for key, slot in incoming.items()}
    active = _active_transitions(sizes)

    def copies() -> None:
        for t in active:
            for (tt, p), slot in outgoing.items():
                if tt == t:
                    slot.copy_(source[tt, p])
            dist.barrier()
            for (tt, p), slot in incoming.items():
                if tt == t:
                    received[tt, p].copy_(slot)

    transfers = itertools.count()

    def copies_through_fresh_files() -> None:
        for t in active:
            transfer = f"fresh{next(transfers)}"
            for (tt, p), data in source.items():
                if tt == t:
                    torch.from_file(path(t, rank, p, transfer), shared=True, size=len(data),
                                    dtype=torch.uint8).copy_(data)
            dist.barrier()
            for (tt, p), slot in incoming.items():
                if tt == t:
                    name = path(t, p, rank, transfer)
                    mapped = torch.from_file(name, shared=True, size=len(slot), dtype=torch.uint8)
                    os.unlink(name)
                    torch.empty_like(slot).copy_(mapped)

    floor = _median_round_seconds(spec, copies)
    try:
        fresh = _median_round_seconds(spec, copies_through_fresh_files)
    except BaseException:  # a failed round's files: this rank's own, which their reader did not unlink
        for name in glob.glob(f"/dev/shm/distflow-floor-{token}-fresh*-*-{rank}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        raise
    return (*floor, fresh[0])


def _active_transitions(sizes: list[list[int]]) -> list[int]:
    """The transitions in which some rank sends something (a collective: every rank
    learns the same list)."""
    import torch.distributed as dist

    moving = torch.tensor([sum(out) for out in sizes], dtype=torch.int64)
    dist.all_reduce(moving)
    return [t for t, n in enumerate(moving.tolist()) if n]


def _median_round_seconds(spec: Spec, one_round) -> tuple[float, float]:
    """`one_round()` after a barrier, warm-up rounds untimed, then `spec.repeats` timed
    rounds: the median over rounds of each round's slowest rank (`_slowest_rank_median`),
    and the mean over ranks of each rank's median CPU seconds (a collective)."""
    import torch.distributed as dist

    rounds, cpu = [], []
    for rnd in range(WARMUP_ROUNDS + spec.repeats):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        one_round()
        if rnd >= WARMUP_ROUNDS:
            rounds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return _slowest_rank_median(rounds), _mean_over_ranks(statistics.median(cpu))


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
    return _record("coordinator", spec, report["laps"], report["busiest"], None, round_seconds=report["rounds"],
                   **report["raw"],
                   phase_seconds=report["phases"], phase_cpu_seconds=report["phase_cpu"],
                   busiest_process_peak_rss_bytes=report["peak_rss"],
                   cpu_seconds_per_rank=report["cpu"], cores=len(os.sched_getaffinity(0)))
