"""A model, not a measurement: GRPO step time at 8-512 GPUs in both modes, from costs
fitted to the end-to-end benchmark's records.

    python benchmarks/projection.py --records benchmarks/e2e.jsonl benchmarks/e2e-vlm.jsonl \
        --plot benchmarks/projection.png --json benchmarks/projection.json

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

With runs of the e2e benchmark's `vlm` setting among the records (`--records
benchmarks/e2e.jsonl benchmarks/e2e-vlm.jsonl`), it also fits the bytes each mode moves
per byte of the step's pixels beyond its text bytes, and adds a VLM line: every sample
carries one `--megapixels` image (Qwen2-VL's float32 patches; its image tokens, a quarter
of the patches, count as prompt tokens in the compute).

The driver's link carries every stage's data in and out, so its time grows with the GPU
count; a node's share stays constant. The paper reports DistFlow 2.62x over verl at 128
GPUs for 7B GRPO, and near-linear scaling to 512 GPUs; the plot shows that point beside
the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distflow.benchmarks.dataplane_common import IMAGE_PATCH_FEATURES, image_patches_of

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


def _host_runs(records: list[dict], mode: str, images: bool) -> list[dict]:
    """One host's runs of `mode` (distributed ones with 2+ workers, which have peers to
    send to), with images or without."""
    return [r for r in records if r["mode"] == mode and r["where"] == "host"
            and (mode == "centralized" or r["num_workers"] > 1)
            and bool(r.get("image_bytes_per_step")) == images]


def fit(records: list[dict]) -> dict[str, float]:
    """The text costs from the text runs; with VLM runs (`image_bytes_per_step` > 0) also
    the bytes each mode moves per byte of the step's pixels, beyond its text bytes."""
    central, distributed = _host_runs(records, "centralized", False), _host_runs(records, "distributed", False)
    if not central or not distributed:
        raise SystemExit("the records need centralized runs and distributed runs with 2+ workers on one host")
    costs = {
        "driver_bytes_per_token": fit_through_origin(
            [(r["tokens_per_step"], r["driver_bytes_per_step"]) for r in central]),
        "worker_bytes_per_token": fit_through_origin(
            [(r["tokens_per_step"], r["peer_bytes_per_step"]) for r in distributed]),
    } | dict(zip(("driver_seconds_per_byte", "driver_seconds_per_step"), fit_line(
        [(r["driver_bytes_per_step"], r["driver_relay_seconds_per_step"]) for r in central])))
    vlm_central, vlm_distributed = _host_runs(records, "centralized", True), _host_runs(records, "distributed", True)
    if vlm_central and vlm_distributed:
        for key, runs, per_token, moved in (("driver", vlm_central, costs["driver_bytes_per_token"],
                                             "driver_bytes_per_step"),
                                            ("worker", vlm_distributed, costs["worker_bytes_per_token"],
                                             "peer_bytes_per_step")):
            # at least 0: runs that moved no pixels between workers (no layout change, no
            # balancing move) fit slightly below 0, since they moved fewer text bytes too
            costs[f"{key}_bytes_per_image_byte"] = max(0.0, fit_through_origin(
                [(r["image_bytes_per_step"], r[moved] - per_token * r["tokens_per_step"]) for r in runs]))
    return costs


def image_bytes_of(megapixels: float) -> int:
    """One image's `pixel_values` as Qwen2-VL's processor makes them: 14-pixel patches of
    1,176 float32 features (the data-plane VLM benchmark's size)."""
    return image_patches_of(megapixels) * IMAGE_PATCH_FEATURES * 4


def _step_seconds(compute: float, driver_bytes: float, node_bytes: float, costs: dict[str, float],
                  nic: float) -> tuple[float, float]:
    """(centralized, distributed) step seconds: the compute, then each mode's data."""
    per_byte = costs["driver_seconds_per_byte"]
    return (compute + driver_bytes / nic + driver_bytes * per_byte + costs["driver_seconds_per_step"],
            compute + node_bytes / nic + node_bytes * per_byte)


def project(costs: dict[str, float], gpus: int, args: argparse.Namespace) -> dict[str, float]:
    tokens_per_gpu = args.prompts_per_gpu * args.group_size * (args.prompt_len + args.response_len)
    tokens = tokens_per_gpu * gpus
    nodes = max(gpus // args.gpus_per_node, 1)
    nic = args.nic_gbit * 1e9 / 8
    compute = tokens_per_gpu / args.gpu_tokens_per_s
    driver_bytes = costs["driver_bytes_per_token"] * tokens
    node_bytes = costs["worker_bytes_per_token"] * tokens / nodes
    central, distributed = _step_seconds(compute, driver_bytes, node_bytes, costs, nic)
    row = {"gpus": gpus, "tokens_per_step": tokens, "compute_s": compute, "centralized_step_s": central,
           "distributed_step_s": distributed, "ratio": central / distributed,
           "centralized_tokens_per_s": tokens / central, "distributed_tokens_per_s": tokens / distributed}
    if "driver_bytes_per_image_byte" in costs:  # the VLM line: one image per sample, its tokens in the prompt
        samples_per_gpu = args.prompts_per_gpu * args.group_size
        tokens_per_gpu += samples_per_gpu * image_patches_of(args.megapixels) // 4  # 2x2-merged patches
        image_bytes = samples_per_gpu * gpus * image_bytes_of(args.megapixels)
        compute = tokens_per_gpu / args.gpu_tokens_per_s
        driver_bytes = costs["driver_bytes_per_token"] * tokens_per_gpu * gpus \
            + costs["driver_bytes_per_image_byte"] * image_bytes
        node_bytes = (costs["worker_bytes_per_token"] * tokens_per_gpu * gpus
                      + costs["worker_bytes_per_image_byte"] * image_bytes) / nodes
        central, distributed = _step_seconds(compute, driver_bytes, node_bytes, costs, nic)
        row |= {"vlm_compute_s": compute, "vlm_driver_bytes": driver_bytes, "vlm_centralized_step_s": central,
                "vlm_distributed_step_s": distributed, "vlm_ratio": central / distributed}
    return row


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    g = [r["gpus"] for r in rows]
    left.plot(g, [r["ratio"] for r in rows], "o-", label="model: distributed / centralized")
    if "vlm_ratio" in rows[0]:
        left.plot(g, [r["vlm_ratio"] for r in rows], "^-", label="model, with images: distributed / centralized")
        left.set_yscale("log")  # the VLM line is orders of magnitude above the text one
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
    parser.add_argument("--records", nargs="+", default=["benchmarks/e2e.jsonl"],
                        help="the e2e benchmark's --json output(s); its vlm setting's runs add the VLM line")
    parser.add_argument("--gpu-tokens-per-s", type=float, default=2500.0,
                        help="tokens per GPU-second for a whole GRPO step of the model (generation + training)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=2048)
    parser.add_argument("--prompts-per-gpu", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nic-gbit", type=float, default=100.0, help="every node's NIC, the driver's included")
    parser.add_argument("--megapixels", type=float, default=1.0,
                        help="the VLM line: each sample's one image (Qwen2-VL's float32 patches)")
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--json", help="write the projection here")
    args = parser.parse_args(argv)
    records = [json.loads(line) for path in args.records for line in Path(path).read_text().splitlines()
               if line.strip()]
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
    vlm = "vlm_ratio" in rows[0]
    print("\n| GPUs | tokens/step | compute s | centralized step s | distributed step s | ratio |"
          + (f" with {args.megapixels:g} MP images: centralized step s | distributed step s | ratio |" if vlm else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|" if vlm else ""))
    for r in rows:
        print(f"| {r['gpus']} | {r['tokens_per_step']:.3g} | {r['compute_s']:.2f} | {r['centralized_step_s']:.2f} "
              f"| {r['distributed_step_s']:.2f} | {r['ratio']:.2f} |"
              + (f" {r['vlm_centralized_step_s']:.2f} | {r['vlm_distributed_step_s']:.2f} | {r['vlm_ratio']:.2f} |"
                 if vlm else ""))
    if not vlm:
        print("\n(no VLM line: the records have no runs of the e2e benchmark's vlm setting in both modes)")
    print(f"\npaper (measured on a real cluster): DistFlow / verl = {PAPER_RATIO_128} at 128 GPUs, 7B GRPO")
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"assumptions": {k: v for k, v in vars(args).items()
                                                               if k not in ("plot", "json")},
                                               "fitted": costs, "rows": rows}, indent=1))
    return 0
