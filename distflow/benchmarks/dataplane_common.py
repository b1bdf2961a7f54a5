"""What every mode of the data-plane benchmark shares: the measurement's size (`Spec`),
the constants, the long-tailed batch each worker builds for its own rows, and the JSON
record of one measurement. The method is in `distflow.benchmarks.dataplane`'s docstring.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distflow.coordinator.partition import contiguous_split
from distflow.runtime.centralized import VERL_INSTALL

MODES = ("coordinator", "centralized-pickle", "centralized-zerocopy")
# verl's own DataProto dispatch (needs verl: README, Benchmarks): its default (torch.save) and numpy paths
VERL_MODES = ("centralized-verl", "centralized-verl-numpy")
# --baseline: the single controller the coordinator is compared with
BASELINE_MODES = {"ours": MODES,
                  "verl": ("coordinator", "centralized-zerocopy", "centralized-verl-numpy", "centralized-verl")}
TRANSITIONS = ("DP->DP", "DP->TP2", "TP2->DP")
FIELD_DTYPES = {"input_ids": torch.int64, "attention_mask": torch.int64,
                "old_log_probs": torch.float32, "advantages": torch.float32}
SEED = 0
VOCAB = 32_000
IMAGE_PATCH_FEATURES = 3 * 2 * 14 * 14  # Qwen2-VL's patch: 3 channels x 2 frames x 14x14 pixels, float32
IMAGE_TOKENS_PER_PATCH = 1 / 4  # its 2x2 merge
WARMUP_ROUNDS = 2  # the coordinator alternates two shared-memory slots: both made before timing
IMBALANCE_SAMPLES, IMBALANCE_KS = 1024, (2, 4, 8)
PLANNING_ROWS_PER_RANK = 256  # the planning section's samples per rank: B = 1024 at N = 4, as above
TIMEOUT_S = 900  # one measurement, generous for N=8 on 2 shared cores


def refuse_verl_modes_without_verl(parser, modes: list[str]) -> None:
    """One line (argparse's error) when a verl mode is asked for in a Python without verl."""
    import importlib.util

    if set(modes) & set(VERL_MODES) and importlib.util.find_spec("verl") is None:
        parser.error(f"the verl modes need verl in this Python: {VERL_INSTALL}")


@dataclass(frozen=True)
class Spec:
    """One measurement's size."""

    num_workers: int
    batch: int
    seq_len: int
    repeats: int
    image_patches: int = 0  # per sample: one image's pixel_values (patches, 1176), as a VLM batch carries

    @property
    def batch_bytes(self) -> int:
        """Tensor bytes of the whole batch (strings not counted)."""
        per_token = sum(torch.empty(0, dtype=d).element_size() for d in FIELD_DTYPES.values())
        return self.batch * (self.seq_len * per_token + self.image_patches * IMAGE_PATCH_FEATURES * 4)


def image_patches_of(megapixels: float) -> int:
    """Qwen2-VL's patches for a square image of `megapixels` (its sides rounded to 28 pixels)."""
    side = max(28, round(math.sqrt(megapixels * 1e6) / 28) * 28)
    return (side // 14) ** 2


def proc_status(key: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


# ---------------------------------------------------------------------------------
# The batch


def sample_lengths(n: int, seq_len: int, seed: int = SEED) -> np.ndarray:
    """Long-tailed token counts: lognormal around L/8, clipped to [L/16, L]."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=np.log(seq_len / 8), sigma=1.0, size=n)
    return np.clip(np.rint(raw), max(1, seq_len // 16), seq_len).astype(np.int64)


def token_lengths(spec: Spec) -> np.ndarray:
    """Each sample's tokens as the planner balances them: its text and its image tokens."""
    return sample_lengths(spec.batch, spec.seq_len) + int(spec.image_patches * IMAGE_TOKENS_PER_PATCH)


def shard_ids(rank: int, spec: Spec) -> list[int]:
    """Sample ids `rank` holds at the start: a contiguous block, as a rollout leaves them."""
    return contiguous_split([0] * spec.batch, spec.num_workers)[rank]


def make_shard(rank: int, spec: Spec) -> tuple[dict[str, torch.Tensor], list[str], list[int], list[int]]:
    """This rank's rows, built locally: (tensors, ground truths, sample ids, token lengths)."""
    ids = shard_ids(rank, spec)
    lengths = sample_lengths(spec.batch, spec.seq_len)[ids]
    gen = torch.Generator().manual_seed(SEED * 1009 + rank)
    n, width = len(ids), spec.seq_len
    mask = (torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]).to(torch.int64)
    tensors = {"input_ids": torch.randint(VOCAB, (n, width), generator=gen) * mask,
               "attention_mask": mask,
               "old_log_probs": -5.0 * torch.rand(n, width, generator=gen) * mask,
               # GRPO: one advantage per sequence, broadcast over its tokens
               "advantages": torch.randn(n, 1, generator=gen) * mask}
    assert {k: v.dtype for k, v in tensors.items()} == FIELD_DTYPES
    if spec.image_patches:  # a VLM sample's pixels: the heaviest field by far
        tensors["pixel_values"] = torch.randn((n, spec.image_patches, IMAGE_PATCH_FEATURES), generator=gen)
    return tensors, [str(s * 37 % 9973) for s in ids], ids, token_lengths(spec)[ids].tolist()


def _record(mode: str, spec: Spec, laps: list[list[float]], busiest: int,
            peak_rss: int | None, round_seconds: list[float] | None = None, **extra: Any) -> dict[str, Any]:
    """One JSON record; `laps` holds each timed round's per-transition seconds, and
    `round_seconds` each round's where it is not their sum (the coordinator's: the slowest
    rank's round, while each transition's slowest rank may be another)."""
    rounds = round_seconds if round_seconds is not None else [sum(lap) for lap in laps]
    return {"mode": mode, "num_workers": spec.num_workers, "batch": spec.batch,
            "seq_len": spec.seq_len, "seconds": statistics.median(rounds),
            "busiest_process_bytes": busiest, "driver_peak_rss_bytes": peak_rss,
            "batch_bytes": spec.batch_bytes, "where": "host", "repeats": spec.repeats,
            "image_patches": spec.image_patches,
            "transition_seconds": dict(zip(TRANSITIONS, (statistics.median(c) for c in zip(*laps)))),
            **extra}
