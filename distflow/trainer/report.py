"""The reward / held-out accuracy plot a run leaves behind (checkpoints: checkpoint.py)."""

from __future__ import annotations

from pathlib import Path


def write_plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in history if "reward/mean" in r]
    val_steps = [r["step"] for r in history if "val/accuracy" in r]
    val = [r["val/accuracy"] for r in history if "val/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, label="train reward (per step)")
    if len(rewards) >= 5:
        k = max(2, len(rewards) // 10)
        smooth = [sum(rewards[max(0, i - k + 1): i + 1]) / len(rewards[max(0, i - k + 1): i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, color="tab:blue", label=f"train reward (mean of {k})")
    ax.plot(val_steps, val, "o-", color="tab:red", label="held-out accuracy (greedy)")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("DistFlow run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
