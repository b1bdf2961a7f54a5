"""The reshard planner at scale, against another checkout's planner in the same run.

Every rank plans every sample of a step (`distflow/coordinator/planner.py`), so the
planner's time is paid by every rank, every step. This times the data-plane
benchmark's two planned transitions, DP(N) -> TP pairs and back (Karmarkar-Karp, 2%
tolerance), in one process for each N with `--per-rank` long-tailed samples per rank,
each rank holding a contiguous block; the best of `--repeats` after one untimed. It plans
as the executor does (`plan_samples` on the all-gathered rows, then on the first plan's
`after`), or through the planner's dict API in a checkout from before that, so
`--against DIR` (the root of another checkout, e.g. `git worktree add /tmp/old <commit>`)
times that checkout's planner on the same inputs, in a subprocess, and prints the ratio:

    python benchmarks/planner_scale.py --workers 8 64 256 --per-rank 256 --against /tmp/old
    python benchmarks/planner_scale.py --workers 128 512 --per-rank 32 --against /tmp/old
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def measure(workers: list[int], per_rank: int, repeats: int) -> list[dict]:
    import numpy as np

    from distflow.benchmarks.dataplane_common import Spec, shard_ids, token_lengths
    from distflow.coordinator import planner
    from distflow.coordinator.layout import Layout

    options = {"balance": "kk", "tolerance": 0.02}

    def by_dicts(src, dst, holdings, lengths):  # a checkout from before the array path (plan_samples)
        found = planner.stay_put_plan(src, dst, holdings, lengths, **options)
        return found if found is not None else planner.plan_reshard(src, dst, holdings, lengths, **options)

    rows = []
    for n in workers:
        spec = Spec(n, per_rank * n, 2048, repeats)
        lengths = dict(enumerate(token_lengths(spec).tolist()))
        holdings = {r: shard_ids(r, spec) for r in range(n)}
        gathered = [np.array([[s, lengths[s]] for s in holdings[r]], dtype=np.int64) for r in range(n)]
        dp, tp = Layout(n), Layout(n, tp_size=2)
        best = [float("inf")] * 2
        for rnd in range(1 + repeats):  # the first untimed
            start = time.perf_counter()
            if hasattr(planner, "plan_samples"):  # as the executor: the rows as arrays, then the plan's `after`
                to_tp = planner.plan_samples(dp, tp, planner.SampleTable.gathered(gathered), **options)
                middle = time.perf_counter()
                planner.plan_samples(tp, dp, to_tp.after, **options)
            else:
                to_tp = by_dicts(dp, tp, holdings, lengths)
                middle = time.perf_counter()
                by_dicts(tp, dp, to_tp.holdings(n), lengths)
            if rnd:
                best = [min(best[0], middle - start), min(best[1], time.perf_counter() - middle)]
        rows.append({"workers": n, "samples": spec.batch, "dp_to_tp2_s": best[0], "tp2_to_dp_s": best[1]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--per-rank", type=int, default=256, help="samples per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--against", help="root of another checkout whose planner to time on the same inputs")
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    ours = measure(args.workers, args.per_rank, args.repeats)
    if args.json_only:
        print(json.dumps(ours))
        return 0
    theirs = None
    if args.against:
        env = {**os.environ, "PYTHONPATH": str(Path(args.against).resolve())}
        argv = [sys.executable, __file__, "--json-only", "--per-rank", str(args.per_rank),
                "--repeats", str(args.repeats), "--workers", *map(str, args.workers)]
        theirs = json.loads(subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout)
    print("| ranks | samples | DP->TP2 s | TP2->DP s |" + (" --against DP->TP2 s | --against TP2->DP s | "
                                                          "--against / this |" if theirs else ""))
    print("|---|---|---|---|" + ("---|---|---|" if theirs else ""))
    for i, row in enumerate(ours):
        line = f"| {row['workers']} | {row['samples']} | {row['dp_to_tp2_s']:.4f} | {row['tp2_to_dp_s']:.4f} |"
        if theirs:
            old = theirs[i]
            ratio = (old["dp_to_tp2_s"] + old["tp2_to_dp_s"]) / (row["dp_to_tp2_s"] + row["tp2_to_dp_s"])
            line += f" {old['dp_to_tp2_s']:.4f} | {old['tp2_to_dp_s']:.4f} | {ratio:.1f}x |"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
