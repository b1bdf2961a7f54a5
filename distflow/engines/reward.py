"""Rule-based rewards and user reward functions.

The reward function contract is verl's `compute_score`:

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float

The default dispatches on the answer style: GSM8K's `#### <answer>` when the response
has one, otherwise `math_verify` on `\\boxed{...}` answers. A custom function is named
as `package.module:function` or `path/to/file.py:function`.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from distflow.plugins import load_callable

_HASH_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


class RewardFn(Protocol):
    def __call__(self, data_source: str, solution_str: str, ground_truth: str,
                 extra_info: dict[str, Any] | None = None) -> float: ...


def extract_hash_answer(text: str) -> str | None:
    """The number after the first `####`, commas removed; None if there is none."""
    m = _HASH_ANSWER.search(text)
    return m.group(1).replace(",", "") if m else None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a.strip() == b.strip()


def gsm8k_score(solution_str: str, ground_truth: str) -> float:
    answer = extract_hash_answer(solution_str)
    return 1.0 if answer is not None and _same_number(answer, ground_truth) else 0.0


def math_verify_score(solution_str: str, ground_truth: str) -> float:
    from math_verify import parse, verify

    gold = parse(ground_truth if "\\boxed" in ground_truth or "$" in ground_truth else f"${ground_truth}$")
    pred = parse(solution_str)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict[str, Any] | None = None) -> float:
    if "####" in solution_str or "gsm8k" in data_source or data_source.startswith("distflow/arith"):
        return gsm8k_score(solution_str, ground_truth)
    return math_verify_score(solution_str, ground_truth)


def load_reward_fn(spec: str | None) -> RewardFn:
    """`None` -> the default; `module:function` or `file.py:function` -> that function."""
    return default_compute_score if spec is None else load_callable(spec, "reward.custom_fn")
