import pytest

from distflow.engines.reward import (default_compute_score, extract_hash_answer, gsm8k_score, load_reward_fn,
                                     math_verify_score)


def test_hash_answer_extraction():
    assert extract_hash_answer("3+4=7\n#### 7") == "7"
    assert extract_hash_answer("#### -1,234") == "-1234"
    assert extract_hash_answer("#### 2.5 and #### 9") == "2.5"
    assert extract_hash_answer("the answer is 7") is None


def test_gsm8k_score():
    assert gsm8k_score("5*6=30\n#### 30", "30") == 1.0
    assert gsm8k_score("#### 30.0", "30") == 1.0
    assert gsm8k_score("#### 31", "30") == 0.0
    assert gsm8k_score("30", "30") == 0.0  # no #### -> no credit, as in verl's strict mode


def test_math_verify_boxed():
    assert math_verify_score("so the result is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_verify_score("$\\boxed{3}$", "\\boxed{4}") == 0.0


def test_default_dispatch():
    assert default_compute_score("distflow/arith", "#### 12", "12") == 1.0
    assert default_compute_score("lighteval/MATH", "$\\boxed{12}$", "12") == 1.0
    assert default_compute_score("lighteval/MATH", "#### 12", "12") == 1.0


def test_custom_reward_from_file_and_module(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 45.0 if ground_truth in solution_str else -4.5\n")
    fn = load_reward_fn(f"{tmp_path / 'my_reward.py'}:score")
    assert fn("x", "abc", "b", {}) == 45.0 and fn("x", "abc", "z", {}) == -4.5
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("my_reward:score")("x", "q", "q", {}) == 45.0
    assert load_reward_fn(None) is default_compute_score


@pytest.mark.parametrize("spec, fragment", [
    ("nosuchmodule_xyz:fn", "cannot import nosuchmodule_xyz"),
    ("/no/file.py:fn", "no such file"),
    ("distflow.engines.reward:nope", "has no function nope"),
    ("justaname", "expected module:function"),
])
def test_bad_custom_reward_specs(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_reward_fn(spec)


# ---------------------------------------------------------------------------- RewardRunner

HOSTILE_REWARDS = '''
import math, os, time

def score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ZeroDivisionError("bad sample")
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "nan":
        return math.nan
    if solution_str == "text":
        return "high"
    if solution_str == "die":
        os._exit(3)
    return float(len(solution_str))
'''


@pytest.mark.parametrize("timeout_s", [0.0, 5.0])
def test_reward_runner_scores_failures_zero_and_goes_on(tmp_path, timeout_s, capsys):
    from distflow.engines.reward import FAILED, OK, RewardRunner

    (tmp_path / "hostile.py").write_text(HOSTILE_REWARDS)
    runner = RewardRunner(f"{tmp_path / 'hostile.py'}:score", timeout_s)
    try:
        assert runner("d", "abc", "x") == (3.0, OK)
        assert runner("d", "raise", "x") == (0.0, FAILED)
        assert runner("d", "nan", "x") == (0.0, FAILED)
        assert runner("d", "text", "x") == (0.0, FAILED)
        assert runner("d", "abcd", "x") == (4.0, OK)
    finally:
        runner.close()
    err = capsys.readouterr().err
    assert err.count("reward function failed") == 1 and "ZeroDivisionError: bad sample" in err


def test_reward_runner_times_out_a_hanging_call_and_survives_a_dying_one(tmp_path):
    import time

    from distflow.engines.reward import FAILED, OK, TIMED_OUT, RewardRunner

    (tmp_path / "hostile.py").write_text(HOSTILE_REWARDS)
    runner = RewardRunner(f"{tmp_path / 'hostile.py'}:score", 1.0)
    try:
        start = time.monotonic()
        assert runner("d", "hang", "x") == (0.0, TIMED_OUT)
        assert time.monotonic() - start < 30  # the per-call limit, not the hour the call wanted
        assert runner("d", "ab", "x") == (2.0, OK)  # a fresh child
        assert runner("d", "die", "x") == (0.0, FAILED)
        assert runner("d", "abc", "x") == (3.0, OK)
    finally:
        runner.close()


def test_math_verify_works_off_the_main_thread():
    """Reward nodes run on the scheduler's threads, where SIGALRM timeouts cannot."""
    from concurrent.futures import ThreadPoolExecutor

    from distflow.engines.reward import math_verify_score

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_verify_score, "so the answer is \\boxed{\\frac{1}{2}}", "0.5").result() == 1.0
