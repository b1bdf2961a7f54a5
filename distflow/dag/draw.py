"""A PNG of a graph with matplotlib (always installed), for machines without Graphviz:
one column per depth, boxes coloured by layout, an arrow per edge."""

from __future__ import annotations

from pathlib import Path

from distflow.dag.graph import Graph

COLOURS = {"local": "#dbeafe", "groups": "#fef3c7", "train": "#dcfce7"}


def depths(graph: Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in graph.order:  # parents come first in the order
        out[name] = 1 + max((out[p] for p in graph.parents[name]), default=0)
    return out


def draw_png(graph: Graph, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    depth = depths(graph)
    columns: dict[int, list[str]] = {}
    for name in graph.order:
        columns.setdefault(depth[name], []).append(name)
    pos = {"prompts": (0.0, 0.0)}
    for d, names in columns.items():
        for i, name in enumerate(names):
            pos[name] = (float(d), (len(names) - 1) / 2 - i)
    height = max(len(v) for v in columns.values())
    fig, ax = plt.subplots(figsize=(2.6 * (len(columns) + 1), 1.3 * height + 1.2))
    w, h = 0.8, 0.5
    for name in graph.order:
        for parent in graph.parents[name] or ["prompts"]:
            (x0, y0), (x1, y1) = pos[parent], pos[name]
            skips = x1 - x0 > 1  # an edge past other columns bends around their boxes
            ax.annotate("", xy=(x1 - w / 2, y1), xytext=(x0 + w / 2, y0),
                        arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 1.2,
                                    "connectionstyle": f"arc3,rad={-0.35 if skips else 0.0}"})
    boxes = [("prompts", "prompts", "#eeeeee")]
    boxes += [(n, f"{n}\n{graph.by_name[n].role}", COLOURS[graph.by_name[n].layout]) for n in graph.order]
    for name, label, colour in boxes:
        x, y = pos[name]
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.03",
                                    facecolor=colour, edgecolor="#333333"))
        ax.text(x, y, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.6, len(columns) + 0.6)
    ax.set_ylim(-height / 2 - 0.3, height / 2 + 0.3)
    ax.axis("off")
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#333333", label=f"layout: {k}") for k, c in COLOURS.items()],
              loc="lower right", fontsize=7, frameon=False)
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
