"""A model, not a measurement: GRPO step time at 8-512 GPUs in both modes, from costs
fitted to the end-to-end benchmark's records.

    python benchmarks/projection.py --records benchmarks/e2e.jsonl --plot benchmarks/projection.png

Fitted from the records (least squares, printed with the output):
- bytes per token that pass through the driver per step in centralized mode (in and
  out), and that workers send each other per step in distributed mode (the Data
  Coordinator's `coordinator/payload_sent_bytes`, summed over workers);
- the driver's time per byte it relays and per step (`driver_relay_seconds` against
  bytes, a line with an intercept: the concatenation, splitting and copies, and the
  per-stage round trips), measured on this machine.

Stated inputs (flags, printed): the model's tokens per GPU-second for a whole RL step
(generation and training), prompt and response lengths, prompts per GPU (weak scaling:
the batch grows with the GPU count), group size, GPUs per node and the NIC speed of every
node, the driver's included. Step time = compute + data, with no overlap of the two in
either mode:

    compute      = tokens per GPU / GPU tokens per second             (the same in both modes)
    centralized  = driver bytes / NIC + driver bytes x driver seconds per byte + driver seconds per step
    distributed  = bytes per node / NIC + bytes per node x driver seconds per byte

The driver's link carries every stage's data in and out, so its time grows with the GPU
count; a node's share stays constant. The paper reports DistFlow 2.62x over verl at 128
GPUs for 7B GRPO, and near-linear scaling to 512 GPUs; the plot shows that point beside
the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAPER_RATIO_128 = 2.62  # DistFlow over verl, 7B GRPO, 128 GPUs (arXiv 2507.13833)


def fit_through_origin(points: list[tuple[float, float]]) -> float:
    """The slope of y = a x by least squares."""
    den = sum(x * x for x, _ in points)
    if not den:
        raise ValueError("no points to fit")
    return sum(x * y for x, y in points) / den


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of y = a x + b by least squares."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if not var:
        raise ValueError("the points need at least two different x")
    a = sum((x - mx) * (y - my) for x, y in points) / var
    return a, my - a * mx


def fit(records: list[dict]) -> dict[str, float]:
    central = [r for r in records if r["mode"] == "centralized" and r["where"] == "host"]
    distributed = [r for r in records if r["mode"] == "distributed" and r["where"] == "host" and r["num_workers"] > 1]
    if not central or not distributed:
        raise SystemExit("the records need centralized runs and distributed runs with 2+ workers on one host")
    return {
        "driver_bytes_per_token": fit_through_origin(
            [(r["tokens_per_step"], r["driver_bytes_per_step"]) for r in central]),
        "worker_bytes_per_token": fit_through_origin(
            [(r["tokens_per_step"], r["peer_bytes_per_step"]) for r in distributed]),
    } | dict(zip(("driver_seconds_per_byte", "driver_seconds_per_step"), fit_line(
        [(r["driver_bytes_per_step"], r["driver_relay_seconds_per_step"]) for r in central])))


def project(costs: dict[str, float], gpus: int, args: argparse.Namespace) -> dict[str, float]:
    tokens_per_gpu = args.prompts_per_gpu * args.group_size * (args.prompt_len + args.response_len)
    tokens = tokens_per_gpu * gpus
    nodes = max(gpus // args.gpus_per_node, 1)
    nic = args.nic_gbit * 1e9 / 8
    compute = tokens_per_gpu / args.gpu_tokens_per_s
    driver_bytes = costs["driver_bytes_per_token"] * tokens
    node_bytes = costs["worker_bytes_per_token"] * tokens / nodes
    central = (compute + driver_bytes / nic + driver_bytes * costs["driver_seconds_per_byte"]
               + costs["driver_seconds_per_step"])
    distributed = compute + node_bytes / nic + node_bytes * costs["driver_seconds_per_byte"]
    return {"gpus": gpus, "tokens_per_step": tokens, "compute_s": compute, "centralized_step_s": central,
            "distributed_step_s": distributed, "ratio": central / distributed,
            "centralized_tokens_per_s": tokens / central, "distributed_tokens_per_s": tokens / distributed}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    g = [r["gpus"] for r in rows]
    left.plot(g, [r["ratio"] for r in rows], "o-", label="model: distributed / centralized")
    left.plot([128], [PAPER_RATIO_128], "r*", markersize=12, label="paper: DistFlow / verl, 7B GRPO")
    left.set_xscale("log", base=2)
    left.set_xlabel("GPUs")
    left.set_ylabel("throughput ratio")
    left.legend(fontsize=8)
    base = rows[0]
    for mode, style in (("distributed", "o-"), ("centralized", "s--")):
        per_gpu0 = base[f"{mode}_tokens_per_s"] / base["gpus"]
        right.plot(g, [r[f"{mode}_tokens_per_s"] / (per_gpu0 * r["gpus"]) for r in rows], style, label=mode)
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_xlabel("GPUs")
    right.set_ylabel(f"scaling efficiency vs {base['gpus']} GPUs")
    right.legend(fontsize=8)
    fig.suptitle("A model fitted to this machine's measurements, not a measurement", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distflow bench project", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", default="benchmarks/e2e.jsonl", help="the e2e benchmark's --json output")
    parser.add_argument("--gpu-tokens-per-s", type=float, default=2500.0,
                        help="tokens per GPU-second for a whole GRPO step of the model (generation + training)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=2048)
    parser.add_argument("--prompts-per-gpu", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nic-gbit", type=float, default=100.0, help="every node's NIC, the driver's included")
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--json", help="write the projection here")
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in Path(args.records).read_text().splitlines() if line.strip()]
    costs = fit(records)
    rows = [project(costs, g, args) for g in args.gpus]
    print("A MODEL, NOT A MEASUREMENT. Assumptions (stated inputs):")
    for key in ("gpu_tokens_per_s", "prompt_len", "response_len", "prompts_per_gpu", "group_size", "gpus_per_node",
                "nic_gbit"):
        print(f"  {key} = {getattr(args, key)}")
    print("  no overlap of compute and data in either mode; weak scaling (the batch grows with the GPUs)")
    print(f"Fitted from {args.records} ({len(records)} records):")
    for key, value in costs.items():
        print(f"  {key} = {value:.4g}")
    print("\n| GPUs | tokens/step | compute s | centralized step s | distributed step s | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus']} | {r['tokens_per_step']:.3g} | {r['compute_s']:.2f} | {r['centralized_step_s']:.2f} "
              f"| {r['distributed_step_s']:.2f} | {r['ratio']:.2f} |")
    print(f"\npaper (measured on a real cluster): DistFlow / verl = {PAPER_RATIO_128} at 128 GPUs, 7B GRPO")
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"assumptions": {k: v for k, v in vars(args).items()
                                                               if k not in ("plot", "json")},
                                               "fitted": costs, "rows": rows}, indent=1))
    return 0
