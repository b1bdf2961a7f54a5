import pytest

from distflow.coordinator.microbatch import padded_tokens, plan_micro_batches
from helpers import run_gloo


def test_fixed_size_keeps_order():
    assert plan_micro_batches([(2, 3)] * 7, micro_batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_token_budget_bounds_the_padded_forward():
    """The forward pads a micro-batch to its widest prompt and widest response, so the
    budget bounds rows x (widest prompt + widest response). Counting real tokens, one long
    row among 40 short ones made a padded tensor of 41 x 2,000 tokens under a budget of 4,096."""
    shapes = [(1000, 1000)] + [(20, 30)] * 40 + [(500, 10), (10, 500)]
    parts = plan_micro_batches(shapes, max_tokens=4096)
    assert sorted(i for p in parts for i in p) == list(range(len(shapes)))
    assert all(padded_tokens([shapes[i] for i in p]) <= 4096 for p in parts)
    assert parts == [[0, 41], [1, 2, 3, 4, 5, 6, 42], list(range(7, 41))]  # longest first, as few as fit
    assert padded_tokens([(500, 10), (10, 500)]) == 2 * (500 + 500)  # the widest prompt and the widest response
    with pytest.raises(ValueError, match="smaller than a 2000-token sequence"):
        plan_micro_batches(shapes, max_tokens=1999)


def _plan(rank, world):
    lengths = [[(100, 200)] * 10, [(100, 200)] * 2][rank]  # rank 1 has far fewer tokens
    return (plan_micro_batches(lengths, micro_batch_size=4),
            plan_micro_batches(lengths, max_tokens=1000))


def test_ranks_agree_on_the_count_and_pad_with_empty_micro_batches():
    (fixed0, budget0), (fixed1, budget1) = run_gloo(_plan, 2)
    assert len(fixed0) == len(fixed1) == 3 and fixed1 == [[0, 1], [], []]
    assert len(budget0) == len(budget1) == 4  # 3000 tokens / 1000, three sequences per part at most
    assert budget1 == [[0], [1], [], []]  # split to run lighter forwards, then empty ones
