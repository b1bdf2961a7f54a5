"""The built-in image task: count the dots in a picture.

Each problem is a small PNG drawn with Pillow (black dots on mid-grey, none touching) and
the question "How many dots are in the image?"; the answer is the count, in GSM8K's
`#### <answer>` convention. Three levels: 1-3, 4-6 and 7-9 dots. Rows use verl's
multimodal schema: an `images` column (a list of `{"bytes": png}`) beside the chat
`prompt`, whose text holds one `<image>` placeholder where the picture goes. Train and
test are disjoint by a stable hash of the dots' positions, like the arithmetic task; each
row is drawn and rendered only when it is read.
"""

from __future__ import annotations

import hashlib
import io
import random
from collections.abc import Sequence
from dataclasses import dataclass

DATA_SOURCE = "distflow/dots"
LEVELS = (1, 2, 3)
IMAGE_SIZE = 56  # pixels per side: 4x4 patches of 14, so 4 image tokens after Qwen2-VL's 2x2 merge
DOT_RADIUS = 3
# CLIP's mean colour, which Qwen2-VL's processor normalises to 0, so that the dots carry the signal
BACKGROUND = (123, 117, 104)
QUESTION = "<image>How many dots are in the image?"


@dataclass(frozen=True)
class Problem:
    centers: tuple[tuple[int, int], ...]
    level: int

    @property
    def answer(self) -> int:
        return len(self.centers)

    @property
    def solution(self) -> str:
        return f"There are {self.answer} dots.\n#### {self.answer}"


def make_problem(rng: random.Random, level: int) -> Problem:
    if level not in LEVELS:
        raise ValueError(f"level={level}: allowed levels are {LEVELS}")
    count = rng.randint(3 * level - 2, 3 * level)
    low, high = DOT_RADIUS + 1, IMAGE_SIZE - DOT_RADIUS - 2
    centers: list[tuple[int, int]] = []
    while len(centers) < count:  # rejection sampling: dots at least one radius apart
        c = (rng.randint(low, high), rng.randint(low, high))
        if all((c[0] - x) ** 2 + (c[1] - y) ** 2 > (3 * DOT_RADIUS) ** 2 for x, y in centers):
            centers.append(c)
    return Problem(tuple(sorted(centers)), level)


def render(p: Problem) -> bytes:
    """The problem's picture as PNG bytes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for x, y in p.centers:
        draw.ellipse((x - DOT_RADIUS, y - DOT_RADIUS, x + DOT_RADIUS, y + DOT_RADIUS), fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _split_of(p: Problem) -> str:
    digest = hashlib.sha256(repr(p.centers).encode()).digest()
    return "test" if digest[0] < 26 else "train"


def problem(split: str, index: int, seed: int = 0, levels: tuple[int, ...] = LEVELS) -> Problem:
    """Problem `index` of `split` ('train' or 'test'), a pure function of its arguments (so
    a worker draws only the rows it reads); `levels` take turns."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: allowed are train, test")
    for attempt in range(1000):  # about 10% of scenes are test scenes
        p = make_problem(random.Random(f"dots-{seed}-{index}-{attempt}"), levels[index % len(levels)])
        if _split_of(p) == split:
            return p
    raise AssertionError("unreachable: a split got no scene in 1000 draws")


def generate(split: str, num: int, seed: int = 0, levels: tuple[int, ...] = LEVELS) -> list[Problem]:
    return [problem(split, i, seed, levels) for i in range(num)]


def to_verl_row(p: Problem, index: int, split: str) -> dict:
    """One row in verl's multimodal parquet schema (as verl's geo3k preprocessing writes it)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION}],
        "images": [{"bytes": render(p)}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
        "extra_info": {"split": split, "index": index, "level": p.level, "answer": p.solution},
    }


class VerlRows(Sequence):
    """`num` rows of `split`, each drawn and rendered when it is read."""

    def __init__(self, split: str, num: int, seed: int = 0, levels: tuple[int, ...] = LEVELS):
        self.split, self.num, self.seed, self.levels = split, num, seed, levels

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, index):
        if not 0 <= index < self.num:
            raise IndexError(index)
        return to_verl_row(problem(self.split, index, self.seed, self.levels), index, self.split)
