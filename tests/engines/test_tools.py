"""Tool calls in the Hermes format: the built-in tools' results against hand-computed
values, and every bad call (not JSON, no name, an unknown tool, wrong arguments, a tool
that raises, one that runs past its limit) answered with an error the model sees."""

from __future__ import annotations

import re

import pytest

from distflow.engines.tools import Toolbox, calculator


@pytest.mark.parametrize("expression, value", [("12 * 7", "84"), ("(3 + 4) ** 2", "49"), ("7 / 2", "3.5"),
                                               ("-5 // 2", "-3"), ("450 - 4.5 * 100", "0"), ("2 ** -1", "0.5")])
def test_calculator_by_hand(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error", [("__import__('os')", "not arithmetic"), ("x + 1", "not arithmetic"),
                                               ("9 ** 9 ** 9", "exponent 387420489 is too large"),
                                               ("'a' * 3", "not arithmetic"),
                                               ("(((9 ** 64) ** 64) ** 64) ** 64", "more than 16384 bits"),
                                               # a product of many big numbers: each step's result is bounded too
                                               ("*".join(["((9 ** 64) ** 64)"] * 150), "more than 16384 bits"),
                                               ("(-8) ** 0.5", "not a real number")])
def test_calculator_refuses_what_is_not_arithmetic(expression, error):
    with pytest.raises(ValueError, match=error):
        calculator(expression)


def test_the_calls_of_a_turn_are_found_in_order():
    box = Toolbox(["calculator"])
    text = ('First <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call> then '
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    assert [box.run(body).text for body in box.calls(text)] == ["2", "6"]
    assert box.calls("#### 42") == []


def test_a_turn_runs_at_most_its_cap_of_calls_and_the_rest_are_answered_with_an_error():
    box = Toolbox(["calculator"], max_calls_per_turn=2)
    body = '{"name": "calculator", "arguments": {"expression": "%d+1"}}'
    results = box.run_turn([body % k for k in range(4)])
    assert [r.text for r in results[:2]] == ["1", "2"] and [r.status for r in results] == ["ok", "ok", "error", "error"]
    assert results[3].text == "error: not run: at most 2 tool calls a turn (rollout.max_tool_calls_per_turn)"


@pytest.mark.parametrize("body, text, status", [
    ("{not json", "error: the tool call is not JSON (Expecting property name enclosed in double quotes)", "error"),
    ('["calculator"]', 'error: a tool call is {"name": ..., "arguments": {...}}', "error"),
    ('{"name": "browser", "arguments": {}}', "error: unknown tool 'browser'; available: calculator, python", "error"),
    ('{"name": "calculator", "arguments": "1+1"}', "error: arguments must be a JSON object", "error"),
    ('{"name": "calculator", "arguments": {"expr": "1+1"}}',
     "error: TypeError: calculator() got an unexpected keyword argument 'expr'", "error"),
    ('{"name": "calculator", "arguments": {"expression": "1/0"}}', "error: ZeroDivisionError: division by zero",
     "error"),
    ("[" * 100_000, "error: the tool call is nested too deep to read", "error"),  # it raised RecursionError: the run stopped
])
def test_bad_calls_become_error_observations(body, text, status):
    result = Toolbox(["calculator", "python"]).run(body)
    assert (result.text, result.status) == (text, status)


def test_python_runs_in_the_sandbox_prints_raises_and_times_out():
    box = Toolbox(["python"], timeout_s=1.0)
    ok = box.run('{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}')
    assert (ok.text, ok.status) == ("45\n", "ok")
    raised = box.run('{"name": "python", "arguments": {"code": "raise KeyError(7)"}}')
    assert (raised.text, raised.status) == ("error: RuntimeError: KeyError: 7", "error")
    slow = box.run('{"name": "python", "arguments": {"code": "while True: pass"}}')
    assert (slow.text, slow.status) == ("error: timed out: the program ran past 1 s", "timeout")
    loud = box.run('{"name": "python", "arguments": {"code": "print(\'x\' * 100000)"}}')  # megabytes stay out
    assert loud.status == "ok" and loud.text == "x" * 8192 + "\n[91809 more characters cut]"


def test_a_sandbox_that_does_not_start_fails_the_call_instead_of_answering_the_model():
    """The program never ran: an error observation would be trained as the policy's
    evidence; raised, its episode fails (env/failed) as an environment's failure does."""
    from distflow.engines.sandbox import SandboxError

    box = Toolbox(["python"])

    def not_started(code):
        raise SandboxError("the sandbox did not start: unshare: Operation not permitted")

    box.tools["python"] = not_started
    with pytest.raises(SandboxError, match="did not start"):
        box.run('{"name": "python", "arguments": {"code": "print(1)"}}')


def test_an_unknown_tool_in_the_config_is_one_line():
    with pytest.raises(ValueError, match=r"^unknown tool 'browser'; built in: calculator, python$"):
        Toolbox(["calculator", "browser"])


def test_environment_rewards_and_openenv_settings_are_checked_in_one_line():
    import importlib.util

    from distflow.config import ConfigError, load_config

    cfg = load_config(None, ["rollout.max_turns=2", "rollout.env=my_env.py:Game", "reward.from_env=true"])
    assert cfg.reward.from_env
    cases = {("reward.from_env=true",): "reward.from_env=true: needs rollout.env",
             ("reward.from_env=true", "rollout.max_turns=2", "rollout.tools=calculator"): "needs rollout.env"}
    if importlib.util.find_spec("openenv") is None:
        cases[("rollout.max_turns=2", "rollout.env=openenv:game:Guess")] = (
            "rollout.env='openenv:game:Guess': the openenv package is not installed; pip install \"distflow[openenv]\"")
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, list(overrides))
