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
