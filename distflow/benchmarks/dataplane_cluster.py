"""The data-plane benchmark on the emulated cluster (`distflow bench dataplane --cluster`).

    python -m distflow.benchmarks.dataplane_cluster --workers 4 --rate-mbit 400 --json benchmarks/dataplane-cluster.jsonl

Host 0 holds the Ray head and the driver; each worker host one rank (one CPU slot each,
so one rank per host). The same three transitions of the same batch as on one host:
the coordinator's ranks exchange over their own links (the launcher's worker actor, one
per host, joins the gloo group; rank 0's host is the master); the centralized modes gather into the driver
on host 0 and send back out, through host 0's link. Each record carries `where:
"cluster"`, `num_hosts`, the bytes each host's link carried per round (host-side veth
counters, both directions, warm-up rounds included in the average; for the coordinator
the window also holds its two plain-transport reference runs, which move the same
payload, so it is averaged over three times the rounds) and `wire_floor_seconds`: the busiest link
direction's bytes per round over the link rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from distflow.benchmarks.dataplane_centralized import _centralized_rounds
from distflow.benchmarks.dataplane_common import (BASELINE_MODES, MODES, TIMEOUT_S, VERL_MODES, WARMUP_ROUNDS, Spec,
                                                  _record, refuse_verl_modes_without_verl)


def _child(mode: str, spec: Spec, address: str, out: str) -> int:
    """Inside host 0: one measurement against the cluster at `address`."""
    os.environ["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "0"  # "-pickle" is Ray's default tensor path
    import ray

    from distflow.runtime.centralized import wire_env
    from distflow.runtime.ray_launcher import check_ray_address

    runtime_env = None
    if mode == "centralized-verl-numpy":  # verl's serialisation switch, here and in every actor
        os.environ.update(wire_env("verl-numpy"))
        runtime_env = {"env_vars": wire_env("verl-numpy")}
    ray.init(address=address, _node_ip_address=check_ray_address(address), log_to_driver=False,
             configure_logging=False, runtime_env=runtime_env)
    try:
        if mode == "coordinator":  # the launcher's own worker actor, one per host, runs the rounds
            from distflow.runtime.ray_launcher import _Worker

            actors = [ray.remote(num_cpus=1)(_Worker).remote() for _ in range(spec.num_workers)]
            master, port = ray.get(actors[0].rendezvous.remote(), timeout=TIMEOUT_S)
            reports = ray.get([a.run.remote("distflow.benchmarks.dataplane_coordinator:_coordinator_rounds",
                                            (r, spec, False), r, spec.num_workers, master, port, "cpu", TIMEOUT_S,
                                            1, 1)  # one worker per emulated host
                               for r, a in enumerate(actors)], timeout=TIMEOUT_S)
            if reports[0]["rows"] != spec.batch:
                raise RuntimeError(f"coordinator ended with {reports[0]['rows']} rows, expected {spec.batch}")
            record = _record("coordinator", spec, reports[0]["laps"], reports[0]["busiest"], None,
                             round_seconds=reports[0]["rounds"], **reports[0]["raw"])
        else:
            record = _centralized_rounds(ray, mode, spec)
        Path(out).write_text(json.dumps(record))
        return 0
    finally:
        ray.shutdown()


def _link_bytes(names: list[str]) -> list[tuple[int, int]]:
    """(bytes out of the host, bytes into the host) per host-side veth."""
    def read(name: str, what: str) -> int:
        return int(Path(f"/sys/class/net/{name}/statistics/{what}_bytes").read_text())
    return [(read(n, "rx"), read(n, "tx")) for n in names]


def measure(spec: Spec, modes: list[str], rate_mbit: float, cluster=None) -> list[dict[str, Any]]:
    """Each mode on a fresh emulated cluster of 1 + N hosts, or on `cluster` (a
    ClusterSpec that is up, with N worker hosts)."""
    from distflow.runtime.cluster import ClusterSpec, EmulatedCluster

    if cluster is not None:
        return _measure_on(cluster, spec, modes)
    cluster = ClusterSpec(hosts=1 + spec.num_workers, rate_mbit=rate_mbit, name="dfd")
    with EmulatedCluster(cluster):
        return _measure_on(cluster, spec, modes)


def _measure_on(cluster, spec: Spec, modes: list[str]) -> list[dict[str, Any]]:
    from distflow.runtime.cluster import in_host, ray_env

    rate_mbit, records = cluster.rate_mbit, []
    with tempfile.TemporaryDirectory(prefix="dfd-") as tmp:
        veths = [cluster.veth(i) for i in range(cluster.hosts)]
        for mode in modes:
            print(f"dataplane (cluster): {cluster.hosts} hosts, N={spec.num_workers} {mode} ...", file=sys.stderr,
                  flush=True)
            out = Path(tmp, f"{mode}.json")
            before = _link_bytes(veths)
            cmd = in_host(cluster, 0, [sys.executable, "-m", "distflow.benchmarks.dataplane_cluster", "--_child", mode,
                                       "--_address", cluster.ray_address, "--_out", str(out),
                                       "--workers", str(spec.num_workers), "--batch", str(spec.batch),
                                       "--seq-len", str(spec.seq_len), "--repeats", str(spec.repeats)])
            proc = subprocess.run(cmd, env=ray_env(cluster), capture_output=True, text=True, timeout=TIMEOUT_S)
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(f"{mode} on the cluster failed:\n{proc.stderr[-3000:]}")
            after = _link_bytes(veths)
            rounds = WARMUP_ROUNDS + spec.repeats
            if mode == "coordinator":
                # the same window holds as many rounds of each plain-transport reference
                # (all_to_all, isend/irecv), which move the same payload bytes (without the
                # metadata, under 1% of them)
                rounds *= 3
            per_round = [((a_out - b_out) / rounds, (a_in - b_in) / rounds)
                         for (b_out, b_in), (a_out, a_in) in zip(before, after)]
            busiest = max(max(pair) for pair in per_round)
            record = json.loads(out.read_text()) | {
                "where": "cluster", "num_hosts": cluster.hosts, "rate_mbit": rate_mbit,
                "link_bytes_per_round": per_round, "busiest_link_bytes": busiest,
                "driver_link_bytes": sum(per_round[0]),
                "wire_floor_seconds": busiest / (rate_mbit * 1e6 / 8)}
            records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distflow bench dataplane --cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[4], help="worker hosts (one rank each, even)")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=400.0)
    p.add_argument("--baseline", choices=tuple(BASELINE_MODES), default="ours",
                   help="as without --cluster: our imitation, or verl's own DataProto dispatch (needs verl)")
    p.add_argument("--modes", nargs="+", choices=MODES + VERL_MODES,
                   help="instead of --baseline's set; the verl modes need verl in this Python (README: Benchmarks)")
    p.add_argument("--json", help="append one JSON record per measurement")
    p.add_argument("--_child", choices=MODES + VERL_MODES, help=argparse.SUPPRESS)
    p.add_argument("--_address", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        return _child(args._child, Spec(args.workers[0], args.batch, args.seq_len, args.repeats), args._address,
                      args._out)
    args.modes = args.modes or list(BASELINE_MODES[args.baseline])
    refuse_verl_modes_without_verl(p, args.modes)
    records = []
    for n in args.workers:
        if n < 2 or n % 2:
            p.error(f"--workers {n}: each N must be even and >= 2 (the TP layout has pairs)")
        records += measure(Spec(n, args.batch, args.seq_len, args.repeats), args.modes, args.rate_mbit)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    base = {r["num_workers"]: r["seconds"] for r in records if r["mode"] == "coordinator"}
    print(f"\nB={args.batch} x L={args.seq_len}, links {args.rate_mbit:g} Mbit/s each way, median of {args.repeats}")
    print("| hosts | N | mode | seconds | x coordinator | wire floor s | within floor | driver link MB/round "
          "| busiest link MB/round |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        ratio = r["seconds"] / base[r["num_workers"]] if r["num_workers"] in base else float("nan")
        print(f"| {r['num_hosts']} | {r['num_workers']} | {r['mode']} | {r['seconds']:.3f} | {ratio:.1f} "
              f"| {r['wire_floor_seconds']:.3f} | {r['seconds'] / r['wire_floor_seconds']:.2f} "
              f"| {r['driver_link_bytes'] / 1e6:.1f} | {r['busiest_link_bytes'] / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
