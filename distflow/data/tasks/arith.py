"""The built-in verifiable task: arithmetic word problems with integer answers.

GSM8K's convention: the worked solution ends with `#### <answer>`. Three difficulty
levels (one addition; add then subtract; a product of small numbers). The tool task
(`builtin:arith-tools:...`) adds a fourth, a product of two two-digit numbers, which the
tiny model cannot work out by itself but can with a calculator. Train and test are
disjoint and deterministic: a problem belongs to a split by a stable hash of its question
text, so the same seed always yields the same rows whatever the requested sizes.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

DATA_SOURCE = "distflow/arith"

_NAMES = ("Ann", "Bob", "Cat", "Dan", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lee", "Max", "Ned", "Oli", "Pam")
_ITEMS = ("pens", "cups", "eggs", "hats", "keys", "maps", "nuts", "pins", "toys", "jars", "apples", "books")

LEVELS = (1, 2, 3)
TOOL_TASK_LEVELS = LEVELS + (4,)


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked steps, then "#### <answer>"
    answer: int
    level: int
    expression: str  # the whole computation in one line, as a calculator takes it


def make_problem(rng: random.Random, level: int) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if level == 1:
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        ans = a + b
        q = f"{name} has {a} {item}, gets {b} more. How many?"
        steps, expression = f"{a}+{b}={ans}", f"{a}+{b}"
    elif level == 2:
        a, b = rng.randint(10, 40), rng.randint(1, 9)
        c = rng.randint(1, 20)
        mid = a - b
        ans = mid + c
        q = f"{name} has {a} {item}, loses {b}, gets {c}. How many?"
        steps, expression = f"{a}-{b}={mid}\n{mid}+{c}={ans}", f"{a}-{b}+{c}"
    elif level == 3:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        ans = a * b
        q = f"{name} buys {a} bags of {b} {item}. How many?"
        steps, expression = f"{a}*{b}={ans}", f"{a}*{b}"
    elif level == 4:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        ans = a * b
        q = f"{name} packs {a} crates of {b} {item}. How many?"
        steps, expression = f"{a}*{b}={ans}", f"{a}*{b}"
    else:
        raise ValueError(f"level={level}: allowed levels are {TOOL_TASK_LEVELS}")
    return Problem(question=q, solution=f"{steps}\n#### {ans}", answer=ans, level=level, expression=expression)


def _split_of(question: str) -> str:
    digest = hashlib.sha256(question.encode()).digest()
    return "test" if digest[0] < 26 else "train"  # about 10% of the problem space is held out


MAX_MISSES = 100_000


def generate(split: str, num: int, seed: int = 0, levels: tuple[int, ...] = LEVELS) -> list[Problem]:
    """`num` distinct problems of `split` ('train' or 'test'), `levels` mixed evenly."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: allowed are train, test")
    rng = random.Random(f"arith-{seed}")
    seen: set[str] = set()
    out: list[Problem] = []
    misses = 0  # draws in a row that gave nothing new: the level has run out of distinct problems
    while len(out) < num:
        level = levels[len(out) % len(levels)]
        p = make_problem(rng, level)
        if p.question in seen or _split_of(p.question) != split:
            misses += 1
            if misses > MAX_MISSES:
                raise ValueError(f"the {split} split runs out of distinct level-{level} problems after {len(out)} "
                                 f"of the {num} asked for (levels mixed evenly); ask for fewer")
            continue
        misses = 0
        seen.add(p.question)
        out.append(p)
    return out


def to_verl_row(p: Problem, index: int, split: str) -> dict:
    """One row in verl's parquet schema (as verl's gsm8k preprocessing writes it)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": p.question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
        "extra_info": {"split": split, "index": index, "level": p.level, "answer": p.solution},
    }


def verl_rows(split: str, num: int, seed: int = 0, levels: tuple[int, ...] = LEVELS) -> list[dict]:
    return [to_verl_row(p, i, split) for i, p in enumerate(generate(split, num, seed, levels))]
