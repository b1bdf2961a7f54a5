"""Each PPO update's straggler: the train move balanced over the step, or over each mini-batch.

Every PPO mini-batch is an optimizer step all training ranks take together, so each one
waits for the rank with the most of that mini-batch's tokens. This plans the trainer's
move to the training layout (`plan_samples`, Karmarkar-Karp, 2% tolerance) for a step of
`--prompts` prompts x `--group-size` responses with long-tailed token lengths (lognormal
around 256, clipped to [128, 2048]), prompt p on rank p mod N as the loader deals them,
in `--mini-batches` mini-batches of whole prompts, without and with the mini-batch as a
label (`Placement.balance_within`), and prints, averaged over `--seeds` draws, the
largest rank's tokens of a mini-batch over the mean (1.0: no straggler), the same for
the whole step (its scoring forwards) and the share of tokens the move sends:

    python benchmarks/minibatch_balance.py --workers 4 8 --seeds 20
"""

import argparse


def measure(workers: int, prompts: int, group_size: int, mini_batches: int, seed: int) -> dict:
    import numpy as np

    from distflow.coordinator.layout import Layout
    from distflow.coordinator.planner import _validate, plan_samples

    rng = np.random.default_rng(seed)
    n = prompts * group_size
    lens = np.clip(rng.lognormal(np.log(256), 0.8, n).astype(int), 128, 2048)
    label = (np.arange(n) // group_size) // (prompts // mini_batches)
    layout = Layout(workers)
    holdings = {r: [s for s in range(n) if (s // group_size) % workers == r] for r in range(workers)}
    lengths = dict(enumerate(lens.tolist()))
    table = _validate(layout, layout, holdings, lengths, "kk")
    out = {}
    for name, labels in (("step", None), ("mini_batch", label[table.ids])):
        plan = plan_samples(layout, layout, table, balance="kk", tolerance=0.02, labels=labels)
        tokens = np.zeros((workers, mini_batches))
        for rank, samples in enumerate(plan.assignment):
            np.add.at(tokens[rank], label[samples], lens[samples])
        step = tokens.sum(1)
        out[name] = {"straggler": float((tokens.max(0) / tokens.mean(0)).mean()),
                     "step": float(step.max() / step.mean()), "moved": plan.moved_tokens(lengths) / float(lens.sum())}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args(argv)
    print("| N | balanced over | largest rank / mean, per mini-batch | largest rank / mean, the step | tokens moved |")
    print("|---|---|---|---|---|")
    for workers in args.workers:
        runs = [measure(workers, args.prompts, args.group_size, args.mini_batches, s) for s in range(args.seeds)]
        for name in ("step", "mini_batch"):
            straggler = sum(r[name]["straggler"] for r in runs) / len(runs)
            step = sum(r[name]["step"] for r in runs) / len(runs)
            moved = sum(r[name]["moved"] for r in runs) / len(runs)
            print(f"| {workers} | {'the step' if name == 'step' else 'each mini-batch'} | {straggler:.3f} | "
                  f"{step:.3f} | {moved:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
