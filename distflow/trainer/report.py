"""The picture a run leaves behind (checkpoints: checkpoint.py): reward and held-out
accuracy, overall and per level, above the signals that explain them (entropy, KL to the
reference, response length, learning rate)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

# (metric, label, scale to fit the 0-1 axis); only those a run has are drawn
_DIAGNOSTICS = (("actor/entropy", "entropy (nats/token)", 1.0), ("actor/kl", "KL to reference x10", 10.0),
                ("response/length_mean", "response length / max", None), ("actor/lr", "lr / peak lr", None),
                ("actor/clip_frac", "clip fraction", 1.0))


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in history if key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]


def write_plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diag) = plt.subplots(2, 1, figsize=(7, 7), sharex=True, height_ratios=(3, 2))
    steps, rewards = _series(history, "reward/mean")
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, label="train reward (per step)")
    if len(rewards) >= 5:
        k = max(2, len(rewards) // 10)
        smooth = [sum(rewards[max(0, i - k + 1): i + 1]) / len(rewards[max(0, i - k + 1): i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, color="tab:blue", label=f"train reward (mean of {k})")
    ax.plot(*_series(history, "val/accuracy"), "o-", color="tab:red", label="held-out accuracy (greedy)")
    levels = sorted({k for r in history for k in r if k.startswith("val/accuracy/")})
    for key, colour in zip(levels, itertools.cycle(("tab:orange", "tab:purple", "tab:brown", "tab:pink",
                                                    "tab:olive"))):
        ax.plot(*_series(history, key), ".--", color=colour, alpha=0.8, label=f"held-out, {key.rsplit('/', 1)[1]}")
    # 0 to 1 where every value is (accuracies are; a shaped, reward-model or custom reward need not be)
    drawn = [v for line in ax.get_lines() for v in line.get_ydata() if math.isfinite(v)]
    ax.set_ylim(min([0.0, *drawn]), max([1.0, *drawn]))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.set_title("DistFlow run")
    for key, label, scale in _DIAGNOSTICS:
        x, y = _series(history, key)
        if not y:
            continue
        top = max(max(y), 1e-12) if scale is None else 1.0 / scale
        diag.plot(x, [v / top for v in y], label=label)
    diag.set_xlabel("step")
    diag.grid(alpha=0.3)
    diag.legend(loc="upper right", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_history(run_dir: Path) -> list[dict]:
    import json

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir}: not a run folder (no metrics.jsonl)")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut by a kill mid-write, or not a record: the report goes on without it
            pass
    return records


def write_overlay(runs: dict[str, list[dict]], path: Path) -> None:
    """Several runs' train reward and held-out accuracy, one colour per run, in one picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward, heldout) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    colours = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for (name, history), colour in zip(runs.items(), colours):
        reward.plot(*_series(history, "reward/mean"), color=colour, alpha=0.8, label=name)
        heldout.plot(*_series(history, "val/accuracy"), "o-", color=colour, label=name)
    reward.set_ylabel("train reward (per step)")
    heldout.set_ylabel("held-out accuracy (greedy)")
    heldout.set_xlabel("step")
    for ax in (reward, heldout):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_summary_row(run_dir: Path) -> dict:
    """One line of `distflow runs`: from summary.json when the run finished, else from its metrics."""
    import json

    summary_path = Path(run_dir) / "summary.json"
    history = read_history(run_dir)
    steps = [r["step"] for r in history if r.get("step", 0) > 0]
    vals = [r["val/accuracy"] for r in history if "val/accuracy" in r]
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        return {"run": str(run_dir), "algorithm": s.get("algorithm", "?"), "steps": s["steps"], "status": "done",
                "heldout": (s["heldout_accuracy_initial"], s["heldout_accuracy_final"]),
                "reward_last": s.get("reward_last"), "wall_s": s.get("wall_seconds")}
    config = Path(run_dir) / "config.json"
    algorithm = json.loads(config.read_text())["algorithm"]["name"] if config.is_file() else "?"
    return {"run": str(run_dir), "algorithm": algorithm, "steps": steps[-1] if steps else 0, "status": "unfinished",
            "heldout": (vals[0], vals[-1]) if vals else None,
            "reward_last": next((r["reward/mean"] for r in reversed(history) if "reward/mean" in r), None),
            "wall_s": None}
