"""Tools the policy can call in a multi-turn rollout, in the Hermes format most chat
models are trained on:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Built in: `calculator` (arithmetic on numbers: + - * / // % ** and parentheses, evaluated
from the syntax tree, never `eval`) and `python` (a program run in the code sandbox of
`sandbox.py`, its limits applying to every call; what it prints is the result). A call
that is not JSON, names no or an unknown tool, raises, or runs past its limit becomes an
error observation the model sees, and is counted. Their JSON schemas (`schemas`) go to
the chat template with the prompt, as verl and TRL pass them: a template that takes
tools shows the model what it may call (calls are read in the Hermes format above, which
Qwen2.5's and Qwen3's templates teach).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
from dataclasses import dataclass
from typing import Callable

from distflow.engines import sandbox

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_POWER = 64  # an exponent past this is refused: 9**9**9 must not hang a worker
MAX_BITS = 16384  # nor may any result grow past this: (((9**64)**64)**64)**64, or products of many big ones
MAX_RESULT_CHARS = 8192  # of a tool's result the model sees (a program may print megabytes)


def tool_call_text(name: str, arguments: dict) -> str:
    """A call as the model writes it (compact JSON: fewer tokens to generate)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}\n</tool_call>"


class ToolTimeout(RuntimeError):
    """The tool ran past its time limit."""


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model sees
    status: str  # ok | error | timeout


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _arith(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
            raise ValueError(f"exponent {right} is too large (at most {MAX_POWER})")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and right > 0 and \
                left.bit_length() * right > MAX_BITS:  # (9**64)**64 ... grows past any use and then hangs
            raise ValueError(f"the result would have more than {MAX_BITS} bits")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):  # a negative number to a fractional power
            raise ValueError("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_BITS:  # so no operand of the next step is larger
            raise ValueError(f"the result would have more than {MAX_BITS} bits")
        return value
    raise ValueError(f"not arithmetic: {ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__}")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, an integer when it is one."""
    value = _arith(ast.parse(str(expression), mode="eval"))
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def python_tool(limits: sandbox.Limits) -> Callable[..., str]:
    def python(code: str) -> str:
        """Run a Python program in the sandbox; what it prints comes back."""
        result = sandbox.run_python(str(code), limits=limits)
        if result.status == sandbox.TIMEOUT:
            raise ToolTimeout(f"the program ran past {limits.time_s:g} s")
        if result.status != sandbox.OK:
            raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.status)
        return result.stdout
    return python


def _schema(name: str, description: str, argument: str, about: str) -> dict:
    """A tool of one string argument in OpenAI's function format, as chat templates take it."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string", "description": about}},
                       "required": [argument]}}}


SCHEMAS = {  # config.TOOLS
    "calculator": _schema("calculator", "Evaluate an arithmetic expression and return its value.", "expression",
                          "numbers with + - * / // % ** and parentheses, e.g. (12 + 3) * 7"),
    "python": _schema("python", "Run a Python program in a sandbox and return what it prints.", "code",
                      "the program; print what you want to see"),
}


def schemas(names: list[str], schemas_file: str | None = None) -> list[dict]:
    """The JSON schemas of the named built-in tools, in order, then those of
    `schemas_file` (rollout.tool_schemas); a ValueError names what is wrong with the file."""
    own = [SCHEMAS[n] for n in names]
    if schemas_file is None:
        return own
    try:
        with open(os.path.expanduser(schemas_file), encoding="utf-8-sig") as f:
            loaded = json.load(f)
    except OSError as e:
        raise ValueError(f"{schemas_file}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"{schemas_file}: not JSON ({e})") from None
    if not isinstance(loaded, list):
        raise ValueError(f"{schemas_file}: expected a JSON list of tool schemas, got {type(loaded).__name__}")
    taken = set(names)
    for i, schema in enumerate(loaded):
        function = schema.get("function") if isinstance(schema, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]):
            raise ValueError(f'{schemas_file}: entry {i} is not {{"type": "function", "function": {{"name": ...}}}}')
        if function["name"] in taken:
            raise ValueError(f"{schemas_file}: tool {function['name']!r} is named twice (rollout.tools or this file)")
        taken.add(function["name"])
    return own + loaded


def _cut(text: str) -> str:
    """A tool's result, at most MAX_RESULT_CHARS of it (the episode's token budget cuts it
    further; tokenising megabytes first would not)."""
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[{len(text) - MAX_RESULT_CHARS} more characters cut]"


class Toolbox:
    """The tools of a rollout (`rollout.tools`), called from the model's text."""

    def __init__(self, names: list[str], timeout_s: float = 5.0, max_calls_per_turn: int = 8):
        available = {"calculator": calculator, "python": python_tool(sandbox.Limits(time_s=timeout_s))}  # config.TOOLS
        unknown = [n for n in names if n not in available]
        if unknown:
            raise ValueError(f"unknown tool {unknown[0]!r}; built in: {', '.join(available)}")
        self.tools = {n: available[n] for n in names}
        self.max_calls_per_turn = max_calls_per_turn

    def calls(self, text: str) -> list[str]:
        """The bodies of the tool calls in an assistant turn, in order."""
        return TOOL_CALL.findall(text)

    def run_turn(self, bodies: list[str]) -> list[ToolResult]:
        """A turn's calls, the first `max_calls_per_turn` run (each up to its time limit, one
        after another), the rest answered with an error: a turn of many slow calls would
        hold its episode, and those behind it on its thread, that many times as long."""
        cap = self.max_calls_per_turn
        return [self.run(body) if k < cap else
                ToolResult(f"error: not run: at most {cap} tool calls a turn (rollout.max_tool_calls_per_turn)", "error")
                for k, body in enumerate(bodies)]

    def run(self, body: str) -> ToolResult:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolResult(f"error: the tool call is not JSON ({e.msg})", "error")
        except RecursionError:  # nested past the parser's depth (a model writing [[[[...): no call, not a crash
            return ToolResult("error: the tool call is nested too deep to read", "error")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolResult('error: a tool call is {"name": ..., "arguments": {...}}', "error")
        tool = self.tools.get(call["name"])
        if tool is None:
            return ToolResult(f"error: unknown tool {call['name']!r}; available: {', '.join(self.tools)}", "error")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            return ToolResult("error: arguments must be a JSON object", "error")
        try:
            return ToolResult(_cut(str(tool(**arguments))), "ok")
        except ToolTimeout as e:
            return ToolResult(f"error: timed out: {e}", "timeout")
        except sandbox.SandboxError:  # the sandbox itself failed, not the model's program: the episode fails
            raise  # (env/failed, rollout.on_failed_episode), it is no evidence about the policy
        except Exception as e:  # what the tool raised is the model's to see
            return ToolResult(f"error: {type(e).__name__}: {e}", "error")
