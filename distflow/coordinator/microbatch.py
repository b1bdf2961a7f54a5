"""Micro-batches that keep ranks in lockstep.

FSDP runs collectives inside every forward and backward, so every rank must run the
same number of micro-batches. The count is agreed with one all-reduce (MAX); a rank
with fewer samples runs empty micro-batches, which the engine turns into a zero-loss
forward on a masked row. Two policies:

* fixed size (`micro_batch_size`): consecutive chunks, order kept;
* token budget (`max_tokens`, verl's `use_dynamic_bsz`): the forward runs a micro-batch
  padded to its widest prompt and its widest response (there is no padding removal), so
  the budget bounds those padded tokens, rows x (widest prompt + widest response), which
  is what the forward's activations scale with. Rows go longest first, each into the
  micro-batch being filled or a new one, so rows of like length share one and little of
  it is padding.
"""

from __future__ import annotations

from collections.abc import Sequence

from distflow.collectives import all_reduce_max

Shape = tuple[int, int]  # (prompt tokens, response tokens) of one row


def padded_tokens(shapes: Sequence[Shape]) -> int:
    """The tokens a padded forward of these rows computes."""
    if not shapes:
        return 0
    return len(shapes) * (max(p for p, _ in shapes) + max(r for _, r in shapes))


def _fill_budget(shapes: Sequence[Shape], max_tokens: int) -> list[list[int]]:
    longest = max(p + r for p, r in shapes)
    if longest > max_tokens:
        raise ValueError(f"actor.max_tokens_per_micro_batch={max_tokens} is smaller than a "
                         f"{longest}-token sequence; raise it to at least that")
    parts: list[list[int]] = []
    rows: list[int] = []
    widest_prompt = widest_response = 0
    for i in sorted(range(len(shapes)), key=lambda i: -sum(shapes[i])):
        p, r = shapes[i]
        prompt, response = max(widest_prompt, p), max(widest_response, r)
        if rows and (len(rows) + 1) * (prompt + response) > max_tokens:
            parts.append(sorted(rows))
            rows, prompt, response = [], p, r
        rows.append(i)
        widest_prompt, widest_response = prompt, response
    return parts + [sorted(rows)]


def local_micro_batches(shapes: Sequence[Shape], *, micro_batch_size: int | None = None,
                        max_tokens: int | None = None) -> list[list[int]]:
    """This rank's micro-batches before the count is agreed (no collective)."""
    assert (micro_batch_size is None) != (max_tokens is None), "give exactly one policy"
    n = len(shapes)
    if micro_batch_size is not None:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    return _fill_budget(shapes, max_tokens) if n else []


def _split_to(parts: list[list[int]], k: int) -> list[list[int]]:
    """Up to k micro-batches, halving the one with the most rows while there are fewer:
    each half computes fewer padded tokens than the whole, so it stays in the budget."""
    parts = list(parts)
    while parts and len(parts) < k:
        biggest = max(range(len(parts)), key=lambda j: len(parts[j]))
        rows = parts[biggest]
        if len(rows) < 2:
            break
        parts[biggest: biggest + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    return parts


def plan_micro_batches(shapes: Sequence[Shape], *, micro_batch_size: int | None = None,
                       max_tokens: int | None = None, group=None) -> list[list[int]]:
    """Row indices of each micro-batch; the same number of micro-batches on every rank.
    `shapes`: each row's (prompt tokens, response tokens)."""
    parts = local_micro_batches(shapes, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    k = all_reduce_max(max(len(parts), 1), group)
    if max_tokens is not None:  # more, smaller parts: less work in each lockstep forward
        parts = _split_to(parts, k)
    return parts + [[] for _ in range(k - len(parts))]
