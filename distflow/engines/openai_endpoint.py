"""An OpenAI-compatible chat endpoint backed by the rollout engine, so that an agent
written against an OpenAI client produces training samples (`rollout.agent`).

    async def run(client: openai.AsyncOpenAI, row: dict) -> float:   # the user's agent
        reply = await client.chat.completions.create(model="policy", messages=row["prompt"])
        ...
        return reward

Every sample of a step gets its own base URL (`/samples/<key>/v1`); `AgentRunner` runs
one `run` per sample, all concurrently, and the endpoint gathers the requests that
arrive together into one batched `generate` call. Each request is recorded token in,
token out: the first request of a sample must render (the tokenizer's chat template,
add_generation_prompt) to the sample's prompt tokens; every later one must extend the
sample's conversation (its earlier messages, then an assistant message standing for the
completion we returned, then new messages), and its prompt is the tokens so far plus
the new messages' tokens (`agent.observation_ids`). So the engine's completion tokens are
never re-tokenised from text, and what is trained is exactly what was sampled (loss
mask 1) plus what the agent sent back (mask 0). Sampling uses the run's temperature and
top_p (the trainer scores at them), each call from its own seed (the sample's seed and
the call's index; a request's `seed`, `temperature` and `top_p` are not used);
`max_tokens` may only lower the run's max_new_tokens; `stop` ends a completion at its
first stop string (the tokens up to it are trained, the text before it answered);
`logprobs=true` returns each sampled token's log-prob. Content given as a list of text
parts is their text. What it cannot honour (`top_logprobs`, a `tool_choice` other than
auto, penalties, `logit_bias`, `parallel_tool_calls=false`, a `response_format` other than
text, image parts) is refused with a 400, not ignored.

Served on 127.0.0.1 only, with a bearer token made per endpoint; a request without it
gets 401, one over `max_request_bytes` 413, an unknown model 404, in OpenAI's error shape
({"error": {"message", "type", "param", "code"}}). A completion's Hermes-format
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks come back as the
message's `tool_calls`.
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import queue
import re
import secrets
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Awaitable, Callable

import torch
from jinja2 import TemplateError

from distflow.data.batch import Batch
from distflow.engines.agent import observation_ids, trajectory_batch
from distflow.engines.common import render_prompt
from distflow.engines.rollout import RolloutEngine, SamplingParams, sample_seed
from distflow.engines.tools import TOOL_CALL

MODEL = "policy"
DRAIN_LIMIT_BYTES = 16 << 20  # an oversized request body is read and dropped up to this size before its 413
# per sample, beside the rollout's fields
AGENT_FIELDS = ("agent_tool_calls", "agent_failed", "agent_scores", "agent_out_of_budget")
_PATH = re.compile(r"^/samples/(?P<key>[A-Za-z0-9_-]+)/v1/(?P<route>chat/completions|models)$")


class RequestError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}}


@dataclass
class Trajectory:
    """One sample: its prompt and, after it, every completion (trained) and what the agent
    sent back between them (not trained)."""

    prompt_ids: list[int]
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict] | None = None  # the previous request's messages
    calls: int = 0
    tool_calls: int = 0
    out_of_budget: bool = False  # a call was refused: the sample had made its calls or used its tokens
    agent_running: bool = True  # its agent has not returned (ChatEndpoint.agent_ended)
    collected: bool = False  # the rollout has taken it: no request of it runs any more
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Pending:
    prompt: list[int]
    seed: int | None
    max_new_tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[list[int], list[float], bool] | None = None  # completion, its log-probs, stopped at EOS
    error: BaseException | None = None


def _not_running(key: str) -> RequestError:
    return RequestError(404, f"no sample {key!r} is running on this endpoint", "not_found")


def _plain(messages: list[dict]) -> list[dict]:
    """Role and text of each message, as a chat template takes them: content given as
    OpenAI's list of parts is their text, joined."""
    return [{"role": m.get("role"), "content": _text(m.get("content"))} for m in messages]


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        other = [p.get("type") for p in content if p.get("type") != "text"]
        if other:
            raise RequestError(400, f"a message has a content part of type {other[0]!r}; this endpoint takes text "
                                    "parts only", "unsupported")
        return "\n".join(str(p.get("text", "")) for p in content)  # as vLLM joins them
    raise RequestError(400, "a message's content must be a string or a list of text parts", "invalid_request")


def _options(request: dict) -> tuple[int | None, list[str], bool]:
    """The request's max tokens, stop strings and logprobs, checked; what the endpoint
    cannot honour is refused rather than ignored."""
    asked = request.get("max_completion_tokens")
    asked = request.get("max_tokens") if asked is None else asked
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
        raise RequestError(400, f"max_tokens must be an integer of at least 1, not {asked!r}", "invalid_request")
    stop = request.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(x, str) and x for x in stops)):
        raise RequestError(400, "stop must be a non-empty string or a list of at most 4 of them", "invalid_request")
    if request.get("top_logprobs"):
        raise RequestError(400, "top_logprobs is not served: logprobs=true gives each sampled token's",
                           "unsupported")
    if request.get("tool_choice") not in (None, "auto"):
        raise RequestError(400, f"tool_choice={request['tool_choice']!r}: the policy's output is not constrained; "
                                "only 'auto' is served", "unsupported")
    response_format = request.get("response_format") or {"type": "text"}
    if not isinstance(response_format, dict):
        raise RequestError(400, f"response_format must be an object, not {response_format!r}", "invalid_request")
    reshaping = {"presence_penalty": request.get("presence_penalty") not in (None, 0),
                 "frequency_penalty": request.get("frequency_penalty") not in (None, 0),
                 "logit_bias": bool(request.get("logit_bias")),
                 "parallel_tool_calls": request.get("parallel_tool_calls") is False,
                 "response_format": response_format.get("type") != "text"}
    for name, refused in reshaping.items():
        if refused:
            raise RequestError(400, f"{name}={request[name]!r}: the policy's own distribution is sampled (the "
                                    "trainer scores it), so nothing may reshape or constrain it", "unsupported")
    return asked, stops, bool(request.get("logprobs"))


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # every sample's agent may connect at once (the default backlog, 5, made them retry)


class ChatEndpoint:
    def __init__(self, engine: RolloutEngine, tokenizer, params: SamplingParams, max_total_tokens: int,
                 max_calls: int, max_request_bytes: int = 1 << 20, batch_gap_s: float = 0.1,
                 batch_wait_s: float = 0.5):
        """A batch of requests goes to the engine once every sample whose agent still runs
        has a request waiting, or when none has come for `batch_gap_s`, or `batch_wait_s`
        after its first."""
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.max_total_tokens, self.max_calls = max_total_tokens, max_calls
        self.max_request_bytes, self.batch_gap_s, self.batch_wait_s = max_request_bytes, batch_gap_s, batch_wait_s
        self.agents_running = 0  # samples whose agent has not returned (`open` and `agent_ended`)
        self.counting = threading.Lock()
        self.token = secrets.token_urlsafe(32)
        self.trajectories: dict[str, Trajectory] = {}
        self.pending: queue.Queue[_Pending | None] = queue.Queue()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.threads = [threading.Thread(target=self.server.serve_forever, name="openai endpoint", daemon=True),
                        threading.Thread(target=self._generate_loop, name="endpoint engine", daemon=True)]
        for t in self.threads:
            t.start()

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/samples/{key}/v1"

    def open(self, prompts: list[list[int]], seeds: list[int] | None) -> list[str]:
        keys = [secrets.token_hex(8) for _ in prompts]
        for i, (key, prompt) in enumerate(zip(keys, prompts)):
            self.trajectories[key] = Trajectory(list(prompt), None if seeds is None else seeds[i])
        with self.counting:
            self.agents_running += len(keys)
        return keys

    def agent_ended(self, key: str) -> None:
        """Sample `key`'s agent returned (or raised): no batch waits for its requests any more."""
        trajectory = self.trajectories[key]
        with self.counting:
            if trajectory.agent_running:
                trajectory.agent_running = False
                self.agents_running -= 1

    def collect(self, key: str) -> Trajectory:
        """Sample `key`'s trajectory, once no request of it runs: an agent cut by its timeout
        may have left one generating (kept, in full), and the rollout must not return while
        the engine still generates on weights the next nodes train. Later requests get 404."""
        self.agent_ended(key)
        trajectory = self.trajectories.pop(key)
        with trajectory.lock:
            trajectory.collected = True
        return trajectory

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.pending.put(None)

    # ------------------------------------------------------------------ a request

    def answer(self, key: str, request: Any) -> dict:
        """The chat completion for `request` in sample `key`, recorded."""
        trajectory = self.trajectories.get(key)
        if trajectory is None:
            raise _not_running(key)
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list) or not request["messages"]:
            raise RequestError(400, "'messages' must be a non-empty list of messages", "invalid_request")
        if request.get("model") != MODEL:
            raise RequestError(404, f"The model `{request.get('model')}` does not exist; this endpoint serves "
                                    f"`{MODEL}`", "model_not_found")
        if request.get("n", 1) != 1 or request.get("stream"):
            raise RequestError(400, "one completion per request, not streamed (n=1, stream=false)", "unsupported")
        messages = request["messages"]
        asked, stops, with_logprobs = _options(request)
        with trajectory.lock:  # one request of a sample at a time
            if trajectory.collected:  # it waited behind another request of its sample past the rollout's end
                raise _not_running(key)
            if trajectory.calls >= self.max_calls:
                trajectory.out_of_budget = True
                raise RequestError(400, f"this sample has made its {self.max_calls} calls (rollout.max_turns)",
                                   "too_many_calls")
            prompt = self._prompt(trajectory, messages, request.get("tools"))
            room = self.max_total_tokens - (len(prompt) - len(trajectory.prompt_ids))
            limit = min(asked or self.params.max_new_tokens, self.params.max_new_tokens, room)
            if limit < 1:
                trajectory.out_of_budget = True
                raise RequestError(400, f"this sample has used its {self.max_total_tokens} tokens "
                                        "(rollout.max_total_tokens)", "context_length_exceeded")
            seed = None if trajectory.seed is None else sample_seed(trajectory.seed, trajectory.calls)
            completion, log_probs, stopped = self._generate(prompt, seed, limit)
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            if stops:
                completion, log_probs, text, stopped = self._until_stop(completion, log_probs, text, stops, stopped)
            observed = prompt[len(trajectory.prompt_ids) + len(trajectory.tokens):]
            trajectory.tokens += observed + completion
            trajectory.trained += [0] * len(observed) + [1] * len(completion)
            trajectory.log_probs += [0.0] * len(observed) + log_probs
            trajectory.messages = messages
            trajectory.calls += 1
            calls = _tool_calls(text, trajectory.calls)
            trajectory.tool_calls += len(calls)
        content = TOOL_CALL.sub("", text).strip() if calls else text
        message = {"role": "assistant", "content": content or None} | ({"tool_calls": calls} if calls else {})
        logprobs = self._logprobs(completion, log_probs) if with_logprobs else None
        return {"id": f"chatcmpl-{key}-{trajectory.calls}", "object": "chat.completion", "created": int(time.time()),
                "model": MODEL, "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                             "finish_reason": "tool_calls" if calls else "stop" if stopped else "length"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
                          "total_tokens": len(prompt) + len(completion)}}

    def _until_stop(self, completion: list[int], log_probs: list[float], text: str, stops: list[str],
                    stopped: bool) -> tuple[list[int], list[float], str, bool]:
        """The completion up to the first of `stops`: the fewest tokens whose text holds
        it (what an engine stopping there samples; trained as sampled) and the text before
        it (OpenAI's answer leaves the stop string out)."""
        found = [(text.find(x) + len(x), text.find(x), x) for x in stops if x in text]
        if not found:
            return completion, log_probs, text, stopped
        _, at, stop = min(found)  # the stop string completed first, as an engine stopping on it meets it
        lo, hi = 1, len(completion)  # the first prefix whose text holds it (a prefix's text is the text's prefix)
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in self.tokenizer.decode(completion[:mid], skip_special_tokens=True):
                hi = mid
            else:
                lo = mid + 1
        return completion[:lo], log_probs[:lo], text[:at], True

    def _logprobs(self, completion: list[int], log_probs: list[float]) -> dict:
        """OpenAI's `logprobs` of the sampled tokens (the end-of-turn token too: it is trained);
        `bytes` is null for a token that is part of a character (its text alone is U+FFFD)."""
        tokens = [self.tokenizer.decode([t]) for t in completion]
        return {"content": [{"token": t, "logprob": lp, "bytes": None if "\ufffd" in t else list(t.encode()),
                             "top_logprobs": []} for t, lp in zip(tokens, log_probs)]}

    def _prompt(self, trajectory: Trajectory, messages: list[dict], tools) -> list[int]:
        if trajectory.messages is None:  # the sample's first request: the row's prompt
            text = render_prompt(self.tokenizer, _plain(messages), tools)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if ids != trajectory.prompt_ids:
                raise RequestError(400, "the first request of a sample must send the row's prompt as its messages, "
                                        "and as tools the schemas of rollout.tool_schemas (rendered by the chat "
                                        "template they must give the sample's prompt tokens)", "prompt_mismatch")
            return ids
        before = trajectory.messages
        extends = (len(messages) > len(before) + 1 and _plain(messages[:len(before)]) == _plain(before)
                   and messages[len(before)].get("role") == "assistant")
        if not extends:
            raise RequestError(400, "a sample's request must extend its conversation: the earlier messages, the "
                                    "assistant's reply, then new messages (token in, token out)", "history_mismatch")
        new = observation_ids(self.tokenizer, _plain(messages[len(before) + 1:]), trajectory.tokens[-1:],
                              self.engine.stop_token_ids)
        room = self.max_total_tokens - len(trajectory.tokens)
        return trajectory.prompt_ids + trajectory.tokens + new[:max(room, 0)]

    def _generate(self, prompt: list[int], seed: int | None, limit: int) -> tuple[list[int], list[float], bool]:
        item = _Pending(prompt, seed, limit)
        self.pending.put(item)
        item.done.wait()
        if item.error is not None:
            raise RequestError(500, f"generation failed: {type(item.error).__name__}: {item.error}", "server_error",
                               "server_error")
        return item.result

    def _generate_loop(self) -> None:
        """One engine call for the requests that arrive together: until every running
        agent has one waiting, none has come for batch_gap_s, or batch_wait_s have passed."""
        while (first := self.pending.get()) is not None:
            items = [first]
            deadline = time.perf_counter() + self.batch_wait_s
            while len(items) < self.agents_running and (left := deadline - time.perf_counter()) > 0:
                try:
                    nxt = self.pending.get(timeout=min(left, self.batch_gap_s))
                except queue.Empty:
                    break
                if nxt is None:
                    self.pending.put(None)
                    break
                items.append(nxt)
            self._run(items)

    def _run(self, items: list[_Pending]) -> None:
        greedy = [i for i in items if i.seed is None]
        sampled = [i for i in items if i.seed is not None]
        for group, is_greedy in ((greedy, True), (sampled, False)):
            if not group:
                continue
            try:
                p = self.params
                params = SamplingParams(temperature=p.temperature, top_p=p.top_p, greedy=is_greedy,
                                        max_new_tokens=max(i.max_new_tokens for i in group))
                out = self.engine.generate([i.prompt for i in group], None if is_greedy else [i.seed for i in group],
                                           params)
                for j, item in enumerate(group):
                    length = min(int(out["response_mask"][j].sum()), item.max_new_tokens)
                    ids = out["responses"][j, :length].tolist()
                    stopped = bool(ids) and ids[-1] in self.engine.stop_token_ids
                    item.result = ids, out["rollout_log_probs"][j, :length].tolist(), stopped
            except BaseException as e:  # answered as a server error, the endpoint goes on
                for item in group:
                    item.error = e
            for item in group:
                item.done.set()


def _tool_calls(text: str, call_index: int) -> list[dict]:
    """The completion's Hermes tool calls in OpenAI's shape (a body that is not a JSON
    call comes back as the function `invalid` with the raw text, for the agent to handle)."""
    out = []
    for n, body in enumerate(TOOL_CALL.findall(text)):
        try:
            call = json.loads(body)
            name, arguments = call["name"], json.dumps(call.get("arguments", {}))
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: [[[[... past the parser's depth
            name, arguments = "invalid", body.strip()
        out.append({"id": f"call_{call_index}_{n}", "type": "function",
                    "function": {"name": str(name), "arguments": arguments}})
    return out


def _handler(endpoint: ChatEndpoint):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: requests are counted in the metrics
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the agent gave up on it (its timeout): nobody reads
                self.close_connection = True

        def _discard(self, size: int) -> None:
            """Read an oversized body in chunks and drop it: a reply sent over an unread
            body can reach the client as a connection reset instead of the 413. Past
            DRAIN_LIMIT_BYTES the connection is closed unread."""
            left = min(size, DRAIN_LIMIT_BYTES)
            while left > 0 and (chunk := self.rfile.read(min(left, 1 << 16))):
                left -= len(chunk)
            self.close_connection = size > DRAIN_LIMIT_BYTES

        def _route(self) -> tuple[str, str]:
            if self.headers.get("Authorization") != f"Bearer {endpoint.token}":
                raise RequestError(401, "Incorrect API key provided: this endpoint takes the run's bearer token",
                                   "invalid_api_key")
            match = _PATH.match(self.path)
            if match is None:
                raise RequestError(404, f"unknown path {self.path}; the endpoint serves "
                                        "/samples/<key>/v1/chat/completions and /models", "not_found")
            return match["key"], match["route"]

        def do_GET(self) -> None:
            try:
                _, route = self._route()
                if route != "models":
                    raise RequestError(405, "chat/completions takes POST", "method_not_allowed")
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                             "owned_by": "distflow"}]})
            except RequestError as e:
                self._send(e.status, e.body())

        def do_POST(self) -> None:
            try:  # the body is read before anything is answered: on a kept-alive connection an unread
                # body would be taken for the next request (an agent trying another route first)
                length = self.headers.get("Content-Length") or "0"
                if not length.isdigit():  # a negative length would read until the client hangs up
                    self.close_connection = True
                    raise RequestError(400, f"Content-Length {length!r} is not a number of bytes", "invalid_request")
                size = int(length)
                if size > endpoint.max_request_bytes:
                    self._discard(size)
                    raise RequestError(413, f"the request has {size} bytes; at most {endpoint.max_request_bytes} "
                                            "are accepted", "request_too_large")
                body = self.rfile.read(size)
                key, route = self._route()
                if route != "chat/completions":
                    raise RequestError(405, "models takes GET", "method_not_allowed")
                try:
                    request = json.loads(body)
                except ValueError:
                    raise RequestError(400, "the body is not JSON", "invalid_json") from None
                try:
                    answer = endpoint.answer(key, request)
                except (ValueError, TypeError, KeyError, AttributeError, TemplateError) as e:  # a request the
                    raise RequestError(400, f"{type(e).__name__}: {e}", "invalid_request") from None  # template refuses
                except RequestError:
                    raise
                except Exception as e:
                    raise RequestError(500, f"{type(e).__name__}: {e}", "server_error", "server_error") from None
                self._send(200, answer)
            except RequestError as e:
                self._send(e.status, e.body())

    return Handler


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    max_total_tokens: int  # response tokens of a sample: completions and what the agent sent back
    max_calls: int  # requests one sample may make (rollout.max_turns)
    timeout_s: float  # one sample's run (rollout.agent_timeout_s)


class AgentRunner:
    """rollout.agent: one `run(client, row)` per sample, all at once, on an endpoint of its own."""

    def __init__(self, engine: RolloutEngine, tokenizer, run: Callable[[Any, dict], Awaitable[float]],
                 settings: AgentSettings):
        self.engine, self.tokenizer, self.run, self.settings = engine, tokenizer, run, settings
        self.endpoint: ChatEndpoint | None = None
        self.first_error: str | None = None

    def generate(self, prompts: list[list[int]], seeds: list[int] | None, params: SamplingParams,
                 rows: list[dict]) -> Batch:
        """The samples (`trajectory_batch` fields) plus `agent_scores` (what `run` returned;
        0 where it raised, which `agent_failed` counts, or `agent_out_of_budget` where the
        endpoint had refused a call of the sample for its turns or tokens: a budget the
        policy used up is the policy's doing, trained and scored 0, as an episode cut at
        its budget is)."""
        if self.endpoint is None or self.endpoint.params != params:
            if self.endpoint is not None:
                self.endpoint.close()
            self.endpoint = ChatEndpoint(self.engine, self.tokenizer, params, self.settings.max_total_tokens,
                                         self.settings.max_calls)
        keys = self.endpoint.open(prompts, seeds)
        outcomes = asyncio.run(self._all(keys, rows))
        trajectories = [self.endpoint.collect(k) for k in keys]
        scores, failed, out_of_budget = [], [], []
        for outcome, trajectory in zip(outcomes, trajectories):
            # a finite real number of any kind (numpy's too), not a bool, NaN or an infinity
            ok = isinstance(outcome, numbers.Real) and not isinstance(outcome, bool) and math.isfinite(outcome)
            ended = not ok and isinstance(outcome, Exception) and trajectory.out_of_budget
            out_of_budget.append(1.0 if ended else 0.0)
            if ended:
                scores.append(0.0)
                failed.append(0.0)
                continue
            if not ok and self.first_error is None:
                self.first_error = f"{type(outcome).__name__}: {outcome}"
                print(f"distflow: rollout.agent failed on a sample (scored 0, counted in agent/failed): "
                      f"{self.first_error}", flush=True)
            scores.append(float(outcome) if ok else 0.0)
            failed.append(0.0 if ok else 1.0)
        batch = trajectory_batch([t.tokens for t in trajectories], [t.trained for t in trajectories],
                                 [t.log_probs for t in trajectories], self.settings.max_total_tokens,
                                 self.tokenizer.pad_token_id)
        batch.tensors |= {"num_turns": torch.tensor([t.calls for t in trajectories], dtype=torch.float32),
                          "agent_tool_calls": torch.tensor([t.tool_calls for t in trajectories], dtype=torch.float32),
                          "agent_failed": torch.tensor(failed), "agent_scores": torch.tensor(scores),
                          "agent_out_of_budget": torch.tensor(out_of_budget)}
        return batch

    async def _all(self, keys: list[str], rows: list[dict]) -> list:
        import httpx
        from openai import AsyncOpenAI

        # each sample's own client and connection, made before any runs, on one SSL context (the endpoint is
        # plain http; a client making its own loads the CA bundle, 30 ms here, which spread a turn's requests
        # over several engine calls; one pool for all costs its pool's scan of every connection per request)
        tls = ssl.create_default_context()
        pools = [httpx.AsyncClient(verify=tls, timeout=self.settings.timeout_s) for _ in keys]
        clients = [AsyncOpenAI(base_url=self.endpoint.base_url(k), api_key=self.endpoint.token, max_retries=0,
                               timeout=self.settings.timeout_s, http_client=pool) for k, pool in zip(keys, pools)]
        try:
            async def one(key: str, client, row: dict):
                try:
                    return await asyncio.wait_for(self.run(client, row), self.settings.timeout_s)
                finally:
                    self.endpoint.agent_ended(key)

            return await asyncio.gather(*(one(*args) for args in zip(keys, clients, rows)), return_exceptions=True)
        finally:
            await asyncio.gather(*(pool.aclose() for pool in pools))

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
