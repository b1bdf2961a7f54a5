"""Rule-based rewards and user reward functions.

The reward function contract is verl's `compute_score`:

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float

The default dispatches on the data source and the answer style: code datasets (APPS,
CodeContests, TACO ...: test cases as JSON) run the response's program in the sandbox
(`engines/sandbox.py`); otherwise GSM8K's `#### <answer>` when the response has one,
else `math_verify` on `\\boxed{...}` answers. A custom function is named
as `package.module:function` or `path/to/file.py:function`.
"""

from __future__ import annotations

import json
import math
import re
import select
import subprocess
import sys
import threading
import traceback
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

    # math_verify's own timeouts use SIGALRM, which only works on the main thread (reward
    # nodes run on the scheduler's threads); RewardRunner's per-call timeout replaces them.
    gold = parse(ground_truth if "\\boxed" in ground_truth or "$" in ground_truth else f"${ground_truth}$",
                 parsing_timeout=None)
    pred = parse(solution_str, parsing_timeout=None)
    return 1.0 if gold and pred and verify(gold, pred, timeout_seconds=None) else 0.0


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict[str, Any] | None = None) -> float:
    from distflow.engines import sandbox

    if data_source.lower().split("/")[-1] in sandbox.CODE_SOURCES:  # e.g. "codecontests", "likaixin/TACO"
        return sandbox.code_score(data_source, solution_str, ground_truth, extra_info)
    if "####" in solution_str or "gsm8k" in data_source or data_source.startswith("distflow/arith"):
        return gsm8k_score(solution_str, ground_truth)
    return math_verify_score(solution_str, ground_truth)


def load_reward_fn(spec: str | None) -> RewardFn:
    """`None` -> the default; `module:function` or `file.py:function` -> that function."""
    return default_compute_score if spec is None else load_callable(spec, "reward.custom_fn")


# ---------------------------------------------------------------------------- running rewards safely

OK, FAILED, TIMED_OUT = 0, 1, 2  # per-sample reward status
START_TIMEOUT_S = 120
_CHILD = """
import json, os, sys
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
from distflow.engines.reward import serve
serve(json.loads(sys.argv[1]), sys.stdin, replies)
"""


def serve(spec: str | None, requests, replies) -> None:
    """The reward child process's loop: JSON lines in, JSON lines out, one call at a time."""
    fn = load_reward_fn(spec)
    replies.write(json.dumps(["ready", None]) + "\n")  # start-up does not count against a call's limit
    replies.flush()
    for line in requests:
        try:
            reply = [True, float(fn(*json.loads(line)))]
        except Exception:
            reply = [False, traceback.format_exc()]
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class RewardRunner:
    """Calls a reward function per sample so that no sample can take the run down.

    An exception, or a value that is not a finite number, scores 0 with status FAILED;
    the first traceback is printed once per worker. With `timeout_s > 0` the function
    runs in a child process: a call that exceeds the limit scores 0 with status
    TIMED_OUT, and the child is killed and restarted. Thread-safe (one call at a time)."""

    def __init__(self, spec: str | None, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.fn = load_reward_fn(spec)  # also in this process: a bad name fails at start-up
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._reported = False

    def __call__(self, data_source: str, solution_str: str, ground_truth: str,
                 extra_info: dict[str, Any] | None = None) -> tuple[float, int]:
        args = (data_source, solution_str, ground_truth, extra_info)
        with self._lock:
            ok, value = self._in_child(args) if self.timeout_s > 0 else self._in_process(args)
        if ok is None:
            return 0.0, TIMED_OUT
        if ok and isinstance(value, float) and math.isfinite(value):
            return value, OK
        self._report(value if not ok else f"reward function returned {value!r}, not a finite number")
        return 0.0, FAILED

    def _in_process(self, args) -> tuple[bool, Any]:
        try:
            return True, float(self.fn(*args))
        except Exception:
            return False, traceback.format_exc()

    def _in_child(self, args) -> tuple[bool | None, Any]:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        try:
            self._proc.stdin.write(json.dumps(args, default=str) + "\n")
            self._proc.stdin.flush()
            line = self._readline(self.timeout_s)
        except (OSError, ValueError):  # the child died (a crash, os._exit, OOM kill)
            line = ""
        if line is None:  # hung: kill it; the next call starts a fresh one
            self._stop()
            return None, None
        if not line:
            self._stop()
            return False, "the reward process died while scoring this sample"
        ok, value = json.loads(line)
        return ok, value

    def _readline(self, timeout: float) -> str | None:
        """A line from the child, "" if it died, None if nothing came within `timeout`."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline() if ready else None

    def _start(self) -> None:
        # a fresh interpreter (not a fork of this threaded, torch-loaded one) that imports
        # only the reward module; its stdout is the reply channel, its prints go to stderr
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(self.spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self._readline(START_TIMEOUT_S)
        if not line or json.loads(line) != ["ready", None]:
            self._stop()
            raise RuntimeError(f"the reward process for {self.spec or 'the default reward'} did not start "
                               f"within {START_TIMEOUT_S} s")

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
        self._proc = None

    def _report(self, text: str) -> None:
        if not self._reported:
            self._reported = True
            print(f"distflow: reward function failed (scored 0, counted in reward/failed; "
                  f"only the first failure is printed):\n{text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            self._stop()
