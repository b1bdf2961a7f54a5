"""The data plane with images: a VLM batch, whose pixels are most of its bytes, through
the Data Coordinator and through a single controller, at growing batch sizes.

Each sample carries one image's `pixel_values` as Qwen2-VL's processor makes them (a
square image of `--megapixels`: its 14-pixel patches of 1,176 float32 features; 1 MP is
5,184 patches, 23.3 MiB) beside the text fields of `distflow.benchmarks.dataplane`, and
counts its image tokens (a quarter of its patches) in the lengths the planner balances.
The same three transitions on N workers (that module's docstring). Per batch size and
mode: seconds, the busiest process's bytes, and its peak RSS (VmHWM): the driver for the
single controller, the largest rank for the coordinator.

The memory budget (`--memory-budget-gib`) is compared with the measured peaks, not
enforced: a mode is not measured at larger batches once its peak is over the budget, and
the report gives the largest batch each mode ran within it.

    python -m distflow.benchmarks.dataplane_vlm --workers 4 --batch 8 16 32 64 --megapixels 1 \\
        --memory-budget-gib 4 --json benchmarks/dataplane-vlm.jsonl --results-md benchmarks/DATAPLANE-VLM.md
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from distflow.benchmarks.dataplane_centralized import run_centralized
from distflow.benchmarks.dataplane_common import MODES, Spec, image_patches_of
from distflow.benchmarks.dataplane_coordinator import run_coordinator
from distflow.benchmarks.records import command_line, save_results

GIB = 1 << 30


def measure(workers: int, batches: list[int], seq_len: int, megapixels: float, modes: list[str], repeats: int,
            budget_bytes: int, log=print) -> list[dict[str, Any]]:
    """Each mode at each batch size, smallest first, until its peak is over the budget."""
    patches, records = image_patches_of(megapixels), []
    for mode in modes:
        for batch in sorted(batches):
            spec = Spec(workers, batch, seq_len, repeats, patches)
            log(f"dataplane-vlm: N={workers} B={batch} {mode} ({spec.batch_bytes / GIB:.2f} GiB) ...")
            record = run_coordinator(spec) if mode == "coordinator" else run_centralized(mode, spec)
            record |= {"megapixels": megapixels, "memory_budget_bytes": budget_bytes,
                       "within_budget": record["busiest_process_peak_rss_bytes"] <= budget_bytes}
            records.append(record)
            if not record["within_budget"]:
                break
    return records


def table(records: list[dict[str, Any]]) -> str:
    head = ["mode", "batch", "batch GiB", "seconds", "busiest process GiB moved", "its peak RSS GiB",
            "within budget"]
    rows = [[r["mode"], str(r["batch"]), f"{r['batch_bytes'] / GIB:.2f}", f"{r['seconds']:.3f}",
             f"{r['busiest_process_bytes'] / GIB:.2f}", f"{r['busiest_process_peak_rss_bytes'] / GIB:.2f}",
             "yes" if r["within_budget"] else "no"] for r in records]
    lines = [head, ["---"] * len(head), *rows]
    return "\n".join("| " + " | ".join(r) + " |" for r in lines)


def largest_within_budget(records: list[dict[str, Any]]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for r in records:
        out.setdefault(r["mode"], None)
        if r["within_budget"]:
            out[r["mode"]] = max(out[r["mode"]] or 0, r["batch"])
    return out


def summary_lines(records: list[dict[str, Any]]) -> list[str]:
    budget = records[0]["memory_budget_bytes"] / GIB
    lines = []
    for mode, batch in largest_within_budget(records).items():
        over = [r["batch"] for r in records if r["mode"] == mode and not r["within_budget"]]
        lines.append(f"{mode}: largest batch within {budget:g} GiB: {batch if batch else 'none measured'}"
                     + (f"; over it at {over[0]}" if over else "; never over it in the batches measured"))
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m distflow.benchmarks.dataplane_vlm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="N (even)")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32, 64], help="batch sizes, in samples")
    p.add_argument("--seq-len", type=int, default=1024, help="padded text width L")
    p.add_argument("--megapixels", type=float, default=1.0, help="each sample's image")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["coordinator", "centralized-zerocopy"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--memory-budget-gib", type=float, default=4.0, help="per process; compared, not enforced")
    p.add_argument("--json", help="write one JSON record per measurement to this file")
    p.add_argument("--results-md", help="write the table and the command as markdown")
    args = p.parse_args(argv)
    if args.workers < 2 or args.workers % 2 or min(args.batch) < args.workers:
        p.error("--workers must be even and >= 2, and every --batch at least --workers")
    if args.megapixels <= 0 or args.memory_budget_gib <= 0:
        p.error("--megapixels and --memory-budget-gib must be > 0")
    records = measure(args.workers, args.batch, args.seq_len, args.megapixels, args.modes, args.repeats,
                      int(args.memory_budget_gib * GIB), log=lambda s: print(s, file=sys.stderr, flush=True))
    text = table(records) + "\n\n" + "\n".join(summary_lines(records))
    print(text)
    command = command_line("python -m distflow.benchmarks.dataplane_vlm", argv)
    save_results(args, records, f"# The data plane with images\n\n`{command}`\n\n{image_patches_of(args.megapixels)} "
                 f"patches per sample ({args.megapixels:g} MP), N={args.workers}, L={args.seq_len}, median of "
                 f"{args.repeats}.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
