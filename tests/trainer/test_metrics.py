import pytest

from distflow.trainer.metrics import MeanAccumulator, StageFailed, StageTimer


def test_stage_errors_name_the_stage_and_step_and_keep_the_cause():
    seen = []
    timer = StageTimer(step=7, on_enter=lambda step, stage: seen.append((step, stage)))
    with pytest.raises(StageFailed, match="stage 'reward' of step 7 failed: ZeroDivisionError") as err:
        with timer("reward"):
            1 / 0
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    assert seen == [(7, "reward")] and "reward" in timer.seconds


def test_single_process_means_totals_and_maxima():
    acc = MeanAccumulator()
    acc.add("reward", 4.5, 1)
    acc.add("reward", 45.0, 2)
    acc.add_total("tokens", 450.0)
    acc.add_max("time", 3.0)
    acc.add_max("time", 1.0)
    assert acc.reduce() == {"reward": 49.5 / 3, "tokens": 450.0, "time": 3.0}


def _metrics_only_some_ranks_add(rank: int, world: int) -> dict:
    """Every rank adds the common metrics; rank 1 alone also adds those of rows only it
    holds (a VLM's images in a mixed batch, a tool's calls), and rank 0 alone another."""
    acc = MeanAccumulator()
    acc.add("reward/mean", 1.0 + rank, 1)
    acc.add_total("tokens/total", 10.0 * (rank + 1))
    acc.add_max("response/length_max", 5.0 * (rank + 1))
    if rank == 1:
        acc.add_total("images/batch_bytes", 64.0)
        acc.add("turns/mean", 6.0, 2)
        acc.add_max("time/tool", 0.5)
    else:
        acc.add("only_rank_0/mean", 7.0, 1)
    return acc.reduce()


def test_a_metric_some_ranks_did_not_add_is_reduced_over_those_that_did():
    from helpers import run_gloo

    want = {"reward/mean": 1.5, "tokens/total": 30.0, "response/length_max": 10.0, "images/batch_bytes": 64.0,
            "turns/mean": 3.0, "time/tool": 0.5, "only_rank_0/mean": 7.0}
    assert run_gloo(_metrics_only_some_ranks_add, 2, timeout=60) == [want, want]
