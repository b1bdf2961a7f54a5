import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distflow.engines.reward import (default_compute_score, extract_gsm8k_answer, extract_hash_answer, gsm8k_score,
                                     load_reward_fn, math_verify_score)


def test_hash_answer_extraction():
    assert extract_hash_answer("3+4=7\n#### 7") == "7"
    assert extract_hash_answer("#### -1,234") == "-1234"
    # the last `####` is the answer (this asserted "2.5", the first one, before: the bug the
    # issue reports, a response that corrects itself must be scored on its final answer)
    assert extract_hash_answer("#### 2.5 and #### 9") == "9"
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
    # markdown headings are not a GSM8K answer: the boxed answer is read by math-verify
    steps = "#### Step 1: compute\n2+3=5\n#### Answer\nThe answer is \\boxed{5}"
    assert default_compute_score("lighteval/MATH", steps, "5") == 1.0
    # nor are numbered ones ("#### 2. Add"): their step number was read as the answer over the boxed one
    numbered = "#### 1. Count the apples\n40\n#### 2. Add the pears\n40 + 2 = 42.\nThe answer is \\boxed{42}."
    assert default_compute_score("math_dapo", numbered, "42") == 1.0
    assert default_compute_score("math_dapo", "##### 3 cases\nThey give 42.\n\\boxed{42}", "42") == 1.0
    assert default_compute_score("math_dapo", "#### 1. Setup\nx = 42\n#### Final answer\n\\boxed{42}", "42") == 1.0
    assert default_compute_score("math_dapo", "#### 1. Setup\nx = 40 + 2\n#### 2. Result\nx = 42", "42") == 1.0
    assert default_compute_score("math_dapo", "so #### 42.", "42") == 1.0  # an answer's full stop is no heading
    # a `####` answer to a ground truth that is more than one number (MATH's LaTeX) is math-verify's to read:
    # the GSM8K rule read the truth's leading number and took wrong answers ...
    assert default_compute_score("lighteval/MATH", "#### 2", "2,\\!000") == 0.0
    assert default_compute_score("lighteval/MATH", "so 2\\sqrt{3}. #### 2", "2\\sqrt{3}") == 0.0
    assert default_compute_score("lighteval/MATH", "#### 10", "10^{5}") == 0.0
    # ... and refused right ones
    assert default_compute_score("lighteval/MATH", "\\boxed{2000}. #### 2000", "2,\\!000") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{\\frac{1}{2}}\n#### 1/2", "\\frac{1}{2}") == 1.0
    assert default_compute_score("lighteval/MATH", "#### 1,000.", "1000") == 1.0  # a number: the GSM8K rule
    assert default_compute_score("mydata", "#### 5", "5 dollars") == 1.0  # ... with a unit, as the rule reads it
    assert default_compute_score("mydata", "#### 1", "1, 2") == 0.0  # two numbers are no one number


def test_custom_reward_from_file_and_module(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 45.0 if ground_truth in solution_str else -4.5\n")
    fn = load_reward_fn(f"{tmp_path / 'my_reward.py'}:score")
    assert fn("x", "abc", "b", {}) == 45.0 and fn("x", "abc", "z", {}) == -4.5
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("my_reward:score")("x", "q", "q", {}) == 45.0
    assert load_reward_fn(None) is default_compute_score


VERL_SIGNATURES = """
from __future__ import annotations
from dataclasses import dataclass

@dataclass
class Settings:  # a dataclass of a module given by its file, under postponed annotations
    bonus: float = 1.0

def reordered(solution_str, ground_truth, data_source=None, extra_info=None):
    return Settings().bonus if solution_str == ground_truth and data_source == "src" else 0.0

def any_keywords(**kwargs):
    return float(kwargs["solution_str"] == kwargs["ground_truth"] and kwargs["extra_info"] == {"k": 1})

def positional(a, b, c, d):
    return 1.0

import asyncio
_judge_loop = None

async def judged(data_source, solution_str, ground_truth, extra_info=None):
    # an LLM judge's shape: it awaits its client, which is bound to the loop it first ran on
    global _judge_loop
    loop = asyncio.get_running_loop()
    _judge_loop = _judge_loop or loop
    if loop is not _judge_loop:
        raise RuntimeError("the judge's client is bound to another event loop")
    await asyncio.sleep(0)
    return {"score": float(solution_str == ground_truth)}
"""


@pytest.mark.parametrize("timeout_s", [0.0, 30.0], ids=["in-process", "child"])
def test_a_reward_function_gets_verl_s_keyword_arguments(tmp_path, timeout_s):
    """verl calls compute_score(data_source=..., solution_str=..., ground_truth=...,
    extra_info=...): a function with its parameters in another order, or taking **kwargs,
    scores as it does there (called by position, the first scored every sample 0 as a
    success and the second failed every sample), and an `async def` one is awaited, call
    after call on one event loop (its coroutine failed every sample). One whose parameters are named otherwise
    is refused at start-up in one line."""
    from distflow.engines.reward import OK, RewardRunner

    (tmp_path / "verl_style.py").write_text(VERL_SIGNATURES)
    reordered = RewardRunner(f"{tmp_path / 'verl_style.py'}:reordered", timeout_s)
    assert reordered("src", "42", "42", {}) == (1.0, OK) and reordered("src", "41", "42", {}) == (0.0, OK)
    assert RewardRunner(f"{tmp_path / 'verl_style.py'}:any_keywords", timeout_s)("s", "7", "7", {"k": 1}) == (1.0, OK)
    judged = RewardRunner(f"{tmp_path / 'verl_style.py'}:judged", timeout_s)  # async def, awaited as verl does
    assert [judged("s", answer, "7", {}) for answer in ("7", "8", "7")] == [(1.0, OK), (0.0, OK), (1.0, OK)]
    with pytest.raises(ValueError, match=r"reward.custom_fn=.*:positional'?: positional\(a, b, c, d\) cannot be "
                                         r"called with verl's keyword arguments"):
        RewardRunner(f"{tmp_path / 'verl_style.py'}:positional", timeout_s)


@pytest.mark.parametrize("spec, fragment", [
    ("nosuchmodule_xyz:fn", "cannot import nosuchmodule_xyz"),
    ("/no/file.py:fn", "no such file"),
    ("distflow.engines.reward:nope", "has no function nope"),
    ("justaname", "expected module:function"),
])
def test_bad_custom_reward_specs(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_reward_fn(spec)


@pytest.mark.parametrize("form", ["module", "file"])
def test_a_module_that_fails_as_it_imports_is_one_line_in_either_form(form, tmp_path, monkeypatch):
    """`module:function` let a SyntaxError (or any error but ImportError) through as a
    traceback, where `file.py:function` gave one line."""
    (tmp_path / "broken_rewards_mod.py").write_text("def score(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "broken_rewards_mod:score" if form == "module" else f"{tmp_path / 'broken_rewards_mod.py'}:score"
    with pytest.raises(ValueError, match=r"^reward.custom_fn=.*: importing .*broken_rewards_mod(\.py)? failed: "
                                         r"SyntaxError: "):
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
    if solution_str == "numeric text":  # str(score) by mistake: float() read it as a score
        return {"score": "0.7"}
    if solution_str == "die":
        os._exit(3)
    if solution_str == "dict":  # verl's DAPO scorer's form
        return {"score": 2.5, "acc": True}
    if solution_str == "tuple":
        return (1.5, {"acc": False})
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
        assert runner("d", "numeric text", "x") == (0.0, FAILED)
        assert runner("d", "abcd", "x") == (4.0, OK)
        assert runner("d", "dict", "x") == (2.5, OK) and runner("d", "tuple", "x") == (1.5, OK)
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


def test_the_reward_process_ends_when_the_worker_that_started_it_is_killed_mid_call(tmp_path):
    """A worker killed (SIGKILL) while its reward child runs a long call: the child did not
    read its closed input until the call ended, an hour here, and lived on as an orphan."""
    import signal
    import time

    (tmp_path / "hostile.py").write_text(HOSTILE_REWARDS)
    worker = subprocess.Popen([sys.executable, "-c", f"""
import threading, time
from distflow.engines.reward import RewardRunner
runner = RewardRunner({str(tmp_path / 'hostile.py')!r} + ":score", 3600.0)
threading.Thread(target=runner, args=("d", "hang", "x"), daemon=True).start()
while runner._proc is None:
    time.sleep(0.05)
print(runner._proc.pid, flush=True)
time.sleep(3600)
"""], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(worker.stdout.readline())
        time.sleep(2.0)  # the child has started and taken the call
        assert _alive(child)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        worker.kill()
        worker.wait(10)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie left for a reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_reward_process_that_fails_to_restart_fails_the_sample_not_the_run(tmp_path, capsys):
    from distflow.engines.reward import FAILED, OK, RewardRunner

    marker = tmp_path / "imported"
    (tmp_path / "second_import_fails.py").write_text(  # imports in the first reward process, not in the next
        "import pathlib\n"
        f"MARKER = pathlib.Path({str(marker)!r})\n"
        "if MARKER.exists():\n"
        "    raise ImportError('a dependency the reward process lacks')\n"
        "MARKER.touch()\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n")
    runner = RewardRunner(f"{tmp_path / 'second_import_fails.py'}:score", 5.0)
    try:
        assert runner("d", "abc", "x") == (1.0, OK)
        runner._proc.kill()  # it dies between calls (an OOM kill): the next call starts another, which fails
        runner._proc.wait(5)
        assert runner("d", "abc", "x") == (0.0, FAILED)
    finally:
        runner.close()
    assert "second_import_fails.py failed: ImportError: a dependency the reward process lacks" in \
        capsys.readouterr().err


@pytest.mark.parametrize("timeout_s", [0.0, 30.0], ids=["in-process", "child"])
def test_reward_fn_kwargs_reach_every_call_of_the_custom_function(tmp_path, timeout_s):
    """verl's custom_reward_function.reward_kwargs: more keyword arguments to every call;
    a function that cannot take them is refused at start-up in one line."""
    from distflow.engines.reward import OK, RewardRunner

    (tmp_path / "tunable.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None, strict=False, bonus=0.0):\n"
        "    right = solution_str == ground_truth if strict else solution_str.strip() == ground_truth\n"
        "    return float(right) + bonus\n")
    spec = f"{tmp_path / 'tunable.py'}:score"
    runner = RewardRunner(spec, timeout_s, kwargs={"strict": True, "bonus": 0.5})
    try:
        assert runner("d", "7", "7", {}) == (1.5, OK) and runner("d", " 7", "7", {}) == (0.5, OK)
    finally:
        runner.close()
    with pytest.raises(ValueError, match=r"cannot be called with verl's keyword arguments data_source, solution_str, "
                                         r"ground_truth, extra_info and reward.custom_fn_kwargs' strict, typo$"):
        RewardRunner(spec, timeout_s, kwargs={"strict": True, "typo": 1})


SEVERAL_REWARDS = """
import asyncio

def fmt(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.startswith("####") else 0.0

def score(data_source, solution_str, ground_truth, extra_info=None):  # verl's DAPO scorer's form
    right = solution_str.removeprefix("####").strip() == ground_truth
    return {"score": 1.0 if right else -1.0, "acc": right}

def only_long(data_source, solution_str, ground_truth, extra_info=None):  # None or NaN: not this one's sample
    return float(len(solution_str)) if len(solution_str) > 4 else None if solution_str != "nan" else float("nan")

def slow_fmt(data_source, solution_str, ground_truth, extra_info=None):  # a plain function beside an async one
    import time
    time.sleep(0.3)
    return 1.0

async def judged(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return 0.25
"""


@pytest.mark.parametrize("timeout_s", [0.0, 30.0], ids=["in-process", "child"])
def test_several_reward_functions_score_their_weighted_sum_each_kept_by_name(tmp_path, timeout_s):
    """TRL's reward_funcs with reward_weights: the score is the weighted sum, each function's
    own score is kept under its name (logged as reward_extra/<name>; a function called
    "score" gets its position), a dict's "acc" stays the accuracy, a None adds nothing, and
    all None fails the sample; an async function among them makes the sum awaited."""
    from distflow.engines.reward import FAILED, OK, RewardRunner

    (tmp_path / "several.py").write_text(SEVERAL_REWARDS)
    path = tmp_path / "several.py"
    runner = RewardRunner(f"{path}:fmt,{path}:score,{path}:only_long", timeout_s, weights=[0.5, 2.0, 0.1])
    try:
        assert runner.scored("d", "#### 7", "7", {}) == (0.5 + 2.0 + 0.1 * 6, OK, {
            "fmt": 1.0, "acc": 1.0, "score_2": 1.0, "only_long": 6.0})
        assert runner.scored("d", "8", "7", {}) == (-2.0, OK, {"fmt": 0.0, "acc": 0.0, "score_2": -1.0})
    finally:
        runner.close()
    nothing = RewardRunner(f"{path}:only_long,{path}:only_long", timeout_s)
    try:
        assert nothing("d", "8", "7", {}) == (0.0, FAILED) and nothing("d", "nan", "7", {}) == (0.0, FAILED)
    finally:
        nothing.close()
    awaited = RewardRunner(f"{path}:fmt,{path}:judged", timeout_s, weights=[1.0, 4.0])
    try:
        assert awaited.is_async and awaited.scored_all([("d", "#### 7", "7", {}), ("d", "7", "7", {})]) == [
            (2.0, OK, {"fmt": 1.0, "judged": 0.25}), (1.0, OK, {"fmt": 0.0, "judged": 0.25})]
    finally:
        awaited.close()
    if timeout_s:  # the plain one runs on a thread: on the event loop, six of its 0.3 s calls in a row put the
        # later samples past their 1 s limits
        beside = RewardRunner(f"{path}:slow_fmt,{path}:judged", 1.0, concurrency=6)
        try:
            assert beside.scored_all([("d", "7", "7", {})] * 6) == [(1.25, OK, {"slow_fmt": 1.0, "judged": 0.25})] * 6
        finally:
            beside.close()


def test_a_custom_reward_module_is_imported_in_the_reward_process_alone(tmp_path):
    """It was imported in the worker too (to fail a bad name early), where it is never
    called: a judge model loaded at import was held twice per worker."""
    from distflow.engines.reward import OK, RewardRunner

    log = tmp_path / "imported-by"
    (tmp_path / "judge_at_import.py").write_text(
        f"import os\nwith open({str(log)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    runner = RewardRunner(f"{tmp_path / 'judge_at_import.py'}:score", 5.0)
    try:
        assert runner("d", "abc", "x") == (1.0, OK)
        assert log.read_text().split() == [str(runner._proc.pid)]
    finally:
        runner.close()


ASYNC_JUDGE = """
import asyncio, time
in_flight = peak = 0

async def judge(data_source, solution_str, ground_truth, extra_info=None):
    global in_flight, peak
    in_flight += 1
    peak = max(peak, in_flight)
    try:
        if solution_str == "slow":  # a request that never comes back
            await asyncio.sleep(3600)
        if solution_str == "block":  # blocking code in the coroutine: its event loop stops with it
            await asyncio.sleep(0.2)
            time.sleep(3600)
        for _ in range(3):  # a request's round trip
            await asyncio.sleep(0)
        return {"score": float(solution_str == ground_truth), "peak": peak}
    finally:
        in_flight -= 1
"""


@pytest.mark.parametrize("timeout_s", [0.0, 2.0], ids=["in-process", "child"])
def test_an_async_reward_function_s_samples_are_awaited_together(tmp_path, timeout_s):
    """An LLM judge awaited one sample after another took a round trip per sample; a
    worker's samples are in flight together now, reward.async_concurrency at a time."""
    from distflow.engines.reward import OK, TIMED_OUT, RewardRunner

    (tmp_path / "judge.py").write_text(ASYNC_JUDGE)
    runner = RewardRunner(f"{tmp_path / 'judge.py'}:judge", timeout_s, concurrency=4)
    try:
        answers = ["7", "8", "7", "7", "9", "7", "7", "8", "7", "7"]
        results = runner.scored_all([("d", answer, "7", {}) for answer in answers])
        assert [(score, status) for score, status, _ in results] == [(float(a == "7"), OK) for a in answers]
        assert max(extras["peak"] for _, _, extras in results) == 4  # four at once, never more
        if not timeout_s:
            return
        child = runner._proc.pid
        slow = runner.scored_all([("d", "7", "7", {}), ("d", "slow", "7", {}), ("d", "8", "7", {})])
        assert [(score, status) for score, status, _ in slow] == [(1.0, OK), (0.0, TIMED_OUT), (0.0, OK)]
        assert runner._proc.pid == child  # cancelled, the others scored: the reward process goes on
        blocked = runner.scored_all([("d", "7", "7", {}), ("d", "block", "7", {})])
        # no reply past the deadline: the process is killed; what was scored before is kept
        assert [(score, status) for score, status, _ in blocked] == [(1.0, OK), (0.0, TIMED_OUT)]
        assert runner.scored_all([("d", "7", "7", {})])[0][:2] == (1.0, OK)  # by a fresh one
        assert runner._proc.pid != child
    finally:
        runner.close()


def test_math_verify_works_off_the_main_thread():
    """Reward nodes run on the scheduler's threads, where SIGALRM timeouts cannot."""
    from concurrent.futures import ThreadPoolExecutor

    from distflow.engines.reward import math_verify_score

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_verify_score, "so the answer is \\boxed{\\frac{1}{2}}", "0.5").result() == 1.0


# ---------------------------------------------------------------------------- reading answers as a grader does

# Each answer form: (form, response, ground truth, strict, flexible, math-verify). These rows
# are the table in docs/REWARDS.md (test_docs_table_matches_the_functions checks that the
# table there is this one); strict/flexible are (what gsm8k_score read, its score).
ANSWER_FORMS = [
    ("plain", "#### 72", "72", ("72", 1), ("72", 1), 1),
    ("corrected answer: the last `####` counts", "#### 72 ... no, wait. #### 73", "73", ("73", 1), ("73", 1), 1),
    ("corrected answer, ground truth the first one", "#### 72 ... no, wait. #### 73", "72", ("73", 0), ("73", 0), 0),
    ("a closing `####` after the answer", "#### 72 ####", "72", ("72", 1), ("72", 1), 1),
    ("a heading after the answer", "#### 72 #### Final Answer", "72", ("72", 1), ("72", 1), 1),
    ("dollar sign", "#### $72", "72", ("72", 1), ("72", 1), 1),
    ("euro sign", "#### €72", "72", ("72", 1), ("72", 1), 1),
    ("pound sign, minus before it", "#### -£5", "-5", ("-5", 1), ("-5", 1), 0),
    ("unit word", "#### 72 dollars", "72", ("72", 1), ("72", 1), 1),
    ("unit word", "#### 72 apples", "72", ("72", 1), ("72", 1), 1),
    ("percent, ground truth the number", "#### 25%", "25", ("25", 1), ("25", 1), 1),
    ("percent, ground truth the fraction", "#### 25%", "0.25", ("25", 0), ("25", 0), 1),
    ("bold", "#### **72**", "72", ("72", 1), ("72", 1), 1),
    ("backticks", "#### `72`", "72", ("72", 1), ("72", 1), 0),
    ("Unicode minus U+2212", "#### \u22125", "-5", ("-5", 1), ("-5", 1), 0),
    ("en dash U+2013 as a minus", "#### \u20135", "-5", (None, 0), (None, 0), 0),
    ("thousands comma", "#### 1,234", "1234", ("1234", 1), ("1234", 1), 1),
    ("thousands commas", "#### 1,234,567", "1234567", ("1234567", 1), ("1234567", 1), 1),
    ("thousands thin space U+2009", "#### 1\u2009234", "1234", ("1234", 1), ("1234", 1), 0),
    ("thousands narrow no-break space U+202F", "#### 1\u202f234", "1234", ("1234", 1), ("1234", 1), 0),
    ("plain space before 3 digits", "#### 1 234", "1234", (None, 0), (None, 0), 1),
    ("trailing period", "#### 72.", "72", ("72", 1), ("72", 1), 1),
    ("decimal equal to an integer", "#### 72.0", "72", ("72.0", 1), ("72.0", 1), 1),
    ("decimal, compared exactly", "#### 0.30", "0.3", ("0.30", 1), ("0.30", 1), 1),
    ("fraction", "#### 3/4", "0.75", ("3/4", 1), ("3/4", 1), 1),
    ("ambiguous comma: decimal comma?", "#### 7,2", "7.2", (None, 0), (None, 0), 1),
    ("ambiguous comma, read as grouping?", "#### 7,2", "72", (None, 0), (None, 0), 0),
    ("ambiguous comma", "#### 72,5", "72.5", (None, 0), (None, 0), 1),
    ("comma before 2 digits", "#### 1,23", "1.23", (None, 0), (None, 0), 1),
    ("a power", "#### 2^10", "1024", (None, 0), (None, 0), 1),
    ("scientific notation", "#### 1.5e3", "1500", (None, 0), (None, 0), 0),
    ("a superscript power", "#### 3\u00b2", "9", (None, 0), (None, 0), 0),
    ("times ten to a power", "#### 2\u00d710^3", "2000", (None, 0), (None, 0), 0),
    ("digits grouped by underscores", "#### 1_000", "1000", (None, 0), (None, 0), 0),
    ("mixed number", "#### 3 1/2", "3.5", (None, 0), (None, 0), 0),
    ("a time", "#### 1:30", "30", (None, 0), (None, 0), 0),
    ("a range", "#### 10-20", "20", (None, 0), (None, 0), 0),
    ("words after `####`", "#### The answer is 72", "72", (None, 0), ("72", 1), 1),
    ("no `####`, last number", "So she has 72 apples.", "72", (None, 0), ("72", 1), 1),
    ("no `####`, last number ambiguous", "So the answer is 7,2.", "7.2", (None, 0), (None, 0), 1),
    ("boxed", "$\\boxed{72}$", "72", (None, 0), ("72", 1), 1),
    ("boxed LaTeX fraction", "$\\boxed{\\frac{1}{2}}$", "0.5", (None, 0), ("2", 0), 1),
    ("boxed percent, ground truth the number", "$\\boxed{25\\%}$", "25", (None, 0), ("25", 1), 1),
    ("boxed percent, ground truth the fraction", "$\\boxed{25\\%}$", "0.25", (None, 0), ("25", 0), 1),
]


@pytest.mark.parametrize("form, response, truth, strict, flexible, verified", ANSWER_FORMS,
                         ids=[f"{i}-{row[0]}" for i, row in enumerate(ANSWER_FORMS)])
def test_answer_forms(form, response, truth, strict, flexible, verified):
    assert (extract_gsm8k_answer(response, "strict"), gsm8k_score(response, truth, "strict")) == strict
    assert (extract_gsm8k_answer(response, "flexible"), gsm8k_score(response, truth, "flexible")) == flexible
    assert math_verify_score(response, truth) == verified


def _cell(read_and_score) -> str:
    read, score = read_and_score
    return f"{score} (read {read})" if read is not None else f"{score} (no answer)"


def _code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def answer_form_rows() -> list[str]:
    """The markdown rows of docs/REWARDS.md's table, from ANSWER_FORMS."""
    return [f"| {form} | {_code(response)} | {_code(truth)} | {_cell(strict)} | {_cell(flexible)} | {verified} |"
            for form, response, truth, strict, flexible, verified in ANSWER_FORMS]


def test_docs_table_matches_the_functions():
    doc = (Path(__file__).parents[2] / "docs" / "REWARDS.md").read_text(encoding="utf-8")
    table = [line for line in doc.splitlines() if line.startswith("| ") and "`" in line]
    assert table == answer_form_rows()


@pytest.mark.parametrize("response, truth, mode, score", [
    ("#### 73 wait no #### 72", "72", "strict", 1.0),  # the correction is the answer
    ("#### 73 wait no #### 72", "73", "strict", 0.0),
    # a `####` with no number after it gives no answer and is skipped, as verl's strict mode skips it (a heading,
    # a closing `####`; also a correction in words, which verl credits alike): this scored 0 before
    ("#### 72 wait, #### seventy-three", "72", "strict", 1.0),
    ("#### 72\n#### Final Answer\nIt is 72.", "72", "strict", 1.0),
    ("#### 72\n\nHuman: next question ####", "72", "flexible", 1.0),
    ("#### 72 wait, #### 7,2", "72", "strict", 0.0),  # an ambiguous last answer: none, no falling back
    ("#### 72\n#### 2. Add the pears", "72", "strict", 1.0),  # a numbered heading is no answer slot (read 2 before)
    ("#### $72", "73", "strict", 0.0),
    ("#### $ 72.50", "72.5", "strict", 1.0),
    ("#### \\$72", "72", "strict", 1.0),
    ("#### $-5", "-5", "strict", 1.0),
    ("#### -$-5", "5", "strict", 0.0),
    ("#### \u2212$5", "-5", "strict", 1.0),
    ("#### 72 %", "72", "strict", 1.0),
    ("#### __72__", "72", "strict", 1.0),
    ("#### `1,234`.", "1234", "strict", 1.0),
    ("#### 1,234.5", "1234.5", "strict", 1.0),
    ("#### 1,2345", "12345", "strict", 0.0),  # a group of 4: no answer, not 1 or 12345
    ("#### 1234,567", "1234567", "strict", 0.0),  # a first group of 4
    ("#### 1,234\u2009567", "1234567", "strict", 0.0),  # two kinds of separator in one number
    ("#### 1\u00a0234", "1234", "strict", 1.0),  # a no-break space groups like a thin space
    ("#### 1\u200923", "123", "strict", 0.0),
    ("#### 1.2.3", "1.2", "strict", 0.0),
    ("#### 3/4/5", "0.75", "strict", 0.0),
    ("#### 3/0", "0", "strict", 0.0),  # no value
    ("#### 6/8", "3/4", "strict", 1.0),  # a ground truth may be a fraction too
    ("#### 0.1", "1/10", "strict", 1.0),
    ("#### 72\n\nQuestion 2: 100 apples", "72", "strict", 1.0),  # what follows on another line is not the answer
    ("#### 72 (that is 3 boxes)", "72", "flexible", 1.0),  # the number right after `####` wins
    ("So she has 72 apples and 3 pears.", "3", "flexible", 1.0),  # the last number, as verl's flexible
    ("x-5", "5", "flexible", 1.0),  # a difference, not -5
    ("it is -5", "-5", "flexible", 1.0),
    ("it is \u22125", "-5", "flexible", 1.0),
    ("it is \u20135", "-5", "flexible", 0.0),
    ("it is 1 234", "234", "flexible", 0.0),  # no falling back to the last group of an SI-style number
    ("it is 7,2 or 8", "8", "flexible", 1.0),  # only the last number counts, ambiguous or not
    ("no number here", "0", "flexible", 0.0),
    ("It takes 1:30", "30", "flexible", 0.0),  # a part of a time, a range or a mixed number is no answer ...
    ("from 10-20 or 10−20", "20", "flexible", 0.0),
    ("about 3 1/2", "1/2", "flexible", 0.0),
    ("it is 3 and then 12", "12", "flexible", 1.0),  # ... numbers apart from each other are
    ("#### 72", "abc", "strict", 0.0),  # a ground truth that is no number matches nothing
])
def test_gsm8k_cases(response, truth, mode, score):
    assert gsm8k_score(response, truth, mode) == score


def test_exact_comparison_has_no_float_surprises():
    assert 0.1 + 0.2 != 0.3  # the float trap exact comparison avoids
    assert gsm8k_score("#### 0.3", "0.30000000000000004") == 0.0
    assert gsm8k_score("#### 0.30", "0.3") == 1.0
    assert gsm8k_score("#### 1/3", "0.333333") == 0.0  # no rounding tolerance either


def test_gsm8k_mode_reaches_the_default_reward():
    assert default_compute_score("openai/gsm8k", "So 72.", "72") == 0.0  # strict by default
    assert default_compute_score("openai/gsm8k", "So 72.", "72", None, gsm8k_mode="flexible") == 1.0
    flexible = load_reward_fn(None, gsm8k_mode="flexible")
    assert isinstance(flexible, functools.partial) and flexible("openai/gsm8k", "So 72.", "72", {}) == 1.0
    assert load_reward_fn(None, gsm8k_mode="strict") is default_compute_score
    # a non-GSM8K source without `####` still goes to math-verify, in either mode
    assert flexible("lighteval/MATH", "so \\boxed{\\frac{1}{2}}", "0.5") == 1.0


@pytest.mark.parametrize("call", [
    lambda: gsm8k_score("#### 72", "72", mode="lenient"),
    lambda: load_reward_fn(None, gsm8k_mode="lenient"),
    lambda: load_reward_fn("distflow.engines.reward:gsm8k_score", gsm8k_mode="lenient"),
    lambda: default_compute_score("openai/gsm8k", "#### 72", "72", gsm8k_mode="lenient"),
])
def test_bad_gsm8k_mode_is_refused(call):
    with pytest.raises(ValueError, match=r"^reward\.gsm8k_mode='lenient': expected one of strict, flexible$"):
        call()


def test_reward_runner_refuses_a_bad_gsm8k_mode():
    from distflow.engines.reward import RewardRunner

    with pytest.raises(ValueError) as e:
        RewardRunner(None, 5.0, gsm8k_mode="Flexible")
    assert "reward.gsm8k_mode" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("timeout_s", [0.0, 30.0])
def test_reward_runner_passes_the_gsm8k_mode(timeout_s):
    """In this process (timeout_s=0) and through the child's argv (timeout_s>0)."""
    from distflow.engines.reward import OK, RewardRunner

    runners = {mode: RewardRunner(None, timeout_s, gsm8k_mode=mode) for mode in ("strict", "flexible")}
    try:
        for mode, runner in runners.items():
            assert runner("openai/gsm8k", "She has 72 apples.", "72") == ((1.0 if mode == "flexible" else 0.0), OK)
            assert runner("openai/gsm8k", "#### 72 no, #### 73", "73") == (1.0, OK)
            if timeout_s > 0:
                assert runner._proc is not None and runner._proc.poll() is None  # it was the child's answer
    finally:
        for runner in runners.values():
            runner.close()


def test_a_failure_of_the_accuracy_metric_s_scorer_says_so(capsys):
    """With a custom reward, the accuracy metric is the default reward's; its failure said
    "counted in reward/failed", where it is counted as a wrong answer."""
    from distflow.engines.reward import FAILED, RewardRunner

    accuracy = RewardRunner(None, 0.0, measures="accuracy")
    assert accuracy("search", "#### 4", {"target": ["4"]}, {}) == (0.0, FAILED)
    err = capsys.readouterr().err
    assert "the default reward, which the accuracy metric reads, failed (the sample counts as wrong" in err
    assert "reward/failed" not in err

