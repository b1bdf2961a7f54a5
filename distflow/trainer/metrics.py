"""Metrics: local sums reduced across workers in one all-reduce, stage timers, and
rank 0's `metrics.jsonl`."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


class MeanAccumulator:
    """Collects (sum, count) pairs so that means are exact over all workers, totals
    summed over them and maxima."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)
        self.maxima: dict[str, float] = {}
        self.lock = threading.Lock()  # nodes of one step add from the scheduler's threads at once

    def add(self, name: str, total: float, count: float) -> None:
        with self.lock:
            self.sums[name] += float(total)
            self.counts[name] += float(count)

    def add_total(self, name: str, value: float) -> None:
        """A quantity summed over workers (not averaged), e.g. tokens processed."""
        with self.lock:
            self.totals[name] += float(value)

    def add_max(self, name: str, value: float) -> None:
        with self.lock:
            self.maxima[name] = max(self.maxima.get(name, float("-inf")), float(value))

    def reduce(self) -> dict[str, float]:
        """Global means, totals and maxima; collective. A name that some workers did not
        add (a metric of rows only some workers hold) is reduced over those that did."""
        names, total_names, max_names = sorted(self.sums), sorted(self.totals), sorted(self.maxima)
        if dist.is_initialized() and dist.get_world_size() > 1:  # the same names, in the same order, everywhere
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (names, total_names, max_names))
            names, total_names, max_names = (sorted(set().union(*(g[i] for g in gathered))) for i in range(3))
        sums = torch.tensor([[self.sums.get(n, 0.0), self.counts.get(n, 0.0)] for n in names]
                            + [[self.totals.get(n, 0.0), 0.0] for n in total_names] or [[0.0, 0.0]],
                            dtype=torch.float64)
        maxima = torch.tensor([self.maxima.get(n, float("-inf")) for n in max_names] or [0.0], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        reduced = sums.tolist()
        out = {n: (s / c if c else 0.0) for n, (s, c) in zip(names, reduced)}
        out.update({n: s for n, (s, _) in zip(total_names, reduced[len(names):])})
        out.update(dict(zip(max_names, maxima.tolist())))
        return out


class StageFailed(RuntimeError):
    """A stage raised: the message names the stage, the step and the original error."""


class StageTimer:
    """Times each named stage, tells `on_enter` which stage starts (the worker's
    status file), and names the stage in any error raised inside it."""

    def __init__(self, step: int = 0, on_enter=None) -> None:
        self.seconds: dict[str, float] = {}
        self.step, self.on_enter = step, on_enter

    @contextmanager
    def __call__(self, stage: str):
        if self.on_enter is not None:
            self.on_enter(self.step, stage)
        start = time.perf_counter()
        try:
            yield
        except StageFailed:
            raise
        except Exception as e:
            raise StageFailed(f"stage '{stage}' of step {self.step} failed: {type(e).__name__}: {e}") from e
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


class MetricsWriter:
    """Append-only JSON lines; one record per step (rank 0 only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def progress_postfix(record: dict, heldout: float | None) -> dict[str, str]:
    """What the progress bar shows beside the step count and ETA (Ray's launcher and torchrun's rank 0 alike);
    a record without throughput (a user's worker program) shows the rest."""
    shown = {"reward": f"{record['reward/mean']:.3f}", "heldout": "-" if heldout is None else f"{heldout:.3f}"}
    if "perf/tokens_per_second" in record:
        shown["tok_s"] = f"{record['perf/tokens_per_second']:,.0f}"
    return shown
