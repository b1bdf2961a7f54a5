import pytest

from distflow.coordinator.microbatch import plan_micro_batches
from helpers import run_gloo


def test_fixed_size_keeps_order():
    assert plan_micro_batches([5] * 7, micro_batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_token_budget_fits_and_balances():
    lengths = [900, 100, 100, 100, 500, 450, 50, 800]
    parts = plan_micro_batches(lengths, max_tokens=1000)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 1000 for p in parts)
    assert len(parts) == 3  # 3000 tokens need at least 3 micro-batches of 1000
    with pytest.raises(ValueError, match="smaller than a 900-token sequence"):
        plan_micro_batches(lengths, max_tokens=800)


def _plan(rank, world):
    lengths = [[300] * 10, [300] * 2][rank]  # rank 1 has far fewer tokens
    return (plan_micro_batches(lengths, micro_batch_size=4),
            plan_micro_batches(lengths, max_tokens=1000))


def test_ranks_agree_on_the_count_and_pad_with_empty_micro_batches():
    (fixed0, budget0), (fixed1, budget1) = run_gloo(_plan, 2)
    assert len(fixed0) == len(fixed1) == 3 and fixed1 == [[0, 1], [], []]
    assert len(budget0) == len(budget1) == 4  # 3000 tokens / 1000, three sequences per part at most
    assert sorted(i for p in budget1 for i in p) == [0, 1] and [] in budget1
