"""Multi-turn rollouts: the policy talks to an environment (tools, a game, a checker) over
several turns, token in, token out.

An episode starts from the dataset's prompt. Each turn the rollout engine generates the
next assistant turn for every episode still running (one batched call: an episode that
calls a tool does not hold up the others, which simply stop taking part); the
environment answers the turn's text with observation messages, or ends the episode.
The observation is rendered by the tokenizer's chat template as the turn that follows
an assistant message, and its token ids are appended as they are: the engine's own
tokens are never decoded and re-encoded, so what is trained is exactly what was sampled
plus exactly what the engine was shown. Observation tokens have loss mask 0
(`observation_mask` 1: attended to, not trained) and rollout log-prob 0.
`rollout.max_turns` and `rollout.max_total_tokens` bound every episode.

Each episode's turn t samples from its own seed (the sequence's seed and t), so an
episode is the same on any worker, whatever else shares its batch.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from distflow.data.batch import Batch
from distflow.data.images import PromptIds
from distflow.engines.rollout import RolloutEngine, SamplingParams, sample_seed
from distflow.engines.tools import Toolbox

Messages = list[dict[str, str]]
COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "env_failed")  # per episode, as batch fields
FAILED_EPISODE_FIELDS = ("env_failed", "agent_failed")  # 1 where an environment / rollout.agent's run raised


@dataclass
class EnvStep:
    observation: Messages  # what the environment answers (nothing when done)
    done: bool
    counts: dict[str, int] = field(default_factory=dict)  # of COUNTS
    reward: float = 0.0  # the step's reward; their sum is the sample's with reward.from_env


class Environment(Protocol):
    """One episode's environment (`rollout.env=module:Class`, made with the rollout's
    Toolbox; `openenv:module:Class` for an OpenEnv one, engines/openenv_env.py). `reset`
    gets the dataset row's task (prompt, ground_truth, data_source, extra_info) and the
    episode's seed (None when greedy); the episode's first messages are the row's prompt.
    A `close()` method, if it has one, is called once the episode ends. An environment
    that raises in reset or step ends its episode there (`env_failed`; with
    reward.from_env it scores 0, and rollout.on_failed_episode says whether its group
    trains), one whose close raises is reported; the other episodes go on."""

    def reset(self, task: dict) -> None: ...

    def step(self, assistant_text: str) -> EnvStep: ...


@dataclass(frozen=True)
class ToolResultForm:
    """How tool results are shown to the model under a chat template (`tool_result_form`)."""
    role: str = "tool"  # "user" where the template refuses the tool role
    framed: bool = True  # in Hermes' <tool_response> tags (False where the template adds them itself)


class ToolEnvironment:
    """The default environment: the tool calls of a turn are run and their results are
    the observation, in the chat template's `form`; a turn that calls no tool is the
    final answer."""

    def __init__(self, toolbox: Toolbox, form: ToolResultForm = ToolResultForm()):
        self.toolbox, self.form = toolbox, form

    def reset(self, task: dict) -> None:
        pass

    def step(self, assistant_text: str) -> EnvStep:
        calls = self.toolbox.calls(assistant_text)
        if not calls:
            return EnvStep([], True)
        results = self.toolbox.run_turn(calls)
        counts = {"tool_calls": len(results), "tool_errors": sum(r.status == "error" for r in results),
                  "tool_timeouts": sum(r.status == "timeout" for r in results)}
        return EnvStep(tool_messages([r.text for r in results], self.form), False, counts)


def tool_messages(results: list[str], form: ToolResultForm = ToolResultForm()) -> Messages:
    """Tools' results as the observation messages the model sees: a tool message each, or
    with the user role one message for all (templates that refuse the tool role make the
    roles alternate)."""
    texts = [f"<tool_response>\n{r}\n</tool_response>" if form.framed else r for r in results]
    if form.role == "tool":
        return [{"role": "tool", "content": t} for t in texts]
    return [{"role": form.role, "content": "\n".join(texts)}]


_TURN = "(an assistant turn)"  # the assistant's message of _BEFORE, found by its text where it ends
_RESULT = "(a tool's result)"  # a tool message's text, looked for in a template's rendering of it
_BEFORE = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _TURN}]


def tool_result_form(tokenizer) -> ToolResultForm:
    """How this chat template takes tool results: in tool messages, in <tool_response> tags
    unless it adds them itself (Qwen2.5's, Qwen3's and other Hermes-style templates do);
    in a user message, in our tags, where it refuses the tool role (Gemma's, for one) or
    renders nothing of a tool message (Phi-3's and Phi-4's know no such role)."""
    try:
        text = tokenizer.apply_chat_template(_BEFORE + [{"role": "tool", "content": _RESULT}], tokenize=False)
    except Exception:
        return ToolResultForm(role="user")
    if _RESULT not in text:
        return ToolResultForm(role="user")
    return ToolResultForm(framed="<tool_response>" not in text)


def observation_ids(tokenizer, messages: Messages, turn: list[int], stop_ids: tuple[int, ...] = ()) -> list[int]:
    """The tokens of `messages` after the assistant's `turn`, up to the next assistant
    turn's opening: what the chat template renders after an assistant message in a
    conversation that goes on with them (the template may add a system prompt or other
    framing at the start, which must not be repeated mid-episode). Where the template
    closes an assistant message with a token a response stops at (`stop_ids`, the engine's
    `stop_token_ids`; the tokenizer's EOS where not given) and more (Qwen's `<|im_end|>\n`,
    Gemma's `<end_of_turn>\n`, whose EOS is another token), what follows that token comes
    first, as the whole conversation renders it; after a turn cut short of that token,
    the token too (verl's #6501). The assistant message's end is found in the whole
    conversation, not by rendering it alone: Qwen3's template renders a last assistant
    message with an empty think block and an earlier one without."""
    full = tokenizer.apply_chat_template(_BEFORE + messages, add_generation_prompt=True, tokenize=False)
    for k, message in enumerate(messages):  # a template may skip a role it does not know, without a word
        content = message.get("content")
        if isinstance(content, str) and content.strip() and content.strip() not in full:  # or escaped it (tojson)
            blank = messages[:k] + [message | {"content": ""}] + messages[k + 1:]
            if tokenizer.apply_chat_template(_BEFORE + blank, add_generation_prompt=True, tokenize=False) == full:
                raise ValueError(f"the chat template renders nothing of a {message.get('role')!r} message's text")
    for stop in stop_ids or (tokenizer.eos_token_id,):
        closing = tokenizer.convert_ids_to_tokens(stop) if stop is not None else None
        end = full.find(_TURN + closing) if closing else -1
        if end >= 0:  # the assistant message ends with this token: what follows it
            opening = closing if not turn or turn[-1] != stop else ""
            return tokenizer(opening + full[end + len(_TURN) + len(closing):], add_special_tokens=False)["input_ids"]
    base = tokenizer.apply_chat_template(_BEFORE, tokenize=False)
    if full.startswith(base):  # another ending: the conversation's rendering after the assistant message's
        return tokenizer(full[len(base):], add_special_tokens=False)["input_ids"]
    return tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]


@dataclass(frozen=True, kw_only=True)
class EpisodeSettings:
    max_turns: int
    max_total_tokens: int  # response tokens of an episode: its turns and observations together
    step_last_turn: bool = False  # reward.from_env: the last turn is stepped too, for its reward
    # token ids an observation may not hold, dropped from it: a VLM's image placeholders
    # (tool output that writes one would stand for an image there is none of)
    dropped_ids: frozenset[int] = frozenset()
    env_workers: int = 8  # threads stepping different episodes' environments at once (1: one after another)
    env_timeout_s: float = 300.0  # an environment call (make and reset, step, close) that takes longer fails its episode
    # each episode's messages after its prompt (its turns as the assistant's, then what the environment answered),
    # as the batch's `episode_messages`: what a reward model reads
    keep_messages: bool = False
    # one episode from its environment's making to its closing before the next is made (an environment whose
    # sessions may not be alive at once: OpenEnv's SUPPORTS_CONCURRENT_SESSIONS unset); each turn one generate
    one_episode_at_a_time: bool = False


_FAILED = object()  # what an environment call that raised gives
_TIMED_OUT = object()  # what one that took longer than settings.env_timeout_s gives


class _Call:
    """One environment call on a lane: its future, and when its lane's thread began it."""

    def __init__(self, fn: Callable[[int], Any], i: int):
        self.fn, self.i, self.future, self.started = fn, i, Future(), None


class _Lanes:
    """Where the environments' calls run: episode i's on lane i % k, a thread of its own
    (an environment is made, stepped and closed on one thread: one tied to its thread, a
    sqlite connection or a browser, keeps working). A call not done within `timeout_s` of
    its start gives _TIMED_OUT, and its lane takes no more calls: the calls queued behind
    it are not run, and its thread (a daemon) is left to it."""

    def __init__(self, k: int, timeout_s: float):
        self.timeout_s, self.stuck = timeout_s, [False] * k
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(k)]
        for j, jobs in enumerate(self.queues):
            threading.Thread(target=self._serve, args=(jobs,), name=f"environment-{j}", daemon=True).start()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while (call := jobs.get()) is not None:
            if call.future.set_running_or_notify_cancel():  # not given up on while it waited
                call.started = time.monotonic()
                try:
                    call.future.set_result(call.fn(call.i))
                except BaseException as e:
                    call.future.set_exception(e)

    def map(self, fn: Callable[[int], Any], episodes: list[int], after_stuck: bool = False) -> list:
        """fn(i) for each episode on its lane; _TIMED_OUT for one whose call took too long
        or whose lane is stuck. `after_stuck`: on a stuck lane the call is still queued, to
        run if the call it waits behind ever returns (closing an environment)."""
        calls = []
        for i in episodes:
            lane, call = i % len(self.queues), _Call(fn, i)
            if not self.stuck[lane] or after_stuck:
                self.queues[lane].put(call)
            calls.append((lane, call))
        out = []
        for lane, call in calls:  # a lane's calls in their order: each waited on once the one before it is done
            out.append(_TIMED_OUT if self.stuck[lane] else self._result(call))
            if out[-1] is _TIMED_OUT and not self.stuck[lane]:
                self.stuck[lane] = True
                if not after_stuck:
                    for other, queued in calls:
                        if other == lane:
                            queued.future.cancel()  # those queued behind it are not run (the running one goes on)
        return out

    def _result(self, call: _Call) -> Any:
        while True:
            started = call.started  # None for a moment: the lane's thread is taking it up
            wait = self.timeout_s if started is None else started + self.timeout_s - time.monotonic()
            try:
                return call.future.result(timeout=max(0.0, wait))
            except FutureTimeout:
                if call.started is not None and time.monotonic() >= call.started + self.timeout_s:
                    return _TIMED_OUT

    def close(self) -> None:
        """Every lane's thread ends once its calls are done (a stuck one's, if its call ever returns)."""
        for jobs in self.queues:
            jobs.put(None)


class EpisodeRunner:
    """Runs a batch of episodes with a rollout engine and returns them as one rollout batch."""

    def __init__(self, engine: RolloutEngine, tokenizer, make_env: Callable[[], Environment],
                 settings: EpisodeSettings):
        self.engine, self.tokenizer, self.make_env, self.settings = engine, tokenizer, make_env, settings
        self.first_error: str | None = None  # the first environment failure, printed once
        self._lock = threading.Lock()

    def generate(self, prompts: list[list[int]], seeds: list[int] | None, params: SamplingParams,
                 tasks: list[dict]) -> Batch:
        """`prompts` (token ids) with their `tasks`; greedy when `seeds` is None. The
        environments of different episodes are made, reset, stepped and closed
        concurrently, on settings.env_workers threads; each episode's on one thread, one
        call at a time; each is closed when its episode ends (with one_episode_at_a_time,
        before the next episode's is made)."""
        s = self.settings
        one_at_a_time = s.one_episode_at_a_time and len(prompts) > 1
        # one at a time: one thread for all of them (OpenEnv runs a REQUIRES_SINGLE_THREAD_EXECUTOR class on one)
        lanes = _Lanes(1 if one_at_a_time else max(1, min(s.env_workers, len(prompts))), s.env_timeout_s)
        try:
            if not one_at_a_time:
                return self._episodes(prompts, seeds, params, tasks, lanes)
            return Batch.concat([self._episodes([p], None if seeds is None else [seeds[i]], params, [tasks[i]], lanes)
                                 for i, p in enumerate(prompts)])
        finally:
            lanes.close()

    def _episodes(self, prompts: list[list[int]], seeds: list[int] | None, params: SamplingParams,
                  tasks: list[dict], lanes: "_Lanes") -> Batch:
        s, n = self.settings, len(prompts)
        envs: list[Environment | None] = [None] * n
        tokens, trained, log_probs = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        turns, counts, rewards = [0] * n, [Counter() for _ in range(n)], [0.0] * n
        messages: list[list[dict]] = [[] for _ in range(n)]  # with settings.keep_messages

        def start(i: int) -> None:
            envs[i] = self.make_env()
            envs[i].reset(tasks[i] | {"seed": None if seeds is None else seeds[i]})

        def failed(i: int, what: str, e: Exception) -> None:
            """Episode i ends here, failed: counted, its reward 0, the runner's first error printed."""
            counts[i]["env_failed"], rewards[i] = 1, 0.0
            self._report(f"{what} (the episode ended there, counted in env/failed)", e)

        def guarded(call: Callable[[int], Any]) -> Callable[[int], Any]:
            """`call(i)` on episode i's environment; where it raises, the episode has failed
            (_FAILED), its environment closed as far as it lets."""
            def run(i: int) -> Any:
                try:
                    return call(i)
                except Exception as e:  # one episode's environment, not the rollout's: the others go on
                    failed(i, "rollout.env failed in an episode", e)
                    close(i)
                    return _FAILED
            return run

        left_to_lane: set[int] = set()  # episodes whose environment a stuck lane holds: closed there, if ever

        def gave_up(results: list, episodes: list[int], failing: bool = True) -> list:
            """`results` of a call on `episodes`; an environment that did not answer within
            env_timeout_s is left to its thread, and (`failing`) its episode has failed."""
            late = f"rollout.env took more than rollout.env_timeout_s={s.env_timeout_s:g} s"
            for i, result in zip(episodes, results):
                if result is _TIMED_OUT:
                    left_to_lane.add(i)
                    if failing:
                        failed(i, late, TimeoutError("no answer"))
                    else:
                        self._report(f"{late} to close an environment (its episode stands)", TimeoutError("no answer"))
            return results

        def close(i: int) -> None:
            """Episode i's environment closed (run on its lane: after a call made it late,
            whatever that call made); what close raises is reported, the episode stands."""
            env, envs[i] = envs[i], None
            try:
                if callable(getattr(env, "close", None)):
                    env.close()
            except Exception as e:
                self._report("rollout.env failed to close an environment (its episode stands)", e)

        try:
            started = gave_up(lanes.map(guarded(start), list(range(n))), list(range(n)))
            active = [i for i in range(n) if started[i] is not _FAILED and i not in left_to_lane]
            for turn in range(s.max_turns):
                if not active:
                    break
                out = self.engine.generate([_continued(prompts[i], tokens[i]) for i in active],
                                           None if seeds is None else [sample_seed(seeds[i], turn) for i in active],
                                           params)
                stepped, texts = [], {}  # the episodes whose environment answers this turn, and their turns
                for j, i in enumerate(active):
                    length = int(out["response_mask"][j].sum())
                    room = s.max_total_tokens - len(tokens[i])
                    new = out["responses"][j, :min(length, room)].tolist()
                    tokens[i] += new
                    trained[i] += [1] * len(new)
                    log_probs[i] += out["rollout_log_probs"][j, :len(new)].tolist()
                    turns[i] += 1
                    last = turn == s.max_turns - 1 or len(tokens[i]) >= s.max_total_tokens  # turns or tokens used up
                    if not last or s.step_last_turn or s.keep_messages:
                        texts[i] = self.tokenizer.decode(new, skip_special_tokens=True)
                        messages[i].append({"role": "assistant", "content": texts[i]})
                    if not last or s.step_last_turn:
                        stepped.append((i, new, last))
                asked = [i for i, _, _ in stepped]
                steps = gave_up(lanes.map(guarded(lambda i: _checked(envs[i].step(texts[i]))), asked), asked)
                running = []
                for (i, new, last), step in zip(stepped, steps):
                    if step is _FAILED or step is _TIMED_OUT:  # the episode ended there
                        continue
                    counts[i].update(step.counts)
                    rewards[i] += step.reward
                    if step.done or last:
                        continue
                    try:
                        rendered = observation_ids(self.tokenizer, step.observation, new, self.engine.stop_token_ids)
                    except Exception as e:  # the chat template cannot take the answer: this episode fails there
                        failed(i, "the chat template could not render rollout.env's answer", e)
                        continue
                    observed = [t for t in rendered if t not in s.dropped_ids][: s.max_total_tokens - len(tokens[i])]
                    if observed:  # what the policy was shown of it
                        messages[i] += step.observation
                    tokens[i] += observed
                    trained[i] += [0] * len(observed)
                    log_probs[i] += [0.0] * len(observed)
                    if len(tokens[i]) < s.max_total_tokens:
                        running.append(i)
                going_on = set(running)
                ended = [i for i in active if i not in going_on and envs[i] is not None and i not in left_to_lane]
                gave_up(lanes.map(close, ended), ended, failing=False)
                active = running
        finally:
            left = [i for i in range(n) if envs[i] is not None and i not in left_to_lane]
            gave_up(lanes.map(close, left), left, failing=False)
            stuck = sorted(left_to_lane)  # queued behind what holds their lane: closed if it ever returns
            lanes.map(close, stuck, after_stuck=True)
        batch = self._batch(tokens, trained, log_probs, turns, counts, rewards)
        if s.keep_messages:
            batch.meta["episode_messages"] = messages
        return batch

    def _report(self, what: str, e: Exception) -> None:
        """The first environment error of this runner, printed once."""
        with self._lock:
            first, self.first_error = self.first_error is None, self.first_error or f"{type(e).__name__}: {e}"
        if first:
            print(f"distflow: {what}: {self.first_error}", flush=True)

    def close(self) -> None:
        """Nothing to release: environments live for one episode."""

    def _batch(self, tokens, trained, log_probs, turns, counts, rewards) -> Batch:
        batch = trajectory_batch(tokens, trained, log_probs, self.settings.max_total_tokens,
                                 self.tokenizer.pad_token_id)
        batch.tensors["num_turns"] = torch.tensor(turns, dtype=torch.float32)
        batch.tensors["env_scores"] = torch.tensor(rewards, dtype=torch.float32)
        batch.tensors |= {name: torch.tensor([c[name] for c in counts], dtype=torch.float32) for name in COUNTS}
        return batch


def _checked(step: EnvStep) -> EnvStep:
    """An environment's answer, its reward a finite float (one that is not fails the
    episode: a NaN would reach its group's advantages)."""
    if not isinstance(step, EnvStep):
        raise TypeError(f"step returned {type(step).__name__}, not an EnvStep")
    reward = float(step.reward)
    if not math.isfinite(reward):
        raise ValueError(f"step returned the reward {reward}")
    return EnvStep(step.observation, step.done, dict(step.counts or {}), reward)


def _continued(prompt: list[int], episode: list[int]) -> list[int]:
    """The prompt followed by the episode so far; a prompt's images stay with it."""
    if not isinstance(prompt, PromptIds):
        return prompt + episode
    out = PromptIds(prompt + episode)
    out.pixel_values, out.image_grid_thw = prompt.pixel_values, prompt.image_grid_thw
    return out


def trajectory_batch(tokens: list[list[int]], trained: list[list[int]], log_probs: list[list[float]], width: int,
                     pad_id: int) -> Batch:
    """Rollout fields of token-in-token-out samples: each sample's tokens after its prompt,
    right-padded to `width`; `trained` 1 where the engine sampled the token (loss mask),
    0 where the environment or agent supplied it (observation_mask 1)."""
    n = len(tokens)
    responses = torch.full((n, width), pad_id, dtype=torch.long)  # (N, R)
    response_mask = torch.zeros((n, width), dtype=torch.long)
    observation_mask = torch.zeros((n, width), dtype=torch.long)
    rollout_log_probs = torch.zeros((n, width), dtype=torch.float32)
    for i in range(n):
        k = len(tokens[i])
        responses[i, :k] = torch.tensor(tokens[i], dtype=torch.long)
        response_mask[i, :k] = torch.tensor(trained[i], dtype=torch.long)
        observation_mask[i, :k] = 1 - response_mask[i, :k]
        rollout_log_probs[i, :k] = torch.tensor(log_probs[i], dtype=torch.float32)
    return Batch({"responses": responses, "response_mask": response_mask, "observation_mask": observation_mask,
                  "rollout_log_probs": rollout_log_probs})
