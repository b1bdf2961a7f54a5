"""The OpenAI-compatible endpoint, driven by the real `openai` client: token in, token out
on the real HF engine and the embedded model, OpenAI-shaped errors, tool calls, and the
agent runner that turns an agent's calls into samples."""

from __future__ import annotations

import copy
import dataclasses
import http.client
import json
import threading

import openai
import pytest
import torch

from distflow.config import BUILTIN_MODEL
from distflow.data.batch import Batch
from distflow.engines.agent import observation_ids
from distflow.engines.common import load_causal_lm, load_tokenizer, render_prompt
from distflow.engines.openai_endpoint import AgentRunner, AgentSettings, ChatEndpoint
from distflow.engines.rollout import HFRolloutEngine, SamplingParams, response_mask_from, sample_seed
from helpers import ScriptedEngine

QUESTION = [{"role": "user", "content": "Q: Tom has 3 apples and buys 4 more. How many apples does he have?"}]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16)


@pytest.fixture(scope="module")
def tiny():
    tok = load_tokenizer(BUILTIN_MODEL)
    return HFRolloutEngine(load_causal_lm(BUILTIN_MODEL), tok), tok


def _prompt(tok, messages=QUESTION) -> list[int]:
    return tok(render_prompt(tok, messages), add_special_tokens=False)["input_ids"]


def _client(endpoint: ChatEndpoint, key: str, token: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url(key), api_key=token or endpoint.token, max_retries=0, timeout=60)


def test_a_conversation_is_recorded_token_in_token_out(tiny):
    engine, tok = tiny
    endpoint = ChatEndpoint(engine, tok, PARAMS, max_total_tokens=80, max_calls=3)
    try:
        prompt = _prompt(tok)
        (key,) = endpoint.open([prompt], [1234])
        client = _client(endpoint, key)
        first = client.chat.completions.create(model="policy", messages=QUESTION)
        follow = [{"role": "user", "content": "Give the final answer as #### <number>."}]
        second = client.chat.completions.create(
            model="policy", messages=QUESTION + [{"role": "assistant", "content": first.choices[0].message.content}]
            + follow)
        trajectory = endpoint.collect(key)
    finally:
        endpoint.close()
    # what the engine itself samples for these contexts and seeds (sampling is per sequence and call)
    c1 = engine.generate([prompt], [sample_seed(1234, 0)], PARAMS)
    c1 = c1["responses"][0, :int(c1["response_mask"][0].sum())].tolist()
    observed = observation_ids(tok, follow, [tok.eos_token_id])
    c2 = engine.generate([prompt + c1 + observed], [sample_seed(1234, 1)], PARAMS)
    c2 = c2["responses"][0, :int(c2["response_mask"][0].sum())].tolist()
    assert trajectory.tokens == c1 + observed + c2  # the completions as sampled, never re-tokenised
    assert trajectory.trained == [1] * len(c1) + [0] * len(observed) + [1] * len(c2)
    assert all(lp < 0 for lp, t in zip(trajectory.log_probs, trajectory.trained) if t)
    assert all(lp == 0 for lp, t in zip(trajectory.log_probs, trajectory.trained) if not t)
    assert first.choices[0].message.content == tok.decode(c1, skip_special_tokens=True)
    assert second.usage.prompt_tokens == len(prompt + c1 + observed) and second.usage.completion_tokens == len(c2)
    assert trajectory.calls == 2


def test_errors_come_in_openai_shapes(tiny):
    engine, tok = tiny
    endpoint = ChatEndpoint(engine, tok, PARAMS, max_total_tokens=40, max_calls=1, max_request_bytes=4000)
    try:
        (key,) = endpoint.open([_prompt(tok)], [1])
        client = _client(endpoint, key)
        with pytest.raises(openai.AuthenticationError) as e:
            _client(endpoint, key, token="wrong").chat.completions.create(model="policy", messages=QUESTION)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-4o", messages=QUESTION)
        assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * 5000}])
        assert e.value.status_code == 413 and e.value.code == "request_too_large"
        for length in ("-1", "ten"):  # a negative length read until the client hung up; a word got no reply
            raw = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
            raw.putrequest("POST", f"/samples/{key}/v1/chat/completions")
            raw.putheader("Authorization", f"Bearer {endpoint.token}")
            raw.putheader("Content-Length", length)
            raw.endheaders()
            answer = raw.getresponse()
            assert answer.status == 400 and "Content-Length" in json.loads(answer.read())["error"]["message"]
            raw.close()
        assert endpoint.server.request_queue_size >= 1024  # every sample's agent may connect at once
        with pytest.raises(openai.BadRequestError) as e:  # the first request must be the row's prompt
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hello"}])
        assert e.value.code == "prompt_mismatch"
        with pytest.raises(openai.NotFoundError) as e:
            _client(endpoint, "nosuchsample").chat.completions.create(model="policy", messages=QUESTION)
        assert e.value.code == "not_found"
        with pytest.raises(openai.NotFoundError) as e:  # a route an agent may try first: its unread body was
            client.completions.create(model="policy", prompt="x")  # taken for the next request on the connection
        assert e.value.code == "not_found"
        assert [m.id for m in client.models.list()] == ["policy"]
        reply = client.chat.completions.create(model="policy", messages=QUESTION)
        with pytest.raises(openai.BadRequestError) as e:  # rollout.max_turns=1: one call per sample
            client.chat.completions.create(model="policy", messages=QUESTION + [
                {"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "?"}])
        assert e.value.code == "too_many_calls"
        assert endpoint.collect(key).calls == 1  # the refused requests left no trace
    finally:
        endpoint.close()


def test_a_request_the_chat_template_refuses_is_a_400(tiny):
    """A template's raise_exception (Gemma's "roles must alternate") is jinja2's
    TemplateError: it was answered 500, which an agent retries."""
    engine, tok = tiny
    refusing = copy.deepcopy(tok)
    refusing.chat_template = ("{% for m in messages %}{% if 'FORBIDDEN' in m['content'] %}"
                              "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
    endpoint = ChatEndpoint(engine, refusing, PARAMS, max_total_tokens=40, max_calls=1)
    try:
        (key,) = endpoint.open([_prompt(refusing)], [1])
        with pytest.raises(openai.BadRequestError) as e:
            _client(endpoint, key).chat.completions.create(model="policy",
                                                           messages=[{"role": "user", "content": "FORBIDDEN"}])
        assert e.value.code == "invalid_request" and "roles must alternate" in e.value.message
    finally:
        endpoint.close()
    skipping = copy.deepcopy(tok)  # Phi-3's shape: a tool message renders as nothing
    skipping.chat_template = ("{%- for m in messages -%}{%- if m.role in ('user', 'assistant') -%}<|{{ m.role }}|>"
                              "{{ m.content }}<|end|>{%- endif -%}{%- endfor -%}"
                              "{%- if add_generation_prompt %}<|assistant|>{% endif -%}")
    endpoint = ChatEndpoint(engine, skipping, PARAMS, max_total_tokens=40, max_calls=2)
    try:
        (key,) = endpoint.open([_prompt(skipping)], [1])
        client = _client(endpoint, key)
        reply = client.chat.completions.create(model="policy", messages=QUESTION).choices[0].message.content
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=QUESTION + [
                {"role": "assistant", "content": reply}, {"role": "tool", "tool_call_id": "c1", "content": "(the tool says 7)"}])
        assert "renders nothing of a 'tool' message's text" in e.value.message
    finally:
        endpoint.close()


def test_tool_calls_come_back_in_openai_shape_and_a_rewritten_history_is_refused():
    tok = load_tokenizer(BUILTIN_MODEL)
    prompt = _prompt(tok)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>'
    engine = ScriptedEngine(tok, {prompt[0]: [f"Let me add. {call}", "#### 7"]})
    endpoint = ChatEndpoint(engine, tok, dataclasses.replace(PARAMS, max_new_tokens=128), max_total_tokens=400,
                            max_calls=3)
    try:
        (key,) = endpoint.open([prompt], [5])
        client = _client(endpoint, key)
        reply = client.chat.completions.create(model="policy", messages=QUESTION)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
        (tool_call,) = choice.message.tool_calls
        assert tool_call.function.name == "calculator"
        assert json.loads(tool_call.function.arguments) == {"expression": "3+4"}
        with pytest.raises(openai.BadRequestError) as e:  # an edited history cannot be token-in-token-out
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "other"},
                                                                     {"role": "assistant", "content": "x"},
                                                                     {"role": "user", "content": "y"}])
        assert e.value.code == "history_mismatch"
        answer = client.chat.completions.create(model="policy", messages=QUESTION + [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "7"}])
        assert answer.choices[0].message.content == "#### 7" and answer.choices[0].finish_reason == "stop"
        trajectory = endpoint.collect(key)
    finally:
        endpoint.close()
    assert trajectory.tool_calls == 1 and trajectory.calls == 2
    # the engine's second context: the prompt, its first completion, the tool result as the template shows it
    assert engine.calls[1][0] == prompt + trajectory.tokens[:len(engine.calls[1][0]) - len(prompt)]
    assert tok.decode([t for t, m in zip(trajectory.tokens, trajectory.trained) if not m]) == \
        tok.decode(observation_ids(tok, [{"role": "tool", "content": "7"}], [tok.eos_token_id]))


def test_stop_strings_logprobs_content_parts_and_what_the_endpoint_cannot_honour(tiny):
    """`stop` ends the completion at its first stop string: the tokens up to it are the
    sample's (as an engine stopping there samples them), the text before it the answer;
    `logprobs` are the sampled tokens'; `max_tokens` lowers the run's limit; content as a
    list of text parts is their text;
    what cannot be honoured is a 400, and leaves no trace in the sample."""
    _, tok = tiny
    prompt = _prompt(tok)
    engine = ScriptedEngine(tok, {prompt[0]: ["Let me think. DONE and then more", "#### 7"]})
    endpoint = ChatEndpoint(engine, tok, dataclasses.replace(PARAMS, max_new_tokens=128), max_total_tokens=400,
                            max_calls=3)
    parts = [{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]
    try:
        (key,) = endpoint.open([prompt], [5])
        client = _client(endpoint, key)
        for bad, code in (({"max_tokens": 0}, "invalid_request"), ({"tool_choice": "required"}, "unsupported"),
                          ({"logprobs": True, "top_logprobs": 2}, "unsupported"),
                          ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_request"),
                          ({"presence_penalty": 0.5}, "unsupported"), ({"frequency_penalty": -1}, "unsupported"),
                          ({"logit_bias": {"42": 5}}, "unsupported"), ({"parallel_tool_calls": False}, "unsupported"),
                          ({"response_format": {"type": "json_object"}}, "unsupported"),
                          ({"response_format": "json"}, "invalid_request")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="policy", messages=QUESTION, **bad)
            assert e.value.code == code
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
        assert e.value.code == "unsupported" and "'image_url'" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:  # a message that is not an object: a 400, not a dropped line
            client.chat.completions.create(model="policy", messages=["hello"])
        assert e.value.code == "invalid_request"
        reply = client.chat.completions.create(model="policy", messages=parts, stop="DONE", logprobs=True)
        choice = reply.choices[0]
        assert choice.message.content == "Let me think. " and choice.finish_reason == "stop"
        cut = tok("Let me think. DONE", add_special_tokens=False)["input_ids"]
        assert [t.logprob for t in choice.logprobs.content] == [-0.5] * len(cut)
        assert "".join(t.token for t in choice.logprobs.content) == "Let me think. DONE"
        follow = [{"role": "user", "content": "Go on."}]
        second = client.chat.completions.create(model="policy", messages=parts + [
            choice.message.model_dump(exclude_none=True)] + follow, max_tokens=2)  # "#### 7" cut at 2 tokens
        assert second.usage.completion_tokens == 2 and second.choices[0].finish_reason == "length"
        trajectory = endpoint.collect(key)
    finally:
        endpoint.close()
    observed = observation_ids(tok, follow, cut)  # as after any turn cut short of its end-of-turn token
    assert engine.calls[1] == [prompt + cut + observed]
    assert trajectory.tokens[:len(cut)] == cut and trajectory.trained[:len(cut)] == [1] * len(cut)
    assert trajectory.calls == 2  # the refused requests are not calls


def test_a_stop_string_is_cut_where_its_last_byte_is_sampled_and_the_first_to_complete_wins(qwen2_model_dir):
    """Byte-level BPE: a character of several tokens is a stop string only once all of
    them are sampled; of two stop strings the one completed first stops the completion
    (as an engine meets them), even where the other starts earlier."""
    tok = load_tokenizer(qwen2_model_dir)
    question = [{"role": "user", "content": "Q: 3 + 4?"}]
    prompt = tok(render_prompt(tok, question), add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine(tok, {prompt[0]: ["ab\u2705cd more"] * 2 + ["xabcdefy"]})
    endpoint = ChatEndpoint(engine, tok, dataclasses.replace(PARAMS, max_new_tokens=64), max_total_tokens=400,
                            max_calls=3)
    try:
        keys = endpoint.open([prompt] * 3, [1, 2, 3])
        replies = [_client(endpoint, k).chat.completions.create(model="policy", messages=question, stop=stop,
                                                                logprobs=True)
                   for k, stop in zip(keys, (["\u2705"], ["d m"], ["abcdef", "cd"]))]
        trajectories = [endpoint.collect(k) for k in keys]
    finally:
        endpoint.close()
    assert [r.choices[0].message.content for r in replies] == ["ab", "ab\u2705c", "xab"]
    assert tok.decode(trajectories[0].tokens) == "ab\u2705"  # every byte of the character: trained as sampled
    for trajectory, stop in zip(trajectories, ("\u2705", "d m", "cd")):  # the fewest tokens that hold the stop
        assert stop in tok.decode(trajectory.tokens) and stop not in tok.decode(trajectory.tokens[:-1])
    pieces = replies[0].choices[0].logprobs.content
    assert len(pieces) == len(trajectories[0].tokens)
    assert all(p.bytes is None for p in pieces if "\ufffd" in p.token)  # part of a character: no bytes of its own


async def _agent(client, row):
    reply = await client.chat.completions.create(model="policy", messages=row["prompt"])
    if row["extra_info"].get("fail"):
        raise RuntimeError("the agent broke")
    if row["extra_info"].get("inf"):  # no number to train on (it reached the advantages)
        return float("inf")
    if row["extra_info"].get("numpy"):  # a reward computed with numpy is a number too (it counted as a failure)
        import numpy as np

        return np.float32(1.0 if reply.choices[0].message.content else 0.5)
    return 1.0 if reply.choices[0].message.content else 0.5


def test_the_agent_runner_runs_every_sample_at_once_and_scores_what_run_returns(tiny):
    engine, tok = tiny
    runner = AgentRunner(engine, tok, _agent, AgentSettings(max_total_tokens=32, max_calls=2, timeout_s=60))
    calls = []
    generate = engine.generate
    engine.generate = lambda prompts, seeds, params: calls.append(len(prompts)) or generate(prompts, seeds, params)
    try:
        rows = [{"prompt": QUESTION, "ground_truth": "7", "data_source": "arith",
                 "extra_info": {"fail": i == 2, "numpy": i == 3, "inf": i == 4}} for i in range(5)]
        out = runner.generate([_prompt(tok)] * 5, [11, 12, 13, 14, 15], PARAMS, rows)
    finally:
        engine.generate = generate
        runner.close()
    assert out["responses"].shape == (5, 32) and out["agent_failed"].tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert out["agent_scores"][2] == out["agent_scores"][4] == 0.0
    assert all(out["agent_scores"][i] in (0.5, 1.0) for i in (0, 1, 3))
    assert out["num_turns"].tolist() == [1.0] * 5 and torch.all(out["observation_mask"] == 0)
    assert sum(calls) == 5 and len(calls) < 5  # requests that arrive together share one engine call
    assert runner.first_error == "RuntimeError: the agent broke"
    # different seeds, different samples (the sample's seed reaches the engine)
    assert len({tuple(r.tolist()) for r in out["responses"]}) > 1


def test_an_agent_cut_by_its_timeout_returns_only_once_its_generation_has_ended(tiny):
    """The agent's client gives up at timeout_s while the engine still generates its
    completion: the rollout waits for that generation (the next nodes train the weights it
    runs on) and keeps the completion in the sample, which scores 0 as failed."""
    engine, tok = tiny
    release, finished = threading.Event(), threading.Event()
    generate = engine.generate

    def slow(prompts, seeds, params):
        release.wait(30)  # generating well past the agent's timeout
        try:
            return generate(prompts, seeds, params)
        finally:
            finished.set()

    runner = AgentRunner(engine, tok, _agent, AgentSettings(max_total_tokens=32, max_calls=2, timeout_s=0.5))
    engine.generate = slow
    timer = threading.Timer(2.0, release.set)  # the engine ends its call 1.5 s after the agent gave up
    timer.start()
    try:
        rows = [{"prompt": QUESTION, "ground_truth": "7", "data_source": "arith", "extra_info": {}}]
        out = runner.generate([_prompt(tok)], [11], PARAMS, rows)
        assert finished.is_set()  # not returned while the engine was still generating
    finally:
        release.set()
        timer.cancel()
        engine.generate = generate
        runner.close()
    assert out["agent_failed"].tolist() == [1.0] and out["agent_scores"].tolist() == [0.0]
    assert out["num_turns"].tolist() == [1.0] and int(out["response_mask"].sum()) > 0


class _SameAnswer:
    """An engine whose every completion is `text` (then EOS), recording each call's size."""

    weight_version, tensor_parallel_size, batches_continuously = 0, 1, False

    def __init__(self, tok, text: str):
        self.tok, self.sizes = tok, []
        self.ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        self.stop_token_ids = (tok.eos_token_id,)

    def generate(self, prompts, seeds, params):
        self.sizes.append(len(prompts))
        resp = torch.full((len(prompts), params.max_new_tokens), self.tok.pad_token_id, dtype=torch.long)
        resp[:, :len(self.ids)] = torch.tensor(self.ids[:params.max_new_tokens])
        mask = response_mask_from(resp, [self.tok.eos_token_id])
        return Batch({"responses": resp, "response_mask": mask, "rollout_log_probs": -0.5 * mask.float()})


async def _until_answered(client, row):
    """A ReAct-style loop: asks again until the reply holds an answer, which it never does."""
    messages = list(row["prompt"])
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages)
        if "####" in reply.choices[0].message.content:
            return 1.0
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "wrong, think again"}]


@pytest.mark.parametrize("calls, tokens", [(3, 1000), (50, 40)])
def test_an_agent_that_uses_up_its_calls_or_tokens_is_trained_and_scored_0_not_failed(calls, tokens):
    """The endpoint refuses the call past rollout.max_turns or rollout.max_total_tokens, and
    an agent loop raises on it: that sample ran out of its budget, the policy's doing (as an
    episode cut at its budget), not a failure that would drop its group."""
    tok = load_tokenizer(BUILTIN_MODEL)
    runner = AgentRunner(_SameAnswer(tok, "try again"), tok, _until_answered,
                         AgentSettings(max_total_tokens=tokens, max_calls=calls, timeout_s=60))
    try:
        rows = [{"prompt": QUESTION, "ground_truth": "7", "data_source": "arith", "extra_info": {}}]
        out = runner.generate([_prompt(tok)], [11], PARAMS, rows)
    finally:
        runner.close()
    assert out["agent_out_of_budget"].tolist() == [1.0] and out["agent_failed"].tolist() == [0.0]
    assert out["agent_scores"].tolist() == [0.0] and runner.first_error is None
    assert out["num_turns"].item() == (3 if calls == 3 else 2) and int(out["response_mask"].sum()) > 0


def test_a_batch_waits_for_every_running_agent_and_not_for_those_that_returned():
    """Each turn of 32 agents is one engine call (the batch goes when every running agent has
    a request waiting), and the agents that returned after one turn are not waited for: with
    the gap and the wait far longer than their runs' timeout, a batch waiting for them would
    time the others out."""
    tok = load_tokenizer(BUILTIN_MODEL)
    engine = _SameAnswer(tok, "maybe")

    async def turns(client, row):
        messages = list(row["prompt"])
        for _ in range(row["extra_info"]["turns"]):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "again"}]
        return 1.0

    runner = AgentRunner(engine, tok, turns, AgentSettings(max_total_tokens=64, max_calls=3, timeout_s=20))
    runner.endpoint = ChatEndpoint(engine, tok, PARAMS, 64, 3, batch_gap_s=60, batch_wait_s=60)
    try:
        rows = [{"prompt": QUESTION, "ground_truth": "7", "data_source": "arith", "extra_info": {"turns": 1 + i % 3}}
                for i in range(32)]
        out = runner.generate([_prompt(tok)] * 32, list(range(32)), PARAMS, rows)
    finally:
        runner.close()
    assert out["agent_failed"].sum() == 0 and out["num_turns"].tolist() == [1.0 + i % 3 for i in range(32)]
    assert engine.sizes == [32, 21, 10]
