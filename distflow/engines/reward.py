"""Rule-based rewards and user reward functions.

The reward function contract is verl's `compute_score`:

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float

(or a dict with a "score", or a tuple whose first item is it, as verl reads them; an
`async def` one is awaited).
The default dispatches on the data source and the answer style: code datasets (APPS,
CodeContests, TACO ...: test cases as JSON) run the response's program in the sandbox
(`engines/sandbox.py`); GSM8K-style data (a `####` answer in the response, a `gsm8k` or
`distflow/arith` data source) is scored by the GSM8K rule; anything else goes through
math-verify (`\\boxed{...}` answers), configured as verl's default scorer. The GSM8K rule
reads the number the way a grader would (the last `####` with one, currency, units, markup,
thousands separators, fractions) and has verl's two modes, strict and flexible; the
choices for ambiguous forms are in docs/REWARDS.md. A custom function is named as
`package.module:function` or `path/to/file.py:function`.
"""

from __future__ import annotations

import asyncio
import decimal
import functools
import inspect
import json
import math
import numbers
import os
import re
import select
import subprocess
import sys
import threading
import time
import traceback
from fractions import Fraction
from typing import Any, Callable, Protocol

from distflow.config import REWARD_ARGUMENTS
from distflow.plugins import PluginError, load_callable

GSM8K_MODES = ("strict", "flexible")

# One number, read at a given position. Signs: ASCII '-'/'+', U+2212 (minus) and U+2013
# (en dash, captured only so that it can be refused: it is as often a dash as a minus).
# Thousands groups need exactly 3 digits after each separator (',', or a no-break or thin
# space: U+00A0, U+2009, U+202F), one separator kind per number; a decimal part is '.'
# only; a fraction is integer/integer.
_SIGN = "[-+\u2212\u2013]"
_SEPS = ",\u00a0\u2009\u202f"
_NUMBER = re.compile(
    rf"(?P<sign1>{_SIGN})?(?:\\?[$€£]\s?)?(?P<sign2>{_SIGN})?"
    rf"(?P<int>\d{{1,3}}(?P<sep>[{_SEPS}])\d{{3}}(?:(?P=sep)\d{{3}})*|\d+)?"
    r"(?:\.(?P<dec>\d+)|/(?P<den>\d+))?"
    # ... and nothing right after it that would make it a different number: another digit,
    # a separator or a point before a digit ('7,2', '1,23', '1,2345', '1.2.3', '3/4/5'), a
    # power ('2^10', '3²', '1.5e3', '2×10^3'), a plain space before a group of 3 ('1 234',
    # SI style), '1_000', a mixed number ('3 1/2'), a range ('10-20') or a time ('1:30').
    # Such a form is no answer at all rather than a guess at one part of it.
    rf"(?![.^/{_SEPS}]?\d| \d{{3}}(?!\d)|[eE][-+]?\d|[_:]\d|[\u00b2\u00b3\u00b9\u2070-\u2079]|\s?[\u00d7x]\s?\d"
    rf"| \d+/\d|{_SIGN}\d)")
# a numbered markdown heading: "#### 2. Add the pears", "#### 3) Count"
_NUMBERED_HEADING = re.compile(r"####[ \t]*\d+[.)][ \t]+\S")
_MARKUP = re.compile(r"[\s*`_]*")  # before the number: spaces, **bold**, `code`, _italics_
_NUMBER_START = re.compile(rf"{_SIGN}?\\?[$€£]|{_SIGN}?\.?\d")  # what a number (or a try at one) starts with
# A candidate number anywhere in a text (flexible mode): not glued to a word ('H2O',
# 'x-5' is a difference, not -5), nor the second part of a time, a range or a mixed number
# ('1:30', '10-20', '3 1/2': the whole is refused where it starts, with no part to fall back
# on), and greedy over digits and separators, so that '7,2' or '1 234' is one candidate
# (then refused) rather than a '2' or '234' to fall back on.
_CANDIDATE = re.compile(
    rf"(?<![\w.])(?<!\d[{_SIGN[1:-1]}:/])(?!(?<=\d )\d+/\d)"
    rf"(?:{_SIGN}?\\?[$€£]\s?)?{_SIGN}?\.?\d(?:[\d.,/^{_SEPS}]| (?=\d{{3}}(?!\d)))*")


class RewardFn(Protocol):
    def __call__(self, data_source: str, solution_str: str, ground_truth: str,
                 extra_info: dict[str, Any] | None = None) -> float: ...


def check_gsm8k_mode(mode: str) -> str:
    if mode not in GSM8K_MODES:
        raise ValueError(f"reward.gsm8k_mode={mode!r}: expected one of {', '.join(GSM8K_MODES)}")
    return mode


def read_number(text: str) -> str | None:
    """The number at the start of `text` (after spaces and markup), as plain text:
    '-1234.5', '3/4'; currency, separators and what follows (units, '%', a period)
    dropped. None if there is no number there or its form is ambiguous."""
    return _read_number(text)[0]


def is_one_number(text: str) -> bool:
    """`text` is one number, with at most words or a percent sign after it: '72', '-1,234.5',
    '$5', '5 dollars', '72%'; not '2\\sqrt{3}', '10^{5}', '2,\\!000', '\\frac{1}{2}' or
    '1, 2' (LaTeX, or another number, after the first)."""
    number, end = _read_number(text)
    return number is not None and not re.search(r"[\\^{}_\d]", text[end:])


def _read_number(text: str) -> tuple[str | None, int]:
    """(read_number's answer, where the number's text ends)."""
    m = _NUMBER.match(text, _MARKUP.match(text).end())
    if m is None or (m["int"] is None and m["dec"] is None) or (m["int"] is None and m["den"]):
        return None, 0  # no digits ('$', '-'), or a fraction without a numerator ('/4')
    if m["sign1"] and m["sign2"]:
        return None, 0  # '-$-5'
    sign = m["sign1"] or m["sign2"] or ""
    if sign == "\u2013":
        return None, 0  # an en dash: a minus to some writers, a dash to others
    digits = re.sub(f"[{_SEPS}]", "", m["int"] or "0")
    tail = f".{m['dec']}" if m["dec"] else f"/{m['den']}" if m["den"] else ""
    return ("-" if sign in ("-", "\u2212") else "") + digits + tail, m.end()


def number_value(number: str | None) -> Fraction | None:
    """Exact value of `read_number`'s text: 72.0 == 72, 3/4 == 0.75, and 0.3 == 0.30 with
    no float rounding; None for None or a zero denominator."""
    try:
        return None if number is None else Fraction(number)
    except (ValueError, ZeroDivisionError):
        return None


def answer_slot(text: str) -> int:
    """Where the last `####` that gives an answer starts: one with a number, or what
    starts like one, right after it (`#### 72`, `#### -3`, `#### **$5**`, and `#### 7,2`,
    which then reads as no answer). A later `####` without one is no answer slot: a
    closing `####`, a heading (`#### Final Answer`, a numbered `#### 2. Add`), as verl's
    strict mode skips it. -1 where no `####` gives one."""
    at = len(text)
    while (at := text.rfind("####", 0, at)) >= 0:
        after = _MARKUP.match(text, at + 4).end()
        if _NUMBER_START.match(text, after) and not _NUMBERED_HEADING.match(text, at):
            return at
    return -1


def extract_hash_answer(text: str) -> str | None:
    """The number in the last answer slot (`answer_slot`; a response that corrects itself,
    `#### 72 ... #### 73`, is graded on its final answer); None where there is none or its
    number is ambiguous (no falling back to an earlier slot)."""
    at = answer_slot(text)
    return None if at < 0 else read_number(text[at + 4:])


def extract_last_number(text: str) -> str | None:
    """The last number anywhere in `text` (verl's flexible mode); None if there is none or
    the last one is ambiguous (no falling back to an earlier number)."""
    last = None
    for last in _CANDIDATE.finditer(text):
        pass
    return None if last is None else read_number(text[last.start():])  # what follows it can make it ambiguous


def extract_gsm8k_answer(text: str, mode: str = "strict") -> str | None:
    """strict: the number right after the last `####`, as verl's strict mode. flexible: the
    same, and failing that the last number after the last `####` (the whole response when
    it has none), as verl's flexible mode reads the last number."""
    check_gsm8k_mode(mode)
    answer = extract_hash_answer(text)
    if answer is None and mode == "flexible":
        answer = extract_last_number(text[text.rfind("####") + 4:] if "####" in text else text)
    return answer


def truth_text(truth: Any) -> str:
    """A ground truth as the rules read it: text as it is, a number (a dataset may store 72 or
    1e-05) as text, a float in positional notation ('0.00001', not '1e-05', which no answer
    reader takes for a number)."""
    if isinstance(truth, float) and math.isfinite(truth):
        return format(decimal.Decimal(repr(truth)), "f")
    return str(truth)


def gsm8k_score(solution_str: str, ground_truth: str | int | float, mode: str = "strict") -> float:
    answer = number_value(extract_gsm8k_answer(solution_str, mode))
    truth = number_value(read_number(truth_text(ground_truth)))
    return 1.0 if answer is not None and answer == truth else 0.0


def math_verify_score(solution_str: str, ground_truth: str) -> float:
    """As verl's default scorer (reward_score/math_verify.py): the ground truth is read as
    `\\boxed{<ground truth>}` with LaTeX extraction, the response with expression and LaTeX
    extraction. A percent on either side equals both the number and the number / 100
    (math-verify's own rule: `\\boxed{25\\%}` matches 25 and 0.25)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math_verify's own timeouts use SIGALRM, which only works on the main thread (reward
    # nodes run on the scheduler's threads); RewardRunner's per-call timeout replaces them.
    gold = parse("\\boxed{" + truth_text(ground_truth) + "}", (LatexExtractionConfig(),), parsing_timeout=None)
    pred = parse(solution_str, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=None)
    return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=None) else 0.0




def _is_code(data_source: str) -> bool:
    from distflow.engines.sandbox import CODE_SOURCES

    return data_source.lower().split("/")[-1] in CODE_SOURCES  # e.g. "codecontests", "likaixin/TACO"


def rule_reads(data_source: str, ground_truth: Any) -> bool:
    """Whether the default reward scores a sample of this ground truth: text or a number, or
    a code dataset's test cases (as JSON text or the mapping); another structure (verl's
    search data, `{"target": [...]}`) is a custom function's to read."""
    return isinstance(ground_truth, (str, int, float)) or _is_code(data_source)


def _answers_after_hashes(solution_str: str, ground_truth: Any) -> bool:
    """A response to score by the GSM8K rule whatever its data source: a `####` gives a
    number (`answer_slot`: "#### 72", "#### -3", "#### $5"; a "#### Step 1", "#### Final
    answer" or numbered "#### 2. Add" heading gives none), it boxes no answer (a heading's
    number is not its answer), and the ground truth is one number (not MATH's 2\\sqrt{3})."""
    return ("\\boxed" not in solution_str and extract_hash_answer(solution_str) is not None
            and is_one_number(truth_text(ground_truth)))


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict[str, Any] | None = None, *, gsm8k_mode: str = "strict",
                          code_time_budget_s: float | None = None) -> float:
    from distflow.engines import sandbox

    if _is_code(data_source):
        return sandbox.code_score(data_source, solution_str, ground_truth, extra_info, time_budget_s=code_time_budget_s)
    if not rule_reads(data_source, ground_truth):
        raise ValueError(f"the default reward reads a ground truth of text or a number, not a "
                         f"{type(ground_truth).__name__}; set reward.custom_fn to score this data_source "
                         f"({data_source!r})")
    if "gsm8k" in data_source or data_source.startswith("distflow/") or _answers_after_hashes(solution_str, ground_truth):
        return gsm8k_score(solution_str, ground_truth, gsm8k_mode)
    return math_verify_score(solution_str, ground_truth)


def load_reward_fn(spec: str | None, gsm8k_mode: str = "strict", code_time_budget_s: float | None = None,
                   kwargs: dict[str, Any] | None = None, weights: list[float] | None = None) -> RewardFn:
    """`None` -> the default in that GSM8K mode, running a code sample's tests while they fit
    in `code_time_budget_s`; `module:function` or `file.py:function` -> that function, given
    `kwargs` (reward.custom_fn_kwargs) at every call; several, comma-separated -> their sum,
    weighted by `weights` (1 each by default; `weighted_sum`). The mode and the budget are the
    default reward's: a custom function ignores them."""
    check_gsm8k_mode(gsm8k_mode)
    if spec is not None:
        specs = [part.strip() for part in spec.split(",") if part.strip()]
        fns = [_takes_verl_keywords(load_callable(part, "reward.custom_fn"), part, kwargs or {}) for part in specs]
        fns = [functools.partial(fn, **kwargs) if kwargs else fn for fn in fns]
        weights = weights or [1.0] * len(fns)
        if len(fns) == 1 and weights == [1.0]:
            return fns[0]
        return weighted_sum(fns, [part.rpartition(":")[2] for part in specs], weights)
    if gsm8k_mode == "strict" and code_time_budget_s is None:
        return default_compute_score  # itself, so that it stays verl's plain signature
    return functools.partial(default_compute_score, gsm8k_mode=gsm8k_mode, code_time_budget_s=code_time_budget_s)


def weighted_sum(fns: list[RewardFn], names: list[str], weights: list[float]) -> RewardFn:
    """Several reward functions as one, as TRL sums its reward_funcs by reward_weights: the
    score is the weighted sum of theirs (one that returns None or NaN for a sample adds
    nothing, as TRL's nansum; none with a number fails the sample), and each one's own score
    is kept under its name, beside their dicts' other numbers (a later function's win), so
    that it is logged as reward_extra/<name>; a name another has, or "score" or "acc", gets
    its position (1, 2 ...) appended. Awaited where one of them is `async def` (the others
    then run on threads)."""
    keys: list[str] = []
    for i, name in enumerate(names, 1):
        keys.append(f"{name}_{i}" if name in keys or name in ("score", "acc") else name)

    def total(results: list) -> dict[str, float]:
        out: dict[str, float] = {"score": 0.0}
        values = [None if result is None else score_of(result) for result in results]
        for key, weight, result, value in zip(keys, weights, results, values):
            if value is not None and not math.isnan(value):
                out |= extras_of(result) | {key: value}
                out["score"] += weight * value
        if len(out) == 1:
            raise ValueError(f"no reward function ({', '.join(names)}) gave this sample a number (None or NaN)")
        return out

    if not any(is_async(fn) for fn in fns):
        return lambda **arguments: total([fn(**arguments) for fn in fns])

    async def awaited(**arguments) -> dict[str, float]:
        # a plain function runs on a thread, as verl runs a plain scorer beside async ones: on the event
        # loop it would hold up every other sample's call (and their time limits would run on meanwhile)
        return total(list(await asyncio.gather(*(fn(**arguments) if is_async(fn) else
                                                 asyncio.to_thread(functools.partial(fn, **arguments))
                                                 for fn in fns))))

    return awaited


def _takes_verl_keywords(fn: RewardFn, spec: str, kwargs: dict[str, Any]) -> RewardFn:
    """`fn`, where it can be called as verl calls a reward function, by keyword, with
    `kwargs` besides; else one line."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: its call will say
        return fn
    try:
        signature.bind(**dict.fromkeys(REWARD_ARGUMENTS), **kwargs)
    except TypeError:
        more = f" and reward.custom_fn_kwargs' {', '.join(kwargs)}" if kwargs else ""
        raise PluginError(f"reward.custom_fn={spec!r}: {getattr(fn, '__name__', 'it')}{signature} cannot be called "
                          f"with verl's keyword arguments {', '.join(REWARD_ARGUMENTS)}{more}") from None
    return fn


def _called(fn: RewardFn, args) -> Any:
    """`fn`'s result for one sample's (data_source, solution_str, ground_truth, extra_info),
    called by keyword as verl does."""
    return fn(**dict(zip(REWARD_ARGUMENTS, args)))


def _scored(fn: RewardFn, args) -> tuple[float, dict[str, float]]:
    """(score, the other numbers of a dict result: `extras_of`) of one sample (`_called`);
    an `async def` function's result awaited, as verl awaits it."""
    result = _called(fn, args)
    if inspect.isawaitable(result):
        result = _event_loop().run_until_complete(result)
    return score_of(result), extras_of(result)


def is_async(fn: RewardFn) -> bool:
    """An `async def` function (a partial of one, an object whose `__call__` is one): its
    samples are awaited together (`scored_together`)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def scored_together(fn: RewardFn, samples: list, limit_s: float | None, concurrency: int,
                    each: Callable[[int, list], None] | None = None) -> list[list]:
    """An async function's samples awaited together on this thread's loop, `concurrency` at
    a time (an LLM judge's requests in flight), each within `limit_s` of its start (None: no
    limit). Per sample [True, `_scored`'s pair], [False, its traceback], or [None, None]
    past the limit (cancelled, so that the others go on); `each(i, outcome)` is told each
    sample's as it comes."""
    async def one(i: int, args, gate: asyncio.Semaphore) -> list:
        async with gate:
            try:
                result = await asyncio.wait_for(_called(fn, args), limit_s)
                outcome = [True, (score_of(result), extras_of(result))]
            except (TimeoutError, asyncio.TimeoutError):  # the same class from Python 3.11 on
                outcome = [None, None]
            except Exception:
                outcome = [False, traceback.format_exc()]
        if each is not None:
            each(i, outcome)
        return outcome

    async def every() -> list[list]:
        gate = asyncio.Semaphore(concurrency)
        return list(await asyncio.gather(*(one(i, args, gate) for i, args in enumerate(samples))))

    return _event_loop().run_until_complete(every())


_loops = threading.local()


def _event_loop() -> asyncio.AbstractEventLoop:
    """This thread's event loop for async reward functions, kept from call to call (not
    `asyncio.run`'s, closed after each: a module-level async client, an LLM judge's, is
    bound to the loop it first ran on)."""
    loop = getattr(_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _loops.loop = asyncio.new_event_loop()
    return loop


# ---------------------------------------------------------------------------- running rewards safely

OK, FAILED, TIMED_OUT = 0, 1, 2  # per-sample reward status
_DIED = "the reward process died while scoring"
START_TIMEOUT_S = 120
CODE_CALL_MARGIN_S = 1.0  # of a reward call's limit, kept for what a code sample's call does besides its tests
_CHILD = """
import json, os, sys
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
spec, gsm8k_mode, code_time_budget_s, kwargs, weights, parent = json.loads(sys.argv[1])
from distflow.engines.reward import end_with_parent, serve
end_with_parent(parent)
serve(spec, sys.stdin, replies, gsm8k_mode, code_time_budget_s, kwargs, weights)
"""


def end_with_parent(parent: int, every_s: float = 0.5) -> None:
    """In the reward child: exit once the worker `parent` that started it is gone, also in
    the middle of a call (its closed input is read only between calls), removing the
    folders of a code sandbox the call was running. Not PR_SET_PDEATHSIG, which fires when
    the starting thread ends, not the process."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        from distflow.engines.sandbox import remove_leftovers

        remove_leftovers(os.getpid())
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def score_of(result: Any) -> float:
    """A reward function's result as verl reads it: a number, a dict's "score" (verl's
    DAPO scorer returns {"score": ..., "acc": ...}) or a tuple's first item."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"the reward function returned a dict without a 'score': {sorted(result)}")
        result = result["score"]
    elif isinstance(result, (tuple, list)) and result:
        result = result[0]
    if isinstance(result, (str, bytes)):  # float() would read "0.7": a mistake's score, counted as a failure instead
        raise TypeError(f"the reward function returned text ({result!r}), not a number")
    return float(result)


def extras_of(result: Any) -> dict[str, float]:
    """A dict result's other finite numbers (a bool as 0 or 1), as verl keeps them beside the
    score (its DAPO scorer's "acc"; they are logged as reward_extra/<name>, and "acc" is the
    sample's accuracy); {} for any other result."""
    if not isinstance(result, dict):
        return {}
    return {str(k): float(v) for k, v in result.items() if k != "score" and isinstance(v, numbers.Real)
            and math.isfinite(v)}


def serve(spec: str | None, requests, replies, gsm8k_mode: str = "strict",
          code_time_budget_s: float | None = None, kwargs: dict[str, Any] | None = None,
          weights: list[float] | None = None) -> None:
    """The reward child process's loop: JSON lines in, JSON lines out, one request at a
    time: one sample's arguments, or {"samples", "limit_s", "concurrency"} for an async
    function's samples together (`scored_together`). Its first line says whether the
    function is async, or why it cannot be loaded (one line, as `load_reward_fn` says it)."""
    try:
        fn = load_reward_fn(spec, gsm8k_mode, code_time_budget_s, kwargs, weights)
    except PluginError as e:
        _reply(replies, ["failed", str(e)])
        return
    _reply(replies, ["ready", {"async": is_async(fn)}])  # start-up counts against no limit
    for line in requests:
        request = json.loads(line)
        if isinstance(request, dict):  # a line per sample as it is scored: [its index, outcome ...]
            scored_together(fn, request["samples"], request["limit_s"], request["concurrency"],
                            lambda i, outcome: _reply(replies, [i, *outcome]))
            continue
        try:
            _reply(replies, [True, _scored(fn, request)])
        except Exception:
            _reply(replies, [False, traceback.format_exc()])


def _reply(replies, message: list) -> None:
    replies.write(json.dumps(message) + "\n")
    replies.flush()


class RewardRunner:
    """Calls a reward function per sample so that no sample can take the run down.

    An exception, or a value that is not a finite number, scores 0 with status FAILED;
    the first traceback is printed once per worker. With `timeout_s > 0` the function
    runs in a child process: a call that exceeds the limit scores 0 with status
    TIMED_OUT, and the child is killed and restarted; the default reward runs a code
    sample's tests while they fit in that limit (`code_score`'s `time_budget_s`), so it
    scores those it ran. A custom function is imported in the child alone (a judge model
    it loads at import is held once), which starts with the runner: a bad one stops the
    run at start-up. An `async def` function's samples are awaited together
    (`scored_all`). Thread-safe (one call at a time).
    `gsm8k_mode` (strict|flexible, config `reward.gsm8k_mode`) is the default reward's GSM8K
    mode, in this process and in the child alike."""

    def __init__(self, spec: str | None, timeout_s: float, gsm8k_mode: str = "strict", measures: str = "reward",
                 concurrency: int = 64, kwargs: dict[str, Any] | None = None, weights: list[float] | None = None):
        """`measures`: "reward", or "accuracy" for the runner of the accuracy metric alone (a
        failure there counts the sample as wrong, not in reward/failed). `concurrency`: an
        async function's samples in flight at once (config `reward.async_concurrency`).
        `kwargs`: more keyword arguments to every call of a custom function
        (`reward.custom_fn_kwargs`); `weights`: of several functions' sum (`weighted_sum`)."""
        self.spec, self.timeout_s, self.gsm8k_mode = spec, timeout_s, check_gsm8k_mode(gsm8k_mode)
        self.measures, self.concurrency, self.kwargs, self.weights = measures, concurrency, kwargs or {}, weights
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._reported = False
        self.fn, self.is_async = None, False  # in a child: learned as it starts
        if timeout_s <= 0:
            self.fn = load_reward_fn(spec, gsm8k_mode, kwargs=kwargs, weights=weights)
            self.is_async = is_async(self.fn)
        elif spec is not None:
            self._start()

    def __call__(self, data_source: str, solution_str: str, ground_truth: str,
                 extra_info: dict[str, Any] | None = None) -> tuple[float, int]:
        """(score, status) of one sample."""
        return self.scored(data_source, solution_str, ground_truth, extra_info)[:2]

    def scored(self, data_source: str, solution_str: str, ground_truth: str,
               extra_info: dict[str, Any] | None = None) -> tuple[float, int, dict[str, float]]:
        """(score, status, the result's other numbers: `extras_of`) of one sample."""
        args = (data_source, solution_str, ground_truth, extra_info)
        with self._lock:
            ok, value = self._in_child(args) if self.timeout_s > 0 else self._in_process(args)
        return self._judged(ok, value)

    def scored_all(self, samples: list[tuple]) -> list[tuple[float, int, dict[str, float]]]:
        """`scored` of each sample's (data_source, solution_str, ground_truth, extra_info): one
        after another, or, for an async function, together (`concurrency` at a time, each
        within the limit; `scored_together`)."""
        if not self.is_async:
            return [self.scored(*args) for args in samples]
        with self._lock:
            outcomes = (self._together_in_child(samples) if self.timeout_s > 0 else
                        scored_together(self.fn, samples, None, self.concurrency))
        return [self._judged(ok, value) for ok, value in outcomes]

    def _judged(self, ok: bool | None, value: Any) -> tuple[float, int, dict[str, float]]:
        """(score, status, extras) of one sample's outcome: (True, (score, extras)), (False,
        the error) or (None, _) past the limit."""
        if ok is None:
            return 0.0, TIMED_OUT, {}
        score, extras = value if ok else (None, {})
        if ok and isinstance(score, float) and math.isfinite(score):
            return score, OK, extras
        self._report(value if not ok else f"reward function returned {score!r}, not a finite number")
        return 0.0, FAILED, {}

    def _in_process(self, args) -> tuple[bool, Any]:
        try:
            return True, _scored(self.fn, args)
        except Exception:
            return False, traceback.format_exc()

    def _in_child(self, args) -> tuple[bool | None, Any]:
        why = self._send(args)
        line = "" if why else self._reply(self.timeout_s)
        if not line:
            return (None, None) if line is None else (False, why or _DIED)
        ok, value = json.loads(line)
        return ok, value

    def _together_in_child(self, samples: list[tuple]) -> list[list]:
        """`scored_together` in the child, which answers each sample as it is scored. Their
        limits run concurrently, so the whole takes at most one limit per `concurrency`
        samples; past that (the function blocks its event loop, or ignores its cancellation)
        the child is killed and the samples not answered by then count as timed out."""
        outcomes: list[list | None] = [None] * len(samples)
        why = self._send({"samples": samples, "limit_s": self.timeout_s, "concurrency": self.concurrency})
        deadline = time.monotonic() + -(-len(samples) // self.concurrency) * self.timeout_s + CODE_CALL_MARGIN_S
        for _ in range(0 if why else len(samples)):
            line = self._reply(max(deadline - time.monotonic(), 0.0))
            if not line:
                why = _DIED if line == "" else None
                break
            i, ok, value = json.loads(line)
            outcomes[i] = [ok, value]
        return [outcome or ([False, why] if why else [None, None]) for outcome in outcomes]

    def _send(self, request) -> str | None:
        """`request` to the child, started first where there is none: None, or why it could not."""
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._start()
            except (RuntimeError, PluginError) as e:  # the samples fail; the next call tries a new child
                return str(e)
        try:
            self._proc.stdin.write(json.dumps(request, default=str) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the child died (a crash, os._exit, OOM kill)
            self._stop()
            return _DIED
        return None

    def _reply(self, timeout: float) -> str | None:
        """The child's next line: "" where it died, None where none came within `timeout`;
        either way it is stopped (the next call starts a fresh one)."""
        line = self._readline(timeout)
        if not line:
            self._stop()
        return line

    def _readline(self, timeout: float) -> str | None:
        """A line from the child, "" if it died, None if nothing came within `timeout`. Read
        from its pipe itself, not through a buffered reader, whose lines read ahead a
        `select` would not see."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._unread:
            ready, _, _ = select.select([self._proc.stdout], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return None
            chunk = os.read(self._proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return ""
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return line.decode() + "\n"

    def _start(self) -> None:
        # a fresh interpreter (not a fork of this threaded, torch-loaded one) that imports
        # only the reward module; its stdout is the reply channel, its prints go to stderr
        budget = max(self.timeout_s - CODE_CALL_MARGIN_S, 0.0)  # a code sample's tests run while they fit in it
        argv = [sys.executable, "-c", _CHILD,
                json.dumps([self.spec, self.gsm8k_mode, budget, self.kwargs, self.weights, os.getpid()])]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._unread = b""  # what came from its pipe after the last line taken
        line = self._readline(START_TIMEOUT_S)
        reply = json.loads(line) if line else None
        if reply is not None and reply[0] == "ready":
            self.is_async = reply[1]["async"]
            return
        if reply is not None and reply[0] == "failed":  # the function cannot be loaded: its one line
            self._stop()
            raise PluginError(reply[1])
        try:  # its reply channel closed ("") as it exits: its exit code
            code = self._proc.wait(5) if line == "" else None
        except subprocess.TimeoutExpired:
            code = None
        self._stop()
        what = (f"did not start within {START_TIMEOUT_S} s" if code is None else
                f"exited with code {code} while starting (its error is above)")
        raise RuntimeError(f"the reward process for {self.spec or 'the default reward'} {what}")

    def _stop(self) -> None:
        if self._proc is not None:
            from distflow.engines.sandbox import remove_leftovers

            self._proc.kill()
            self._proc.wait(5)
            remove_leftovers(self._proc.pid)  # the folders of a code sandbox it was running
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
        self._proc = None

    def _report(self, text: str) -> None:
        if not self._reported:
            self._reported = True
            what = ("reward function failed (scored 0, counted in reward/failed" if self.measures == "reward" else
                    "the default reward, which the accuracy metric reads, failed (the sample counts as wrong in "
                    "reward/accuracy")
            print(f"distflow: {what}; only the first failure is printed):\n{text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            self._stop()
